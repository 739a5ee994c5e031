"""Shared pieces of the engine tests: a tiny fourfold Llama, its Hugging Face twin's greedy output, an engine."""

import torch

from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.requests import SamplingParams
from fourfold.tokenizer import ByteTokenizer
from fourfold.config import build_config
from fourfold.models.llama import Llama
from tests.test_model import hugging_face_twin

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tiny_model(init_std: float = 0.4) -> Llama:
    """A 2-layer float64 Llama whose weights are large enough that every context token moves the argmax."""
    torch.manual_seed(0)
    cfg = build_config({"model": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                      max_seq_len=64, init_std=init_std), "train": {"seq_len": 32}}).model
    return Llama(cfg).double().eval()


class Twin:
    """A tiny float64 fourfold Llama (vocab 64, context 64) and transformers' LlamaForCausalLM with its weights."""

    def __init__(self):
        self.model = tiny_model()
        self.hf = hugging_face_twin(self.model)

    def hf_greedy(self, prompt: list[int], n: int) -> list[int]:
        out = self.hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def engine(self, **cfg) -> LLMEngine:
        cfg.setdefault("block_size", 4)
        cfg.setdefault("num_kv_blocks", 64)
        return LLMEngine.from_model(self.model, ByteTokenizer(), EngineConfig(**cfg))


def run_to_end(engine: LLMEngine, requests: dict) -> tuple[dict, list]:
    """Add {request_id: (prompt, params)}, step until done; ({request_id: token ids}, every step's outputs)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens, steps = {rid: [] for rid in requests}, []
    while engine.has_unfinished():
        outs = engine.step()
        steps.append(outs)
        for o in outs:
            tokens[o.request_id] += o.token_ids
    return tokens, steps
