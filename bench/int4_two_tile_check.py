"""GPU parity and timing of the tensor-core int4 decode GEMV at 9-16 token rows (two 8-row tiles, NTILE 2).

    python bench/int4_two_tile_check.py --out DIR [--preset llama-1b]      # exit code 1 if a parity check fails

Before this, steps of 9-16 token rows ran fourfold.quant.int4_gemm (a Triton GEMM) with the RMSNorms, residual adds
and SiLU*mul as kernels of their own; fourfold.quant.int4_mma's GEMV now takes them with its fusions. 1. Parity
through Int4WeightLinear.decode against a float32 matmul of the dequantized weights (bench/int4_mma_check.py's
reference_case, rel err < 1e-2) on the preset's four decoder shapes, schemes int4-g128 / -asym, int4-g32,
int4-g64-asym, at 9, 12 and 16 rows, forms plain, bias, residual, norm (gate|up gated); then K split over 2 and 3
blocks, each launched twice (the tickets reset). 2. Per kernel at 16 rows, each a CUDA graph over 12 weight
copies: cuBLAS on bf16 weights, int4_gemm, the two-tile GEMV (default config and a sweep of warps and quads a
warp). 3. One decoder layer's matmuls, norms, residual adds and SiLU*mul as the engine's fused decoder runs them
(12 layers in a graph) at 9, 12 and 16 rows: the GEMV chain (4 kernels) against the GEMM path (int4_gemm with
add_rms_norm twice and silu_mul: int4_mma.MAX_ROWS 8) and the bf16 model's (cuBLAS, same norms). 4. The GEMV
chain with other launch configs per kernel (LAYER_CONFIGS). Writes int4_two_tile_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import int4_mma_check as mc  # noqa: E402
from gemv_check import graph_us, rel_err  # noqa: E402
from int4_gemv_check import DEV, TOL, module  # noqa: E402

from fourfold.infer.fused_ops import add_rms_norm, silu_mul  # noqa: E402
from fourfold.quant import int4_mma  # noqa: E402

ROWS = (9, 12, 16)
EPS = 1e-5


def parity(results: list) -> int:
    failed = 0
    cases = [("int4-g128", "gate_up"), ("int4-g128-asym", "down"), ("int4-g32", "qkv"), ("int4-g64-asym", "o"),
             ("int4-g128", "qkv"), ("int4-g128", "down")]
    for scheme, shape in cases:
        n, k = mc.SHAPES[shape]
        gated = shape == "gate_up"
        mod, w = module(n, k, scheme)
        for rows in ROWS:
            for form in ("plain", "bias", "residual", "norm"):
                mod.bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if form == "bias" else None
                x, kw, ref = mc.reference_case(w, n, k, gated, rows, form, mod.bias)
                assert mod.uses_gemv(x), "the two-tile GEMV does not run here"
                err = rel_err(mod.decode(x, **kw), ref)
                failed += not err < TOL
                results.append({"scheme": scheme, "shape": shape, "rows": rows, "form": form, "rel_err": err})
                print(f"{'ok  ' if err < TOL else 'FAIL'} {scheme:15s} {shape:8s} x{rows:<2d} {form:8s} "
                      f"rel err {err:.2e}")
        mod.bias = None
    for shape, (n, k) in mc.SHAPES.items():
        gated = shape == "gate_up"
        mod, w = module(n, k, "int4-g128-asym")
        for sp in (2, 3):
            launch = int4_mma.config(k, 128, gated, split=sp, rows=16)
            for rows in (9, 16):
                for form in ("norm", "residual") if not gated else ("norm",):
                    x, kw, ref = mc.reference_case(w, n, k, gated, rows, form)
                    for _ in range(2):   # the second launch finds the tickets the first one left at zero
                        y = mc.run_launch(mod, x, launch, **kw)
                    err = rel_err(y, ref)
                    failed += not err < TOL
                    results.append({"scheme": "int4-g128-asym", "shape": shape, "rows": rows, "form": form,
                                    "config": launch, "rel_err": err})
                    print(f"{'ok  ' if err < TOL else 'FAIL'} split {launch} {shape:8s} x{rows:<2d} {form:8s} "
                          f"rel err {err:.2e}")
    return failed


def kernel_timing(results: list, copies: int = 12) -> None:
    for name, (n, k) in mc.SHAPES.items():
        gated = name == "gate_up"
        mods = [module(n, k, "int4-g128")[0] for _ in range(copies)]
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(16, k, device=DEV, dtype=torch.bfloat16)
        row = {"shape": name, "rows": 16, "cublas": graph_us([lambda w=w: F.linear(x, w) for w in ws]),
               "int4_gemm": mc.with_setting(int4_mma, "MAX_ROWS", int4_mma.TILE_ROWS,
                                            lambda: graph_us([lambda m=m: m(x) for m in mods])),
               "two_tile": graph_us([lambda m=m: m.decode(x, gated=gated) for m in mods])}
        sweep = {}
        for warps in (4, 8, 16):
            for max_quads in (2, 3, 4, 6):
                cfg = int4_mma.config(k, 128, gated, warps=warps, max_quads=max_quads, rows=16)
                if cfg not in sweep.values():
                    sweep[f"w{warps}_q{cfg[1]}_s{cfg[2]}"] = cfg
        row["sweep"] = sorted(((label, cfg, graph_us([lambda m=m, c=cfg: mc.run_launch(m, x, c, gated=gated)
                                                        for m in mods])) for label, cfg in sweep.items()),
                              key=lambda r: r[2])
        results.append(row)
        print(f"{name:8s} x16: cuBLAS {row['cublas']:.2f}, int4_gemm {row['int4_gemm']:.2f}, two-tile "
              f"{row['two_tile']:.2f} us (default {int4_mma.config(k, 128, gated, rows=16)}); best "
              + ", ".join(f"{lb} {us:.2f}" for lb, _, us in row["sweep"][:3]))
        del mods, ws
        torch.cuda.empty_cache()


def unfused_layer(linear, x: torch.Tensor, att: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """The fused decoder's layer where its linears run no GEMV, linear(name, rows) each matmul: norm, q|k|v, o,
    add + norm, gate|up, SiLU*mul, down (the next layer's add + norm closes it: counted here)."""
    normed, _ = add_rms_norm(x, None, nw, EPS)
    linear("qkv", normed)
    normed, h = add_rms_norm(linear("o", att), x, nw, EPS)
    out = linear("down", silu_mul(linear("gate_up", normed)))
    return add_rms_norm(out, h, nw, EPS)[1]


def layer_timing(results: list, layers: int = 12) -> None:
    dim = mc.SHAPES["o"][0]
    nw = torch.ones(dim, device=DEV, dtype=torch.bfloat16)
    mods = [{nm: module(n, k, "int4-g128")[0] for nm, (n, k) in mc.SHAPES.items()} for _ in range(layers)]
    bf16 = [{nm: torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5 for nm, (n, k) in mc.SHAPES.items()}
            for _ in range(layers)]
    for rows in ROWS:
        x = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        att = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        row = {"rows": rows,
               "two_tile_gemv": graph_us([lambda L=L: mc.engine_layer(L, x, att, nw) for L in mods]),
               "int4_gemm_path": mc.with_setting(int4_mma, "MAX_ROWS", int4_mma.TILE_ROWS, lambda: graph_us(
                   [lambda L=L: unfused_layer(lambda name, v: L[name](v), x, att, nw) for L in mods])),
               "bf16_cublas_path": graph_us([lambda W=W: unfused_layer(lambda name, v: F.linear(v, W[name]), x, att, nw)
                                             for W in bf16])}
        results.append(row)
        print(f"layer at {rows} rows: two-tile GEMVs {row['two_tile_gemv']:.2f} us, int4_gemm path "
              f"{row['int4_gemm_path']:.2f} us, bf16 (cuBLAS) {row['bf16_cublas_path']:.2f} us")


LAYER_CONFIGS = {   # (WARPS, MAXQ, SPLIT) of q|k|v, o, gate|up, down at 9-16 rows (llama-1b); None: int4_mma.config's
    "default": (None, None, None, None),
    "gate|up 4 warps split 2": (None, None, (4, 4, 2), None),
    "down 16 warps 6 quads": (None, None, None, (16, 6, 1)),
    "gate|up 4w s2, down 16w q6": (None, None, (4, 4, 2), (16, 6, 1)),
    "q|k|v 8 warps, gate|up 4w s2, down 16w q6": ((8, 4, 1), None, (4, 4, 2), (16, 6, 1)),
    "gate|up 4w s2, down 8w q6 s1": (None, None, (4, 4, 2), (8, 6, 2)),
}


def layer_configs(results: list, layers: int = 12) -> None:
    """The two-tile GEMV chain of a decoder layer (as the engine runs it: norms, residual adds, SiLU*mul fused) with
    each kernel's launch config from LAYER_CONFIGS, at 9, 12 and 16 rows: a kernel's neighbours in the chain change
    which of its configs is fastest."""
    dim = mc.SHAPES["o"][0]
    nw = torch.ones(dim, device=DEV, dtype=torch.bfloat16)
    mods = [{nm: module(n, k, "int4-g128")[0] for nm, (n, k) in mc.SHAPES.items()} for _ in range(layers)]

    def run(L, name, x, cfg, rows, **kw):
        k = mc.SHAPES[name][1]
        launch = cfg or int4_mma.config(k, 128, name == "gate_up", rows=rows)
        return mc.run_launch(L[name], x, launch, **kw)

    for rows in ROWS:
        x = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        att = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        row = {"rows": rows, "layer_configs": {}}
        for label, (c_qkv, c_o, c_gu, c_down) in LAYER_CONFIGS.items():
            def layer(L, c_qkv=c_qkv, c_o=c_o, c_gu=c_gu, c_down=c_down):
                run(L, "qkv", x, c_qkv, rows, norm_weight=nw)
                h = run(L, "o", att, c_o, rows, residual=x)
                act = run(L, "gate_up", h, c_gu, rows, gated=True, norm_weight=nw)
                return run(L, "down", act, c_down, rows, residual=h)
            row["layer_configs"][label] = graph_us([lambda L=L: layer(L) for L in mods])
        results.append(row)
        print(f"layer at {rows} rows by config: " + ", ".join(f"{lb} {us:.2f}" for lb, us in
                                                              row["layer_configs"].items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-two-tile-check")
    p.add_argument("--preset", default="llama-1b")
    args = p.parse_args()
    mc.SHAPES.update(mc.preset_shapes(args.preset))
    torch.manual_seed(0)
    results: list = []
    failed = parity(results)
    print(f"parity: {failed} failed of {len(results)}")
    kernel_timing(results)
    layer_timing(results)
    if args.preset == "llama-1b":   # LAYER_CONFIGS are llama-1b's (a config must cover K)
        layer_configs(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_two_tile_check.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset, "failed": failed,
         "results": results}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
