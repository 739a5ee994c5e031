"""Experiment: llama-1b's four int4 decode GEMVs of every layer as one persistent kernel, against the engine's chain.

    python bench/persistent_layers_check.py --out DIR       # exit code 1 if the two disagree

bench/persistent_layers.cu runs, for one token row, q|k|v (RMSNorm fused), o (+ residual), gate|up (RMSNorm,
SiLU * up) and down (+ residual) of --layers int4-g128 layers (default 22, llama-1b's count) in one launch: one
block per SM, each block's weights for a phase copied into shared memory a layer ahead, grid barriers between
phases. The o input is a fixed vector (as bench/int4_mma_check.py's layer chain: no attention here). The same
chain through the engine's kernels (Int4WeightLinear.decode: the tensor-core GEMVs, Triton gate|up at one row) is
the reference for the time (CUDA graphs, median of replays) and, with the mma kernel for gate|up too, for the
numbers: bit for bit over 1-4 layers where a block's warps split K as the engine's do (a rare rounding flip
where they do not, amplified by 22 random layers, leaves ~1e-2 at the end). Timing variants (VARIANTS) take
the barrier, the weight stream or the sums away to show what each costs; block 0's global timer at each
barrier gives per-phase times. Writes persistent_layers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import graph_us, rel_err  # noqa: E402
from int4_gemv_check import DEV, DIM, FFN, QKV, module  # noqa: E402
from int4_mma_check import preset_shapes  # noqa: E402

from fourfold.ops import nvrtc_launch  # noqa: E402
from fourfold.quant import int4_mma  # noqa: E402

SHAPES = preset_shapes("llama-1b")   # the kernel's DIM / FFN / QKV

EPS = 1e-5
VARIANTS = {"flag barrier": {}, "atomic barrier": {"FLAG_BARRIER": 0},
            "weights of layer 0 only (no stream)": {"STREAM": 0},
            "barriers and x staging only": {"STREAM": 0, "MATH": 0},
            "barriers only": {"STREAM": 0, "BARRIER_ONLY": 1},
            "barriers only, lite": {"STREAM": 0, "BARRIER_ONLY": 1, "LITE_BARRIER": 1},
            "atomic barriers only": {"STREAM": 0, "BARRIER_ONLY": 1, "FLAG_BARRIER": 0},
            "flag barrier, lite": {"LITE_BARRIER": 1}}
CHECKED = ("flag barrier", "atomic barrier", "flag barrier, lite")


def source() -> str:
    """The int4 mma kernels' helpers (int4_mma_common.cuh), then the persistent kernel."""
    return int4_mma.helpers_source() + (Path(__file__).parent / "persistent_layers.cu").read_text()


