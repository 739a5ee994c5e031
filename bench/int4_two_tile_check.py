"""GPU parity and timing of the tensor-core int4 decode GEMV at 9-32 token rows (two to four 8-row tiles, NTILE 2-4).

    python bench/int4_two_tile_check.py --out DIR [--preset llama-1b] [--rows 9,12,16]   # exit 1: a parity failure

Before this, steps of 9-16 token rows ran fourfold.quant.int4_gemm (a Triton GEMM) with the RMSNorms, residual adds
and SiLU*mul as kernels of their own; fourfold.quant.int4_mma's GEMV now takes them with its fusions. 1. Parity
through Int4WeightLinear.decode against a float32 matmul of the dequantized weights (bench/int4_mma_check.py's
reference_case, rel err < 1e-2) on the preset's four decoder shapes, schemes int4-g128 / -asym, int4-g32,
int4-g64-asym, at each of --rows, forms plain, bias, residual, norm (gate|up gated), centred weights or not
(int4_mma.centered); then K split over 2 and 3 blocks, each launched twice (the tickets reset), and the staged form.
2. Per kernel at the most rows (the output head's shape too), each a CUDA graph over 12 weight copies: cuBLAS on
bf16 weights, int4_gemm, the GEMV (default config, and a sweep of warps, quads a warp, register or staged form,
centred weights or the sum-of-x mma). 3. One decoder layer's matmuls, norms, residual adds and SiLU*mul as the
engine's fused decoder runs them (12 layers in a graph) at each of --rows: the GEMV chain (4 kernels; centred
weights and not) against the GEMM path (int4_gemm with add_rms_norm twice and silu_mul: int4_mma.MAX_ROWS 8) and
the bf16 model's (cuBLAS, same norms). 4. The GEMV chain with other launch configs per kernel (LAYER_CONFIGS, at
9-16 rows on llama-1b). Writes int4_two_tile_check.json.
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

ROWS = [9, 12, 16]
"""Token rows checked (--rows)."""
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
                assert mod.uses_gemv(x), "the tensor-core GEMV does not run here"
                for mode in ("0", "1"):
                    err = rel_err(mc.with_setting(int4_mma, "CENTERED_MODE", mode, lambda: mod.decode(x, **kw)), ref)
                    failed += not err < TOL
                    results.append({"scheme": scheme, "shape": shape, "rows": rows, "form": form,
                                    "centered": mode == "1", "rel_err": err})
                    print(f"{'ok  ' if err < TOL else 'FAIL'} {scheme:15s} {shape:8s} x{rows:<2d} {form:8s} "
                          f"centred {mode} rel err {err:.2e}")
        mod.bias = None
    for shape, (n, k) in mc.SHAPES.items():
        gated = shape == "gate_up"
        mod, w = module(n, k, "int4-g128-asym")
        launches = [(int4_mma.config(k, 128, gated, split=sp, rows=max(ROWS)), False) for sp in (2, 3)]
        launches.append((int4_mma.staged_config(k, 128, gated), True))
        for launch, staged in launches:
            for rows in (min(ROWS), max(ROWS)):
                for form in ("norm", "residual") if not gated else ("norm",):
                    err = mc.launch_error(mod, w, n, k, gated, rows, form, launch, staged)
                    failed += not err < TOL
                    results.append({"scheme": "int4-g128-asym", "shape": shape, "rows": rows, "form": form,
                                    "config": launch, "staged": staged, "rel_err": err})
                    print(f"{'ok  ' if err < TOL else 'FAIL'} {'staged' if staged else 'split'} {launch} {shape:8s} "
                          f"x{rows:<2d} {form:8s} rel err {err:.2e}")
    return failed


def kernel_sweep(k: int, gated: bool, rows: int) -> dict[str, tuple[tuple[int, int, int], bool]]:
    """Launch configs of one shape to time: register form at 4-16 warps and 2-6 quads a warp, staged at 4-8 warps
    and 4-8 quads (distinct configs; those whose split-K sums fit SPLIT_VALUES)."""
    sweep: dict[str, tuple[tuple[int, int, int], bool]] = {}
    for warps in (4, 8, 16):
        for max_quads in (2, 3, 4, 6):
            cfg = int4_mma.config(k, 128, gated, warps=warps, max_quads=max_quads, rows=rows)
            if int4_mma.reduction_bytes(cfg[0], rows, gated, True) > int4_mma.MAX_REDUCTION_BYTES:
                continue
            if (cfg, False) not in sweep.values():
                sweep[f"w{warps}_q{cfg[1]}_s{cfg[2]}"] = (cfg, False)
    for warps in (4, 8):
        for max_quads in (4, 8):
            cfg = int4_mma.staged_config(k, 128, gated, warps=warps, max_quads=max_quads)
            if int4_mma.reduction_bytes(cfg[0], rows, gated, True) > int4_mma.MAX_REDUCTION_BYTES:
                continue
            if (cfg, True) not in sweep.values():
                sweep[f"staged_w{warps}_q{cfg[1]}_s{cfg[2]}"] = (cfg, True)
    return sweep


def kernel_timing(results: list, copies: int = 12) -> None:
    rows = max(ROWS)
    shapes = dict(mc.SHAPES, head=(32000, 2048)) if mc.SHAPES["o"] == (2048, 2048) else mc.SHAPES   # llama-1b's head
    for name, (n, k) in shapes.items():
        gated = name == "gate_up"
        copies_here = copies if name != "head" else 4
        mods = [module(n, k, "int4-g128")[0] for _ in range(copies_here)]
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies_here)]
        x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
        row = {"shape": name, "rows": rows, "cublas": graph_us([lambda w=w: F.linear(x, w) for w in ws]),
               "int4_gemm": mc.with_setting(int4_mma, "MAX_ROWS", int4_mma.TILE_ROWS,
                                            lambda: graph_us([lambda m=m: m(x) for m in mods])),
               "gemv_default": graph_us([lambda m=m: m.decode(x, gated=gated) for m in mods])}
        timed = []
        for label, (cfg, staged) in kernel_sweep(k, gated, rows).items():
            for centred in (False, True):
                us = graph_us([lambda m=m, c=cfg, st=staged, ce=centred: mc.run_launch(
                    m, x, c, st, gated=gated, centered_weights=ce) for m in mods])
                timed.append((f"{label}{'_centred' if centred else ''}", cfg, us))
        row["sweep"] = sorted(timed, key=lambda r: r[2])
        results.append(row)
        print(f"{name:8s} x{rows}: cuBLAS {row['cublas']:.2f}, int4_gemm {row['int4_gemm']:.2f}, GEMV "
              f"{row['gemv_default']:.2f} us (default {int4_mma.config(k, 128, gated, rows=rows)}); best "
              + ", ".join(f"{lb} {us:.2f}" for lb, _, us in row["sweep"][:5]), flush=True)
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
               "gemv_chain": graph_us([lambda L=L: mc.engine_layer(L, x, att, nw) for L in mods]),
               "gemv_chain_uncentred": mc.with_setting(int4_mma, "CENTERED_MODE", "0", lambda: graph_us(
                   [lambda L=L: mc.engine_layer(L, x, att, nw) for L in mods])),
               "gemv_chain_centred": mc.with_setting(int4_mma, "CENTERED_MODE", "1", lambda: graph_us(
                   [lambda L=L: mc.engine_layer(L, x, att, nw) for L in mods])),
               "int4_gemm_path": mc.with_setting(int4_mma, "MAX_ROWS", int4_mma.TILE_ROWS, lambda: graph_us(
                   [lambda L=L: unfused_layer(lambda name, v: L[name](v), x, att, nw) for L in mods])),
               "bf16_cublas_path": graph_us([lambda W=W: unfused_layer(lambda name, v: F.linear(v, W[name]), x, att, nw)
                                             for W in bf16])}
        results.append(row)
        print(f"layer at {rows} rows: GEMVs {row['gemv_chain']:.2f} us (centred {row['gemv_chain_centred']:.2f}, not "
              f"{row['gemv_chain_uncentred']:.2f}), int4_gemm path {row['int4_gemm_path']:.2f} us, bf16 (cuBLAS) "
              f"{row['bf16_cublas_path']:.2f} us", flush=True)


LAYER_CONFIGS = {   # (WARPS, MAXQ, SPLIT) of q|k|v, o, gate|up, down at 9-16 rows (llama-1b), register form
    # (None: the engine's default)
    "default": (None, None, None, None),
    "gate|up 4 warps split 2": (None, None, (4, 4, 2), None),
    "down 16 warps 6 quads": (None, None, None, (16, 6, 1)),
    "gate|up 4w s2, down 16w q6": (None, None, (4, 4, 2), (16, 6, 1)),
    "q|k|v 8 warps, gate|up 4w s2, down 16w q6": ((8, 4, 1), None, (4, 4, 2), (16, 6, 1)),
    "gate|up 4w s2, down 8w q6 s1": (None, None, (4, 4, 2), (8, 6, 2)),
}

MANY_TILE_LAYER_CONFIGS = {   # the same at 17-32 rows; ("staged", cfg) runs the staged form
    "default": (None, None, None, None),
    "o register 16w q2": (None, (16, 2, 1), None, None),
    "o register 16w q2, q|k|v staged 4w q8": (("staged", (4, 8, 1)), (16, 2, 1), None, None),
    "down staged 4w q8 s3": (None, None, None, ("staged", (4, 8, 3))),
    "gate|up staged 8w q4": (None, None, ("staged", (8, 4, 1)), None),
    "all register (STAGE 0 defaults)": tuple(("register", None) for _ in range(4)),
}


def layer_configs(results: list, layers: int = 12) -> None:
    """The GEMV chain of a decoder layer (as the engine runs it: norms, residual adds, SiLU*mul fused) with each
    kernel's launch config from LAYER_CONFIGS (9-16 rows) or MANY_TILE_LAYER_CONFIGS (17-32): a kernel's neighbours
    in the chain change which of its configs is fastest."""
    dim = mc.SHAPES["o"][0]
    nw = torch.ones(dim, device=DEV, dtype=torch.bfloat16)
    mods = [{nm: module(n, k, "int4-g128")[0] for nm, (n, k) in mc.SHAPES.items()} for _ in range(layers)]

    def run(L, name, x, choice, rows, **kw):
        if choice is None:                    # the engine's own pick
            return L[name].decode(x, **kw)
        form, cfg = choice if isinstance(choice[0], str) else ("register", choice)
        cfg = cfg or int4_mma.config(mc.SHAPES[name][1], 128, name == "gate_up", rows=rows)
        return mc.run_launch(L[name], x, cfg, form == "staged", **kw)

    for rows in ROWS:
        configs = LAYER_CONFIGS if rows <= 2 * int4_mma.TILE_ROWS else MANY_TILE_LAYER_CONFIGS
        x = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        att = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        row = {"rows": rows, "layer_configs": {}}
        for label, (c_qkv, c_o, c_gu, c_down) in configs.items():
            def layer(L, c_qkv=c_qkv, c_o=c_o, c_gu=c_gu, c_down=c_down):
                run(L, "qkv", x, c_qkv, rows, norm_weight=nw)
                h = run(L, "o", att, c_o, rows, residual=x)
                act = run(L, "gate_up", h, c_gu, rows, gated=True, norm_weight=nw)
                return run(L, "down", act, c_down, rows, residual=h)
            row["layer_configs"][label] = graph_us([lambda L=L: layer(L) for L in mods])
        results.append(row)
        print(f"layer at {rows} rows by config: " + ", ".join(f"{lb} {us:.2f}" for lb, us in
                                                              row["layer_configs"].items()), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-two-tile-check")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--rows", default="9,12,16", help="token rows, comma-separated (9..int4_mma.MAX_ROWS)")
    p.add_argument("--skip-sweep", action="store_true", help="leave out part 2 (per kernel)")
    p.add_argument("--skip-configs", action="store_true", help="leave out part 4 (LAYER_CONFIGS)")
    args = p.parse_args()
    ROWS[:] = sorted(int(r) for r in args.rows.split(","))
    mc.SHAPES.update(mc.preset_shapes(args.preset))
    torch.manual_seed(0)
    results: list = []
    failed = parity(results)
    print(f"parity: {failed} failed of {len(results)}")
    if not args.skip_sweep:
        kernel_timing(results)
    layer_timing(results)
    if args.preset == "llama-1b" and not args.skip_configs:   # LAYER_CONFIGS are llama-1b's (a config covers K)
        layer_configs(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_two_tile_check.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset, "failed": failed,
         "results": results}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
