"""GPU check of fourfold.infer.argmax_gpu against torch.argmax: same ids, and time per call inside a CUDA graph.

    python bench/argmax_check.py --out DIR

For (rows, vocab) shapes of decode steps (llama-1b's 32000 and Llama 3's 128256 vocabulary, 1-256 rows),
bf16 and float32 logits: random values, values rounded so that most rows hold ties, a row of -inf; the
indices must equal torch.argmax's exactly. Then each of the two runs CALLS times in one captured CUDA graph
(the greedy pick as the decode graph runs it): microseconds per call, the median over the replays of
bench/gemv_check.graph_us. Writes argmax_check.json to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import torch  # noqa: E402
from gemv_check import graph_us  # noqa: E402

from fourfold.infer.argmax_gpu import argmax_rows  # noqa: E402

SHAPES = [(1, 32000), (8, 32000), (64, 32000), (256, 32000), (1, 128256), (8, 128256)]
CALLS = 20


def cases(rows: int, vocab: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    noise = torch.randn(rows, vocab, generator=gen)
    ties = (noise * 2).round().clamp(-6, 3)  # many entries equal the row's maximum
    inf_row = noise.clone()
    inf_row[0] = float("-inf")
    return {name: t.to(dtype).cuda() for name, t in (("random", noise), ("ties", ties), ("-inf row", inf_row))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    rows_out, failures = [], 0
    print(f"{'rows':>5s} {'vocab':>7s} {'dtype':>9s} {'equal':>6s} {'torch us':>9s} {'fourfold us':>12s}")
    for rows, vocab in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            inputs = cases(rows, vocab, dtype, gen)
            equal = all(torch.equal(argmax_rows(x), x.argmax(dim=-1)) for x in inputs.values())
            failures += not equal
            x = inputs["random"]
            torch_us = graph_us([lambda: x.argmax(dim=-1)] * CALLS)
            ours_us = graph_us([lambda: argmax_rows(x)] * CALLS)
            rows_out.append({"rows": rows, "vocab": vocab, "dtype": str(dtype), "equal": equal,
                             "torch_us": torch_us, "fourfold_us": ours_us})
            print(f"{rows:5d} {vocab:7d} {str(dtype)[6:]:>9s} {str(equal):>6s} {torch_us:9.2f} {ours_us:12.2f}",
                  flush=True)
    with open(os.path.join(args.out, "argmax_check.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "calls_per_graph": CALLS,
                   "rows": rows_out}, f, indent=2)
    print(f"{len(rows_out) - failures}/{len(rows_out)} shapes equal to torch.argmax")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
