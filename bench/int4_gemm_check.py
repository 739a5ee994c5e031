"""GPU check and timing of the Triton int4 GEMM (fourfold.quant.int4_gemm) against torch's int4 mm and cuBLAS bf16.

    python bench/int4_gemm_check.py --out DIR [--sweep all|w-left|w-right] [--budget-s 150]

Shapes: the `llama-1b` matmuls (q|k|v 2560x2048, o 2048x2048, gate|up 11264x2048, down 2048x5632, head
32000x2048), plain (no SiLU*mul). 1. Timing at 1-2048 rows (ROWS): cuBLAS F.linear (bf16 weights) vs torch
`_weight_int4pack_mm` (tinygemm, up to 64 rows) vs int4_gemm's fused kernel ("fused", its default config by
rows) and its dequantize + cuBLAS path ("dequant"), both also on int4_mma's fragment-order words ("fused-words",
"dequant-words": the one run-time copy of fourfold.quant.one_copy), each a CUDA graph of R launches over R weight copies
(gemv_check.graph_us: more bytes than L2 holds), median per launch in us; prints the cuBLAS / best and
tinygemm / best ratios and the suggested int4_gemm.DEQUANT_ROWS. 2. Parity against a float32 matmul of the
dequantized weights on fresh random inputs, ||y - ref|| / ||ref|| (bf16 output: < 1e-2), for both methods and
for Int4WeightLinear's own forward (torch's mm or int4_gemm by rows: int4_gemm.TINYGEMM_ROWS), schemes
int4-g128, int4-g128-asym, int4-g32, 8da4w-g128, at 3, 16, 100, 300 rows; on the words (groups of 64 or more) the
same check (and whether the output equals the stored layout's bit for bit). 3. `--sweep`: the fused kernel's tile and
split-K configs (SWEEP; W_LEFT_SWEEP with the weight as the dot's left operand) at SWEEP_ROWS per block shape,
fastest first (until --budget-s), each checked against the dequantize path first. Writes
int4_gemm_check.json. Exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemv_check import SHAPES, bf16_weights, graph_us, int4_weights, rel_err  # noqa: E402

from fourfold.ops.triton_launch import triton  # noqa: E402
from fourfold.quant import int4_gemm, int4_mma  # noqa: E402
from fourfold.quant.fake_quant import dequantize_weight, fake_quantize_activation, quantize_weight  # noqa: E402
from fourfold.quant.packing import Int4WeightLinear, int4_kernel_weight, scales_and_zeros  # noqa: E402
from fourfold.quant.schemes import scheme_by_name  # noqa: E402

SCHEMES = ["int4-g128", "int4-g128-asym", "int4-g32", "8da4w-g128"]
ROWS = (1, 4, 8, 16, 64, 128, 256, 512, 2048)
TINYGEMM_MAX_ROWS = 64
"""torch's tiled kernel is timed up to this many rows only (at 256 it is 8-12x slower than the others)."""
METHODS = ("fused", "dequant")
LAYOUTS = ("", "-words")
"""Column suffixes of the timing: the stored nibbles, int4_mma's words."""
TOL = 1e-2
DEV = torch.device("cuda")
SWEEP = [base + (split,) for split in (1, 2, 4, 8) for base in [
    (16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 32, 64, 4, 4), (32, 64, 128, 4, 3), (64, 32, 128, 4, 3),
    (64, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3)]]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) configs of the sweep; those with BLOCK_M above
the row count (rounded up to 16) are skipped."""
W_LEFT_SWEEP = ([(bm, bn, 128, 4, stages, split, 1) for bm in (16, 32, 64) for bn in (64, 128) for stages in (3, 4)
                 for split in (1, 2, 4)]
                + [(bm, bn, 128, 8, stages, 1, 1) for bm in (64, 128) for bn in (128, 256) for stages in (3, 4)]
                + [(128, 128, 128, 4, 3, 1, 1), (256, 128, 128, 8, 3, 1, 1), (128, 128, 64, 8, 4, 1, 1),
                   (256, 128, 64, 8, 4, 1, 1), (256, 128, 128, 8, 4, 1, 1)])
"""The same with the weight tile as the dot's left operand (W_LEFT): split-K only for tiles of up to 64 rows."""
SWEEP_ROWS = (16, 64, 128, 256, 512, 2048)
WORDS_SWEEP_ROWS = (16, 64, 128)


