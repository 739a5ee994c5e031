"""`fourfold serve`: an OpenAI-compatible HTTP server (streaming completions and chat) with a chat page at /.

    fourfold serve --model runs/tiny [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}'

Needs the `serve` extra (`pip install -e '.[serve]'`: FastAPI, uvicorn, prometheus-client).
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import ConfigError


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", required=True, help="run directory, checkpoint directory or imported model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("FOURFOLD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $FOURFOLD_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks; more than 1 starts them with torchrun (NCCL on GPUs, gloo on CPUs)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages, one rank each, started with torchrun; the requests are split into one "
                        "micro-batch per stage so the stages work at once (not with --tp)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32")
    p.add_argument("--max-requests", type=int, default=256, help="requests in flight before 429 (at least 1)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may run (> 0)")
    p.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024, help="largest request body accepted")
    engine = p.add_argument_group("engine (see fourfold.infer.engine_config.EngineConfig)")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (decodes first, then prefill chunks)")
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of GPU memory for the model and KV cache")
    engine.add_argument("--kv-cache-bytes", type=int, default=None, help="KV-cache size on CPU")
    engine.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help="largest step with prefill tokens replayed from a CUDA graph (0: none)")
    engine.add_argument("--prefill-graph-seqs", type=int, default=None,
                        help="most sequences a step with prefill tokens replayed from a CUDA graph may hold "
                             "(default: --max-num-seqs; 1: steps that mix prefill and decode run eagerly)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    engine.add_argument("--no-chunked-prefill", action="store_true",
                        help="prefill whole prompts in steps of their own (the classic baseline)")
    engine.add_argument("--no-pipeline-micro-batching", action="store_true",
                        help="with --pp: one step in flight (the other stages idle while one computes)")
    return p


def engine_config(a):
    """The EngineConfig the flags ask for (unset flags keep the engine's defaults); ranges checked."""
    from dataclasses import fields

    from fourfold.infer.engine_config import EngineConfig

    flags = {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
             "block_size": a.block_size, "gpu_memory_utilization": a.gpu_memory_utilization,
             "kv_cache_bytes": a.kv_cache_bytes, "prefill_graph_seqs": a.prefill_graph_seqs,
             "prefill_graph_tokens": a.prefill_graph_tokens}
    cfg = EngineConfig(**{k: v for k, v in flags.items() if v is not None},
                       enable_prefix_caching=not a.no_prefix_caching,
                       enable_chunked_prefill=not a.no_chunked_prefill,
                       pipeline_micro_batching=not a.no_pipeline_micro_batching)
    for f in fields(cfg):
        rng, value = f.metadata.get("range"), getattr(cfg, f.name)
        if rng is not None and not rng.accepts(value):
            flag = "--" + f.name.replace("_", "-")
            raise ConfigError(f"{flag} {value} is out of range; set it to a value {rng.text()}.")
    return cfg


def _check(a) -> None:
    if not 0 <= a.port < 65536:
        raise ConfigError(f"--port {a.port} is not a port; pass a number in [0, 65535].")
    if a.max_requests < 1 or a.request_timeout <= 0 or a.max_body_bytes < 1024 or a.tp < 1 or a.pp < 1:
        raise ConfigError("--max-requests, --tp and --pp must be at least 1, --request-timeout above 0 and "
                          "--max-body-bytes at least 1024.")
    if not Path(a.model).exists():
        raise ConfigError(f"--model {a.model}: no such directory; pass a run, checkpoint or imported model directory.")


def main(argv: list[str], console: Console) -> int:
    """Load the model into the engine and serve until SIGTERM/Ctrl-C; return 0."""
    a = _parser().parse_args(argv)
    _check(a)
    try:
        from fourfold.serve.app import ServeSettings, build_app
        from fourfold.serve.server import serve_forever
    except ImportError as e:
        raise ConfigError(f"fourfold serve needs the serve extra ({e}); run `pip install -e '.[serve]'`.") from None
    from fourfold.serve.engine_setup import open_engine

    config = engine_config(a)  # checked before any process starts
    if a.tp > 1 and a.pp > 1:
        raise ConfigError(f"--tp {a.tp} with --pp {a.pp}: serving does not combine tensor and pipeline parallelism "
                          "yet; pass only one of them.")
    if max(a.tp, a.pp) > 1 and "RANK" not in os.environ:
        from fourfold.cli.common import launch_torchrun

        return launch_torchrun("serve", max(a.tp, a.pp), argv)  # the ranks come back here, under torchrun
    engine = open_engine(a.model, device=a.device, dtype=a.dtype, tp=a.tp, pp=a.pp, config=config)
    if engine is None:  # a follower rank: rank 0 has shut down
        return 0
    name = a.served_model_name or Path(a.model).resolve().name
    app = build_app(engine, ServeSettings(model_name=name, api_key=a.api_key, max_requests_in_flight=a.max_requests,
                                          request_timeout_s=a.request_timeout, max_body_bytes=a.max_body_bytes))
    console.print(f"serving [bold]{name}[/] on http://{a.host}:{a.port} (chat page at /, OpenAI API at /v1)")
    try:
        serve_forever(app, a.host, a.port)
    finally:
        engine.shutdown()
    return 0
