"""The training loop behind `fourfold train`: set up the layout, then step, log, validate and checkpoint.

    from fourfold.train.trainer import train
    summary = train(cfg, out_dir="runs/demo", resume=False)

The same function runs in one process or under torchrun; the layout in `cfg.parallel` decides how the
model is split. Losses are reported as the mean over the whole global batch, so every layout prints the
same numbers as one process.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from fourfold.checkpoint.async_save import AsyncSaver
from fourfold.checkpoint.init_from import config_with_init_model, load_init_weights
from fourfold.checkpoint.resume import check_data_position, data_signature, resume_from
from fourfold.checkpoint.store import save_checkpoint
from fourfold.config import Config
from fourfold.config_text import to_toml
from fourfold.distributed import DistEnv, init_distributed, world_from_env
from fourfold.hardware import peak_flops, peak_memory_bytes, reset_peak_memory
from fourfold.layout import grad_accumulation_steps, validate_layout
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import parameter_counts, training_flops_per_token
from fourfold.optim import lr_at, set_lr
from fourfold.parallel.build import build_model
from fourfold.parallel.data_parallel import build_data_parallel
from fourfold.plan.memory import MEASURED_KEYS, estimate_memory
from fourfold.plan.recompute_cost import recompute_summary, without_recompute
from fourfold.train.dataset import build_data
from fourfold.train.metrics import MetricsWriter, TrainProgress
from fourfold.train.runner import StepResult, StepRunner, build_runner
from fourfold.units import format_bytes


@dataclass
class TrainSummary:
    """What a finished run reports back (rank 0 has the real values)."""

    run_dir: Path
    steps: int
    first_loss: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    losses: list[float] = field(default_factory=list)


def default_run_dir() -> Path:
    """runs/<timestamp>: where a run goes when --out is not given."""
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class Trainer:
    """Owns the data, the schedule, metrics and checkpoints of one run; its step runner owns the model.

    The runner (`fourfold.train.runner`, picked once from the layout) computes each step's gradients;
    the trainer sets the learning rate, steps the optimizer, logs, validates and checkpoints, the same
    way for every layout.
    """

    def __init__(self, cfg: Config, run_dir: Path, resume: bool | str = False, console: Console | None = None):
        cfg = config_with_init_model(cfg)  # checkpoint.init_from: the model's shape is the checkpoint's
        self.cfg = cfg
        # The layout is checked against the world size before any process group exists.
        validate_layout(cfg, world_from_env()[1])
        self.env: DistEnv = init_distributed(cfg.compute.device)
        self.console = console or Console()
        self.is_main = self.env.is_main
        self.mesh = ParallelMesh.build(cfg, self.env.world_size, self.env.rank, self.env.device.type)
        self.run_dir = Path(run_dir)
        self.device = self.env.device
        torch.manual_seed(cfg.train.seed)
        self._setup_run_dir()
        self._setup_data()
        self._setup_model()
        self.step = 0
        self.loaded_from: Path | None = None  # the checkpoint this run resumed from: keep-K never deletes it
        self.saver = AsyncSaver() if cfg.checkpoint.async_save else None
        if cfg.checkpoint.init_from:
            load_init_weights(cfg.checkpoint.init_from, self.runner.checkpoint_modules, self.run_dir)
            self._log(f"Initial weights from {cfg.checkpoint.init_from}.")
        if resume:
            self._resume(resume)
        self.metrics = MetricsWriter(self.run_dir, cfg.log.tensorboard, self.console) if self.is_main else None

    # ----- set-up -------------------------------------------------------------------------------
    def _setup_run_dir(self) -> None:
        if self.is_main:
            (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(self.cfg))
        self._barrier()

    def _setup_data(self) -> None:
        dp_rank, dp_world = self.mesh.data_parallel_rank, self.mesh.data_parallel_size
        if self.is_main:
            build_data(self.cfg, dp_rank, dp_world, is_writer=True)
        self._barrier()
        self.tokenizer, self.train_batches, self.val_batches = build_data(self.cfg, dp_rank, dp_world,
                                                                          is_writer=False)

    def _setup_model(self) -> None:
        cfg = self.cfg
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)
        self.dp = build_data_parallel(self.mesh, cfg.parallel, cfg.optim, self.device)
        chunks = build_model(cfg.model, cfg.parallel, cfg.compute, cfg.quant, self.mesh, self.dp, self.device,
                             seed=cfg.train.seed)
        self.runner: StepRunner = build_runner(cfg, self.mesh, self.dp, chunks, self.device)
        self.model, self.optimizer, self.scaler = self.runner.model, self.runner.optimizer, self.runner.scaler

    def _data_signature(self) -> dict:
        """What the saved data position depends on (checked on resume)."""
        dataset = getattr(self.train_batches, "dataset", None)
        sequences = len(dataset) if hasattr(dataset, "__len__") else None
        return data_signature(self.cfg.train.global_batch, self.cfg.train.seq_len, self.cfg.data.path, sequences)

    def _resume(self, resume: bool | str) -> None:
        path, meta = resume_from(self.run_dir, resume, self.runner.checkpoint_modules, self.optimizer, self._log,
                                 verify=self.cfg.checkpoint.verify)
        if path is None:
            self._log(f"[yellow]--resume: no checkpoint in {self.run_dir / 'checkpoints'}; starting from step 0.[/]")
            return
        check_data_position(meta, path, self._data_signature())
        self.loaded_from = path
        self.step = int(meta["step"])
        self.train_batches.load_state_dict(meta["data"])
        if self.scaler is not None and "loss_scaler" in meta:
            self.scaler.load_state_dict(meta["loss_scaler"])
        self._log(f"Resumed from {path} at step {self.step}.")

    # ----- helpers ------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _log(self, text: str) -> None:
        if self.is_main:
            self.console.print(text)

    # ----- the loop -----------------------------------------------------------------------------
    def train_step(self, micro: list | None = None) -> StepResult:
        """One optimizer step: returns (mean loss on this rank, gradient norm, skipped) as tensors/flags.

        `micro`: this rank's (inputs, targets) micro-batches for the step; by default the next ones from
        the training data (benchmarks pass their own, e.g. to probe the largest micro-batch).
        """
        cfg = self.cfg
        set_lr(self.optimizer, lr_at(self.step, cfg.optim, cfg.train.steps))
        if micro is None:
            micro = self.train_batches.next_step()
        result = self.runner.step(micro)
        if not result.skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def run(self, until: int | None = None) -> TrainSummary:
        """Train to cfg.train.steps (or stop early after step `until`, as an interrupted run would)."""
        cfg = self.cfg
        stop = cfg.train.steps if until is None else min(until, cfg.train.steps)
        tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self._print_start()
        progress = TrainProgress(cfg.train.steps, self.step, self.is_main and cfg.log.progress, self.console)
        summary = TrainSummary(run_dir=self.run_dir, steps=cfg.train.steps)
        reset_peak_memory(self.device)
        t_last, steps_since = time.perf_counter(), 0
        try:
            while self.step < stop:
                loss, grad_norm, skipped = self.train_step()
                self.step += 1
                steps_since += 1
                last = self.step == cfg.train.steps
                record = None
                if self.step % cfg.log.every == 0 or last or self.step == 1:
                    record = self._record(loss, grad_norm, skipped, tokens_per_step * steps_since,
                                          time.perf_counter() - t_last)
                    summary.losses.append(record["loss"])
                    summary.first_loss = summary.first_loss if summary.first_loss is not None else record["loss"]
                    summary.last_loss, summary.tokens_per_s = record["loss"], record["tokens_per_s"]
                    if self.step == 1:
                        self._print_memory()
                    t_last, steps_since = time.perf_counter(), 0
                if cfg.train.val_every and (self.step % cfg.train.val_every == 0 or last) and self.val_batches:
                    summary.val_loss = self._validate()
                    t_last = time.perf_counter()
                if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or (last and cfg.checkpoint.save_final):
                    self.save()
                    t_last = time.perf_counter()
                progress.update(self.step, record)
            self._finish_saving()
            self._report_runner()
        finally:
            if self.saver is not None and self.saver.pending:
                with contextlib.suppress(Exception):  # training failed: let a save in flight finish, keep its error
                    self.saver.wait()
            progress.close()
            if self.metrics is not None:
                self.metrics.close()
        return summary

    def _report_runner(self) -> None:
        """The runner's end-of-run report (e.g. the pipeline bubble), into the metrics and onto the console."""
        report = self.runner.report(self.run_dir)
        if report is None:
            return
        if self.metrics is not None and report.record:
            self.metrics.write({"step": self.step, **report.record})
        for line in report.lines:
            self._log(line)

    def _record(self, loss, grad_norm, skipped, tokens, elapsed) -> dict:
        tokens_per_s = tokens / max(elapsed, 1e-9)
        peak = peak_flops(self.device)
        mfu = self.flops_per_token * tokens_per_s / (peak * self.env.world_size) if peak else None
        record = {
            "step": self.step,
            "loss": self.runner.global_mean(loss),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.env.world_size,
            "mfu": mfu,
            "peak_mem_bytes": peak_memory_bytes(self.device),
        }
        if self.scaler is not None:
            record["loss_scale"] = float(self.scaler.scale)
            record["skipped_steps"] = self.scaler.skipped_steps
        if self.metrics is not None:
            self.metrics.write(record)
        return record

    def _validate(self) -> float:
        self.model.eval()
        val = self.runner.global_mean(self.runner.evaluate(self.val_batches))
        self.model.train()
        if self.metrics is not None:
            self.metrics.write({"step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))})
        self._log(f"step {self.step}: validation loss {val:.4f}, perplexity {math.exp(min(val, 50.0)):.2f}")
        return val

    def save(self) -> Path:
        """Write a checkpoint of the current step (every rank takes part; with checkpoint.async_save in the
        background); returns its directory. Logs ckpt_stall_s (training stalled) and ckpt_save_s (writing)."""
        meta = {"step": self.step, "config": self.cfg.to_dict(), "data": self.train_batches.state_dict(),
                "data_signature": self._data_signature(), "tokenizer": self.cfg.data.tokenizer}
        if self.scaler is not None:
            meta["loss_scaler"] = self.scaler.state_dict()
        args = (self.run_dir, self.step, self.runner.checkpoint_modules, self.optimizer, meta,
                self.cfg.checkpoint.keep)
        protect = [self.loaded_from] if self.loaded_from else []
        begin = time.perf_counter()
        if self.saver is None:
            path = save_checkpoint(*args, protect=protect)
            seconds = time.perf_counter() - begin
            self._write_metrics({"step": self.step, "ckpt_stall_s": seconds, "ckpt_save_s": seconds})
            return path
        previous = self.saver.wait()
        if previous is not None:
            self._write_metrics({"step": self._saving_step, "ckpt_save_s": previous})
        self.saver.save(*args, protect=protect)
        self._saving_step = self.step
        self._write_metrics({"step": self.step, "ckpt_stall_s": time.perf_counter() - begin})
        return self.run_dir / "checkpoints" / f"step_{self.step}"

    def _finish_saving(self) -> None:
        """Wait for an asynchronous save still in flight (the end of training)."""
        seconds = self.saver.wait() if self.saver is not None else None
        if seconds is not None:
            self._write_metrics({"step": self._saving_step, "ckpt_save_s": seconds})

    def _write_metrics(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def _print_start(self) -> None:
        if not self.is_main:
            return
        cfg = self.cfg
        n_params, _ = parameter_counts(cfg.model)
        lines = [
            f"[bold]fourfold[/] run dir [cyan]{self.run_dir}[/]",
            f"layout {self.mesh.describe()} on {self.env.world_size} x {self.device.type}; "
            f"precision {cfg.compute.precision}; recompute {cfg.compute.recompute}",
            f"batch: global {cfg.train.global_batch} seqs x {cfg.train.seq_len} tokens, micro {cfg.train.micro_batch}, "
            f"grad accumulation {grad_accumulation_steps(cfg)}",
        ]
        lines.append(f"model: {n_params / 1e6:.2f}M parameters, {self.flops_per_token / 1e6:.1f} MFLOP/token")
        self.console.print("\n".join(lines))
        estimate = self._memory_estimate()
        if estimate is not None:
            self.console.print(estimate.table())
        if cfg.compute.recompute != "none" and estimate is not None:
            baseline = self._memory_estimate(cfg=without_recompute(cfg))
            if baseline is not None:
                self.console.print(recompute_summary(cfg, estimate, baseline).line())

    def _memory_estimate(self, rank: int | None = None, cfg: Config | None = None):
        """The memory prediction for this layout (or `cfg`'s), or None (with a warning) if the model cannot handle it.

        The prediction is advice: a shape or option it does not model must never stop a training run.
        """
        try:
            return estimate_memory(cfg or self.cfg, self.env.world_size, rank)
        except Exception as e:  # noqa: BLE001 - report and train on
            self._log(f"[yellow]memory prediction unavailable for this layout: {e}[/]")
            return None

    def _print_memory(self) -> None:
        report = self.dp.memory_report(self.model, self.optimizer)
        if not self.is_main:
            return
        peak = peak_memory_bytes(self.device)
        est = self._memory_estimate(self.env.rank)
        parts = []
        for key, value in report.items():
            name = MEASURED_KEYS.get(key) if est is not None else None
            predicted = f" (predicted {format_bytes(getattr(est, name))})" if name else ""
            parts.append(f"{key.replace('_bytes', '')} {format_bytes(value)}{predicted}")
        # On CPUs the peak is the process's resident set, not comparable with the prediction.
        peak_predicted = f" (predicted {format_bytes(est.total)})" if est and self.device.type == "cuda" else ""
        self.console.print(f"rank 0 holds {', '.join(parts)}; measured peak {format_bytes(peak)}{peak_predicted}")


def train(cfg: Config, out_dir: str | Path | None = None, resume: bool | str = False,
          console: Console | None = None) -> TrainSummary:
    """Train with `cfg`; writes the run directory; returns a summary."""
    run_dir = Path(out_dir) if out_dir else default_run_dir()
    trainer = Trainer(cfg, run_dir, resume=resume, console=console)
    return trainer.run()


@contextlib.contextmanager
def quiet_nonzero_ranks():
    """Silence stdout on ranks other than 0 (their errors still go to stderr)."""
    if int(os.environ.get("RANK", "0")) == 0:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield
        sys.stdout.flush()