def check_parity(results: list, m_list=(3, 16, 100, 300)) -> int:
    failed = 0
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        for scheme_name in SCHEMES:
            scheme = scheme_by_name(scheme_name)
            q, s, z = quantize_weight(w, scheme)
            w_hat = dequantize_weight(q, s, z, scheme).float()
            lin = torch.nn.Linear(k, n, bias=True, device=DEV, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            module = Int4WeightLinear.from_float(lin, scheme, name).to(DEV)
            for m in m_list:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                xq = fake_quantize_activation(x) if scheme.activation != "none" else x
                ref = xq.float() @ w_hat.T + module.bias.float()
                with torch.no_grad():
                    ys = [(method, int4_gemm.int4_gemm(xq, module.weight_int4, module.scales, module.zero_points,
                                                       scheme.group_size, module.bias, asym=not scheme.symmetric,
                                                       method=method)) for method in METHODS]
                    ys.append(("module", module(x)))
                    if scheme.group_size % 64 == 0:
                        words = int4_mma.repack_mma(module.weight_int4)
                        for method, y in ys[:len(METHODS)]:
                            yw = int4_gemm.int4_gemm(xq, words, module.scales, module.zero_points, scheme.group_size,
                                                     module.bias, asym=not scheme.symmetric, method=method, words=True)
                            err, equal = rel_err(yw, ref), torch.equal(yw, y)
                            failed += not err < TOL
                            results.append({"kernel": f"{scheme_name} {method}-words", "shape": name, "rows": m,
                                            "rel_err": err, "equal_to_stored": equal})
                            print(f"{'ok  ' if err < TOL else 'FAIL'} {scheme_name:15s} {method}-words {name:8s} "
                                  f"x{m:<3d} rel err {err:.2e}, {'equal to' if equal else 'not'} "
                                  "the stored layout's bit for bit")
                for label, y in ys:
                    err = rel_err(y, ref)
                    failed += not err < TOL
                    results.append({"kernel": f"{scheme_name} {label}", "shape": name, "rows": m, "rel_err": err})
                    print(f"{'ok  ' if err < TOL else 'FAIL'} {scheme_name:15s} {label:7s} {name:8s} x{m:<3d} "
                          f"rel err {err:.2e}")
    return failed


def time_cases(results: list) -> None:
    print(f"\n{'shape':8s} {'rows':>4s} | {'cuBLAS':>7s} {'int4mm':>7s} | " + " ".join(f"{m:>7s}" for m in METHODS)
          + " | " + " ".join(f"{m + '-w':>9s}" for m in METHODS) + " | cuBLAS/best int4mm/best  (us per call)")
    for name, (n, k) in SHAPES.items():
        ws = bf16_weights(n, k)
        i4, _ = int4_weights(n, k)
        tiled = [(int4_kernel_weight(p.cpu(), DEV), scales_and_zeros(s, z, torch.bfloat16)) for p, s, z, *_ in i4]
        words = [int4_mma.repack_mma(p) for p, *_ in i4]
        for m in ROWS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "rows": m, "config": int4_gemm._config(m, n, k, 128),
                   "cublas_us": graph_us([lambda w=w: F.linear(x, w) for w in ws]),
                   "int4mm_us": graph_us([lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], 128, t[1])
                                          for t in tiled]) if m <= TINYGEMM_MAX_ROWS else float("nan")}
            for method in METHODS:
                row[f"{method}_us"] = graph_us([lambda t=t: int4_gemm.int4_gemm(x, t[0], t[1], t[2], 128, asym=False,
                                                                                method=method) for t in i4])
                row[f"{method}-words_us"] = graph_us([lambda t=t, w=w: int4_gemm.int4_gemm(
                    x, w, t[1], t[2], 128, asym=False, method=method, words=True) for t, w in zip(i4, words)])
            best = min(row[f"{method}_us"] for method in METHODS)
            print(f"{name:8s} {m:4d} | {row['cublas_us']:7.2f} {row['int4mm_us']:7.2f} | "
                  + " ".join(f"{row[f'{method}_us']:7.2f}" for method in METHODS) + " | "
                  + " ".join(f"{row[f'{method}-words_us']:9.2f}" for method in METHODS)
                  + f" | {row['cublas_us'] / best:10.2f}x {row['int4mm_us'] / best:10.2f}x")
            results.append(row)
        del ws, i4, tiled, words
        torch.cuda.empty_cache()


