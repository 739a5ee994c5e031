"""Pipeline schedules as data, checked without processes: coverage, dependencies, messages, memory, bubble.

Every valid (schedule, pp in {2, 4}, vpp in {1, 2}, micro-batches in {p, 2p, 4p}) is built for all
ranks and timed by `simulate` (NCCL's in-order rules, t_F = 1, t_B = 2, t_BW = 1); the tests read the
action lists and the simulated timelines. Also: the timeline files (Chrome trace, picture) and the
errors users see for impossible combinations.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from fourfold.errors import LayoutError
from fourfold.parallel.pipeline.executor import forward_only_schedule
from fourfold.parallel.pipeline.schedules import (SCHEDULES, Action, ScheduleError, TimedAction, analytic_bubble,
                                         build_schedule, match_messages, peak_in_flight, simulate)
from fourfold.parallel.pipeline.timeline import draw_timeline, measured_bubble, pipeline_bubble, write_chrome_trace


def _valid_cases():
    cases = []
    for name in SCHEDULES:
        for pp in (2, 4):
            for vpp in (1, 2):
                for n_micro in (pp, 2 * pp, 4 * pp):
                    try:
                        build_schedule(name, pp, vpp, n_micro, 0)
                    except LayoutError:
                        continue
                    cases.append((name, pp, vpp, n_micro))
    return cases


CASES = _valid_cases()
_SIMULATED: dict = {}


def _schedules(case):
    name, pp, vpp, n_micro = case
    return [build_schedule(name, pp, vpp, n_micro, r) for r in range(pp)]


def _timeline(case):
    if case not in _SIMULATED:
        _SIMULATED[case] = simulate(_schedules(case))
    return _SIMULATED[case]


def test_every_schedule_and_vpp_is_covered():
    covered = {(name, vpp) for name, _, vpp, _ in CASES}
    assert covered == {("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2)}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_microbatch_runs_once_per_chunk(case):
    name, pp, vpp, n_micro = case
    expected_kinds = ("F", "BI", "BW") if name == "zero-bubble" else ("F", "B")
    for rank, actions in enumerate(_schedules(case)):
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in actions if not a.is_comm)
        want = Counter({(k, mb, c): 1 for k in expected_kinds for mb in range(n_micro) for c in range(vpp)})
        assert counts == want, f"rank {rank}"
        position = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions)}
        for mb in range(n_micro):
            for c in range(vpp):
                order = [position[(k, mb, c)] for k in expected_kinds]
                assert order == sorted(order), f"rank {rank}: {expected_kinds} of mb {mb} chunk {c} out of order"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_simulation_respects_dependencies(case):
    """Forward of mb i on stage s starts after stage s-1's forward of mb i ended and its receive completed;
    backward likewise from stage s+1; every rank's list completes (no deadlock)."""
    _, pp, vpp, _ = case
    timeline = _timeline(case)
    done = {}
    for rank, records in enumerate(timeline):
        assert len(records) == len(_schedules(case)[rank])
        for rec in records:
            a = rec.action
            done[(a.kind, a.microbatch, a.chunk * pp + rank)] = rec
    last = pp * vpp - 1
    for (kind, mb, stage), rec in done.items():
        if kind == "F" and stage > 0:
            assert done[("F", mb, stage - 1)].end <= done[("RECV_F", mb, stage)].end <= rec.start
        if kind in ("B", "BI"):
            assert done[("F", mb, stage)].end <= rec.start
            if stage < last:
                upstream = done.get(("B", mb, stage + 1)) or done[("BI", mb, stage + 1)]
                assert upstream.end <= done[("RECV_B", mb, stage)].end <= rec.start
        if kind == "BW":
            assert done[("BI", mb, stage)].end <= rec.start


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sends_match_receives_one_to_one(case):
    schedules = _schedules(case)
    matches = match_messages(schedules)
    comm = [(r, i) for r, actions in enumerate(schedules) for i, a in enumerate(actions) if a.is_comm]
    assert sorted(matches) == sorted(comm)
    for (r, i), (q, j) in matches.items():
        assert matches[(q, j)] == (r, i)
        assert schedules[r][i].microbatch == schedules[q][j].microbatch
    # Each receive comes before the compute that consumes it.
    for actions in schedules:
        seen = set()
        for a in actions:
            if a.kind.startswith("RECV"):
                seen.add((a.kind[-1], a.microbatch, a.chunk))
            elif a.kind in ("F", "B", "BI") and any(x.kind == "RECV_" + a.kind[0] and x.microbatch == a.microbatch
                                                      and x.chunk == a.chunk for x in actions):
                assert (a.kind[0], a.microbatch, a.chunk) in seen


