"""The planner on published layouts: Megatron-LM GPT 1T, Korthikanti et al. 2022 Table 5, Llama 3 405B.

    python bench/planner_published.py              # print the table; rewrite docs/planner.md's PUBLISHED table
    python bench/planner_published.py --no-write

For each published layout: the planner's step time, tokens/s/GPU and TFLOP/s/GPU for that exact layout,
next to the published figure, and the layout it would pick instead on the same GPUs (searched over a
reduced space: micro-batch 1-2, selective or full recompute, bf16, 1F1B or interleaved schedules), with its
predicted gain (negative: the published layout is faster but does not fit by fourfold's memory model). Model shapes are from the papers (stated in docs/planner.md); GPT's 4h GELU MLP is
represented by a SwiGLU MLP of the same parameter count (ffn = 8h/3), dense multi-head attention by
n_kv_heads = n_heads. No GPU is needed.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_doc_block  # noqa: E402
from fourfold.config import build_config  # noqa: E402
from fourfold.plan.hardware import load_hardware  # noqa: E402
from fourfold.plan.predict import predict  # noqa: E402
from fourfold.plan.report import describe  # noqa: E402
from fourfold.plan.search import SearchSpace, rank_layouts  # noqa: E402

BEGIN, END = "<!-- PUBLISHED BEGIN -->", "<!-- PUBLISHED END -->"


def gpt(layers: int, hidden: int, heads: int) -> dict:
    """A GPT shape (Megatron's) as fourfold model keys."""
    return {"model.dim": hidden, "model.n_layers": layers, "model.n_heads": heads, "model.n_kv_heads": heads,
            "model.ffn_dim": 8 * hidden // 3 // 128 * 128, "model.vocab_size": 51200, "model.max_seq_len": 2048}


LLAMA3_405B = {"model.preset": "llama3-405b"}
PP16_405B = "[7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]"

# name, model keys, seq, global batch, gpus, layout keys, recompute, device, interconnect, published figure,
# published seconds per step (or None), published TFLOP/s per GPU (or None)
CASES = [
    ("GPT 22B, full recompute", gpt(48, 6144, 64), 2048, 4, 8, {"parallel.tp": 8}, "full", "a100", "ib200",
     "1.42 s", 1.42, None),
    ("GPT 22B, selective + SP", gpt(48, 6144, 64), 2048, 4, 8, {"parallel.tp": 8}, "selective", "a100", "ib200",
     "1.10 s", 1.10, None),
    ("GPT 175B, full recompute", gpt(96, 12288, 96), 2048, 64, 64, {"parallel.tp": 8, "parallel.pp": 8}, "full",
     "a100", "ib200", "18.13 s", 18.13, None),
    ("GPT 175B, selective + SP", gpt(96, 12288, 96), 2048, 64, 64, {"parallel.tp": 8, "parallel.pp": 8},
     "selective", "a100", "ib200", "13.75 s", 13.75, None),
    ("GPT 530B, full recompute", gpt(105, 20480, 128), 2048, 280, 280, {"parallel.tp": 8, "parallel.pp": 35},
     "full", "a100", "ib200", "49.05 s", 49.05, None),
    ("GPT 530B, selective + SP", gpt(105, 20480, 128), 2048, 280, 280, {"parallel.tp": 8, "parallel.pp": 35},
     "selective", "a100", "ib200", "37.83 s", 37.83, None),
    ("GPT 1T, full recompute", gpt(128, 25600, 160), 2048, 512, 512, {"parallel.tp": 8, "parallel.pp": 64},
     "full", "a100", "ib200", "94.42 s", 94.42, None),
    ("GPT 1T, selective + SP", gpt(128, 25600, 160), 2048, 512, 512, {"parallel.tp": 8, "parallel.pp": 64},
     "selective", "a100", "ib200", "71.49 s", 71.49, None),
    ("GPT 1T on 3,072 A100 (Narayanan 2021)", gpt(128, 25600, 160), 2048, 3072, 3072,
     {"parallel.tp": 8, "parallel.pp": 64, "parallel.dp": 6}, "full", "a100", "ib200",
     "163 TFLOP/s/GPU (52%; 502 PFLOP/s)", None, 163.0),
    ("Llama 3 405B, 8,192 H100", LLAMA3_405B, 8192, 2048, 8192,
     {"parallel.tp": 8, "parallel.pp": 16, "parallel.dp": 64, "parallel.pp_layers": PP16_405B}, "none", "h100",
     "roce400", "430 TFLOP/s/GPU (43%)", None, 430.0),
    ("Llama 3 405B, 16,384 H100", LLAMA3_405B, 8192, 2048, 16384,
     {"parallel.tp": 8, "parallel.pp": 16, "parallel.dp": 128, "parallel.pp_layers": PP16_405B}, "none", "h100",
     "roce400", "400 TFLOP/s/GPU (41%)", None, 400.0),
    ("Llama 3 405B, 16,384 H100, cp16 at 128k", {**LLAMA3_405B, "model.max_seq_len": 131072}, 131072, 128, 16384,
     {"parallel.tp": 8, "parallel.cp": 16, "parallel.pp": 16, "parallel.dp": 8, "parallel.pp_layers": PP16_405B},
     "none", "h100", "roce400", "380 TFLOP/s/GPU (38%)", None, 380.0),
]
SPACE = SearchSpace(micro_batches=(1, 2), recompute=("selective", "full"), float8=(False,),
                    sequence_parallel=(True,), vpp=(1, 2), schedules=("1f1b", "interleaved-1f1b"), max_cp=16)


def _config(model: dict, seq: int, batch: int, layout: dict, recompute: str, extra: dict | None = None):
    flat = {**model, "train.seq_len": seq, "train.global_batch": batch, "train.micro_batch": 1,
            "compute.precision": "bf16", "compute.device": "cuda", "compute.recompute": recompute,
            "compute.compile": True, **layout, **(extra or {})}
    if int(flat.get("parallel.dp", 1)) * int(flat.get("parallel.cp", 1)) > 1:  # FSDP (over dp or cp)
        flat.setdefault("parallel.param_dtype", "bf16")
    return build_config({}, {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in flat.items()})


def evaluate(search: bool) -> list[dict]:
    """One row per published case."""
    hw = load_hardware(calibration=False)
    rows = []
    for name, model, seq, batch, gpus, layout, rc, dev, link, figure, seconds, tflops in CASES:
        cfg = _config(model, seq, batch, layout, rc)
        pred = predict(cfg, gpus, hw, dev, 8, link)
        step = pred.step
        tf = step.model_flops / step.seconds / gpus / 1e12
        row = {"name": name, "gpus": gpus, "device": dev, "layout": describe(cfg) + f", {rc} recompute",
               "published": figure, "pred_s": step.seconds, "pred_tflops": tf,
               "mem": f"{pred.peak_bytes / 2**30:.0f} GiB" + ("" if pred.fits else " (does not fit)"),
               "error": ((step.seconds - seconds) / seconds) if seconds else ((tf - tflops) / tflops)}
        if search:
            base = _config(model, seq, batch, {}, rc)
            ranked, total, _ = rank_layouts(base, gpus, hw, dev, 8, link, top=1, space=SPACE, max_memory_checks=300)
            if ranked:
                best = ranked[0]
                row["pick"] = (f"{describe(best.cfg)}, micro-batch {best.cfg.train.micro_batch}, "
                               f"{best.cfg.compute.recompute} recompute")
                row["gain"] = step.seconds / best.prediction.step.seconds - 1
            else:
                row["pick"], row["gain"] = "nothing fits in the reduced space", None
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """The published-vs-predicted table."""
    lines = ["| case | GPUs | layout | published | predicted step | predicted TFLOP/s/GPU | error vs published "
             "| predicted peak per GPU | planner's pick instead | predicted gain |",
             "|---|---:|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        gain = "—" if r.get("gain") is None else f"{r['gain']:+.1%}"
        lines.append(f"| {r['name']} | {r['gpus']:,} × {r['device']} | {r['layout']} | {r['published']} | "
                     f"{r['pred_s']:.2f} s | {r['pred_tflops']:.0f} | {r['error']:+.1%} | {r['mem']} | {r.get('pick', '—')} | "
                     f"{gain} |")
    return "\n".join(lines)


def main() -> None:
    """Evaluate every case, print the table, rewrite docs/planner.md's PUBLISHED table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--doc", default=os.path.join(os.path.dirname(HERE), "docs", "planner.md"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--no-search", action="store_true", help="only predict the published layouts")
    args = p.parse_args()
    text = markdown(evaluate(not args.no_search))
    print(text)
    if not args.no_write:
        write_doc_block(args.doc, BEGIN, END, text)


if __name__ == "__main__":
    main()
