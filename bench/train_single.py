"""Single-GPU training speed and memory: fourfold's trainer vs Hugging Face LlamaForCausalLM, side by side.

    python bench/train_single.py --preset llama-1b --micro-batch 4 --seq 2048 --steps 20 --out train_single.json

Every variant runs in its own process on the same GPU, shape, batch, precision (bf16 autocast, fp32
master weights) and optimizer (fused AdamW). fourfold variants run the real `Trainer.train_step` (data
loading, loss, clipping and optimizer included); Hugging Face variants run the usual loop
`model(input_ids, labels).loss.backward(); clip; step` (eager, then `torch.compile(model)`). The table
gives tokens/s, MFU and peak memory, and each variant's ratio to the compiled Hugging Face run.

    python bench/train_single.py --max-batch --variants hf-compile,fourfold-compile-model

finds instead the largest micro-batch each variant trains at: in one process per variant it runs two
steps at each size of --batch-sizes in turn (random tokens, the same step as above) and stops at the
first out-of-memory; the table gives the largest size that ran and its peak memory.
"""

from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]  # bench/ for common.py, the repo root for fourfold
from common import figures, fourfold_step, print_table, report, run_variant_process, save, time_steps  # noqa: E402

VARIANTS = {
    "hf-eager": {},
    "hf-compile": {"compile": True},
    "fourfold": {},
    "fourfold-compile": {"compute.compile": "true"},
    "fourfold-compile-chunked-ce": {"compute.compile": "true", "compute.loss_chunk": "4096"},
    "fourfold-compile-model": {"compute.compile": "true", "compute.compile_scope": "model"},
    "fourfold-compile-model-budget95": {"compute.compile": "true", "compute.compile_scope": "model",
                                        "compute.compile_memory_budget": "0.95"},
    "fourfold-compile-model-budget99": {"compute.compile": "true", "compute.compile_scope": "model",
                                        "compute.compile_memory_budget": "0.99"},
    "fourfold-compile-model-chunked-ce": {"compute.compile": "true", "compute.compile_scope": "model", "compute.loss_chunk": "4096"},
    "fourfold-compile-selective": {"compute.compile": "true", "compute.recompute": "selective"},
    "fourfold-compile-full-recompute": {"compute.compile": "true", "compute.recompute": "full"},
    "fourfold-compile-full-recompute-chunked-ce": {"compute.compile": "true", "compute.recompute": "full",
                                                   "compute.loss_chunk": "4096"},
    "fourfold-compile-float8": {"compute.compile": "true", "quant.float8": "true"},
    "fourfold-compile-model-float8": {"compute.compile": "true", "compute.compile_scope": "model", "quant.float8": "true"},
    "fourfold-compile-full-recompute-float8": {"compute.compile": "true", "compute.recompute": "full",
                                               "compute.loss_chunk": "4096", "quant.float8": "true"},
    "hf-eager-recompute": {"recompute": True},
}


def hf_step(preset: str, micro_batch: int, seq: int, compile_model: bool, recompute: bool = False):
    """A plain Hugging Face training step for the same shape (random tokens, same optimizer settings).

    The step takes an optional batch size (default `micro_batch`), for the largest-micro-batch probe.
    """
    import torch
    import transformers

    from fourfold.config import build_config

    cfg = build_config({}, {"model.preset": preset, "train.seq_len": str(seq), "model.max_seq_len": str(max(seq, 16))})
    m = cfg.model
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).cuda().train()
    if recompute:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compile_model else model
    gen = torch_generator()

    def step(batch: int = micro_batch):
        """One Hugging Face training step on random tokens; return the detached loss."""
        ids = torch.randint(0, m.vocab_size, (batch, seq), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, cfg


def profile_table(step, path: str, rows: int = 25) -> str:
    """Run 3 steps under torch.profiler; write and return the top CUDA kernels by total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(table)
    return table


def build_step(name: str, args):
    """(step function, config) of one variant; the step takes an optional micro-batch size."""
    extra = dict(VARIANTS[name])
    if name.startswith("hf"):
        return hf_step(args.preset, args.micro_batch, args.seq, extra.get("compile", False), extra.get("recompute", False))
    step, cfg, trainer = fourfold_step(args.preset, args.micro_batch, args.seq, extra)
    vocab = cfg.model.vocab_size
    gen = torch_generator()

    def sized_step(batch: int | None = None):
        """The trainer's step on its own data, or on `batch` random sequences (same loss, clip and optimizer)."""
        if batch is None:
            return step()
        import torch

        ids = torch.randint(0, vocab, (batch, args.seq + 1), device="cuda", generator=gen)
        return trainer.train_step([(ids[:, :-1], ids[:, 1:])])[0]

    return sized_step, cfg


def torch_generator():
    """A seeded CUDA generator for random token batches."""
    import torch

    return torch.Generator(device="cuda").manual_seed(0)


def largest_batch(name: str, args) -> None:
    """Two steps at each of --batch-sizes in turn until one runs out of memory; report the largest that ran."""
    import torch

    step, cfg = build_step(name, args)
    fitted, peak, failed = 0, 0.0, None
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(2):
                step(batch)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            failed = batch
            break
        fitted, peak = batch, torch.cuda.max_memory_allocated() / 2**30
        print(f"{name}: micro-batch {batch} fits, peak {peak:.1f} GiB", flush=True)
    report({"variant": name, "gpus": 1, "largest_micro_batch": fitted, "peak_mem_gib": peak,
            "first_failed": failed, "seq": args.seq, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__})


def run_one(name: str, args) -> None:
    """Time one variant in this process and report its row; with --profile-dir also write its kernel table."""
    if args.max_batch:
        return largest_batch(name, args)
    step, cfg = build_step(name, args)
    sec, loss = time_steps(step, args.warmup, args.steps)
    report(figures(name, cfg.model, args.seq, args.micro_batch * args.seq, sec, loss, 1))
    if args.profile_dir:
        print(profile_table(step, os.path.join(args.profile_dir, f"profile-{name}.txt")), flush=True)


def main() -> None:
    """Run each variant in its own process (or only --one), print the table against hf-compile, save JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="train_single.json")
    p.add_argument("--profile-dir", default="", help="also write a torch.profiler kernel table per variant here")
    p.add_argument("--max-batch", action="store_true", help="find each variant's largest micro-batch instead")
    p.add_argument("--batch-sizes", default="4,8,12,16,20,24,32,40,48,56,64")
    p.add_argument("--inductor-cdt", action="store_true", help="inductor coordinate-descent tuning (slower compile)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        if args.inductor_cdt:
            import torch._inductor.config as inductor_config

            inductor_config.coordinate_descent_tuning = True
        return run_one(args.one, args)
    common = ["--preset", args.preset, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-dir", args.profile_dir,
              "--batch-sizes", args.batch_sizes, *(["--max-batch"] if args.max_batch else []),
              *(["--inductor-cdt"] if args.inductor_cdt else [])]
    rows = []
    for name in args.variants.split(","):
        rows.append(run_variant_process(__file__, name, 1, common))
        print(rows[-1], flush=True)
    if args.max_batch:
        for r in rows:
            print(f"{r['variant']:36s} largest micro-batch {r.get('largest_micro_batch', 'FAILED')} "
                  f"(peak {r.get('peak_mem_gib', 0):.1f} GiB; first failing {r.get('first_failed')})")
    else:
        print_table(rows, {n: "hf-compile" for n in VARIANTS})
    save(args.out, args, rows)


if __name__ == "__main__":
    main()
