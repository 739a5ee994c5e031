"""fourfold.parallel.comm on gloo: each collective against the single-process computation it stands for.

One spawn of 4 ranks arranged as a 2 x 2 DeviceMesh. Each collective runs on the whole world (a ring
of 4, so "next" and "previous" differ) and on the mesh's outer dimension (pairs {0, 2} and {1, 3},
whose group ranks differ from their global ranks). The ranks return their outputs and gradients; the
parent recomputes the global function with plain torch ops on every rank's inputs and compares
(float64, tolerance 1e-12).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_ranks

WORLD = 4
SHAPE = (3, 4, 2)  # gathered along dim 1
TOL = dict(rtol=1e-12, atol=1e-12)


def _tensor(shape, global_rank: int, salt: int) -> torch.Tensor:
    """A float64 tensor reproducible in the parent from (rank, salt)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + global_rank),
                       dtype=torch.float64)


def _gathered_shape(size: int) -> tuple[int, ...]:
    return (SHAPE[0], SHAPE[1] * size, SHAPE[2])


def _run_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.comm import all_gather_along, send_recv_next

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    groups = {"world": dist.group.WORLD, "pair": mesh["outer"].get_group()}
    results: dict = {}
    for name, group in groups.items():
        x = _tensor(SHAPE, rank, salt=1).requires_grad_()
        y = all_gather_along(x, 1, group)
        # Each rank's loss is one term of a sum over ranks: sum(y * upstream_r).
        (y * _tensor(_gathered_shape(dist.get_world_size(group)), rank, salt=2)).sum().backward()
        results[(name, "all_gather")] = (y.detach(), x.grad)
        sent = [torch.full((2,), float(rank), dtype=torch.float64), torch.arange(3) * rank]
        results[(name, "ring")] = send_recv_next(sent, group)
        results[(name, "ring-async")] = send_recv_next([t + 1 for t in sent], group, async_op=True).wait()
    return results


def _reference(members: list[int], position: int):
    """(output, grad) of group member `position` for the all-gather: concatenation, loss summed over ranks."""
    xs = [_tensor(SHAPE, m, salt=1).requires_grad_() for m in members]
    ups = [_tensor(_gathered_shape(len(members)), m, salt=2) for m in members]
    gathered = torch.cat(xs, dim=1)
    sum((gathered * u).sum() for u in ups).backward()
    return gathered.detach(), xs[position].grad


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run_collectives, WORLD)


def _membership(rank: int) -> dict[str, tuple[list[int], int]]:
    pair = [0, 2] if rank in (0, 2) else [1, 3]
    return {"world": ([0, 1, 2, 3], rank), "pair": (pair, pair.index(rank))}


def test_all_gather_along_matches_single_process(results):
    for rank in range(WORLD):
        for name, (members, position) in _membership(rank).items():
            out, grad = results[rank][(name, "all_gather")]
            ref_out, ref_grad = _reference(members, position)
            torch.testing.assert_close(out, ref_out, **TOL, msg=lambda m: f"{name} rank {rank} output: {m}")
            torch.testing.assert_close(grad, ref_grad, **TOL, msg=lambda m: f"{name} rank {rank} grad: {m}")


def test_send_recv_next_receives_from_previous_rank(results):
    for rank in range(WORLD):
        for name, (members, position) in _membership(rank).items():
            prev = members[(position - 1) % len(members)]
            for key, offset in (("ring", 0), ("ring-async", 1)):
                got = results[rank][(name, key)]
                assert torch.equal(got[0], torch.full((2,), float(prev), dtype=torch.float64) + offset)
                assert torch.equal(got[1], torch.arange(3) * prev + offset)
