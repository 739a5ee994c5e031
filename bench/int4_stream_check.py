"""GPU parity and timing of the streaming one-row int4 GEMV (fourfold.quant.int4_stream) against the engine's.

    python bench/int4_stream_check.py --out DIR [--presets llama3-8b,llama-1b]   # exit code 1 if a check fails

1. Parity: int4_stream_gemv against int4_mma_gemv with the same warps (SPLIT 1), which must be equal bit for bit,
and against a float32 matmul of the dequantized weight (rel err < 1e-2): plain, residual, RMSNorm-prologue,
gated (+ norm) and bias forms, groups 32-256 symmetric and asymmetric, rings of 1-16 quads, grids of 1-2 blocks an
SM and of 3 blocks (many tiles a block). 2. Per-kernel time at one row on each preset's decoder shapes:
the engine before this kernel (Int4WeightLinear.decode with FOURFOLD_INT4_STREAM off: int4_mma or Triton) against
the streaming kernel at 8/16 warps, 64/128 KiB rings, 1/2 blocks an SM; each a CUDA graph over copies of the
weight (more than L2 holds, bench/gemv_check.graph_us). 3. One decoder layer's four GEMVs with their fused norms
and residuals as the engine runs them (12 layers in a graph), streaming off and on. Writes int4_stream_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import copies_for, graph_us, rel_err  # noqa: E402
from int4_gemv_check import DEV, TOL, module  # noqa: E402
from int4_mma_check import engine_layer, preset_shapes, with_setting  # noqa: E402

from fourfold.quant import int4_mma, int4_stream  # noqa: E402


def with_mode(mode: str, fn):
    return with_setting(int4_stream, "MODE", mode, fn)


def reference(w: torch.Tensor, x, gated, res, nw, bias, eps=1e-5):
    xf = x.float()
    if nw is not None:
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).bfloat16().float() * nw.float()
    y = xf @ w.T + (bias.float() if bias is not None else 0)
    if gated:
        half = y.shape[-1] // 2
        y = torch.nn.functional.silu(y[..., :half]) * y[..., half:]
    return y + (res.float() if res is not None else 0)


def parity(results: list) -> int:
    failed = 0
    cases = [  # (n, k, scheme, form, ring, blocks a SM)
        (4096, 4096, "int4-g128", "plain", None, 1), (4096, 4096, "int4-g128", "residual", 4, 2),
        (6144, 4096, "int4-g128", "norm", 16, 1), (28672, 4096, "int4-g128", "gated_norm", None, 1),
        (4096, 14336, "int4-g128", "residual", None, 1), (11264, 2048, "int4-g128", "gated_norm", 2, 1),
        (2560, 2048, "int4-g32", "norm", 8, 1), (2048, 5632, "int4-g64-asym", "residual", 1, 2),
        (1024, 1024, "int4-g256", "gated", 8, 1), (2048, 2048, "int4-g128-asym", "bias", 16, 1),
        (4096, 4096, "int4-g128", "gated_norm", 8, None), (2048, 5632, "int4-g128", "plain", 16, None)]
    for n, k, scheme, form, ring, bps in cases:
        torch.manual_seed(n + k)
        mod, w = module(n, k, scheme)
        gated = form.startswith("gated")
        out_n = n // 2 if gated else n
        if form == "bias":
            mod.bias = torch.nn.Parameter(torch.randn(n, device=DEV, dtype=torch.bfloat16) * 0.1)
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        res = torch.randn(1, out_n, device=DEV, dtype=torch.bfloat16) if form == "residual" else None
        nw = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16) if form.endswith("norm") else None
        words, sw = mod.mma_words()
        g = mod.scheme.group_size
        warps, ring_, maxq = int4_stream.stream_config(k, g, gated, ring=ring)
        kw = dict(bias=mod.bias, gated=gated, residual=res, norm_weight=nw)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        grid = sms * bps if bps else 3    # 3 blocks: every block streams many tiles
        y = int4_stream.int4_stream_gemv(x, words, sw, g, launch_config=(warps, ring_, maxq), grid=grid, **kw)
        base = int4_mma.int4_mma_gemv(x, words, sw, g, launch_config=int4_mma.config(k, g, gated, warps=warps, split=1),
                                      **kw)
        err = rel_err(y, reference(w, x, gated, res, nw, mod.bias))
        same = torch.equal(y, base)
        ok = same and err < TOL
        failed += not ok
        row = {"n": n, "k": k, "scheme": scheme, "form": form, "ring": ring_, "grid": grid,
               "equal_to_int4_mma": same, "rel_err": err}
        results.append(row)
        print(f"{'ok  ' if ok else 'FAIL'} {n}x{k} {scheme} {form} ring {ring_} grid {grid}: equal {same}, "
              f"rel err {err:.2e}")
    return failed


def kernel_timing(preset: str, results: list) -> None:
    for name, (n, k) in preset_shapes(preset).items():
        gated = name == "gate_up"
        nbytes = n * k // 2 + n * k // 32
        mods = [module(n, k, "int4-g128")[0] for _ in range(copies_for(nbytes))]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        row = {"preset": preset, "shape": name}
        row["engine"] = with_mode("0", lambda: graph_us([lambda m=m: m.decode(x, gated=gated) for m in mods]))
        packed = [m.mma_words() for m in mods]
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        for warps in (8, 16):
            for ring_kib in (64, 128):
                ring = int4_stream.stream_config(k, 128, gated, warps=warps)[1] * ring_kib // 128
                cfg = int4_stream.stream_config(k, 128, gated, warps=warps, ring=max(1, ring))
                for bps in (1, 2):
                    if bps * (int4_stream.shared_bytes(cfg[0], cfg[1], k, gated) + 2 * 8 * warps * 128) > 228 * 1024:
                        continue   # two blocks would not fit an SM
                    grid = sms * bps
                    row[f"w{warps}_r{cfg[1]}_b{bps}"] = graph_us([
                        lambda p=p: int4_stream.int4_stream_gemv(x, p[0], p[1], 128, gated=gated, launch_config=cfg,
                                                                 grid=grid) for p in packed])
        results.append(row)
        best = min((v, lb) for lb, v in row.items() if lb not in ("preset", "shape", "engine"))
        print(f"{preset:9s} {name:8s} engine {row['engine']:6.2f} us, best stream {best[0]:6.2f} ({best[1]}); "
              + ", ".join(f"{lb} {v:.2f}" for lb, v in row.items() if lb not in ("preset", "shape", "engine")))
        del mods, packed
        torch.cuda.empty_cache()


def layer_timing(preset: str, results: list, layers: int = 12) -> None:
    shapes = preset_shapes(preset)
    dim = shapes["o"][0]
    nw = torch.ones(dim, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, dim, device=DEV, dtype=torch.bfloat16)
    att = torch.randn(1, dim, device=DEV, dtype=torch.bfloat16)
    mods = [{nm: module(n, k, "int4-g128")[0] for nm, (n, k) in shapes.items()} for _ in range(layers)]


    row = {"preset": preset, "layer": True}
    for mode in ("0", "auto", "1"):
        row[f"stream_{mode}"] = with_mode(mode, lambda: graph_us([lambda L=L: engine_layer(L, x0, att, nw)
                                                                 for L in mods]))
    results.append(row)
    print(f"{preset} layer at one row, us: streaming off {row['stream_0']:.2f}, auto {row['stream_auto']:.2f}, "
          f"all {row['stream_1']:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-stream-check")
    p.add_argument("--presets", default="llama3-8b,llama-1b")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    results: list = []
    failed = parity(results)
    if args.timing:
        for preset in args.presets.split(","):
            kernel_timing(preset, results)
            layer_timing(preset, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_stream_check.json").write_text(json.dumps({"torch": torch.__version__,
                                                            "device": torch.cuda.get_device_name(),
                                                            "failed": failed, "results": results}, indent=1))
    print(f"parity failures: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
