"""Does every program of a decode GEMV reading the same activation row cost time? A probe on one GPU.

    python bench/x_broadcast_floor.py --json F        # one H200; prints us per link

At one token row every program of a decode GEMV reads the whole input row (llama-1b: 2048 bf16, 4 KiB) right
after its dependency wait, so hundreds of programs ask the L2 for the same 32 lines at once. This times chains of
dependent kernels (programmatic dependent launch, as fourfold's kernels) in which each kernel waits, reads the row
the one before wrote, and writes the next row:
- `own`: each program reads only the 2048/P values it writes (no broadcast; the floor of a dependent link);
- `shared`: each program reads the whole row (the decode GEMVs' pattern);
- `replicas R`: the row is written R times and program p reads copy p % R (fewer programs a line).
If `shared` costs more than `own` and replicas win it back, producers writing copies of their outputs is a lever.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import graph_us  # noqa: E402

from fourfold.ops.triton_launch import pdl, pdl_signal, pdl_wait, triton  # noqa: E402

import triton.language as tl  # noqa: E402

DIM = 2048
DEV = torch.device("cuda")


@triton.jit
def _row_link(src, dst, REPLICAS: tl.constexpr, SHARED: tl.constexpr, CHUNK: tl.constexpr, DIM: tl.constexpr,
              PDL: tl.constexpr):
    """Program p writes values [p*CHUNK, (p+1)*CHUNK) of the next row (to every replica), each its input value
    plus a tiny multiple of the sum over the whole row it read (SHARED) or over its own chunk."""
    pdl_signal(PDL)
    p = tl.program_id(0)
    mine = p * CHUNK + tl.arange(0, CHUNK)
    pdl_wait(PDL)
    base = src + (p % REPLICAS) * DIM
    if SHARED:
        s = tl.sum(tl.load(base + tl.arange(0, DIM)).to(tl.float32), axis=0)
    else:
        s = 0.0
    x = tl.load(base + mine).to(tl.float32)
    if not SHARED:
        s = tl.sum(x, axis=0)
    y = (x + s * 1e-6).to(tl.bfloat16)
    for r in tl.static_range(REPLICAS):
        tl.store(dst + r * DIM + mine, y)


def link_us(programs: int, replicas: int, shared: bool) -> float:
    """us per link of a chain of 96 dependent kernels of `programs` programs."""
    a, b = (torch.randn(replicas * DIM, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    use = pdl(DEV)

    def one(src, dst):
        _row_link[(programs,)](src, dst, REPLICAS=replicas, SHARED=shared, CHUNK=DIM // programs, DIM=DIM,
                               PDL=use, num_warps=4, launch_pdl=use)
    return graph_us([lambda i=i: one(a, b) if i % 2 == 0 else one(b, a) for i in range(96)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "pdl": pdl(DEV), "us": {}}
    for programs in (128, 256, 512, 1024):
        for name, replicas, shared in (("own", 1, False), ("shared", 1, True), ("replicas 4", 4, True),
                                       ("replicas 16", 16, True)):
            us = results["us"][f"{programs} {name}"] = link_us(programs, replicas, shared)
            print(f"{programs:5d} programs, {name:12s}: {us:6.2f} us a link", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