def _memory_bound(name, pp, vpp, n_micro, rank):
    if name == "gpipe":
        return n_micro
    if name == "1f1b":
        return pp - rank
    if name == "interleaved-1f1b":
        return min(vpp * n_micro, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)
    # zero-bubble: 1F1B's peak (rank 0's) on every rank
    return pp if vpp == 1 else min(vpp * n_micro, 2 * (pp - 1) + (vpp - 1) * pp + 1)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_peak_in_flight_activations_within_bound(case):
    name, pp, vpp, n_micro = case
    for rank, actions in enumerate(_schedules(case)):
        peak = peak_in_flight([a for a in actions if not a.is_comm])
        assert peak <= _memory_bound(name, pp, vpp, n_micro, rank), f"rank {rank}"
    if name == "1f1b":  # the bound is tight: rank 0 holds pp micro-batches
        assert peak_in_flight(_schedules(case)[0]) == min(pp, n_micro)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_simulated_bubble_equals_analytic(case):
    name, pp, vpp, n_micro = case
    assert pipeline_bubble(_timeline(case)) == pytest.approx(analytic_bubble(name, pp, vpp, n_micro), rel=1e-9)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_zero_bubble_bubble_below_1f1b(pp, factor):
    zb = pipeline_bubble(_timeline(("zero-bubble", pp, 1, factor * pp)))
    one_f_one_b = pipeline_bubble(_timeline(("1f1b", pp, 1, factor * pp)))
    assert zb < one_f_one_b
    assert zb == pytest.approx(one_f_one_b / 3)


@pytest.mark.parametrize("pp,vpp,n_micro", [(2, 1, 4), (4, 1, 3), (2, 2, 4), (4, 2, 8)])
def test_forward_only_schedule_completes(pp, vpp, n_micro):
    timeline = simulate([forward_only_schedule(pp, vpp, n_micro, r) for r in range(pp)])
    assert all(sum(not t.action.is_comm for t in rank) == vpp * n_micro for rank in timeline)


def test_simulator_catches_deadlock_and_mismatch():
    schedules = _schedules(("1f1b", 2, 1, 2))
    # Rank 0 waits for a gradient before sending its first activation: a cycle.
    rank0 = [a for a in schedules[0] if a.kind != "RECV_B"]
    recv = [a for a in schedules[0] if a.kind == "RECV_B"]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([recv + rank0, schedules[1]])
    # Rank 1 receives one activation fewer than rank 0 sends.
    dropped = list(schedules[1])
    dropped.remove(next(a for a in dropped if a.kind == "RECV_F"))
    with pytest.raises(ScheduleError, match="sends 2 messages"):
        simulate([schedules[0], dropped])
    # Rank 1 receives the activations in the wrong order.
    swapped = [Action("RECV_F", 1 - a.microbatch, a.chunk, a.peer) if a.kind == "RECV_F" else a for a in schedules[1]]
    with pytest.raises(ScheduleError, match="order of messages"):
        simulate([schedules[0], swapped])


@pytest.mark.parametrize("name,pp,vpp,n_micro,words", [
    ("interleaved-1f1b", 4, 2, 6, "multiple of pp"),
    ("interleaved-1f1b", 2, 1, 4, "parallel.vpp >= 2"),
    ("1f1b", 2, 2, 4, "interleaved-1f1b"),
    ("gpipe", 2, 2, 4, "parallel.vpp 1"),
    ("zero-bubble", 4, 2, 6, "multiple of pp"),
    ("pipedream", 2, 1, 4, "choose one of"),
    ("1f1b", 2, 1, 0, "micro-batches"),
])
def test_impossible_combinations_raise_layout_error(name, pp, vpp, n_micro, words):
    with pytest.raises(LayoutError, match=words):
        build_schedule(name, pp, vpp, n_micro, 0)


def test_bubble_measures_on_hand_made_records():
    f, b = Action("F", 0), Action("B", 0)
    recv = Action("RECV_B", 0, 0, 1)
    records = [TimedAction(f, 0.0, 1.0), TimedAction(recv, 1.0, 2.0), TimedAction(b, 2.0, 4.0)]
    assert measured_bubble(records) == pytest.approx(0.25)  # waiting in a receive is idle
    other = [TimedAction(f, 1.0, 2.0), TimedAction(b, 2.0, 3.0)]
    assert pipeline_bubble([records, other]) == pytest.approx(4.0 / 3.0 - 1.0)


def test_trace_and_picture_from_simulated_timeline(tmp_path):
    timeline = _timeline(("zero-bubble", 4, 1, 8))
    trace = write_chrome_trace(timeline, tmp_path / "trace.json", time_unit=1e-3)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(r) for r in timeline)
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert {e["cat"] for e in spans} == {"F", "BI", "BW", "comm"}
    end = max(r.end for rank in timeline for r in rank)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(end * 1e3)  # 1 unit shown as 1 ms
    picture = draw_timeline(timeline, tmp_path / "timeline.png", "zero-bubble, pp=4, m=8")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 5000
