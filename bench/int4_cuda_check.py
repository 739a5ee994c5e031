"""Check fourfold's CUDA int4/int8 weight paths against a dequantized bf16 matmul, and time them beside bf16 F.linear.

    python bench/int4_cuda_check.py [--out bench/results/<date>-h200-int4]

For Llama-1.1B-shaped linears (2048->2048, 2048->256, 2048->5632, 5632->2048) and 1 and 16 tokens, every
scheme's converted module (Int4WeightLinear through `_convert_weight_to_int4pack` + `_weight_int4pack_mm`,
Int8WeightLinear through `_weight_int8pack_mm`) must match x @ dequantize(q, scales, zero points).T computed
in float32, within 1e-2 of max |y| (bf16 rounding). A wrong nibble order or scale/zero layout gives errors
of order 1. Then, per shape, the batch-1 time of the int4 kernel vs bf16 F.linear (the same weights in
bf16): CUDA events, median of 200 runs after warm-up. Exit code 1 if any check fails. Writes check.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fourfold.quant.fake_quant import dequantize_weight, fake_quantize_activation, quantize_weight  # noqa: E402
from fourfold.quant.packing import Int4WeightLinear, Int8WeightLinear  # noqa: E402
from fourfold.quant.schemes import scheme_by_name  # noqa: E402

SHAPES = [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048)]    # (in, out)
SCHEMES = ["int4-g32", "int4-g64", "int4-g128", "int4-g256", "int4-g128-asym", "8da4w-g128", "int8"]
TOL = 1e-2


def time_ms(fn, runs: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=f"bench/results/{datetime.date.today()}-int4-cuda")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}")
    torch.manual_seed(0)
    checks, timings, failed = [], [], 0
    for k, n in SHAPES:
        linear = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        for name in SCHEMES:
            scheme = scheme_by_name(name)
            cls = Int4WeightLinear if scheme.weight_bits == 4 else Int8WeightLinear
            module = cls.from_float(linear, scheme, "check").to(dev)
            q, scales, zeros = quantize_weight(linear.weight, scheme)
            w_hat = dequantize_weight(q, scales, zeros, scheme).to(dev)
            for m in (1, 16):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                xq = fake_quantize_activation(x) if scheme.activation != "none" else x
                ref = xq.float() @ w_hat.T
                with torch.no_grad():
                    y = module(x).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                ok = err < TOL
                failed += not ok
                checks.append({"in": k, "out": n, "tokens": m, "scheme": name, "rel_err": err, "ok": ok})
                print(f"{'ok  ' if ok else 'FAIL'} {name:<15} {k:>5}->{n:<5} x{m:<3} relative error {err:.2e}")
        module = Int4WeightLinear.from_float(linear, scheme_by_name("int4-g128"), "check").to(dev)
        w = linear.weight.to(dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            bf16_ms, int4_ms = time_ms(lambda: F.linear(x, w)), time_ms(lambda: module(x))
        timings.append({"in": k, "out": n, "bf16_ms": bf16_ms, "int4_g128_ms": int4_ms,
                        "speedup": bf16_ms / int4_ms})
        print(f"batch 1 {k}->{n}: bf16 {bf16_ms * 1e3:.1f} us, int4-g128 {int4_ms * 1e3:.1f} us, "
              f"x{bf16_ms / int4_ms:.2f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(dev),
                                                "checks": checks, "timings": timings}, indent=1))
    print(f"{len(checks) - failed}/{len(checks)} checks passed; wrote {out / 'check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
