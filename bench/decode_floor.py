"""Where a batch-1 decode layer's time goes on one GPU: dependent-launch cost, and weights in HBM versus L2.

    python bench/decode_floor.py --out DIR          # one H200; writes decode_floor.json, prints us per item

Each item is a CUDA graph of back-to-back launches, every one reading what the one before wrote (as in a
decode step), timed by bench/gemv_check.graph_us:
1. `link`: a trivial kernel (programmatic dependent launch, as fourfold's kernels) with 1 or 640 programs:
   the floor of one dependent kernel.
2. One llama-1b layer's GEMVs and norms at one token row (attention left out), bf16 and int4-g128, with each
   layer's own weights (12 layers: more than L2 holds, as in a real step) and with one layer's weights 12
   times (after the first, they come from L2): the difference is what reading the weights from HBM costs.
3. The same int4 layer without its two add+RMSNorm kernels, and with them fused into the GEMVs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import graph_us  # noqa: E402

from fourfold.infer import gemv_gpu  # noqa: E402
from fourfold.infer.fused_ops import add_rms_norm  # noqa: E402
from fourfold.ops.triton_launch import pdl, triton  # noqa: E402
from fourfold.quant.packing import Int4WeightLinear  # noqa: E402
from fourfold.quant.schemes import scheme_by_name  # noqa: E402

import triton.language as tl  # noqa: E402

from fourfold.ops.triton_launch import pdl_signal, pdl_wait  # noqa: E402

DIM, FFN, QKV = 2048, 5632, 2560
DEV = torch.device("cuda")
LAYERS = 12


@triton.jit
def _link_kernel(src, dst, PDL: tl.constexpr, BLOCK: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i) + 1.0)


def link_us(programs: int) -> float:
    """One dependent trivial kernel of `programs` programs (128 threads each), in a chain of 96."""
    a, b = (torch.zeros(programs * 128, device=DEV) for _ in range(2))
    use = pdl(DEV)

    def one(src, dst):
        _link_kernel[(programs,)](src, dst, PDL=use, BLOCK=128, num_warps=4, launch_pdl=use)
    return graph_us([lambda i=i: one(a, b) if i % 2 == 0 else one(b, a) for i in range(96)])


def layers() -> tuple[list[dict], list[dict]]:
    """LAYERS layers of random bf16 weights and the same converted to int4-g128 (planes made)."""
    bf, i4 = [], []
    shapes = {"qkv": (QKV, DIM), "o": (DIM, DIM), "gu": (2 * FFN, DIM), "down": (DIM, FFN)}
    for _ in range(LAYERS):
        ws = {}
        for name, (n, k) in shapes.items():
            lin = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16).requires_grad_(False)
            ws[name] = lin
        bf.append({name: lin.weight for name, lin in ws.items()})
        i4.append({name: Int4WeightLinear.from_float(lin, scheme_by_name("int4-g128")).to(DEV)
                   for name, lin in ws.items()})
        for m in i4[-1].values():
            m.planes()
    return bf, i4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "pdl": pdl(DEV)}
    for programs in (1, 640):
        results[f"link_{programs}"] = link_us(programs)
        print(f"dependent trivial kernel, {programs:4d} programs: {results[f'link_{programs}']:6.2f} us")
    bf, i4 = layers()
    nw = torch.ones(DIM, device=DEV, dtype=torch.bfloat16)
    h0 = torch.randn(1, DIM, device=DEV, dtype=torch.bfloat16)
    state = {"h": h0}

    def attention_stand_in(qkv):  # the layer's attention output: q's slice, so the o GEMV waits for q|k|v
        return qkv[:, :DIM]

    def bf16_layer(w):
        normed, res = add_rms_norm(state["h"], None, nw, 1e-5)
        x = gemv_gpu.gemv_triton(attention_stand_in(gemv_gpu.gemv_triton(normed, w["qkv"])), w["o"])
        normed, res = add_rms_norm(x, res, nw, 1e-5)
        state["h"] = gemv_gpu.gemv_triton(gemv_gpu.gemv_triton(normed, w["gu"], gated=True), w["down"])

    def int4_layer(m):
        normed, res = add_rms_norm(state["h"], None, nw, 1e-5)
        x = m["o"].decode(attention_stand_in(m["qkv"].decode(normed)))
        normed, res = add_rms_norm(x, res, nw, 1e-5)
        state["h"] = m["down"].decode(m["gu"].decode(normed, gated=True))

    def int4_layer_no_norms(m):
        x = m["o"].decode(attention_stand_in(m["qkv"].decode(state["h"])))
        state["h"] = m["down"].decode(m["gu"].decode(x, gated=True))

    def int4_layer_fused_norms(m):
        h = state["h"]
        x = m["o"].decode(attention_stand_in(m["qkv"].decode(h, norm_weight=nw)), residual=h)
        state["h"] = m["down"].decode(m["gu"].decode(x, gated=True, norm_weight=nw), residual=x)

    for name, fn, weights in (("bf16", bf16_layer, bf), ("int4", int4_layer, i4),
                              ("int4_no_norms", int4_layer_no_norms, i4),
                              ("int4_fused_norms", int4_layer_fused_norms, i4)):
        hbm = graph_us([lambda w=w: fn(w) for w in weights])
        l2 = graph_us([lambda: fn(weights[0]) for _ in weights])
        results[f"layer_{name}_hbm"], results[f"layer_{name}_l2"] = hbm, l2
        print(f"layer {name:18s} weights in HBM {hbm:6.2f} us, in L2 {l2:6.2f} us")
    with open(Path(args.out) / "decode_floor.json", "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
