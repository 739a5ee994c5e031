"""fourfold.parallel.comm on gloo: every autograd collective against the single-process computation it stands for.

One spawn of 4 ranks arranged as a 2 x 2 DeviceMesh. Each collective runs on the whole world (a ring
of 4, so "next" and "previous" differ) and on the mesh's outer dimension (pairs {0, 2} and {1, 3},
whose group ranks differ from their global ranks). The ranks return their outputs and gradients; the
parent recomputes each global function with plain torch ops on every rank's inputs and compares
(float64, tolerance 1e-12). `torch.autograd.gradcheck` (float64) checks each collective paired with its
dual, per rank, on the 2-rank groups.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_ranks

WORLD = 4
SHAPE = (3, 4, 2)  # gathered/scattered along dim 1
TOL = dict(rtol=1e-12, atol=1e-12)


def _tensor(shape, global_rank: int, salt: int) -> torch.Tensor:
    """A float64 tensor reproducible in the parent from (rank, salt)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + global_rank),
                       dtype=torch.float64)


def _sources(fname: str, rank: int, first_member: int) -> tuple[int, int]:
    """Whose seed gives (input, upstream grad): all_reduce and copy act on a tensor replicated over the
    group; all_reduce's output is replicated too, so its loss (and upstream grad) is the same on all ranks."""
    replicated_in = fname in ("all_reduce", "copy")
    return (first_member if replicated_in else rank), (first_member if fname == "all_reduce" else rank)


def _output_shape(fname: str, size: int) -> tuple[int, ...]:
    along = {"all_gather": SHAPE[1] * size, "reduce_scatter": SHAPE[1] // size}.get(fname, SHAPE[1])
    return (SHAPE[0], along, SHAPE[2])


def _run_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.comm import (all_gather_along, all_reduce_sum, copy_to_group, reduce_scatter_along,
                                        send_recv_next)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    groups = {"world": dist.group.WORLD, "pair": mesh["outer"].get_group()}
    results: dict = {}
    for name, group in groups.items():
        for fname, fn in (("all_gather", lambda x, g: all_gather_along(x, 1, g)),
                          ("reduce_scatter", lambda x, g: reduce_scatter_along(x, 1, g)),
                          ("all_reduce", all_reduce_sum), ("copy", copy_to_group)):
            in_seed, up_seed = _sources(fname, rank, dist.get_global_rank(group, 0))
            x = _tensor(SHAPE, in_seed, salt=1).requires_grad_()
            y = fn(x, group)
            (y * _tensor(_output_shape(fname, dist.get_world_size(group)), up_seed, salt=2)).sum().backward()
            results[(name, fname)] = (y.detach(), x.grad)
        sent = [torch.full((2,), float(rank), dtype=torch.float64), torch.arange(3) * rank]
        results[(name, "ring")] = send_recv_next(sent, group)
        results[(name, "ring-async")] = send_recv_next([t + 1 for t in sent], group, async_op=True).wait()
    results["gradcheck"] = _gradchecks(rank, groups["pair"])
    return results


def _gradchecks(rank: int, group) -> bool:
    """gradcheck each collective composed with its dual around a rank-dependent elementwise map."""
    import torch.distributed as dist

    from fourfold.parallel.comm import all_gather_along, all_reduce_sum, copy_to_group, reduce_scatter_along

    gen = torch.Generator().manual_seed(7 + rank)
    weight = torch.rand((3, 4 * dist.get_world_size(group), 2), generator=gen, dtype=torch.float64) + 0.5
    local = torch.randn((3, 4, 2), generator=gen, dtype=torch.float64, requires_grad=True)
    # Gathered, transformed elementwise per rank, scattered back: rank r's output depends on its own
    # input only (sum over ranks of weight_r * tanh(x_r)), so a per-rank Jacobian check is exact.
    torch.autograd.gradcheck(lambda x: reduce_scatter_along(torch.tanh(all_gather_along(x, 1, group)) * weight,
                                                            1, group), (local,))
    # A replicated input entering through copy_to_group, per-rank partial results summed by all_reduce_sum.
    shared = torch.randn((3, 8, 2), generator=torch.Generator().manual_seed(11), dtype=torch.float64,
                         requires_grad=True)
    torch.autograd.gradcheck(lambda x: all_reduce_sum(torch.sin(copy_to_group(x, group)) * weight, group),
                             (shared,))
    return True


def _reference(fname: str, members: list[int], position: int):
    """(output, grad) of group member `position` for the global function the collective computes."""
    seeds = [_sources(fname, m, members[0]) for m in members]
    xs = [_tensor(SHAPE, s, salt=1).requires_grad_() for s, _ in seeds]
    if fname == "copy":
        xs = xs[:1] * len(members)  # one tensor, replicated
    ups = [_tensor(_output_shape(fname, len(members)), s, salt=2) for _, s in seeds]
    if fname == "all_gather":
        outs = [torch.cat(xs, dim=1)] * len(members)
    elif fname == "reduce_scatter":
        outs = list(torch.stack(xs).sum(0).chunk(len(members), dim=1))
    elif fname == "all_reduce":
        outs = [torch.stack(xs).sum(0)] * len(members)
    else:
        outs = [xs[0]] * len(members)
    if fname == "all_reduce":
        loss = (outs[0] * ups[0]).sum()  # replicated output: the loss is counted once
    else:
        loss = sum((o * u).sum() for o, u in zip(outs, ups))  # one loss term per rank
    loss.backward()
    return outs[position].detach(), xs[position].grad


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run_collectives, WORLD)


def _membership(rank: int) -> dict[str, tuple[list[int], int]]:
    pair = [0, 2] if rank in (0, 2) else [1, 3]
    return {"world": ([0, 1, 2, 3], rank), "pair": (pair, pair.index(rank))}


@pytest.mark.slow
@pytest.mark.parametrize("fname", ["all_gather", "reduce_scatter", "all_reduce", "copy"])
def test_collective_matches_single_process(results, fname):
    for rank in range(WORLD):
        for name, (members, position) in _membership(rank).items():
            out, grad = results[rank][(name, fname)]
            ref_out, ref_grad = _reference(fname, members, position)
            torch.testing.assert_close(out, ref_out, **TOL, msg=lambda m: f"{name} rank {rank} output: {m}")
            torch.testing.assert_close(grad, ref_grad, **TOL, msg=lambda m: f"{name} rank {rank} grad: {m}")


@pytest.mark.slow
def test_send_recv_next_receives_from_previous_rank(results):
    for rank in range(WORLD):
        for name, (members, position) in _membership(rank).items():
            prev = members[(position - 1) % len(members)]
            for key, offset in (("ring", 0), ("ring-async", 1)):
                got = results[rank][(name, key)]
                assert torch.equal(got[0], torch.full((2,), float(prev), dtype=torch.float64) + offset)
                assert torch.equal(got[1], torch.arange(3) * prev + offset)


@pytest.mark.slow
def test_gradcheck_of_dual_pairs(results):
    assert all(r["gradcheck"] for r in results)
