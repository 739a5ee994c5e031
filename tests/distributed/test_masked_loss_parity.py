"""Chat data's masked loss trains the same on every layout as in one process (gloo, float64).

The data are chat JSONL records of very different lengths (some truncated, some mostly padding, plain
text records among them), so micro-batches and data ranks hold different numbers of trained tokens: a
layout that averaged per-micro-batch or per-rank means instead of the global batch's token mean, lost
the mask under vocab-parallel loss, context parallel's sequence split or the last pipeline stage, or
let padding into the loss would differ from one process. Losses, gradient norms, final weights and the
validation loss are compared with the single-process run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fourfold.testing import LAYOUTS, PARITY_OVERRIDES, PARITY_STEPS, PARITY_TOLERANCE, ParityLayout
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import assert_matches_reference, run_results, tiny_config, train_on_rank

LAYOUTS_UNDER_TEST = {
    "fsdp2": LAYOUTS["fsdp2"],
    "tp2": LAYOUTS["tp2"],
    "tp2-sp": LAYOUTS["tp2-sp"],
    "cp2": LAYOUTS["cp2"],
    "pp2-1f1b": LAYOUTS["pp2-1f1b"],
    "dp2-tp2": ParityLayout(4, {"parallel.dp": 2, "parallel.tp": 2}),
}
SLOW = {"dp2-tp2", "tp2"}


def write_chat_data(path: Path) -> Path:
    """24 records: 22 conversations of 1 or 2 turns with answers of 2 to 46 characters, and 2 text records."""
    records = []
    for i in range(22):
        turns = 2 if i % 4 == 3 else 1
        messages = [{"role": "system", "content": "Be kind."}] if i % 4 == 0 else []
        for t in range(turns):
            messages.append({"role": "user", "content": f"q{i}.{t}" + "?" * (i % 5)})
            messages.append({"role": "assistant", "content": ("abc " * 20)[: 2 + (i * 13 + t * 7) % 45]})
        records.append({"messages": messages})
        if i in (5, 13):
            records.append({"text": "plain text record " * (1 + i % 3)})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("masked")
    data = write_chat_data(tmp / "chat.jsonl")
    overrides = {**PARITY_OVERRIDES, "data.path": str(data), "train.seq_len": 128, "model.max_seq_len": 128,
                 "data.val_fraction": 0.05, "train.val_every": PARITY_STEPS, "train.val_batches": 2}
    run = tmp / "single"
    train(tiny_config(tmp, **overrides), run)
    return tmp, overrides, run_results(run), val_losses(run)


def val_losses(run_dir: Path) -> list[float]:
    return [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]


def test_the_data_really_is_masked_and_uneven(chat_setup):
    """The premise: targets are partly ignored, and unevenly so across the micro-batches of a step."""
    from fourfold.ops.cross_entropy import IGNORE_INDEX
    from fourfold.train.dataset import build_data

    tmp, overrides, _, _ = chat_setup
    _, batches, _ = build_data(tiny_config(tmp, **overrides), 0, 1, is_writer=True)
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in batches.next_step()]
    assert len(set(counts)) > 1 and 0 < sum(counts) < 8 * 128 / 2


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW else ())
                                  for n in LAYOUTS_UNDER_TEST])
def test_masked_loss_matches_single_process(name, chat_setup):
    tmp, overrides, ref, ref_val = chat_setup
    layout = LAYOUTS_UNDER_TEST[name]
    run_ranks(train_on_rank, layout.ranks, args=(str(tmp), {**overrides, **layout.overrides}, name))
    assert_matches_reference(tmp / name, ref)
    rtol, atol = PARITY_TOLERANCE["loss"]
    assert len(ref_val) == 1
    torch.testing.assert_close(torch.tensor(val_losses(tmp / name)), torch.tensor(ref_val), rtol=rtol, atol=atol)
