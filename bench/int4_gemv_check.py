"""GPU parity and timing of the int4 decode GEMV's fused forms (fourfold.quant.int4_gemv) on llama-1b shapes.

    python bench/int4_gemv_check.py --out DIR          # exit code 1 if a parity check fails

1. Parity against a float32 matmul of the dequantized weights, fresh random inputs per case, bf16 output
(||y - ref|| / ||ref|| < 1e-2): groups 32/64/128/256, symmetric and asymmetric, 1/2/4/8 token rows, the plain,
gated (SiLU*mul), residual-add and RMSNorm-prologue forms, through Int4WeightLinear.decode (its cached planes).
2. One decoder layer's matmul work at one row, as the engine runs it, each in a CUDA graph over 12 layers'
weights (more than L2 holds): (a) bf16 Triton GEMVs + add+RMSNorm kernels (the bf16 model's path); (b) torch's
int4 mm (tinygemm) + add+RMSNorm + SiLU*mul kernels (the int4 path before); (c) the int4 GEMV with separate
norms; (d) norms and residual adds fused into the GEMVs (fused_decoder.INT4_FUSED_NORMS). Per-kernel times of the int4
GEMV at 1..8 rows against tinygemm: bench/gemv_check.py. 3. `--sweep-s S`: tile configs at one row per shape.
Writes int4_gemv_check.json.
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

from fourfold.infer import gemv_gpu  # noqa: E402
from fourfold.infer.fused_ops import add_rms_norm, silu_mul  # noqa: E402
from fourfold.quant.fake_quant import dequantize_weight, quantize_weight  # noqa: E402
from fourfold.quant.packing import Int4WeightLinear  # noqa: E402
from fourfold.quant.schemes import scheme_by_name  # noqa: E402

DIM, FFN, QKV = 2048, 5632, 2560
DEV = torch.device("cuda")
TOL = 1e-2


def module(n: int, k: int, scheme: str) -> tuple[Int4WeightLinear, torch.Tensor]:
    """A converted (n, k) layer of random weights and its dequantized float32 weight."""
    lin = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
    lin.weight.data.normal_(0, k ** -0.5)
    s = scheme_by_name(scheme)
    q, sc, z = quantize_weight(lin.weight, s)
    return Int4WeightLinear.from_float(lin, s).to(DEV), dequantize_weight(q, sc, z, s).float()


def parity(results: list) -> int:
    failed = 0
    cases = [("int4-g128", "gate_up"), ("int4-g128-asym", "down"), ("int4-g32", "qkv"), ("int4-g64-asym", "o"),
             ("int4-g256", "gate_up"), ("int4-g128", "qkv"), ("int4-g128", "o"), ("int4-g128", "down")]
    shapes = {"qkv": (QKV, DIM), "o": (DIM, DIM), "gate_up": (2 * FFN, DIM), "down": (DIM, FFN)}
    for scheme, shape in cases:
        n, k = shapes[shape]
        gated = shape == "gate_up"
        mod, w = module(n, k, scheme)
        for rows in (1, 2, 4, 8):
            for form in ("plain", "residual", "norm"):
                x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
                nw = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16)
                r = torch.randn(rows, n // 2 if gated else n, device=DEV, dtype=torch.bfloat16)
                xin = add_rms_norm(x, None, nw, 1e-5)[0] if form == "norm" else x
                ref = xin.float() @ w.T
                ref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:] if gated else ref
                ref = ref + r.float() if form == "residual" else ref
                y = mod.decode(x, gated=gated, residual=r if form == "residual" else None,
                               norm_weight=nw if form == "norm" else None, eps=1e-5)
                err = rel_err(y, ref)
                ok = err < TOL
                failed += not ok
                results.append({"scheme": scheme, "shape": shape, "rows": rows, "form": form, "rel_err": err})
                print(f"{'ok  ' if ok else 'FAIL'} {scheme:15s} {shape:8s} x{rows} {form:8s} rel err {err:.2e}")
        del mod, w
    return failed


def sweep(results: list, deadline: float) -> dict:
    """Tile configs (BLOCK_N, KC, num_warps) of the int4 GEMV at one row per llama-1b shape, fastest first."""
    import triton
    from gemv_check import int4_weights
    from fourfold.quant import int4_gemv

    best = {}
    shapes = {"qkv": (QKV, DIM), "o": (DIM, DIM), "gate_up": (2 * FFN, DIM), "down": (DIM, FFN)}
    for name, (n, k) in shapes.items():
        gated = name == "gate_up"
        # 8..64 packed words a thread (both halves when gated), chunks no longer than K rounded up to a power of 2
        configs = [(bn, kc, w) for bn in (4, 8, 16, 32) for kc in (1024, 2048, 4096, 8192) for w in (1, 2, 4, 8)
                   if kc <= triton.next_power_of_2(k) and 8 <= bn * kc // 8 // (32 * w) * (1 + gated) <= 64]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        i4, nbytes = int4_weights(n, k)
        found = []
        for cfg in configs:
            if time.time() > deadline:
                break
            us = graph_us([lambda t=t: int4_gemv.int4_gemv(x, t[0], t[1], t[2], 128, gated=gated, config=cfg,
                                                           asym=False, words=t[3]) for t in i4])
            found.append((us, cfg))
        found.sort()
        default = int4_gemv._config(n // (2 if gated else 1), k, 128)
        results.append({"shape": name, "best": found[:6], "default": default, "bytes": nbytes})
        if found:
            best[name] = found[0]
            print(f"sweep {name:8s}: " + ", ".join(f"{c} {u:.2f}us" for u, c in found[:4])
                  + f" | best {nbytes / 1e3 / found[0][0]:.0f} GB/s packed; default {default}")
        del i4
    return best


def layer_timing(results: list, layers: int = 12) -> None:
    """One decoder layer's matmuls + norms at one token row (attention excluded), per layer, in us."""
    bf, i4 = [], []
    for _ in range(layers):
        ws = {nm: torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
              for nm, (n, k) in {"qkv": (QKV, DIM), "o": (DIM, DIM), "gu": (2 * FFN, DIM), "down": (DIM, FFN)}.items()}
        bf.append(ws)
        i4.append({nm: Int4WeightLinear.from_float(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=DEV,
                                                                   dtype=torch.bfloat16).requires_grad_(False),
                                                   scheme_by_name("int4-g128")).to(DEV) for nm, w in ws.items()})
    nw = torch.ones(DIM, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, DIM, device=DEV, dtype=torch.bfloat16)
    att = torch.randn(1, DIM, device=DEV, dtype=torch.bfloat16)
    for L in i4:
        for m in L.values():
            m.planes()
            m._kernel_args(x0)

    def bf16_layer(ws):
        normed, res = add_rms_norm(x0, att, nw, 1e-5)
        gemv_gpu.gemv_triton(normed, ws["qkv"])
        x = gemv_gpu.gemv_triton(att, ws["o"])
        normed, res = add_rms_norm(x, res, nw, 1e-5)
        gemv_gpu.gemv_triton(gemv_gpu.gemv_triton(normed, ws["gu"], gated=True), ws["down"])

    def tinygemm_layer(L):
        normed, res = add_rms_norm(x0, att, nw, 1e-5)
        with torch.no_grad():
            L["qkv"](normed)   # MAX_ROWS patched to 0 below: torch's int4 mm
            x = L["o"](att)
            normed, res = add_rms_norm(x, res, nw, 1e-5)
            L["down"](silu_mul(L["gu"](normed)))

    def gemv_layer(L):
        normed, res = add_rms_norm(x0, att, nw, 1e-5)
        L["qkv"].decode(normed)
        x = L["o"].decode(att)
        normed, res = add_rms_norm(x, res, nw, 1e-5)
        L["down"].decode(L["gu"].decode(normed, gated=True))

    def fused_layer(L):     # as the engine runs it (INT4_FUSED_NORMS): norms and residual adds in the GEMVs
        L["qkv"].decode(x0, norm_weight=nw)
        h = L["o"].decode(att, residual=x0)
        L["down"].decode(L["gu"].decode(h, gated=True, norm_weight=nw), residual=h)

    from fourfold.quant import int4_gemv
    saved = int4_gemv.MAX_ROWS
    row = {}
    for name, fn, weights in (("bf16_gemv+norms", bf16_layer, bf), ("int4_tinygemm+norms+silu", tinygemm_layer, i4),
                              ("int4_gemv+norms", gemv_layer, i4), ("int4_gemv_fused", fused_layer, i4)):
        int4_gemv.MAX_ROWS = 0 if "tinygemm" in name else saved
        row[name] = graph_us([lambda w=w: fn(w) for w in weights])
        print(f"layer at 1 row, {name:26s} {row[name]:7.2f} us")
    int4_gemv.MAX_ROWS = saved
    int4_bytes = (QKV + DIM + 2 * FFN) * DIM // 2 + DIM * FFN // 2
    row["int4_fused_TBps_packed"] = int4_bytes / row["int4_gemv_fused"] / 1e6
    row["bf16_TBps"] = int4_bytes * 4 / row["bf16_gemv+norms"] / 1e6
    print(f"packed int4 bytes / fused layer time: {row['int4_fused_TBps_packed']:.2f} TB/s; "
          f"bf16 bytes / bf16 layer time: {row['bf16_TBps']:.2f} TB/s; "
          f"bf16 / int4 fused: {row['bf16_gemv+norms'] / row['int4_gemv_fused']:.2f}x")
    results.append(row)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-gemv-check")
    p.add_argument("--sweep-s", type=float, default=0, help="seconds for a tile-config sweep at one row (0: none)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    start = time.time()
    torch.manual_seed(0)
    checks, timing, sweeps = [], [], []
    failed = parity(checks)
    print(f"{len(checks) - failed}/{len(checks)} parity checks passed ({time.time() - start:.0f}s)")
    if a.sweep_s > 0:
        sweep(sweeps, time.time() + a.sweep_s)
    layer_timing(timing)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_gemv_check.json").write_text(json.dumps({"device": torch.cuda.get_device_name(DEV),
                                                          "parity": checks, "layer": timing,
                                                          "sweep": sweeps}, indent=1))
    print(f"wrote {out / 'int4_gemv_check.json'} in {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
