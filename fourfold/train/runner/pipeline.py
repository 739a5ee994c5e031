"""The pipeline step runner: this rank's stages run a schedule through `PipelineExecutor` (pp > 1).

Only the rank holding the last stage computes a loss; the others report zero and `global_mean` counts
the ranks of one stage. Clipping takes the gradient norm over all stages. At the end of a run the
runner gathers every stage's timeline of the last step and reports the measured bubble next to the
analytic one, with a Chrome trace and a timeline picture (rank 0 writes them).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fourfold.config import Config
from fourfold.layout import grad_accumulation_steps
from fourfold.mesh import ParallelMesh
from fourfold.parallel.data_parallel import DataParallel
from fourfold.parallel.grad_norm import clip_across_stages
from fourfold.parallel.pipeline import (PipelineExecutor, analytic_bubble, draw_timeline, pipeline_bubble,
                                        write_chrome_trace)
from fourfold.precision import master_dtype
from fourfold.train.runner.base import REPLICA_DIMS, RunReport, StepRunner, as_plain_tensor


def stage_activation_shape(cfg: Config, mesh: ParallelMesh) -> tuple[int, int, int]:
    """(micro_batch, local sequence, dim): what one stage sends the next, after cp (and sequence-parallel tp) split the sequence."""
    seq = cfg.train.seq_len // mesh.size("cp")
    if mesh.size("tp") > 1 and cfg.parallel.sequence_parallel:
        seq //= mesh.size("tp")
    return cfg.train.micro_batch, seq, cfg.model.dim


class PipelineRunner(StepRunner):
    """The step's micro-batches through this rank's pipeline chunks, in the order parallel.pp_schedule says."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dp: DataParallel, chunks: list[nn.Module],
                 device: torch.device):
        super().__init__(cfg, mesh, dp, chunks, device)
        p = cfg.parallel
        self.executor = PipelineExecutor(
            chunks, p.pp_schedule, mesh.coord("pp"), mesh.size("pp"), p.vpp, grad_accumulation_steps(cfg),
            mesh.group("pp"), self.token_loss, self.device, master_dtype(cfg.compute.precision),
            autocast=self.autocast, scale_loss=self.scaler.scale_loss if self.scaler is not None else None,
            grad_sync=lambda i, last: self.dp.grad_sync(self.chunks[i], last),
            activation_shape=stage_activation_shape(cfg, mesh),
        )

    @staticmethod
    def _one_module(chunks: list[nn.Module]) -> nn.Module:
        return nn.ModuleList(chunks)  # one module for the optimizer and clipping, even with one chunk

    def _sharded(self, batches: list) -> list:
        return batches if self.shard_batch is None else [self.shard_batch(x, y) for x, y in batches]

    def _forward_backward(self, micro_batches: list) -> torch.Tensor:
        self.set_loss_divisor(micro_batches)
        with self.loss_context():
            loss = self.executor.step(self._sharded(micro_batches))
        return as_plain_tensor(loss) if loss is not None else torch.zeros((), device=self.device)

    def evaluate(self, batches: list) -> torch.Tensor:
        """Forward-only passes of n_micro batches at a time (batches repeat to fill the last group)."""
        n = self.executor.n_micro
        batches = [batches[i % len(batches)] for i in range(max(n, len(batches)))]
        batches = batches[:len(batches) // n * n]  # whole groups of n_micro only
        self.set_loss_divisor(batches)  # counted before context parallel splits the targets
        batches = self._sharded(batches)
        total = torch.zeros((), device=self.device)
        groups = [batches[i:i + n] for i in range(0, len(batches), n)]
        with self.loss_context():
            for group in groups:
                out = self.executor.evaluate(group)
                total += as_plain_tensor(out) if out is not None else 0.0
        self._reshard()
        return total / len(groups)

    def _clip(self) -> torch.Tensor:
        return clip_across_stages(self.model.parameters(), self.cfg.optim.grad_clip, self.mesh.group("pp"))

    def _ranks_with_loss(self) -> int:
        return self.mesh.world_size // self.mesh.size("pp")

    @property
    def checkpoint_modules(self) -> list[nn.Module]:
        return self.chunks

    @property
    def checkpoint_shard(self) -> tuple[bool, str]:
        writes, _ = super().checkpoint_shard
        return writes, f"stage{self.mesh.coord('pp')}"

    def report(self, run_dir: Path) -> RunReport | None:
        """Measured vs analytic bubble of the last step, a Chrome trace and a timeline picture (rank 0)."""
        world = self.mesh.world_size
        gathered: list = [None] * world
        dist.all_gather_object(gathered, self.executor.last_timeline)
        if self.mesh.rank != 0:
            return None
        stages = sorted((self.mesh.coords_of(r)["pp"], r) for r in range(world)
                        if all(self.mesh.coords_of(r)[d] == 0 for d in REPLICA_DIMS))
        per_rank = [gathered[r] for _, r in stages]
        p, m = self.cfg.parallel, self.executor.n_micro
        measured = pipeline_bubble(per_rank)
        analytic = analytic_bubble(p.pp_schedule, p.pp, p.vpp, m)
        trace, picture = run_dir / "pp_trace.json", run_dir / "pp_timeline.png"
        report = RunReport(record={"pp_bubble_measured": measured, "pp_bubble_analytic": analytic})
        write_chrome_trace(per_rank, trace)
        try:
            draw_timeline(per_rank, picture, f"{p.pp_schedule}: pp={p.pp} vpp={p.vpp} m={m}, bubble {measured:.1%}")
        except ImportError as e:
            report.lines.append(f"[yellow]No timeline picture: {e}[/]")
        report.lines.append(f"pipeline bubble: measured {measured:.1%}, analytic {analytic:.1%} "
                            f"(trace {trace}, picture {picture})")
        return report
