"""CPU generation speed: fourfold's engine vs Hugging Face `generate`, same model, prompts and lengths, bf16.

    python bench/generate_cpu.py --model runs/smollm2 [--hf-model DIR] [--batches 1 16] [--prompt-len 64]
                                 [--new-tokens 64] [--dtype bf16] [--threads N] [--repeat R] [--json out.json]
                                 [--kernels-ab]

`--model` is a fourfold model directory (a run, a checkpoint, or a Hugging Face import once it lands);
the peer is `--hf-model` (the original Hugging Face directory) or, by default, a LlamaForCausalLM built
from the same weights by renaming (fourfold's Llama uses Hugging Face's rotary layout, so nothing is
permuted). Prompts are random token ids (one fixed seed), every sequence generates exactly
`--new-tokens` tokens greedily (eos ignored on both sides), each engine gets one warm-up run, then the
timed runs, fourfold and HF alternating, `--repeat` times (the best of each counts); tok/s counts
generated tokens over the wall time of the whole batch, prefill included. Beside the wall-clock ratio it
prints the ratio of process CPU time (user + system of all threads), which a busy shared machine
disturbs less (with several threads it also counts threads spinning at barriers). Prints one row per
batch size; `--json` writes the rows. `--kernels-ab` also times fourfold with its fused C kernels off
(fourfold.infer.cpu_kernels; the CPU step's torch ops instead), in the same process and rounds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.llm import LLM
from fourfold.infer.loading import parse_dtype
from fourfold.infer.requests import SamplingParams

HF_BLOCK_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                  "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                  "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                  "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                  "ffn_norm": "post_attention_layernorm"}


def hf_twin(model, dtype):
    """A transformers LlamaForCausalLM holding `model`'s weights (renamed), in eval mode."""
    import transformers

    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False)
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            for a, b in HF_BLOCK_NAMES.items():
                rest = rest.replace(a, b)
            state[f"model.layers.{i}.{rest}"] = v
        else:
            state[{"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}[k]] = v
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(state, strict=False)
    return hf.to(dtype).eval()


def time_hf(hf, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of HF greedy generation of `new_tokens` for every prompt."""
    with torch.inference_mode():
        start, cpu = time.perf_counter(), time.process_time()
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return elapsed, cpu


def time_fourfold(llm: LLM, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of the engine's greedy generation of `new_tokens` for every prompt."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    results = llm.generate(prompts.tolist(), params, progress=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(r.token_ids) == new_tokens for r in results)
    return elapsed, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--hf-model", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine and batch size (best counts)")
    p.add_argument("--json", default=None)
    p.add_argument("--kernels-ab", action="store_true", help="also time fourfold with the fused C kernels off")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cpu = torch.device("cpu")
    dtype = parse_dtype(a.dtype, cpu)
    llm = LLM(a.model, device=cpu, dtype=dtype,
              config=EngineConfig(max_num_seqs=max(a.batches), max_num_batched_tokens=max(a.batches) * a.prompt_len,
                                  enable_prefix_caching=False))
    model = llm.engine.runner.model
    decoder = llm.engine.runner.cpu_decoder
    kernels = decoder.kernels if decoder is not None else None
    print(f"fourfold CPU step: {'fused C kernels' if kernels is not None else 'torch ops (no C kernels)'}")
    if a.hf_model:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(a.hf_model, torch_dtype=dtype).eval()
    else:
        hf = hf_twin(model, dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'batch':>5} {'fourfold tok/s':>15} {'HF tok/s':>10} {'ratio':>6} {'ms CPU/token ours':>18} {'HF':>7} "
          f"{'CPU ratio':>9}   ({a.dtype}, prompt {a.prompt_len}, {a.new_tokens} new, {torch.get_num_threads()} threads)")
    for batch in a.batches:
        prompts = torch.randint(0, model.cfg.vocab_size, (batch, a.prompt_len), generator=gen)
        time_fourfold(llm, prompts, min(a.new_tokens, 4))
        time_hf(hf, prompts, min(a.new_tokens, 4))
        ours, theirs, plain = [], [], []
        for _ in range(a.repeat):
            ours.append(time_fourfold(llm, prompts, a.new_tokens))
            theirs.append(time_hf(hf, prompts, a.new_tokens))
            if a.kernels_ab and kernels is not None:
                decoder.kernels = None
                plain.append(time_fourfold(llm, prompts, a.new_tokens))
                decoder.kernels = kernels
        tokens = batch * a.new_tokens
        wall_ours, wall_hf = min(w for w, _ in ours), min(w for w, _ in theirs)
        cpu_ours, cpu_hf = min(c for _, c in ours), min(c for _, c in theirs)
        row = {"batch": batch, "fourfold_tok_s": tokens / wall_ours, "hf_tok_s": tokens / wall_hf,
               "ratio": wall_hf / wall_ours, "fourfold_cpu_ms_per_token": 1e3 * cpu_ours / tokens,
               "hf_cpu_ms_per_token": 1e3 * cpu_hf / tokens, "cpu_ratio": cpu_hf / cpu_ours}
        if plain:
            row["fourfold_no_kernels_tok_s"] = tokens / min(w for w, _ in plain)
            row["kernels_speedup"] = min(w for w, _ in plain) / wall_ours
        rows.append(row)
        print(f"{batch:>5} {row['fourfold_tok_s']:>15.1f} {row['hf_tok_s']:>10.1f} {row['ratio']:>6.2f} "
              f"{row['fourfold_cpu_ms_per_token']:>18.2f} {row['hf_cpu_ms_per_token']:>7.2f} {row['cpu_ratio']:>9.2f}"
              + (f"   C kernels off: {row['fourfold_no_kernels_tok_s']:.1f} tok/s (kernels {row['kernels_speedup']:.2f}x)"
                 if plain else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "dtype": a.dtype, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                       "threads": torch.get_num_threads(), "repeat": a.repeat, "c_kernels": kernels is not None,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
