"""GPU memory of a converted int4 model at run time through the engine: one copy of each weight against three.

    python bench/int4_memory_gpu.py --out DIR [--preset llama-1b] [--quant int4-g128]

Three engines, each in a process of its own on the same random-weight checkpoints (bench/generate.py's
model_dir): the bf16 model; the int4 model with FOURFOLD_INT4_ONE_COPY=0 (the default: its linears keep the stored
nibbles and, once steps run, the tensor-core GEMVs' words and the one-row Triton GEMV's planes beside them); the
int4 model with FOURFOLD_INT4_ONE_COPY=1 (fourfold.quant.one_copy: the words only). Each engine sizes its KV pool itself
(gpu_memory_utilization), then greedy requests run at 1, 8, 64 and 200 concurrent sequences (a 256-token prompt
each, so prefill runs 256-row GEMMs), which makes every kernel's copies. Per engine: the KV blocks it got, the bytes
the model holds at run time (torch.cuda.memory_allocated less the pool), the bytes of the int4 linears' own tensors
(buffers and the copies cached beside them, each storage once) against the bf16 bytes of the same weights, the
peak, and the token ids; the driver checks that both int4 engines give the same tokens. Writes
int4_memory.json and int4_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from common import run_variant_process  # noqa: E402

MODES = {"bf16": {}, "int4, three copies": {"FOURFOLD_INT4_ONE_COPY": "0"},
         "int4, one copy": {"FOURFOLD_INT4_ONE_COPY": "1"}}
CONCURRENCY = (1, 8, 64, 200)
PROMPT, NEW = 256, 16


def tensors_of(module) -> list:
    """A module's buffers and the tensors of its kernel caches."""
    import torch

    out = [t for t in module._buffers.values() if t is not None]
    for cache in (module._kernel_cache, module._planes_cache, module._mma_cache):
        for value in cache.values():
            out += [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, torch.Tensor)]
    return out


def child(args) -> None:
    import torch

    from fourfold.infer.llm import LLM
    from fourfold.infer.requests import SamplingParams
    from fourfold.quant.packing import Int4WeightLinear
    from generate import model_dir, prompts_for, preset_vocab

    quant = None if args.mode == "bf16" else args.quant
    ns = types.SimpleNamespace(preset=args.preset, device="cuda", workdir=args.workdir)
    path = model_dir(ns, quant)
    llm = LLM(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=256, max_num_batched_tokens=2048)
    engine = llm.engine
    pool = engine.runner.pool
    pool_bytes = sum(t.numel() * t.element_size() for t in (pool.keys, pool.values))
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, detokenize=False)
    vocab = preset_vocab(ns)
    tokens = {}
    for c in CONCURRENCY:
        results = llm.generate(prompts_for(c, PROMPT, vocab, seed=c), params, progress=False)
        tokens[c] = [r.token_ids for r in results]
    torch.cuda.synchronize()
    model = engine.runner.model
    modules = [m for m in model.modules() if isinstance(m, Int4WeightLinear)]
    bf16 = sum(m.in_features * m.out_features * 2 for m in modules)
    fused = engine.runner.fused
    if fused is not None:
        modules += [lin.packed for _, b in fused.blocks for lin in (b.qkv, b.wo, b.gate_up, b.w2)
                    if lin.packed is not None]
    seen, held = set(), 0
    for m in modules:
        for t in tensors_of(m):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                held += t.untyped_storage().nbytes()
    row = {"mode": args.mode, "kv_blocks": pool.num_blocks, "pool_bytes": pool_bytes,
           "model_bytes": torch.cuda.memory_allocated() - pool_bytes,
           "peak_bytes_over_pool": torch.cuda.max_memory_allocated() - pool_bytes,
           "int4_linear_bytes": held, "int4_linear_bf16_bytes": bf16,
           "words_layout": sum(m.holds_words for m in modules), "int4_modules": len(modules),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens}
    print("RESULT " + json.dumps(row), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-memory")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--quant", default="int4-g128")
    p.add_argument("--workdir", default="/tmp/fourfold-bench")
    p.add_argument("--one", dest="mode", default=None, help=argparse.SUPPRESS)   # the child's
    args = p.parse_args()
    if args.mode is not None:
        child(args)
        return 0
    rows = []
    for mode, env in MODES.items():
        row = run_variant_process(__file__, mode, 1, ["--preset", args.preset, "--quant", args.quant,
                                                      "--workdir", args.workdir],
                                  timeout=400, extra_env=env)
        if "error" in row:
            print(f"{mode}: failed\n{row['error']}")
            return 1
        rows.append(row)
    gib = 2 ** 30
    lines = [f"{args.preset}, {args.quant}, {rows[0]['device']}, torch {rows[0]['torch']}", "",
             "| engine | KV blocks | model GiB at run time | int4 linears GiB (of bf16) | peak over pool GiB |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        share = (f"{r['int4_linear_bytes'] / gib:.3f} ({r['int4_linear_bytes'] / r['int4_linear_bf16_bytes']:.3f})"
                 if r["int4_linear_bf16_bytes"] else "—")
        lines.append(f"| {r['mode']} | {r['kv_blocks']} | {r['model_bytes'] / gib:.3f} | {share} | "
                     f"{r['peak_bytes_over_pool'] / gib:.3f} |")
    three, one = rows[1]["tokens"], rows[2]["tokens"]
    same = {c: sum(a == b for a, b in zip(three[c], one[c])) for c in three}
    lines += ["", "int4 sequences with the same greedy tokens, one copy against three: "
              + ", ".join(f"{same[c]}/{len(three[c])} at {c}" for c in three)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_memory.json").write_text(json.dumps({"rows": rows, "same_tokens": same}, indent=1))
    (out / "int4_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
