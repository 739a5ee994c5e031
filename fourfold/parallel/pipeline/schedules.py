"""Pipeline schedules as data: pure functions from (pp, vpp, n_microbatches, rank) to one rank's ordered actions.

    actions = build_schedule("1f1b", pp=4, vpp=1, n_micro=8, rank=1)
    print(" ".join(map(str, actions)))    # RECV_F0<-0 F0 SEND_F0->2 RECV_F1<-0 F1 SEND_F1->2 RECV_F2<-0 ...
    timeline = simulate([build_schedule("1f1b", 4, 1, 8, r) for r in range(4)])   # no processes

Stages: with `vpp` chunks per rank, chunk c of pp-rank r is global stage `c * pp + r`, so activations
flow rank 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ...  A schedule is first an order of compute
actions per rank (F and B, or F, BI and BW for zero-bubble); `add_communication` then inserts the
sends and receives. The executor runs consecutive communication actions as one `batch_isend_irecv`
and waits for a received tensor only when a compute needs it.

`simulate` times all ranks' lists under NCCL's rules (each rank's batches run in order; a send
finishes only once its receiver has posted the receive), which are stricter than gloo's, so a set of
lists it completes runs on both without deadlock. The same timed lists draw the ideal timeline
(fourfold.parallel.pipeline.timeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from fourfold.errors import LayoutError

COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: compute on (microbatch, local chunk), or a send/receive with `peer`.

    kind: F (forward), B (full backward), BI (backward for the stage input only), BW (backward for the
    weights only), SEND_F / RECV_F (activations), SEND_B / RECV_B (gradients of activations).
    peer: the pp-local rank a send goes to or a receive comes from; None for compute.
    """

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    @property
    def is_comm(self) -> bool:
        """True for a send or a receive."""
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        peer = "" if self.peer is None else ("->" if self.kind.startswith("SEND") else "<-") + str(self.peer)
        return f"{self.kind}{self.microbatch}{chunk}{peer}"


class TimedAction(NamedTuple):
    """An action with its start and end time (simulated units, or seconds since the step began)."""

    action: Action
    start: float
    end: float


class ScheduleError(RuntimeError):
    """A schedule is internally inconsistent (a bug in a schedule, not a user mistake): deadlock or mismatch."""


def _require_known(name: str) -> None:
    if name not in SCHEDULES:
        raise LayoutError(f"Unknown pipeline schedule '{name}'; choose one of {', '.join(SCHEDULES)} "
                          "(--parallel.pp_schedule).")


def check_schedule(name: str, pp: int, vpp: int, n_micro: int) -> None:
    """The schedules' own rules, as LayoutErrors naming the keys to change (fourfold.layout runs this before any
    process group; build_schedule runs it too). The compute-order functions below only assert them."""
    _require_known(name)
    if pp < 1 or vpp < 1 or n_micro < 1:
        raise LayoutError(f"A pipeline needs pp, vpp and micro-batches >= 1 (got pp={pp}, vpp={vpp}, "
                          f"micro-batches={n_micro}).")
    if vpp > 1 and pp < 2:
        raise LayoutError(f"parallel.vpp={vpp} splits each pipeline rank into virtual stages, but parallel.pp is "
                          f"{pp}; set --parallel.pp 2 or more, or --parallel.vpp 1.")
    interleaved = name == "interleaved-1f1b" or (name == "zero-bubble" and vpp > 1)
    if interleaved and n_micro % pp:
        raise LayoutError(f"Interleaved schedules ({name}, vpp={vpp}) need the micro-batches per step ({n_micro}) "
                          f"to be a multiple of pp ({pp}); change train.global_batch or train.micro_batch.")
    if name == "interleaved-1f1b" and vpp < 2:
        raise LayoutError("interleaved-1f1b needs parallel.vpp >= 2 virtual stages per rank; set --parallel.vpp 2 "
                          "or use --parallel.pp_schedule 1f1b.")
    if name in ("gpipe", "1f1b") and vpp != 1:
        raise LayoutError(f"The {name} schedule runs one chunk per rank, but parallel.vpp is {vpp}; set "
                          "--parallel.vpp 1, or --parallel.pp_schedule interleaved-1f1b (or zero-bubble) for "
                          "virtual stages.")


