"""GPU parity and timing of the tensor-core int4 decode GEMV (fourfold.quant.int4_mma) against the Triton one.

    python bench/int4_mma_check.py --out DIR [--preset llama3-8b]     # exit code 1 if a parity check fails

1. Parity through Int4WeightLinear.decode against a float32 matmul of the dequantized weights (rel err < 1e-2)
and against the Triton GEMV (fourfold.quant.int4_gemv, FOURFOLD_INT4_MMA off): the preset's shapes (default
llama-1b), groups 32/64/128/256, symmetric and asymmetric, 1/2/3/8 token rows, plain, bias, residual,
RMSNorm-prologue and gated forms; then K split over 2 and 3 blocks (int4_mma.config's SPLIT) against the same
reference, and the staged kernel (weights through shared memory) at three configs. 2. Per-kernel time of each
shape at 1 and 8 rows, both kernels (the mma one also at 4/8/16/32 warps a block, at 8/16 warps with K split over
1-4 blocks, and staged at 2-8 warps and 4-32 quads a warp), each in a CUDA graph over 12 copies of the weight
(more than L2 holds). 3. One decoder layer's matmuls and norms as the engine runs them
(fused_decoder.INT4_FUSED_NORMS) with each kernel, with the mma kernels' block sizes and splits swept in that
chain (int4_mma.config's defaults come from it), with some or all of its kernels staged, and over one layer's
weights replayed 12 times (so they come from L2, not HBM). Writes
int4_mma_check.json.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import graph_us, rel_err  # noqa: E402
from int4_gemv_check import DEV, TOL, module  # noqa: E402

from fourfold.infer.fused_ops import add_rms_norm  # noqa: E402
from fourfold.models.presets import PRESETS  # noqa: E402
from fourfold.quant import int4_mma  # noqa: E402

SHAPES: dict[str, tuple[int, int]] = {}
"""name -> (out features, in features) of the preset's decoder matmuls; set by main()."""


