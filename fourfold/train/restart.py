"""What a resumed or restarted run decides before its first step: which checkpoint to load, and whether any
training is left to do.

Restarts resume on their own: when torchrun restarts a job's workers (TORCHELASTIC_RESTART_COUNT > 0, as
with `--max-restarts`), the run continues from the newest complete checkpoint of its run directory, whether
or not `--resume` was given (and even if `--resume` named another checkpoint: the run has moved past it). With
no checkpoint yet it starts again from step 0. A first attempt resumes only when asked (`--resume`).

Nothing left to do: resuming a checkpoint at or past `train.steps` is a user error (exit 2) that says to
raise `--train.steps`, except on an automatic restart that finds the run already finished (a rank died after
the final checkpoint), which ends at once, successfully.
"""

from __future__ import annotations

from pathlib import Path

from fourfold.checkpoint.store import latest_checkpoint
from fourfold.errors import ConfigError


def resume_target(resume: bool | str, run_dir: Path, attempt: int) -> bool | str:
    """What to resume from on attempt `attempt` (0: the first): `resume` as given on the first attempt; on a
    restart the newest checkpoint of `run_dir` ('latest') when there is one, else `resume` as given."""
    if attempt > 0 and latest_checkpoint(run_dir) is not None:
        return "latest"
    return resume


def restart_message(attempt: int, resume: bool | str, step: int) -> str | None:
    """The line a restarted run prints about where it continues, or None on a first attempt."""
    if attempt == 0:
        return None
    if step == 0:
        return f"Restart {attempt} (torchrun): no checkpoint yet, training again from step 0."
    return f"Restart {attempt} (torchrun): continuing from the newest checkpoint, step {step}."


def work_left(step: int, steps: int, automatic: bool, source: str) -> bool:
    """Whether a run resumed at `step` has steps to train up to `steps`.

    False only for an automatic restart of a finished run (`step == steps`); a resume at or past `steps`
    otherwise raises ConfigError naming `source` (the checkpoint) and what to change.
    """
    if step < steps:
        return True
    if automatic and step == steps:
        return False
    raise ConfigError(f"The checkpoint {source} is at step {step} and train.steps is {steps}: there is nothing "
                      f"left to train. Pass --train.steps greater than {step} to continue training from it (the "
                      "learning-rate schedule follows the new total), or leave out --resume to start a new run.")
