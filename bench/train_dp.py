"""Data-parallel training speed and memory: fourfold DDP/FSDP vs plain PyTorch DDP/FSDP2, and 1 -> N scaling.

    python bench/train_dp.py --gpus 2 --preset llama-1b --micro-batch 4 --seq 2048 --out train_dp.json

Every variant runs under torchrun in its own process group on the same GPUs with the same model
(fourfold's Llama), batch (micro-batch per GPU fixed), bf16 and fused AdamW. fourfold variants run the
real trainer step; the peers are the plain loops a PyTorch user writes: `DistributedDataParallel` around
the model with bf16 autocast, and `fully_shard` per block + root with a bf16 `MixedPrecisionPolicy`.
The table gives tokens/s per GPU, MFU, peak memory and the ratio fourfold / peer; scaling efficiency is
tokens/s per GPU on N GPUs over the 1-GPU figure.
"""

from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]  # bench/ for common.py, the repo root for fourfold
from common import figures, fourfold_step, print_table, report, run_variant_process, save, time_steps  # noqa: E402

PEERS = {"fourfold-1gpu": "torch-1gpu", "fourfold-ddp": "torch-ddp", "fourfold-fsdp": "torch-fsdp2",
         "fourfold-ddp-bucket100": "torch-ddp", "fourfold-ddp-bf16-reduce": "torch-ddp",
         "fourfold-ddp-nccl8ch": "torch-ddp"}
# Variants that differ only in their environment: NCCL on at most 8 channels (fewer SMs taken from the
# overlapped backward's matmuls, slower all-reduce), to measure how much of DDP's scaling loss is contention.
VARIANT_ENV = {"fourfold-ddp-nccl8ch": {"NCCL_MAX_NCHANNELS": "8"}}


def fourfold_layout(name: str, world: int) -> dict:
    """Config overrides of a fourfold variant on `world` GPUs."""
    return {"fourfold-1gpu": {}, "fourfold-ddp": {"parallel.dp": world},
            "fourfold-ddp-bucket100": {"parallel.dp": world, "parallel.bucket_mb": 100},
            "fourfold-ddp-bf16-reduce": {"parallel.dp": world, "parallel.reduce_dtype": "bf16"},
            "fourfold-ddp-nccl8ch": {"parallel.dp": world},
            "fourfold-fsdp": {"parallel.fsdp": world, "parallel.param_dtype": "bf16"}}[name]


def torch_step(kind: str, preset: str, micro_batch: int, seq: int, compile_blocks: bool):
    """A plain PyTorch loop over fourfold's Llama module: 1 GPU, DDP, or FSDP2."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fourfold.config import build_config
    from fourfold.models.llama import Llama

    cfg = build_config({}, {"model.preset": preset, "train.seq_len": str(seq)})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    torch.manual_seed(0)
    model = Llama(cfg.model).cuda()
    if compile_blocks:
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(block))
    autocast = True
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    elif kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        autocast = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    vocab = cfg.model.vocab_size

    def step():
        """One step on random tokens: forward, loss, backward, clip, AdamW; return the detached loss."""
        ids = torch.randint(0, vocab, (micro_batch, seq + 1), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, cfg


def run_one(name: str, args) -> None:
    """Time one variant in this process (every torchrun rank) and report its row."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    compiled = {"compute.compile": "true"} if args.compile else {}
    if name.startswith("fourfold"):
        step, cfg, _ = fourfold_step(args.preset, args.micro_batch, args.seq, {**fourfold_layout(name, world), **compiled})
    else:
        kind = {"torch-1gpu": "single", "torch-ddp": "ddp", "torch-fsdp2": "fsdp2"}[name]
        step, cfg = torch_step(kind, args.preset, args.micro_batch, args.seq, args.compile)
    sec, loss = time_steps(step, args.warmup, args.steps)
    report(figures(name, cfg.model, args.seq, args.micro_batch * args.seq * world, sec, loss, world))


def main() -> None:
    """Run each variant in its own process (or only --one), add scaling efficiency, print the table, save JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="compile blocks in both fourfold and the peers")
    p.add_argument("--variants", default="torch-1gpu,fourfold-1gpu,torch-ddp,fourfold-ddp,torch-fsdp2,fourfold-fsdp",
                   help="also: fourfold-ddp-bucket100, fourfold-ddp-bf16-reduce (bf16 gradient all-reduce), "
                        "fourfold-ddp-nccl8ch (NCCL_MAX_NCHANNELS=8)")
    p.add_argument("--out", default="train_dp.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return run_one(args.one, args)
    common = ["--preset", args.preset, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
              "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--compile"] if args.compile else [])
    chosen = args.variants.split(",")
    unknown = set(chosen) - {*PEERS, *PEERS.values()}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {sorted({*PEERS, *PEERS.values()})}")
    plan = [(name, 1 if name.endswith("-1gpu") else args.gpus) for name in chosen]
    rows = []
    for name, n in plan:
        rows.append(run_variant_process(__file__, name, n, common, extra_env=VARIANT_ENV.get(name)))
        print(rows[-1], flush=True)
    one = {r["variant"]: r for r in rows if "error" not in r}
    for r in rows:
        base = one.get("fourfold-1gpu" if r["variant"].startswith("fourfold") else "torch-1gpu")
        if "error" not in r and base and r["gpus"] > 1:
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    print_table(rows, PEERS, extra=("scaling_efficiency",))
    save(args.out, args, rows)


if __name__ == "__main__":
    main()
