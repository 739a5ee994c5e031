"""GPU check and timing of the decode GEMV kernels (bf16 and int4) against cuBLAS and torch's int4 kernel.

    python bench/gemv_check.py --out DIR [--sweep] [--budget-s 200]

Shapes: the `llama-1b` decode matmuls (q|k|v 2560x2048, o 2048x2048, gate|up 11264x2048 with SiLU*mul
fused, down 2048x5632, head 32000x2048). 1. Parity: fourfold.infer.gemv_gpu and fourfold.quant.int4_gemv
(the kernel, and Int4WeightLinear's own path; schemes int4-g128, int4-g128-asym, int4-g32, 8da4w-g128, gated form too)
against a float32 reference on fresh random inputs, ||y - ref|| / ||ref|| (bf16 output: < 1e-2), output
poisoned before each run. 2. Timing at 1..16 token rows: cuBLAS F.linear (+ the Triton SiLU*mul for
gate|up) vs the Triton GEMV; torch `_weight_int4pack_mm` vs the int4 GEMV. Each case is a CUDA graph of R
launches over R copies of the weights (more bytes than L2 holds, as in a decode step), replayed 30 times;
median per launch in us and weight GB/s. 3. `--sweep`: tile configs of both kernels at one row, per shape,
fastest first (until --budget-s). Writes gemv_check.json; prints a table. Exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fourfold.infer import gemv_gpu  # noqa: E402
from fourfold.infer.fused_ops import silu_mul  # noqa: E402
from fourfold.quant import int4_gemv  # noqa: E402
from fourfold.quant.fake_quant import dequantize_weight, fake_quantize_activation, quantize_weight  # noqa: E402
from fourfold.quant.packing import Int4WeightLinear, int4_kernel_weight, scales_and_zeros  # noqa: E402
from fourfold.quant.schemes import scheme_by_name  # noqa: E402

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "head": (32000, 2048)}      # (out rows N, in K); gate_up is gated: N/2 outputs
SCHEMES = ["int4-g128", "int4-g128-asym", "int4-g32", "8da4w-g128"]
ROWS = (1, 2, 4, 8, 16)
TOL = 1e-2
DEV = torch.device("cuda")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).norm() / ref.norm())


def gated_ref(y: torch.Tensor) -> torch.Tensor:
    half = y.shape[-1] // 2
    return F.silu(y[..., :half]) * y[..., half:]


def check_parity(results: list, m_list=(1, 3, 8)) -> int:
    failed = 0
    for name, (n, k) in SHAPES.items():
        gated = name == "gate_up"
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        for m in m_list:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            ref = x.float() @ w.float().T
            ref = gated_ref(ref) if gated else ref
            y = gemv_gpu.gemv_triton(x, w, gated=gated)
            err = rel_err(y, ref)
            failed += not err < TOL
            results.append({"kernel": "bf16", "shape": name, "rows": m, "rel_err": err})
            print(f"{'ok  ' if err < TOL else 'FAIL'} bf16 gemv {name:8s} x{m:<2d} rel err {err:.2e}")
        for scheme_name in SCHEMES:
            scheme = scheme_by_name(scheme_name)
            q, s, z = quantize_weight(w, scheme)
            w_hat = dequantize_weight(q, s, z, scheme).float()
            lin = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            module = Int4WeightLinear.from_float(lin, scheme, name).to(DEV)
            for m in m_list:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                xq = fake_quantize_activation(x) if scheme.activation != "none" else x
                ref = xq.float() @ w_hat.T
                ref = gated_ref(ref) if gated else ref
                with torch.no_grad():
                    kernel = int4_gemv.int4_gemv(xq, module.weight_int4, module.scales, module.zero_points,
                                                 scheme.group_size, gated=gated, asym=not scheme.symmetric)
                    torch_mm = module(x)  # the module's own path at this row count (int4_gemv.MAX_ROWS)
                for label, y in (("triton", kernel), ("module", gated_ref(torch_mm.float()) if gated else torch_mm)):
                    err = rel_err(y, ref)
                    failed += not err < TOL
                    results.append({"kernel": f"{scheme_name} {label}", "shape": name, "rows": m, "rel_err": err})
                    print(f"{'ok  ' if err < TOL else 'FAIL'} {scheme_name:15s} {label:6s} {name:8s} x{m:<2d} "
                          f"rel err {err:.2e}")
    return failed


def graph_run(calls: list) -> tuple[float, list]:
    """(median us per call, the captured outputs) with `calls` back to back in one CUDA graph, replayed 30 times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [c() for c in calls]
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times), outs


def graph_us(calls: list) -> float:
    """Median time of one call (us) when all `calls` run back to back in one replayed CUDA graph."""
    return graph_run(calls)[0]