def smem_bytes(maxt_qkv: int, maxt_gu: int) -> int:
    """persistent_layers.cu's SMEM_BYTES: the four weight slots, x and the norm weight."""
    def slot(k, maxt, parts):
        return maxt * parts * (k * 8 + k // 2)
    return slot(DIM, maxt_qkv, 1) + slot(DIM, 1, 1) + slot(DIM, maxt_gu, 2) + slot(FFN, 1, 1) + FFN * 2 + DIM * 2


class Persistent:
    """The persistent kernel over `layers` (dicts of Int4WeightLinear by shape name, plus norm weights)."""

    def __init__(self, layers: list[dict], blocks: int, switches: dict | None = None):
        self.blocks = blocks
        self.maxt_qkv, self.maxt_gu = -(-QKV // 16 // blocks), -(-FFN // 16 // blocks)
        self.smem = smem_bytes(self.maxt_qkv, self.maxt_gu)
        defines = {"DIM": DIM, "FFN": FFN, "QKV_TILES": QKV // 16, "MAXT_QKV": self.maxt_qkv, "MAXT_GU": self.maxt_gu,
                   **(switches or {})}
        self.kernel = nvrtc_launch.compiled_kernel(source(), "persistent_layers", defines, DEV)
        ptrs = []
        for L in layers:
            for name in ("qkv", "o", "gate_up", "down"):
                words, sw = L[name].mma_words()
                ptrs += [words.data_ptr(), sw.data_ptr()]
            ptrs += [L["attn_norm"].data_ptr(), L["ffn_norm"].data_ptr()]
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=DEV)
        self.n_layers = len(layers)
        self.bar = torch.zeros(max(2, blocks), dtype=torch.int32, device=DEV)   # barrier words
        self.h_mid = torch.empty(1, DIM, device=DEV, dtype=torch.bfloat16)
        self.qkv = torch.empty(1, QKV, device=DEV, dtype=torch.bfloat16)
        self.act = torch.empty(1, FFN, device=DEV, dtype=torch.bfloat16)

    def __call__(self, h: torch.Tensor, att: torch.Tensor, stamps: torch.Tensor | None = None,
                 layers: int | None = None) -> None:
        """Runs the first `layers` (default all) on h (1, DIM) in place."""
        nvrtc_launch.launch(self.kernel, self.blocks, 512,
                            [self.table, h, self.h_mid, self.qkv, att, self.act, self.bar, stamps,
                             layers or self.n_layers, EPS], DEV, shared_bytes=self.smem)


def engine_layer(L: dict, h: torch.Tensor, att: torch.Tensor, mma_gate_up: bool) -> tuple:
    """One layer through the engine's kernels; mma_gate_up: the mma kernel for gate|up too (the same rounding as
    the persistent kernel; the engine uses Triton at one row)."""
    qkv = L["qkv"].decode(h, norm_weight=L["attn_norm"], eps=EPS)
    h_mid = L["o"].decode(att, residual=h)
    if mma_gate_up:
        act = int4_mma.int4_mma_gemv(h_mid, *L["gate_up"].mma_words(), 128, gated=True, norm_weight=L["ffn_norm"],
                                     eps=EPS)
    else:
        act = L["gate_up"].decode(h_mid, gated=True, norm_weight=L["ffn_norm"], eps=EPS)
    return qkv, h_mid, act, L["down"].decode(act, residual=h_mid)


def finish_or_exit(what: str, seconds: float = 30.0) -> None:
    """Wait for the GPU, exiting the process if it has not finished in `seconds` (a grid barrier that hangs)."""
    done = torch.cuda.Event()
    done.record()
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > seconds:
            print(f"HANG: {what} did not finish in {seconds:.0f} s", flush=True)
            os._exit(3)
        time.sleep(0.01)


def phase_times(pk: Persistent, h: torch.Tensor, att: torch.Tensor, n: int) -> dict:
    """Median us per phase from block 0 leaving one barrier to leaving the next (layers after the first)."""
    stamps = torch.zeros(4 * n + 1, dtype=torch.int64, device=DEV)
    for _ in range(3):
        pk(h, att, stamps)
    finish_or_exit("the stamped launches")
    s = stamps.cpu().tolist()
    out = {}
    for i, ph in enumerate(("qkv", "o", "gate_up", "down")):
        v = sorted((s[4 * layer + i + 1] - s[4 * layer + i]) / 1000 for layer in range(1, n))
        out[ph] = v[len(v) // 2]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against b (inf where a is not finite)."""
    return rel_err(a, b.float())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/persistent-layers")
    p.add_argument("--layers", type=int, default=22)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    blocks = torch.cuda.get_device_properties(DEV).multi_processor_count
    layers = []
    for _ in range(a.layers):
        L = {name: module(n, k, "int4-g128")[0] for name, (n, k) in SHAPES.items()}
        L["attn_norm"] = (torch.rand(DIM, device=DEV) + 0.5).to(torch.bfloat16)
        L["ffn_norm"] = (torch.rand(DIM, device=DEV) + 0.5).to(torch.bfloat16)
        layers.append(L)
    h0 = torch.randn(1, DIM, device=DEV, dtype=torch.bfloat16)
    att = torch.randn(1, DIM, device=DEV, dtype=torch.bfloat16)
    n = a.layers
    ref = h0.clone()
    for L in layers:
        qkv, h_mid, act, ref = engine_layer(L, ref, att, mma_gate_up=True)
    ref1 = engine_layer(layers[0], h0.clone(), att, mma_gate_up=True)   # one layer: q|k|v, h_mid, act, h
    again = h0.clone()
    for L in layers:
        again = engine_layer(L, again, att, mma_gate_up=True)[3]
    print(f"engine chain run twice, {n} layers: rel diff {rel(again, ref):.2e}")
    he = h0.clone()   # graph_us gives the time per call: per layer for the engine's chain
    t_eng = n * graph_us([lambda L=L: engine_layer(L, he, att, mma_gate_up=False) for L in layers])
    t_eng_mma = n * graph_us([lambda L=L: engine_layer(L, he, att, mma_gate_up=True) for L in layers])
    print(f"engine chain {t_eng:.1f} us ({t_eng / n:.2f} a layer), with mma gate|up {t_eng_mma:.1f} us "
          f"({t_eng_mma / n:.2f})")
    results, ok = {}, True
    for label, switches in VARIANTS.items():
        pk = Persistent(layers, blocks, switches)
        h = h0.clone()
        pk(h, att)
        finish_or_exit(f"{label}: the first launch")
        row = {"switches": switches}
        if label in CHECKED:   # the others skip work, so their numbers are not the layer's
            row["rel_err"] = {"h": rel(h, ref), "qkv (last layer)": rel(pk.qkv, qkv),
                              "h_mid (last layer)": rel(pk.h_mid, h_mid), "act (last layer)": rel(pk.act, act)}
            h1 = h0.clone()
            pk(h1, att, layers=1)
            finish_or_exit(f"{label}: one layer")
            row["rel_err_one_layer"] = {nm: rel(mine, theirs) for nm, mine, theirs in zip(
                ("qkv", "h_mid", "act", "h"), (pk.qkv, pk.h_mid, pk.act, h1), ref1)}
            row["rel_err_h_by_layers"] = {}
            for k in (2, 3, 4):
                hk, rk = h0.clone(), h0.clone()
                pk(hk, att, layers=k)
                for L in layers[:k]:
                    rk = engine_layer(L, rk, att, mma_gate_up=True)[3]
                finish_or_exit(f"{label}: {k} layers")
                row["rel_err_h_by_layers"][k] = rel(hk, rk)
            print(f"     {label}, h after 2, 3, 4 layers, rel err: "
                  + ", ".join(f"{v:.2e}" for v in row["rel_err_h_by_layers"].values()))
            print(f"     {label}, one layer, rel err: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in row["rel_err_one_layer"].items()))
            good = (all(v < 5e-3 for v in row["rel_err_one_layer"].values())
                    and all(v < 2e-2 for v in row["rel_err"].values()) and bool(torch.isfinite(h).all()))
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {label} vs engine kernels, {n} layers, rel err: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in row["rel_err"].items()))
        hp = h0.clone()
        row["us"] = graph_us([lambda: pk(hp, att)])
        row["phase_us_block0"] = phase_times(pk, hp, att, n)
        print(f"{label}: {row['us']:.1f} us ({row['us'] / n:.2f} a layer; engine / this {t_eng / row['us']:.2f}x); "
              "block 0 barrier to barrier: " + ", ".join(f"{k} {v:.2f}" for k, v in row["phase_us_block0"].items()))
        results[label] = row

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "persistent_layers.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(DEV), "blocks": blocks, "layers": n, "engine_chain_us": t_eng,
        "engine_chain_mma_gate_up_us": t_eng_mma, "variants": results, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