def choose(timing: list) -> dict:
    """Per row count, the summed time over shapes of each method, and the row count above which dequantizing the
    whole weight + cuBLAS beats the fused kernel (what int4_gemm.DEQUANT_ROWS should be; 0: it never does)."""
    total = {(m + w, r): sum(row[f"{m}{w}_us"] for row in timing if row["rows"] == r)
             for m in METHODS for w in LAYOUTS for r in ROWS}
    dequant_rows = 0
    for prev, r in zip((int4_gemm.TINYGEMM_ROWS,) + ROWS[:-1], ROWS):
        if r > int4_gemm.TINYGEMM_ROWS and total["dequant", r] < total["fused", r]:
            dequant_rows = prev
            break
    print("summed us per row count: " + "; ".join(
        f"{r}: " + ", ".join(f"{m}{w} {total[m + w, r]:.1f}" for m in METHODS for w in LAYOUTS) for r in ROWS))
    return {"dequant_rows_suggested": dequant_rows, "dequant_rows": int4_gemm.DEQUANT_ROWS,
            "summed_us": {f"{key[0]} x{key[1]}": round(us, 2) for key, us in total.items()}}


def sweep(results: list, deadline: float, configs: list, words: bool = False, rows=SWEEP_ROWS) -> None:
    """Each config at `rows` on the block shapes, fastest first; a config whose output differs from the
    dequantize + cuBLAS path by more than TOL is recorded as failed and not ranked. `words`: on int4_mma's words."""
    for m in rows:
        for name, (n, k) in SHAPES.items():
            if name == "head":  # bf16 unless converted with --output; the block linears first
                continue
            i4, _ = int4_weights(n, k)
            if words:
                i4 = [(int4_mma.repack_mma(p), s, z) for p, s, z, *_ in i4]
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = int4_gemm.int4_gemm(x, i4[0][0], i4[0][1], i4[0][2], 128, asym=False, method="dequant", words=words)
            found, failed = [], []
            for cfg in [c for c in configs if c[0] <= max(16, triton.next_power_of_2(m))]:
                if time.time() > deadline:
                    break
                try:
                    y = int4_gemm.int4_gemm(x, i4[0][0], i4[0][1], i4[0][2], 128, asym=False, config=cfg,
                                            method="fused", words=words)
                except triton.runtime.errors.OutOfResources:   # e.g. more shared memory than an SM has
                    continue
                if not rel_err(y, ref) < TOL:
                    failed.append(cfg)
                    continue
                us = graph_us([lambda t=t: int4_gemm.int4_gemm(x, t[0], t[1], t[2], 128, asym=False, config=cfg,
                                                                   method="fused", words=words) for t in i4])
                found.append((us, cfg))
            found.sort()
            results.append({"sweep": "int4_gemm" + ("-words" if words else ""), "shape": name, "rows": m,
                            "best": found[:5], "failed": failed, "default": int4_gemm._config(m, n, k, 128, words)})
            print(f"sweep{'-words' if words else ''} x{m:<4d} {name:8s}: " + ", ".join(f"{c} {u:.2f}us" for u, c in found[:4])
                  + (f"; FAILED {failed}" if failed else ""))
            del i4
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-gemm-check")
    p.add_argument("--sweep", choices=["all", "w-left", "w-right", "words"], default=None,
                   help="sweep the fused kernel's tile configs at SWEEP_ROWS (w-left: the weight tile as the dot's "
                        "left operand only; w-right: the original form only; words: both forms on int4_mma's words "
                        "at WORDS_SWEEP_ROWS)")
    p.add_argument("--budget-s", type=float, default=150, help="stop the sweep after this many seconds in all")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    start = time.time()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(DEV)}; "
          f"TINYGEMM_ROWS={int4_gemm.TINYGEMM_ROWS}")
    torch.manual_seed(0)
    parity, timing, sweeps = [], [], []
    time_cases(timing)
    choice = choose(timing)
    print(f"timing done ({time.time() - start:.0f}s); choice: {choice}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = check_parity(parity)
    print(f"{len(parity) - failed}/{len(parity)} parity checks passed ({time.time() - start:.0f}s)")
    for last in (False, True):
        (out / "int4_gemm_check.json").write_text(json.dumps({
            "torch": torch.__version__, "device": torch.cuda.get_device_name(DEV), "parity": parity,
            "timing": timing, "choice": choice, "sweep": sweeps}, indent=1))
        if a.sweep and not last:
            if a.sweep == "words":
                configs = [c for c in SWEEP + W_LEFT_SWEEP if c[2] % 64 == 0 and c[1] >= 64]
                sweep(sweeps, start + a.budget_s, configs, words=True, rows=WORDS_SWEEP_ROWS)
            else:
                configs = {"all": W_LEFT_SWEEP + SWEEP, "w-left": W_LEFT_SWEEP, "w-right": SWEEP}[a.sweep]
                sweep(sweeps, start + a.budget_s, configs)
    print(f"wrote {out / 'int4_gemm_check.json'} in {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