def copies_for(nbytes: int) -> int:
    return max(2, min(24, -(-400_000_000 // nbytes)))


def bf16_weights(n, k):
    return [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]


def int4_weights(n, k, group=128):
    nbytes = n * k // 2 + n * (k // group) * 3
    out = []
    for _ in range(copies_for(nbytes)):
        packed = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
        s = (torch.rand(n, k // group, device=DEV) * 0.02 + 0.01).to(torch.bfloat16)
        z = torch.zeros(n, k // group, device=DEV, dtype=torch.int8)
        out.append((packed, s, z, int4_gemv.repack_planes(packed, group)))
    return out, nbytes


def time_cases(results: list) -> None:
    print(f"\n{'shape':8s} {'rows':>4s} | {'cuBLAS us':>9s} {'GB/s':>6s} | {'gemv us':>8s} {'GB/s':>6s} | "
          f"{'int4mm us':>9s} | {'int4 gemv':>9s} {'GB/s':>6s} | gemv/cuBLAS int4gemv/int4mm")
    for name, (n, k) in SHAPES.items():
        gated = name == "gate_up"
        ws = bf16_weights(n, k)
        i4, i4_bytes = int4_weights(n, k)
        tiled = [(int4_kernel_weight(p.cpu(), DEV), scales_and_zeros(s, z, torch.bfloat16)) for p, s, z, _ in i4]
        for m in ROWS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            if gated:
                cublas = [lambda w=w: silu_mul(F.linear(x, w)) for w in ws]
            else:
                cublas = [lambda w=w: F.linear(x, w) for w in ws]
            ours = [lambda w=w: gemv_gpu.gemv_triton(x, w, gated=gated) for w in ws]
            mm = [lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], 128, t[1]) for t in tiled]
            g4 = [lambda t=t: int4_gemv.int4_gemv(x, t[0], t[1], t[2], 128, gated=gated, asym=False, words=t[3])
                  for t in i4]
            row = {"shape": name, "n": n, "k": k, "rows": m, "cublas_us": graph_us(cublas),
                   "gemv_us": graph_us(ours), "int4mm_us": graph_us(mm), "int4_gemv_us": graph_us(g4)}
            gb = n * k * 2 / 1e3
            print(f"{name:8s} {m:4d} | {row['cublas_us']:9.2f} {gb / row['cublas_us']:6.0f} | {row['gemv_us']:8.2f} "
                  f"{gb / row['gemv_us']:6.0f} | {row['int4mm_us']:9.2f} | {row['int4_gemv_us']:9.2f} "
                  f"{i4_bytes / 1e3 / row['int4_gemv_us']:6.0f} | {row['cublas_us'] / row['gemv_us']:6.2f}x "
                  f"{row['int4mm_us'] / row['int4_gemv_us']:6.2f}x")
            results.append(row)
        del ws, i4, tiled
        torch.cuda.empty_cache()


def sweep(results: list, deadline: float, bf16: bool) -> None:
    for name, (n, k) in SHAPES.items():
        gated = name == "gate_up"
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        ws = bf16_weights(n, k) if bf16 else []
        found = []
        for bn in (2, 4, 8, 16):
            for bk in (256, 512, 1024):
                for warps in (4, 8):
                    if time.time() > deadline or not bf16:
                        break
                    cfg = (bn, bk, warps)
                    us = graph_us([lambda w=w: gemv_gpu.gemv_triton(x, w, gated=gated, config=cfg) for w in ws])
                    found.append((us, cfg))
        found.sort()
        if bf16:
            results.append({"sweep": "bf16", "shape": name, "best": found[:5],
                            "default": gemv_gpu._config(n // (2 if gated else 1), k)})
            print(f"sweep bf16 {name:8s}: " + ", ".join(f"{c} {u:.2f}us" for u, c in found[:4])
                  + f" | {n * k * 2 / 1e3 / found[0][0]:.0f} GB/s" if found else "")
        del ws
        i4, i4_bytes = int4_weights(n, k)
        found = []
        for bn in (2, 4, 8, 16):
            for kc in (256, 512, 1024):
                for warps in (2, 4, 8):
                    if time.time() > deadline or k % kc:
                        break
                    cfg = (bn, kc, warps)
                    us = graph_us([lambda t=t: int4_gemv.int4_gemv(x, t[0], t[1], t[2], 128, gated=gated, config=cfg,
                                                                   asym=False, words=t[3]) for t in i4])
                    found.append((us, cfg))
        found.sort()
        results.append({"sweep": "int4-g128", "shape": name, "best": found[:5]})
        print(f"sweep int4 {name:8s}: " + ", ".join(f"{c} {u:.2f}us" for u, c in found[:4])
              + f" | {i4_bytes / 1e3 / found[0][0]:.0f} GB/s" if found else "")
        del i4
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gemv-check")
    p.add_argument("--sweep", action="store_true", help="sweep both kernels' tile configs")
    p.add_argument("--sweep-int4", action="store_true", help="sweep the int4 kernel's only")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--budget-s", type=float, default=200, help="stop the sweep after this many seconds in all")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    start = time.time()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(DEV)}")
    torch.manual_seed(0)
    parity, timing, sweeps = [], [], []
    failed = check_parity(parity)
    print(f"{len(parity) - failed}/{len(parity)} parity checks passed ({time.time() - start:.0f}s)")
    if not a.no_timing:
        time_cases(timing)
    print(f"timing done ({time.time() - start:.0f}s)")
    if a.sweep or a.sweep_int4:
        sweep(sweeps, start + a.budget_s, bf16=a.sweep)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_check.json").write_text(json.dumps({"torch": torch.__version__,
                                                     "device": torch.cuda.get_device_name(DEV), "parity": parity,
                                                     "timing": timing, "sweep": sweeps}, indent=1))
    print(f"wrote {out / 'gemv_check.json'} in {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
