"""The rotary + KV-write kernel at several tokens a program: same bits as one, and its time by step size (one GPU).

    python bench/rotary_check.py --out DIR [--tokens 8,64,256,1024,4096] [--per-program 1,2,4,8,16,32]

llama-1b's heads (32 query, 4 KV, head dim 64), bf16, a pool of 8192 16-slot blocks, random positions below 4096 and
distinct random slots. For each step size and each (tokens a program, warps) setting, fused_ops.rotary_kv_write's
rotated queries and pool must equal the one-token-a-program kernel's bit for bit; its time is the mean of 22
launches (a model's layers) in a CUDA graph replayed 50 times. The default rule's choice (fused_ops.ROTARY_TOKENS,
ROTARY_WARPS) is marked. Writes rotary.json and rotary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH)]

LAYERS, REPLAYS = 22, 50
HQ, HKV, D, BLOCKS, BLOCK_SIZE = 32, 4, 64, 8192, 16


def step(tokens: int, device):
    import torch

    gen = torch.Generator().manual_seed(tokens)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.outer(torch.arange(4096).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return dict(qkv=torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16).to(device),
                positions=torch.randint(0, 4096, (tokens,), generator=gen).to(device),
                cos=angles.cos().to(device), sin=angles.sin().to(device),
                k_cache=torch.zeros(BLOCKS, BLOCK_SIZE, HKV, D, dtype=torch.bfloat16, device=device),
                v_cache=torch.zeros(BLOCKS, BLOCK_SIZE, HKV, D, dtype=torch.bfloat16, device=device),
                slot_mapping=torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:tokens].to(device))


def call(s):
    from fourfold.infer import fused_ops

    return fused_ops.rotary_kv_write(s["qkv"], s["positions"], s["cos"], s["sin"], s["k_cache"], s["v_cache"],
                                     s["slot_mapping"], HQ, HKV)


def graph_us(s) -> float:
    """Mean us a launch: LAYERS launches in a CUDA graph, replayed REPLAYS times."""
    import torch

    for _ in range(2):
        call(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            call(s)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * LAYERS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/rotary")
    p.add_argument("--tokens", default="8,64,256,1024,4096")
    p.add_argument("--per-program", default="1,2,4,8,16,32")
    p.add_argument("--warps", default="1,2,4")
    args = p.parse_args()
    import torch

    from fourfold.infer import fused_ops

    device = torch.device("cuda")
    default_rule, default_warps = fused_ops.ROTARY_TOKENS, dict(fused_ops.ROTARY_WARPS)
    rows, checks, failures = [], 0, 0
    for tokens in [int(t) for t in args.tokens.split(",")]:
        s = step(tokens, device)
        chosen = (fused_ops.rotary_tokens_per_program(tokens), None)
        chosen = (chosen[0], default_warps.get(chosen[0], 4))
        fused_ops.ROTARY_TOKENS, fused_ops.ROTARY_WARPS = ((None, 1),), {1: 1}
        q_ref = call(s)
        k_ref, v_ref = s["k_cache"].clone(), s["v_cache"].clone()
        for block_t in [int(b) for b in args.per_program.split(",")]:
            for warps in [int(w) for w in args.warps.split(",")]:
                fused_ops.ROTARY_TOKENS, fused_ops.ROTARY_WARPS = ((None, block_t),), {block_t: warps}
                s["k_cache"].zero_()
                s["v_cache"].zero_()
                q = call(s)
                same = bool(torch.equal(q, q_ref) and torch.equal(s["k_cache"], k_ref)
                            and torch.equal(s["v_cache"], v_ref))
                checks, failures = checks + 1, failures + (not same)
                rows.append({"tokens": tokens, "per_program": block_t, "warps": warps, "same_bits": same,
                             "us": graph_us(s), "default": (block_t, warps) == chosen})
        fused_ops.ROTARY_TOKENS, fused_ops.ROTARY_WARPS = default_rule, default_warps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"rotary + KV write, llama-1b heads, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
             f"us a launch ({LAYERS} in a graph); * = the default rule's choice; bit-equal to one token a program: "
             f"{checks - failures}/{checks}", "",
             "| tokens | tokens a program | warps | us | same bits |", "|---:|---:|---:|---:|---|"]
    for r in rows:
        mark = " *" if r["default"] else ""
        lines.append(f"| {r['tokens']} | {r['per_program']} | {r['warps']} | {r['us']:.2f}{mark} | "
                     f"{'yes' if r['same_bits'] else 'NO'} |")
    best = {}
    for r in rows:
        if r["same_bits"] and (r["tokens"] not in best or r["us"] < best[r["tokens"]]["us"]):
            best[r["tokens"]] = r
    lines += ["", "best by step size: " + "; ".join(f"{t}: {b['per_program']} x {b['warps']} warps {b['us']:.2f} us"
                                                      for t, b in best.items())]
    (out / "rotary.json").write_text(json.dumps(rows, indent=1))
    (out / "rotary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