def _gpipe_compute(pp: int, vpp: int, n_micro: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (micro-batch order): peak memory m, bubble (p-1)/m."""
    assert vpp == 1, "check_schedule: gpipe runs one chunk per rank"
    return [Action("F", i) for i in range(n_micro)] + [Action("B", i) for i in range(n_micro)]


def _one_f_one_b_compute(pp: int, vpp: int, n_micro: int, rank: int) -> list[Action]:
    """pp-rank-1 warm-up forwards, then alternate one forward and one backward, then drain backwards."""
    assert vpp == 1, "check_schedule: 1f1b runs one chunk per rank"
    warmup = min(pp - rank - 1, n_micro)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    return order + [Action("B", i) for i in range(n_micro - warmup, n_micro)]


def _interleaved_unit(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) unit: groups of pp micro-batches per chunk."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    return group * pp + within % pp, (chunk if forward else vpp - 1 - chunk)


def _interleaved_compute(pp: int, vpp: int, n_micro: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B: (pp-rank-1)*2 + (vpp-1)*pp warm-up forwards, then 1F1B over chunk units."""
    assert vpp >= 2 and pp >= 2 and n_micro % pp == 0, "check_schedule: interleaved needs vpp, pp >= 2, pp | n_micro"
    units = n_micro * vpp
    warmup = min(units, (pp - rank - 1) * 2 + (vpp - 1) * pp)
    order = [Action("F", *_interleaved_unit(k, pp, vpp, True)) for k in range(warmup)]
    for k in range(units - warmup):
        order.append(Action("F", *_interleaved_unit(warmup + k, pp, vpp, True)))
        order.append(Action("B", *_interleaved_unit(k, pp, vpp, False)))
    return order + [Action("B", *_interleaved_unit(k, pp, vpp, False)) for k in range(units - warmup, units)]


def peak_in_flight(compute: list[Action]) -> int:
    """Most micro-batch activations held at once: forwards done minus backwards done (BW frees for zero-bubble)."""
    held = peak = 0
    for a in compute:
        held += {"F": 1, "B": -1, "BW": -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


def _zero_bubble_compute(pp: int, vpp: int, n_micro: int, rank: int) -> list[Action]:
    """ZB-H1: the 1F1B (vpp=1) or interleaved order with each B split into BI and a deferred BW.

    Only BI is on the critical path between stages; a rank's BW waits until `rank 0's peak in-flight
    - this rank's` later backwards have run, so every rank holds at most rank 0's 1F1B peak of
    activations (1F1B's peak memory) and the deferred BWs fill the cool-down, where the rank would
    otherwise wait for gradients. Once its forwards are done, each BI is followed by one BW.
    """
    base_fn = _one_f_one_b_compute if vpp == 1 else _interleaved_compute
    base = base_fn(pp, vpp, n_micro, rank)
    deferred = peak_in_flight(base_fn(pp, vpp, n_micro, 0)) - peak_in_flight(base)
    forwards_left = sum(a.kind == "F" for a in base)
    order: list[Action] = []
    pending: list[Action] = []
    for a in base:
        if a.kind == "F":
            order.append(a)
            forwards_left -= 1
            continue
        order.append(Action("BI", a.microbatch, a.chunk))
        pending.append(Action("BW", a.microbatch, a.chunk))
        if len(pending) > (deferred if forwards_left else 0):
            order.append(pending.pop(0))
    return order + pending


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _gpipe_compute,
    "1f1b": _one_f_one_b_compute,
    "interleaved-1f1b": _interleaved_compute,
    "zero-bubble": _zero_bubble_compute,
}
"""Schedule name -> compute order for one rank, (pp, vpp, n_micro, rank) -> list of F/B/BI/BW actions."""


UNIT_COSTS = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0}
"""Relative compute times used to lay out communication (t_F = t_BI = t_BW, t_B = t_BI + t_BW)."""


