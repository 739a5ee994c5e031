"""Batch-1 decode ms/step as bench/generate.py times it, with the default KV pool and with a small one (GPU).

    python bench/decode_pool_size_gpu.py [--quant int4-g128] [--blocks 0 4096] | tee pool.log

For each --blocks value (0: the engine's default, `gpu_memory_utilization` 0.9 of the GPU, ~240k llama-1b blocks
on an H200) runs generate.py's own fourfold child routine (`run_fourfold`: warm-up, a 128 + 256-token request,
three long/short pairs, the decode graph alone) in this process on an engine whose pool has that many blocks, and
prints the RESULT row. Each value runs on a fresh engine; the order is as given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import generate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default=None, help="a fourfold.quant scheme (e.g. int4-g128); default bf16")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 4096])
    args = parser.parse_args()
    setup = argparse.Namespace(workdir="/tmp/fourfold-bench-generate", preset="llama-1b", device="cuda",
                               max_num_seqs=256, max_batched_tokens=4096, prompt_len=128, new_tokens=256,
                               no_fused=False, no_overlap=False, no_look_ahead=False, gemv_rows=None,
                               int4_gemv_rows=None, int4_fused_norms=None, graphs="auto", decode_shortcuts="on",
                               concurrency=[1], profile=False)
    build = generate.build_llm
    for blocks in args.blocks:
        generate.say(f"PROGRESS num_kv_blocks={blocks} (0: the default pool)")
        generate.build_llm = lambda a, quant=None, **config: build(a, quant, num_kv_blocks=blocks, **config)
        generate.run_fourfold(setup, args.quant)


if __name__ == "__main__":
    main()
