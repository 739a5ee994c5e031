"""`fourfold generate`: continue prompts with the inference engine (paged KV cache, continuous batching).

    fourfold generate --checkpoint runs/tiny --prompt "def " [--temperature 0.8 --top-k 50 --top-p 0.95]
    fourfold generate --checkpoint runs/tiny --prompt "Write a haiku" --chat
    fourfold generate --checkpoint runs/tiny --prompts-file in.jsonl --output out.jsonl

A prompts file has one JSON object per line, {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}]}
(rendered with the model's chat template); the output file gets one object per line in the same order:
{"prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"}.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import ConfigError


def _generate_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold generate", description="Continue prompts from a checkpoint with the engine.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory (newest checkpoint)")
    p.add_argument("--prompt", help="text to continue (not empty)")
    p.add_argument("--prompts-file", help="JSONL file: one {\"prompt\": ...} or {\"messages\": [...]} per line")
    p.add_argument("--output", help="JSONL file for the results of --prompts-file (default: print them)")
    p.add_argument("--chat", action="store_true", help="render --prompt as a user message with the chat template")
    p.add_argument("--max-new-tokens", type=int, default=200, help="at least 1")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy; at least 0")
    p.add_argument("--top-k", type=int, default=50, help="0 disables; at least 0")
    p.add_argument("--top-p", type=float, default=0.95, help="in (0, 1]; 1.0 disables")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="in [0, 2^63)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16 or fp32")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most")
    return p


def _check_sampling(p: ArgumentParser, a: argparse.Namespace) -> None:
    """Raise ConfigError, naming the flag, for a generate option outside its range."""
    if a.prompt is None and a.prompts_file is None:
        p.error("give --prompt TEXT or --prompts-file FILE")
    if a.prompt is not None and a.prompts_file is not None:
        p.error("give --prompt or --prompts-file, not both")
    if a.prompt is not None and not a.prompt:
        raise ConfigError("--prompt is empty; give the text to continue, e.g. --prompt 'def '.")
    rules = [("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, "a whole number of at least 1"),
             ("--temperature", a.temperature, math.isfinite(a.temperature) and a.temperature >= 0,
              "a finite number of at least 0 (0 is greedy)"),
             ("--top-k", a.top_k, a.top_k >= 0, "a whole number of at least 0 (0 disables it)"),
             ("--top-p", a.top_p, math.isfinite(a.top_p) and 0 < a.top_p <= 1, "a number in (0, 1] (1 disables it)"),
             ("--seed", a.seed, 0 <= a.seed < 2**63, "a whole number in [0, 2^63)"),
             ("--max-num-seqs", a.max_num_seqs, a.max_num_seqs >= 1, "a whole number of at least 1")]
    for flag, value, ok, valid in rules:
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range; set {flag} to {valid}.")


def read_prompts(path: str) -> list[dict]:
    """The prompts file's objects; ConfigError naming the line for anything but {"prompt"} / {"messages"}."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--prompts-file {path} cannot be read ({e}).") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"--prompts-file {path} line {n} is not JSON ({e}).") from None
        if not isinstance(item, dict) or not (isinstance(item.get("prompt"), str) and item["prompt"]
                                              or isinstance(item.get("messages"), list)):
            raise ConfigError(f"--prompts-file {path} line {n} needs a non-empty \"prompt\" string or a "
                              "\"messages\" list.")
        items.append(item)
    if not items:
        raise ConfigError(f"--prompts-file {path} has no prompts; write one JSON object per line.")
    return items


def main(argv: list[str], console: Console) -> int:
    """`fourfold generate`: print (or write) sampled continuations of the prompts; return 0."""
    import torch

    from fourfold.chat import check_messages
    from fourfold.distributed import pick_device
    from fourfold.infer.engine_config import EngineConfig
    from fourfold.infer.llm import LLM
    from fourfold.infer.loading import find_checkpoint
    from fourfold.infer.requests import SamplingParams

    parser = _generate_parser()
    a = parser.parse_args(argv)
    _check_sampling(parser, a)  # before anything is loaded
    items = read_prompts(a.prompts_file) if a.prompts_file else [{"prompt": a.prompt}]
    for item in items:
        if "messages" in item:
            check_messages(item["messages"])
    device = pick_device(a.device, flag="--device")
    checkpoint = find_checkpoint(a.checkpoint)
    torch.manual_seed(a.seed)
    llm = LLM(checkpoint, device=device, dtype=a.dtype, config=EngineConfig(max_num_seqs=a.max_num_seqs))
    template = llm.engine.chat_template
    texts = []
    for item in items:
        if "messages" in item:
            texts.append(template.render(item["messages"]))
        elif a.chat:
            texts.append(template.render([{"role": "user", "content": item["prompt"]}]))
        else:
            texts.append(item["prompt"])
    params = [SamplingParams(max_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                             seed=a.seed + i, stop=a.stop) for i in range(len(texts))]
    results = llm.generate(texts, params, progress=a.prompts_file is not None and console.is_terminal)
    if a.prompts_file is None:
        print(results[0].text if a.chat else a.prompt + results[0].text)
        return 0
    lines = [json.dumps({"prompt": t, "text": r.text, "finish_reason": r.finish_reason,
                         "prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(r.token_ids)})
             for t, r in zip(texts, results)]
    if a.output:
        Path(a.output).write_text("".join(line + "\n" for line in lines))
        console.print(f"wrote {len(lines)} results to {a.output}")
    else:
        print("\n".join(lines))
    return 0