def ideal_timeline(computes: list[list[Action]], pp: int, vpp: int,
                   cost: dict[str, float] = UNIT_COSTS) -> list[list[TimedAction]]:
    """Time every rank's compute order with free, instant messages: each compute starts when its rank is
    free and its input (previous stage's forward, next stage's backward) is done."""
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}  # (F|B, microbatch, global stage) -> end time
    out: list[list[TimedAction]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while len(out[r]) < len(computes[r]):
                a = computes[r][len(out[r])]
                stage = a.chunk * pp + r
                need = None
                if a.kind == "F" and stage > 0:
                    need = ("F", a.microbatch, stage - 1)
                elif a.kind in ("B", "BI") and stage < last:
                    need = ("B", a.microbatch, stage + 1)
                if need is not None and need not in done:
                    break
                begin = max(free[r], done[need] if need else 0.0)
                free[r] = begin + cost[a.kind]
                out[r].append(TimedAction(a, begin, free[r]))
                if a.kind != "BW":
                    done[("F" if a.kind == "F" else "B", a.microbatch, stage)] = free[r]
                progressed = True
    if any(len(o) < len(c) for o, c in zip(out, computes)):
        raise ScheduleError("the compute orders wait on each other in a cycle.")
    return out


def add_communication(computes: list[list[Action]], pp: int, vpp: int, rank: int) -> list[Action]:
    """Rank `rank`'s compute order with its sends and receives inserted (`computes`: every rank's order).

    A send follows the compute that produces it. A receive is posted where the receiver stands, in
    the ideal timeline, when the sender sends: so the batches that hold the two ends of a message are
    posted at the same ideal time on both ranks, which keeps NCCL's in-order streams from waiting on
    each other in a cycle, and messages between two ranks are received in the order they are sent.
    """
    timeline = ideal_timeline(computes, pp, vpp)
    last = pp * vpp - 1
    starts = [t.start for t in timeline[rank]]
    recvs_before: list[list[tuple[float, Action]]] = [[] for _ in range(len(starts) + 1)]
    for sender in sorted({(rank - 1) % pp, (rank + 1) % pp} - {rank}):
        for a, _, end in timeline[sender]:
            stage = a.chunk * pp + sender
            if a.kind == "F" and stage < last and (sender + 1) % pp == rank:
                recv = Action("RECV_F", a.microbatch, (stage + 1) // pp, sender)
            elif a.kind in ("B", "BI") and stage > 0 and (sender - 1) % pp == rank:
                recv = Action("RECV_B", a.microbatch, (stage - 1) // pp, sender)
            else:
                continue
            slot = next((i for i, begin in enumerate(starts) if begin >= end), len(starts))
            recvs_before[slot].append((end, recv))
    out: list[Action] = []
    for i, a in enumerate(computes[rank]):
        out += [recv for _, recv in sorted(recvs_before[i], key=lambda x: x[0])]
        out.append(a)
        stage = a.chunk * pp + rank
        if a.kind == "F" and stage < last:
            out.append(Action("SEND_F", a.microbatch, a.chunk, (rank + 1) % pp))
        if a.kind in ("B", "BI") and stage > 0:
            out.append(Action("SEND_B", a.microbatch, a.chunk, (rank - 1) % pp))
    return out


def build_schedule(name: str, pp: int, vpp: int, n_micro: int, rank: int) -> list[Action]:
    """The full action list (compute and communication) of pp-rank `rank`; LayoutError for impossible combos."""
    check_schedule(name, pp, vpp, n_micro)
    if not 0 <= rank < pp:
        raise LayoutError(f"pp rank {rank} is outside 0..{pp - 1}.")
    computes = [SCHEDULES[name](pp, vpp, n_micro, r) for r in range(pp)]
    return add_communication(computes, pp, vpp, rank)


def analytic_bubble(name: str, pp: int, vpp: int, n_micro: int) -> float:
    """Ideal idle time relative to the ideal (bubble-free) step time.

    GPipe and 1F1B: (p-1)/m. Interleaved 1F1B: (p-1)/(v*m). Zero-bubble (ZB-H1): with t_F = t_BI = t_BW
    the idle time per rank is (p-1)(t_F + t_BI - t_BW) = (p-1) t_F against 3 m v t_F of work, i.e.
    (p-1)/(3 v m), a third of 1F1B's (ZB-H1 keeps only the warm-up forwards' wait). The simulator
    reproduces these exactly with t_B = 2 t_F (= 2 t_BW) for m >= p (ZB with vpp > 1: for pp <= 4).
    """
    _require_known(name)
    bubble = (pp - 1) / (vpp * n_micro)
    return bubble / 3 if name == "zero-bubble" else bubble


def match_messages(schedules_per_rank: list[list[Action]]) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair every send with its receive, first-in first-out per (sender, receiver); check they agree.

    Returns {(rank, index) -> (peer rank, peer index)} in both directions. Raises ScheduleError if a
    send has no receive, or a matched pair disagrees on kind, micro-batch or stage.
    """
    pp = len(schedules_per_rank)
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for r, actions in enumerate(schedules_per_rank):
        for i, a in enumerate(actions):
            if a.kind.startswith("SEND"):
                sends.setdefault((r, a.peer), []).append(i)
            elif a.kind.startswith("RECV"):
                recvs.setdefault((a.peer, r), []).append(i)
    matches: dict[tuple[int, int], tuple[int, int]] = {}
    for pair in set(sends) | set(recvs):
        src, dst = pair
        s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
        if len(s_list) != len(r_list):
            raise ScheduleError(f"rank {src} sends {len(s_list)} messages to rank {dst}, which receives {len(r_list)}.")
        for si, ri in zip(s_list, r_list):
            s, rv = schedules_per_rank[src][si], schedules_per_rank[dst][ri]
            step = 1 if s.kind == "SEND_F" else -1
            if (rv.kind != "RECV" + s.kind[4:] or rv.microbatch != s.microbatch
                    or rv.chunk * pp + dst != s.chunk * pp + src + step):
                raise ScheduleError(f"rank {src}'s {s} is received by rank {dst}'s {rv}: the order of messages "
                                    "between these ranks differs.")
            matches[(src, si)] = (dst, ri)
            matches[(dst, ri)] = (src, si)
    return matches


def _batches(actions: list[Action]) -> list[int]:
    """Batch id of each action: consecutive communication actions share one; compute actions get -1."""
    ids, current, prev_comm = [], -1, False
    for a in actions:
        if a.is_comm:
            if not prev_comm:
                current += 1
            ids.append(current)
        else:
            ids.append(-1)
        prev_comm = a.is_comm
    return ids


class _Transport:
    """Communication batches of every rank under NCCL's rules, resolved lazily as ranks post them.

    A rank's batches run one after another on its communication stream: batch b starts when posted
    and when batch b-1 has finished; it finishes once every peer batch holding a matching message
    has started. Only compute that consumes a received tensor waits for the batch.
    """

    def __init__(self, schedules_per_rank: list[list[Action]]):
        self.schedules = schedules_per_rank
        self.matches = match_messages(schedules_per_rank)
        self.batch_of = [_batches(a) for a in schedules_per_rank]
        self.members: dict[tuple[int, int], list[int]] = {}
        for r, ids in enumerate(self.batch_of):
            for i, b in enumerate(ids):
                if b >= 0:
                    self.members.setdefault((r, b), []).append(i)
        self.posted: dict[tuple[int, int], float] = {}

        self._known: dict[tuple[str, int, int], float] = {}
        self._visiting: set[tuple[str, int, int]] = set()

    def _resolve(self, what: str, r: int, b: int) -> float | None:
        """Start or finish time of batch b of rank r; None while it depends on something not yet posted."""
        key = (what, r, b)
        if key in self._known:
            return self._known[key]
        if key in self._visiting or (r, b) not in self.posted:
            return None  # a cycle (deadlock, reported by the caller) or not posted yet
        self._visiting.add(key)
        if what == "start":
            times = [self.posted[(r, b)]] + ([self._resolve("finish", r, b - 1)] if b > 0 else [])
        else:
            times = [self._resolve("start", r, b)]
            for i in self.members[(r, b)]:
                q, j = self.matches[(r, i)]
                times.append(self._resolve("start", q, self.batch_of[q][j]))
        self._visiting.discard(key)
        if any(t is None for t in times):
            return None
        self._known[key] = max(times)
        return self._known[key]

    def finish(self, r: int, b: int) -> float | None:
        """Finish time of batch `b` of rank `r`; None while it depends on a batch not yet posted (or deadlocks)."""
        return self._resolve("finish", r, b)


def simulate(schedules_per_rank: list[list[Action]], t_f: float = 1, t_b: float = 2,
             t_w: float = 1) -> list[list[TimedAction]]:
    """Time every rank's actions: F takes t_f, B t_b, BI t_b - t_w, BW t_w, communication nothing.

    Communication follows `_Transport` (NCCL's stream order, stricter than gloo); a compute waits for
    the batch that received its input; a rank ends when its last batch has finished. A communication
    record spans from posting to finishing. Raises ScheduleError on mismatched messages or deadlock.
    """
    cost = {"F": t_f, "B": t_b, "BI": t_b - t_w, "BW": t_w}
    net = _Transport(schedules_per_rank)
    pp = len(schedules_per_rank)
    pc, clock = [0] * pp, [0.0] * pp
    received: list[dict[tuple[str, int, int], int]] = [{} for _ in range(pp)]  # (F|B, mb, chunk) -> batch
    out: list[list[TimedAction]] = [[] for _ in range(pp)]
    progressed = True
    while progressed:
        progressed = False
        for r, actions in enumerate(schedules_per_rank):
            while pc[r] < len(actions):
                a = actions[pc[r]]
                if a.is_comm:
                    b = net.batch_of[r][pc[r]]
                    net.posted.setdefault((r, b), clock[r])
                    if a.kind.startswith("RECV"):
                        received[r][(a.kind[-1], a.microbatch, a.chunk)] = b
                else:
                    b = received[r].get(("F" if a.kind == "F" else "B", a.microbatch, a.chunk))
                    ready = clock[r] if b is None or a.kind == "BW" else net.finish(r, b)
                    if ready is None:
                        break
                    clock[r] = max(clock[r], ready)
                    out[r].append(TimedAction(a, clock[r], clock[r] + cost[a.kind]))
                    clock[r] += cost[a.kind]
                pc[r] += 1
                progressed = True
    stuck = [f"rank {r} at {schedules_per_rank[r][pc[r]]}" for r in range(pp) if pc[r] < len(schedules_per_rank[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    for r, actions in enumerate(schedules_per_rank):
        for i, a in enumerate(actions):
            if a.is_comm:
                b = net.batch_of[r][i]
                end = net.finish(r, b)
                if end is None:
                    raise ScheduleError(f"deadlock: rank {r}'s {a} never completes.")
                out[r].append(TimedAction(a, net.posted[(r, b)], end))
        out[r].sort(key=lambda t: (t.start, t.end))
    return out
