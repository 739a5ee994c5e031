"""`fourfold plan`: predict memory and step time of every layout for a model on a cluster, and pick the best.

    fourfold plan --model llama3-70b --gpus 64 --gpus-per-node 8 --gpu h100 --seq 8192 --global-batch 1024 \\
        [--interconnect ib400] [--top 10] [--toml best.toml] [--hardware my.toml] [--eager]
    fourfold plan --inference --model llama3-70b --gpu h100 --context 8192
    fourfold plan calibrate [--out FILE]
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import ConfigError


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold plan", description="Rank the parallel layouts of a training run by predicted "
                       "speed (those that fit in memory), or plan inference; `fourfold plan calibrate` measures "
                       "this machine.")
    p.add_argument("--model", help="model preset (llama3-8b, llama3-70b, llama3-405b, llama-1b, tiny)")
    p.add_argument("--config", help="TOML config whose model (and train) sections are the base")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the run")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default: min(gpus, 8))")
    p.add_argument("--gpu", default="h100", help="device kind from the hardware table (h100, h200, a100, b200, cpu)")
    p.add_argument("--interconnect", default="ib400", help="link between nodes (ib400, ib200, roce400, eth100, ...)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's max_seq_len)")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per optimizer step (default 8 per GPU)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--eager", action="store_true", help="plan without torch.compile")
    p.add_argument("--no-float8", action="store_true", help="leave float8 out of the search")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--toml", help="write the best layout as a config file `fourfold train --config` runs")
    p.add_argument("--hardware", action="append", default=[], help="hardware TOML overriding the shipped table")
    p.add_argument("--inference", action="store_true", help="plan inference instead of training")
    p.add_argument("--context", type=int, default=8192, help="inference: tokens per sequence (prompt + output)")
    p.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp8", "int8", "int4"))
    return p


def _base_config(args):
    from fourfold.config import build_config, load_config

    if args.config:
        cfg = load_config(args.config)
        sections = {"model": {k: v for k, v in cfg.to_dict()["model"].items() if v is not None}}
    elif args.model:
        sections = {"model": {"preset": args.model}}
    else:
        raise ConfigError("fourfold plan needs --model PRESET or --config FILE (the model to plan for).")
    probe = build_config(sections)
    seq = args.seq or probe.model.max_seq_len
    batch = args.global_batch or 8 * args.gpus
    overrides = {"train.seq_len": str(seq), "train.global_batch": str(batch), "model.max_seq_len":
                 str(max(seq, probe.model.max_seq_len)), "compute.precision": args.precision,
                 "compute.device": "cpu" if args.gpu == "cpu" else "cuda"}
    return build_config(sections, overrides)


def _train(args, console: Console) -> int:
    from fourfold.plan.hardware import load_hardware
    from fourfold.plan.report import config_toml, layout_overrides, ranked_table
    from fourfold.plan.search import SearchSpace, rank_layouts

    if args.gpus < 1 or args.top < 1:
        raise ConfigError("--gpus and --top must be at least 1.")
    per_node = args.gpus_per_node or min(args.gpus, 8)
    if args.gpus % per_node and args.gpus > per_node:
        raise ConfigError(f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({per_node}).")
    hw = load_hardware(args.hardware)
    hw.link(args.interconnect)
    base = _base_config(args)
    space = SearchSpace(compile=(False,) if args.eager else (True,),
                        float8=(False,) if args.no_float8 else (False, True))
    ranked, total, checked = rank_layouts(base, args.gpus, hw, args.gpu, per_node, args.interconnect, args.top,
                                          space)
    title = (f"{base.model.preset or 'model'} on {args.gpus} x {args.gpu} ({per_node} per node, {args.interconnect}), "
             f"seq {base.train.seq_len}, global batch {base.train.global_batch}: {total} valid layouts, "
             f"{len(ranked)} fastest that fit shown ({checked} checked for memory)")
    if not ranked:
        raise ConfigError(f"No layout of {base.model.preset or 'this model'} fits {args.gpus} x {args.gpu} at seq "
                          f"{base.train.seq_len} and global batch {base.train.global_batch}: use more GPUs, a "
                          "larger device, or a shorter sequence.")
    console.print(ranked_table(ranked, args.gpus, title))
    best = ranked[0].cfg
    launch = (f"fourfold train --nproc {args.gpus}" if args.gpus <= per_node else
              f"torchrun --nnodes {args.gpus // per_node} --nproc-per-node {per_node} --rdzv-backend c10d "
              "--rdzv-endpoint HOST:PORT -m fourfold train")
    console.print(f"Run the best with:\n  {launch} " + " ".join(layout_overrides(best)), soft_wrap=True)
    if args.toml:
        header = f"fourfold plan: best of {total} layouts on {args.gpus} x {args.gpu}, predicted " \
                 f"{ranked[0].prediction.step.seconds:.3f} s/step, {ranked[0].prediction.peak_bytes / 2**30:.1f} GiB"
        try:
            Path(args.toml).write_text(config_toml(best, header))
        except OSError as e:
            raise ConfigError(f"Could not write --toml {args.toml}: {e}.") from None
        console.print(f"wrote {args.toml} (fourfold train --config {args.toml})")
    return 0


def _inference(args, console: Console) -> int:
    from rich.table import Table

    from fourfold.plan.hardware import load_hardware
    from fourfold.plan.inference import plan_inference

    hw = load_hardware(args.hardware)
    dev = hw.device(args.gpu)
    base = _base_config(args)
    per_node = args.gpus_per_node or 8
    rows = plan_inference(base.model, dev, hw.efficiency, hw.link(dev.intra_node), args.context, per_node,
                          args.weight_dtype)
    table = Table(title=f"{base.model.preset or 'model'} inference on {args.gpu}, context {args.context}, "
                        f"weights {args.weight_dtype} (predicted, not yet validated)", title_justify="left")
    for name in ("tp", "pp", "weights/GPU GiB", "KV/sequence GiB (all GPUs)", "max sequences", "tok/s batch 1",
                 "tok/s max batch"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r.tp), str(r.pp), f"{r.weight_bytes / 2**30:.1f}", f"{r.kv_bytes_per_sequence / 2**30:.2f}",
                      str(r.max_sequences), f"{r.tokens_per_s_batch1:,.1f}" if r.max_sequences else "does not fit",
                      f"{r.tokens_per_s_max:,.0f}" if r.max_sequences else "")
    console.print(table)
    return 0


def _calibrate(argv: list[str], console: Console) -> int:
    from fourfold.plan.calibrate import measure, write_calibration
    from fourfold.plan.hardware import calibration_path

    p = ArgumentParser(prog="fourfold plan calibrate", description="Measure this machine's matmul rate, memory "
                       "bandwidth and collective bandwidth (on CPUs also the per-op costs, rates by size and gloo "
                       "latencies of the CPU step model, by micro-benchmarks); later predictions read them.")
    p.add_argument("--out", default=None, help=f"where to write (default {calibration_path()})")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="smaller problems (seconds)")
    args = p.parse_args(argv)
    figures = measure(args.device, args.quick)
    path = write_calibration(figures, Path(args.out) if args.out else calibration_path())
    link = figures["link"]
    console.print(f"{figures['name']}: fp32 matmul {figures['flops_fp32'] / 1e12:.2f} TFLOP/s, bf16 "
                  f"{figures['flops_bf16'] / 1e12:.2f} TFLOP/s, copy {figures['hbm_bandwidth'] / 1e9:.1f} GB/s"
                  + (f", all-reduce bus {link['bandwidth'] / 1e9:.2f} GB/s, latency {link['latency'] * 1e6:.0f} us"
                     if link else "")
                  + (f"\nCPU step model: {cpu['op_overhead'] * 1e6:.1f} us per op, gloo all-reduce latency "
                     f"{cpu['latency'][0] * 1e6:.0f} us" if (cpu := figures.get("cpu")) else "") + f"\nwrote {path}")
    return 0


def main(argv: list[str], console: Console) -> int:
    """`fourfold plan`: rank layouts, plan inference, or (`calibrate`) measure this machine; return 0."""
    if argv[:1] == ["calibrate"]:
        return _calibrate(argv[1:], console)
    args = _parser().parse_args(argv)
    return _inference(args, console) if args.inference else _train(args, console)