def preset_shapes(preset: str) -> dict[str, tuple[int, int]]:
    p = PRESETS[preset]
    dim, ffn = p["dim"], p["ffn_dim"]
    qkv = dim + 2 * p["n_kv_heads"] * (dim // p["n_heads"])
    return {"qkv": (qkv, dim), "o": (dim, dim), "gate_up": (2 * ffn, dim), "down": (dim, ffn)}


def with_setting(module, name: str, value, fn):
    """fn() with module.name set to value (a module-level switch such as int4_mma.ENABLED), then restored."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        return fn()
    finally:
        setattr(module, name, saved)


def with_mma(enabled: bool, fn):
    return with_setting(int4_mma, "ENABLED", enabled, fn)


def parity(results: list) -> int:
    failed = 0
    cases = [("int4-g128", "gate_up"), ("int4-g128-asym", "down"), ("int4-g32", "qkv"), ("int4-g64-asym", "o"),
             ("int4-g256", "gate_up"), ("int4-g128", "qkv"), ("int4-g128", "o"), ("int4-g256-asym", "down")]
    for scheme, shape in cases:
        n, k = SHAPES[shape]
        gated = shape == "gate_up"
        mod, w = module(n, k, scheme)
        assert n > int4_mma.MAX_OUT_FEATURES or mod._uses_mma(torch.zeros(1, k, device=DEV, dtype=torch.bfloat16)), \
            "the mma kernel does not run here"
        for rows in (1, 2, 3, 8):
            for form in ("plain", "bias", "residual", "norm"):
                mod.bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if form == "bias" else None
                x, kw, ref = reference_case(w, n, k, gated, rows, form, mod.bias)
                r = kw["residual"]
                y = with_mma(True, lambda: mod.decode(x, **kw))
                y_triton = with_mma(False, lambda: mod.decode(x[:1], **{**kw, "residual": r[:1] if form == "residual"
                                                                      else None}))
                err, err_triton = rel_err(y, ref), rel_err(y[:1], y_triton)
                ok = err < TOL and err_triton < TOL
                failed += not ok
                results.append({"scheme": scheme, "shape": shape, "rows": rows, "form": form, "rel_err": err,
                                "vs_triton_row0": err_triton})
                print(f"{'ok  ' if ok else 'FAIL'} {scheme:15s} {shape:8s} x{rows} {form:8s} rel err {err:.2e}"
                      f" | vs triton (row 0) {err_triton:.2e}")
        del mod, w
    return failed + launch_parity(results)


def reference_case(w: torch.Tensor, n: int, k: int, gated: bool, rows: int, form: str, bias: torch.Tensor | None = None):
    """Inputs of one parity case and the float32 reference: (x, decode kwargs, reference); form is plain, bias
    (pass `bias`), residual or norm."""
    n_out = n // 2 if gated else n
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    nw = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16)
    r = torch.randn(rows, n_out, device=DEV, dtype=torch.bfloat16)
    xin = add_rms_norm(x, None, nw, 1e-5)[0] if form == "norm" else x
    ref = xin.float() @ w.T + (bias.float() if form == "bias" else 0)
    ref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:] if gated else ref
    ref = ref + r.float() if form == "residual" else ref
    kw = dict(gated=gated, residual=r if form == "residual" else None, norm_weight=nw if form == "norm" else None,
              eps=1e-5)
    return x, kw, ref


def run_launch(mod, x: torch.Tensor, cfg: tuple[int, int, int], staged: bool = False, **kw) -> torch.Tensor:
    """x through `mod`'s int4 words (group 128) at launch config `cfg`, register or staged form, with the
    workspace of cfg's split and `mod`'s bias."""
    return int4_mma.int4_mma_gemv(x, *mod.mma_words(), 128, mod.bias, launch_config=cfg,
                                  workspace=mod.mma_workspace(cfg[2]), staged=staged, **kw)


def launch_error(mod, w: torch.Tensor, n: int, k: int, gated: bool, rows: int, form: str,
                 launch: tuple[int, int, int], staged: bool) -> float:
    """Relative error against the float32 reference (reference_case) of one launch config, launched twice: the
    second launch finds the tickets the first one left at zero."""
    x, kw, ref = reference_case(w, n, k, gated, rows, form, mod.bias)
    for _ in range(2):
        y = run_launch(mod, x, launch, staged, **kw)
    return rel_err(y, ref)


def launch_parity(results: list) -> int:
    """Launch configs the engine does not pick by default, against the float32 reference: K split over 2 and 3
    blocks (a ticket per row block, float32 partials), and the staged kernel (weights through shared memory) at
    4/16, 2/8 and 8/32 warps/quads a warp, split or not as staged_config gives (its default, 8/8, is what parity()
    checks wherever int4_mma.use_staged picks it)."""
    failed = 0
    for shape, (n, k) in SHAPES.items():
        gated = shape == "gate_up"
        mod, w = module(n, k, "int4-g128-asym")
        launches = [(f"split {sp}", int4_mma.config(k, 128, gated, split=sp), False) for sp in (2, 3)]
        launches += [(f"staged w{wp} q{mq}", int4_mma.staged_config(k, 128, gated, warps=wp, max_quads=mq), True)
                     for wp, mq in ((4, 16), (2, 8), (8, 32))]
        for label, launch, staged in launches:
            for rows in (1, 3, 8):
                for form in (("norm", "bias") if gated else ("residual", "norm", "bias")):
                    mod.bias = torch.randn(n, device=DEV, dtype=torch.bfloat16) if form == "bias" else None
                    err = launch_error(mod, w, n, k, gated, rows, form, launch, staged)
                    failed += not err < TOL
                    results.append({"scheme": "int4-g128-asym", "shape": shape, "rows": rows, "form": form,
                                    "launch": label, "config": launch, "rel_err": err})
                    print(f"{'ok  ' if err < TOL else 'FAIL'} {label:16s} {str(launch):12s} {shape:8s} x{rows} {form:8s} "
                          f"rel err {err:.2e}")
        mod.bias = None
        del mod, w
    return failed


def staged_configs(k: int, gated: bool) -> dict[str, tuple[int, int, int]]:
    """The staged kernel's sweep for one shape: 2-8 warps a block, 4-32 quads a warp at most (distinct configs)."""
    out: dict[str, tuple[int, int, int]] = {}
    for warps in (2, 4, 8):
        for max_quads in (4, 8, 16, 32):
            cfg = int4_mma.staged_config(k, 128, gated, warps=warps, max_quads=max_quads)
            if cfg not in out.values():
                out[f"staged_w{warps}_q{cfg[1]}_s{cfg[2]}"] = cfg
    return out


def kernel_timing(results: list, copies: int = 12) -> None:
    for name, (n, k) in SHAPES.items():
        gated = name == "gate_up"
        mods = [module(n, k, "int4-g128")[0] for _ in range(copies)]
        for rows in (1, 8):
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            row = {"shape": name, "rows": rows}
            for label, enabled in (("mma", True), ("triton", False)):
                if not enabled and rows > 1:
                    continue   # the Triton GEMV takes one row (more go to torch's int4 mm)
                row[label] = with_mma(enabled, lambda: graph_us([lambda m=m: m.decode(x, gated=gated) for m in mods]))
            for warps in (4, 8, 16, 32):   # block sizes of the mma kernel
                cfg = int4_mma.config(k, 128, gated, warps=warps)
                row[f"mma_w{warps}"] = graph_us([lambda m=m: run_launch(m, x, cfg, gated=gated) for m in mods])
            for warps in (8, 16):          # K split over blocks
                for split in (1, 2, 3, 4):
                    cfg = int4_mma.config(k, 128, gated, warps=warps, split=split)
                    row[f"mma_w{warps}_s{split}"] = graph_us([lambda m=m: run_launch(m, x, cfg, gated=gated)
                                                              for m in mods])
            for label, cfg in staged_configs(k, gated).items():   # weights through shared memory
                row[label] = graph_us([lambda m=m: run_launch(m, x, cfg, True, gated=gated) for m in mods])
            results.append(row)
            print(f"{name:8s} x{rows}: " + ", ".join(f"{lb} {us:.2f} us" for lb, us in row.items()
                                                     if lb not in ("shape", "rows")))
        del mods


def engine_layer(L: dict, x0: torch.Tensor, att: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """One decoder layer's four int4 GEMVs as the engine runs them at decode (fused_decoder.INT4_FUSED_NORMS):
    q|k|v with the RMSNorm, o + residual, gate|up with the RMSNorm and SiLU*mul, down + residual."""
    L["qkv"].decode(x0, norm_weight=nw)
    h = L["o"].decode(att, residual=x0)
    return L["down"].decode(L["gate_up"].decode(h, gated=True, norm_weight=nw), residual=h)


def layer_timing(results: list, layers: int = 12) -> None:
    dim = SHAPES["o"][0]
    nw = torch.ones(dim, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, dim, device=DEV, dtype=torch.bfloat16)
    att = torch.randn(1, dim, device=DEV, dtype=torch.bfloat16)
    mods = [{nm: module(n, k, "int4-g128")[0] for nm, (n, k) in SHAPES.items()} for _ in range(layers)]

    def fused_layer(L):
        engine_layer(L, x0, att, nw)

    row = {}
    for label, enabled in (("mma", True), ("triton", False)):
        row[label] = with_mma(enabled, lambda: graph_us([lambda L=L: fused_layer(L) for L in mods]))
    # the same chain over one layer's weights, which then sit in L2: how much of a layer is waiting for HBM
    row["mma_weights_in_l2"] = graph_us([lambda: fused_layer(mods[0]) for _ in mods])
    print(f"fused layer at 1 row: mma {row['mma']:.2f} us, triton {row['triton']:.2f} us "
          f"({row['triton'] / row['mma']:.2f}x); mma with the weights in L2 {row['mma_weights_in_l2']:.2f} us")
    results.append(row)
    layer_configs(results, mods, nw)


LAYER_CONFIGS = {   # (warps, split) of q|k|v, o, down; None: int4_mma.config's default
    "default": (None, None, None),
    "16 warps, no split": ((16, 1), (16, 1), (16, 1)),
    "q|k|v and o at 8 warps": ((8, None), (8, None), (16, None)),
    "down split 2": (None, None, (16, 2)),
    "down split 3": (None, None, (16, 3)),
    "q|k|v, o split 2": ((16, 2), (16, 2), None),
    "all split 2": ((16, 2), (16, 2), (16, 2)),
}


STAGED_LAYERS = {   # kernels of the layer run staged (int4_mma.staged_config's default); the others as the engine does
    "staged gate|up": ("gate_up",),
    "staged gate|up, down": ("gate_up", "down"),
    "staged all": ("qkv", "o", "gate_up", "down"),
}


def layer_configs(results: list, mods: list, nw: torch.Tensor) -> None:
    """Block sizes and K splits of the q|k|v, o and down kernels timed in the layer's chain (each kernel's
    neighbours change how much of its wait it hides, so a kernel repeated alone can prefer another size); gate|up
    as the engine runs it (Triton at one row, the mma kernel at 8 where it takes the shape)."""
    def gemv(L, name, x, cfg, **kw):
        k = SHAPES[name][1]
        return run_launch(L[name], x, int4_mma.config(k, 128, **(dict(zip(("warps", "split"), cfg)) if cfg else {})),
                          **kw)

    def layer(L, x, att, c_qkv, c_o, c_down):
        gemv(L, "qkv", x, c_qkv, norm_weight=nw)
        h = gemv(L, "o", att, c_o, residual=x)
        return gemv(L, "down", L["gate_up"].decode(h, gated=True, norm_weight=nw), c_down, residual=h)

    def staged_layer(L, x, att, which):
        def run(name, x, **kw):
            if name not in which:
                return L[name].decode(x, **kw)
            k = SHAPES[name][1]
            return run_launch(L[name], x, int4_mma.staged_config(k, 128, kw.get("gated", False)), True, **kw)
        run("qkv", x, norm_weight=nw)
        h = run("o", att, residual=x)
        return run("down", run("gate_up", h, gated=True, norm_weight=nw), residual=h)

    dim = SHAPES["o"][0]
    for rows in (1, 8):
        x = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        att = torch.randn(rows, dim, device=DEV, dtype=torch.bfloat16)
        row = {"rows": rows}
        for label, cfgs in LAYER_CONFIGS.items():
            row[label] = graph_us([lambda L=L: layer(L, x, att, *cfgs) for L in mods])
        for label, which in STAGED_LAYERS.items():
            row[label] = graph_us([lambda L=L: staged_layer(L, x, att, which) for L in mods])
        results.append(row)
        print(f"layer at {rows} rows by block size and split: " + ", ".join(f"{lb} {us:.2f} us" for lb, us in row.items()
                                                                            if lb != "rows"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-mma-check")
    p.add_argument("--preset", default="llama-1b", choices=sorted(PRESETS))
    p.add_argument("--layers-only", action="store_true", help="only part 3 (the decoder layer's chain)")
    a = p.parse_args()
    SHAPES.update(preset_shapes(a.preset))
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    start = time.time()
    torch.manual_seed(0)
    checks, kernels, layer = [], [], []
    failed = 0
    if not a.layers_only:
        failed = parity(checks)
        print(f"{len(checks) - failed}/{len(checks)} parity checks passed ({time.time() - start:.0f}s)")
        kernel_timing(kernels)
    layer_timing(layer)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_mma_check.json").write_text(json.dumps({"device": torch.cuda.get_device_name(DEV), "preset": a.preset,
                                                         "stage_mode": int4_mma.STAGE_MODE, "carveout": int4_mma.CARVEOUT,
                                                         "parity": checks, "kernels": kernels, "layer": layer},
                                                        indent=1))
    print(f"wrote {out / 'int4_mma_check.json'} in {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
