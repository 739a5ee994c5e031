"""Between backward and the optimizer step: skip a step whose loss or gradients are NaN/inf, and notice SIGTERM.

    guard = StepGuard(cfg.train.max_bad_steps, device, catch_sigterm=True)
    guard.watch_sigterm()                        # SIGTERM now sets a flag instead of killing the process
    skip = guard.check(loss, grad_norm, scaler_skipped, step)   # every rank gets the same answer
    if not skip:
        optimizer.step()
    if guard.stop_signal: ...                    # some rank got SIGTERM: all checkpoint, then stop
    guard.unwatch_sigterm()

Agreement: each rank contributes two flags (its loss or the global gradient norm is not finite, or the fp16
loss scaler skipped; it received SIGTERM) to one all-reduce (MAX) of two numbers per step, so all ranks
skip the same steps and stop after the same step. This costs one tiny collective and one host
synchronisation per step. A skipped step still counts: the data moves on and the learning-rate schedule
advances, but no weight or optimizer state changes. After `max_bad_steps` skipped steps in a row the run
stops with `TrainingError` (0 never stops).

SIGTERM (a preemption, or torchrun shutting the workers down): the handler only records the signal and
puts back the previous handler, so a second SIGTERM acts at once. The trainer finishes the step, saves a
checkpoint and stops (exit code 143 from the command line). torchrun gives workers 30 s after its SIGTERM
before it sends SIGKILL.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from fourfold.errors import TrainingError


class StepGuard:
    """Counts skipped steps, stops after too many in a row, and turns SIGTERM into a stop request all ranks share."""

    def __init__(self, max_bad_steps: int, device: torch.device, catch_sigterm: bool = True):
        self.max_bad_steps, self.device, self.catch_sigterm = max_bad_steps, device, catch_sigterm
        self.skipped_steps = 0
        """Steps skipped since the run began (restored on resume)."""
        self.bad_in_a_row = 0
        self.stop_signal: int | None = None
        """The signal every rank agreed to stop on (set by `check`), else None."""
        self._received: int | None = None
        self._previous = None

    # ----- per step -----------------------------------------------------------------------------
    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, scaler_skipped: bool, step: int) -> bool:
        """Whether step `step` must skip its optimizer step (every rank gets the same answer); raises
        TrainingError after `max_bad_steps` skipped steps in a row."""
        finite = torch.isfinite(_plain(loss)).all() & torch.isfinite(_plain(grad_norm)).all()
        flags = torch.stack([(~finite).to(self.device, torch.float32),
                             torch.tensor(float(self._received or 0), device=self.device)])
        if scaler_skipped:
            flags[0] = 1.0
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, received = flags.tolist()  # the step's one host synchronisation
        bad, received = bool(bad), int(received)
        if received:
            self.stop_signal = received
        if not bad:
            self.bad_in_a_row = 0
            return False
        self.skipped_steps += 1
        self.bad_in_a_row += 1
        if self.max_bad_steps and self.bad_in_a_row >= self.max_bad_steps:
            raise TrainingError(
                f"{self.bad_in_a_row} steps in a row, up to step {step}, had a NaN or infinite loss or gradient norm "
                f"(train.max_bad_steps {self.max_bad_steps}); every one was skipped, so the weights are those "
                "before the first of them. Lower optim.lr or raise optim.warmup_steps, check the data at these "
                "steps, use compute.precision bf16 instead of fp16, or raise train.max_bad_steps (0 never stops).")
        return True

    # ----- SIGTERM ------------------------------------------------------------------------------
    def watch_sigterm(self) -> None:
        """From now on SIGTERM records a stop request (main thread only; elsewhere nothing changes)."""
        if not self.catch_sigterm or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def record(signum, frame):
            self._received = signum
            signal.signal(signal.SIGTERM, previous)  # a second SIGTERM acts at once

        self._previous = previous
        signal.signal(signal.SIGTERM, record)

    def unwatch_sigterm(self) -> None:
        """Put back the SIGTERM handler `watch_sigterm` replaced."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    # ----- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The skip counters, for checkpoints (JSON)."""
        return {"skipped_steps": self.skipped_steps, "bad_in_a_row": self.bad_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s counters (missing keys, from older checkpoints, read as 0)."""
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.bad_in_a_row = int(state.get("bad_in_a_row", 0))


def _plain(t) -> torch.Tensor:
    """A loss or norm as an ordinary detached tensor (a replicated DTensor becomes its full value)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else torch.as_tensor(t)
    return t.detach()
