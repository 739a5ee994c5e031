"""GPU check and timing of decode attention in 2 kernels against rotary_kv_write + paged_attention (3 kernels).

    python bench/decode_attention_check.py --out DIR [--layers 22] [--max-model-len 2048] [--sweep]

Shapes: `llama-1b` attention (hq 32, hkv 4, head_dim 64, block size 16, bf16), batches 1/4/16/64, contexts
128..2048; the block tables are as wide as a captured decode graph's (--max-model-len / 16), since the
split count (attention_gpu.decode_splits, the same for both paths) follows the table width. 1. Parity, per
(batch, context): fourfold.infer.decode_attention_gpu (rotary + KV write + attention, then attention_gpu's
combine) against fourfold.infer.fused_ops.rotary_kv_write + fourfold.infer.attention_gpu.paged_attention on
copies of one pool: the pools afterwards must be equal bit for bit, the outputs within 2e-2 (bf16; max abs
diff and relative error printed; whether they are bit-equal too is reported, not required), a second call
equal to the first, outputs and partials poisoned (NaN) before each run. 2. Timing: `--layers` back-to-back
calls, each layer with its own pool and q|k|v rows as in a decode step, captured in one CUDA graph per path
and replayed 30 times; median us per layer, old / new ratio; after the replays the graph's outputs are
checked against an eager run. 3. `--sweep`: the new path at forced split counts 1..32 (batch 1, 4, 16);
`--sweep-three`: the three-kernel path at forced split counts 1..16 (batch 16..128); `--skip-checks`: sweeps only.
Writes decode_attention_check.json; prints a table. Exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import graph_run  # noqa: E402

from fourfold.infer import attention_gpu, decode_attention_gpu  # noqa: E402
from fourfold.infer.fused_ops import rotary_kv_write  # noqa: E402

HQ, HKV, D, BS = 32, 4, 64, 16
BATCHES = (1, 4, 16, 64)
CONTEXTS = (128, 512, 1024, 2048)
TOL = 2e-2
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


class Step:
    """One decode step's tensors, shared by all layers as in the engine: shuffled pages, a scratch last block."""

    def __init__(self, batch: int, context: int, width: int, gen: torch.Generator):
        per_seq = -(-context // BS)
        self.blocks = batch * per_seq + 1
        order = torch.randperm(self.blocks - 1, device=DEV, generator=gen).int()
        self.tables = torch.full((batch, width), self.blocks - 1, dtype=torch.int32, device=DEV)
        self.tables[:, :per_seq] = order[:batch * per_seq].view(batch, per_seq)
        self.positions = torch.full((batch,), context - 1, dtype=torch.long, device=DEV)
        self.slots = self.tables[:, (context - 1) // BS].long() * BS + (context - 1) % BS
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
        self.starts = torch.arange(batch + 1, dtype=torch.int32, device=DEV)


class Layer:
    """One layer's pool and q|k|v rows for a step."""

    def __init__(self, step: Step, gen: torch.Generator):
        self.step = step
        batch = step.tables.shape[0]
        self.k = torch.randn(step.blocks, BS, HKV, D, device=DEV, dtype=DTYPE, generator=gen)
        self.v = torch.randn(step.blocks, BS, HKV, D, device=DEV, dtype=DTYPE, generator=gen)
        self.qkv = torch.randn(batch, (HQ + 2 * HKV) * D, device=DEV, dtype=DTYPE, generator=gen)


def rope(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    angles = torch.outer(torch.arange(length, device=DEV).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def old_step(layer: Layer, cos, sin, k=None, v=None) -> torch.Tensor:
    (k, v), st = (layer.k, layer.v) if k is None else (k, v), layer.step
    q = rotary_kv_write(layer.qkv, st.positions, cos, sin, k, v, st.slots, HQ, HKV)
    return attention_gpu.paged_attention(q, k, v, st.tables, st.seq_lens, st.starts, D ** -0.5)


def new_step(layer: Layer, cos, sin, k=None, v=None, splits=None) -> torch.Tensor:
    (k, v), st = (layer.k, layer.v) if k is None else (k, v), layer.step
    return decode_attention_gpu.decode_attention(layer.qkv, st.positions, cos, sin, k, v, st.slots, st.tables,
                                                 st.seq_lens, D ** -0.5, HQ, HKV, splits=splits)


def splits_of(batch: int, width: int) -> int:
    """The split count both paths use for this batch and block-table width (shapes only)."""
    return attention_gpu.decode_splits(batch * HKV, width * BS)


def poisoned(fn):
    """Run fn with torch.empty filling NaN (outputs, partials), so unwritten memory shows."""
    empty = torch.empty
    torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
    try:
        return fn()
    finally:
        torch.empty = empty


def check_parity(results: list, width: int, cos, sin) -> int:
    failed = 0
    gen = torch.Generator(device=DEV).manual_seed(1)
    for batch in BATCHES:
        for context in [c for c in CONTEXTS if c <= width * BS]:
            layer = Layer(Step(batch, context, width, gen), gen)
            k_old, v_old, k_new, v_new = layer.k.clone(), layer.v.clone(), layer.k.clone(), layer.v.clone()
            want = poisoned(lambda: old_step(layer, cos, sin, k_old, v_old))
            got = poisoned(lambda: new_step(layer, cos, sin, k_new, v_new))
            again = poisoned(lambda: new_step(layer, cos, sin, k_new, v_new))
            torch.cuda.synchronize()
            pool_equal = bool(torch.equal(k_old, k_new) and torch.equal(v_old, v_new))
            diff = float((got.float() - want.float()).abs().max()) if torch.isfinite(got).all() else float("inf")
            rel = float((got.float() - want.float()).norm() / want.float().norm())
            repeat = bool(torch.equal(got, again))
            bit_equal = bool(torch.equal(got, want))
            ok = pool_equal and diff < TOL and repeat
            failed += not ok
            splits = splits_of(batch, width)
            results.append({"batch": batch, "context": context, "splits": splits, "pool_equal": pool_equal,
                            "max_abs_diff": diff, "rel_err": rel, "out_bit_equal": bit_equal, "repeat_equal": repeat,
                            "ok": ok})
            print(f"{'ok  ' if ok else 'FAIL'} batch {batch:3d} context {context:5d} splits {splits:2d}: pool "
                  f"{'equal' if pool_equal else 'DIFFERS'}, max |diff| {diff:.2e}, rel {rel:.2e}, output "
                  f"{'bit-equal' if bit_equal else 'not bit-equal'}, repeat {'equal' if repeat else 'DIFFERS'}")
    return failed


def time_cases(results: list, width: int, n_layers: int, cos, sin) -> int:
    failed = 0
    print(f"\n{'batch':>5s} {'context':>7s} {'splits':>6s} | {'3 kernels us':>12s} | {'2 kernels us':>12s} | old/new"
          f"  ({n_layers} layers in one graph, us per layer)")
    gen = torch.Generator(device=DEV).manual_seed(2)
    for batch in BATCHES:
        for context in [c for c in CONTEXTS if c <= width * BS]:
            step = Step(batch, context, width, gen)
            layers = [Layer(step, gen) for _ in range(n_layers)]
            old_us, _ = graph_run([lambda la=la: old_step(la, cos, sin) for la in layers])
            new_us, outs = graph_run([lambda la=la: new_step(la, cos, sin) for la in layers])
            eager = [old_step(la, cos, sin) for la in layers]
            torch.cuda.synchronize()
            diff = max(float((o.float() - e.float()).abs().max()) for o, e in zip(outs, eager))
            ok = diff < TOL
            failed += not ok
            splits = splits_of(batch, width)
            results.append({"batch": batch, "context": context, "splits": splits, "layers": n_layers,
                            "old_us_per_layer": old_us, "new_us_per_layer": new_us, "ratio": old_us / new_us,
                            "graph_vs_eager_max_abs_diff": diff, "ok": ok})
            print(f"{batch:5d} {context:7d} {splits:6d} | {old_us:12.2f} | {new_us:12.2f} | {old_us / new_us:5.2f}x"
                  + ("" if ok else f"  FAIL: graph outputs differ from eager by {diff:.2e}"))
            del layers, outs, eager
            torch.cuda.empty_cache()
    return failed


def sweep(results: list, width: int, n_layers: int, cos, sin) -> None:
    gen = torch.Generator(device=DEV).manual_seed(3)
    for batch in (1, 4, 16):
        for context in [c for c in (512, 2048) if c <= width * BS]:
            step = Step(batch, context, width, gen)
            layers = [Layer(step, gen) for _ in range(n_layers)]
            found = []
            for splits in (1, 2, 4, 8, 16, 32):
                us, _ = graph_run([lambda la=la: new_step(la, cos, sin, splits=splits) for la in layers])
                found.append((us, splits))
            results.append({"batch": batch, "context": context, "us_by_splits": {s: u for u, s in found},
                            "default": splits_of(batch, width)})
            print(f"sweep batch {batch} context {context}: " + ", ".join(f"{s}: {u:.2f}us" for u, s in found))
            del layers
            torch.cuda.empty_cache()


def sweep_three_kernels(results: list, width: int, n_layers: int, cos, sin) -> None:
    """The three-kernel path (the engine's above decode_attention_gpu.MAX_TOKENS sequences) at forced split counts,
    batches 16-128: attention_gpu.decode_splits is replaced for the capture."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    chosen = attention_gpu.decode_splits
    try:
        for batch in (16, 32, 64, 128):
            for context in [c for c in (256, 512, 1024, 2048) if c <= width * BS]:
                step = Step(batch, context, width, gen)
                layers = [Layer(step, gen) for _ in range(n_layers)]
                found = []
                for splits in (1, 2, 4, 8, 16):
                    attention_gpu.decode_splits = lambda programs, max_kv, s=splits: s
                    us, _ = graph_run([lambda la=la: old_step(la, cos, sin) for la in layers])
                    found.append((us, splits))
                attention_gpu.decode_splits = chosen
                results.append({"path": "three kernels", "batch": batch, "context": context,
                                "us_by_splits": {s: u for u, s in found}, "default": splits_of(batch, width)})
                print(f"three-kernel sweep batch {batch} context {context} (default {splits_of(batch, width)}): "
                      + ", ".join(f"{s}: {u:.2f}us" for u, s in found))
                del layers
                torch.cuda.empty_cache()
    finally:
        attention_gpu.decode_splits = chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/decode-attention-check")
    p.add_argument("--layers", type=int, default=22, help="layer calls per captured graph (llama-1b: 22)")
    p.add_argument("--max-model-len", type=int, default=2048, help="block-table width x 16, as the engine's graphs")
    p.add_argument("--sweep", action="store_true", help="time forced split counts too")
    p.add_argument("--sweep-three", action="store_true",
                   help="time the three-kernel path at forced split counts, batches 16-128")
    p.add_argument("--skip-checks", action="store_true", help="no parity checks or default timings (sweeps only)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    start = time.time()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(DEV)}")
    width = -(-a.max_model_len // BS)
    cos, sin = rope(a.max_model_len)
    parity, timing, sweeps = [], [], []
    failed = 0
    if not a.skip_checks:
        failed = check_parity(parity, width, cos, sin)
        print(f"{len(parity) - failed}/{len(parity)} parity checks passed ({time.time() - start:.0f}s)")
        failed += time_cases(timing, width, a.layers, cos, sin)
    if a.sweep:
        sweep(sweeps, width, a.layers, cos, sin)
    if a.sweep_three:
        sweep_three_kernels(sweeps, width, a.layers, cos, sin)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_check.json").write_text(json.dumps(
        {"torch": torch.__version__, "device": torch.cuda.get_device_name(DEV), "max_model_len": a.max_model_len,
         "split_target_programs": attention_gpu.SPLIT_TARGET_PROGRAMS, "kernels": {"old": 3, "new": 2},
         "parity": parity, "timing": timing, "sweep": sweeps}, indent=1))
    print(f"wrote {out / 'decode_attention_check.json'} in {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
