"""Packed bf16 CPU linears: the same outputs as nn.Linear, and a packed model generates what the unpacked one does."""

import copy

import pytest
import torch

from fourfold.infer.cpu_linear import PackedLinear, pack_cpu_linears, packing_works
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.tokenizer import ByteTokenizer
from tests.engine_helpers import GREEDY, run_to_end, tiny_model

pytestmark = pytest.mark.skipif(not packing_works(), reason="this torch build has no oneDNN bf16 linear")


def test_packed_linear_matches_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(lin.weight)(x).float(), lin(x).float(), rtol=1e-2, atol=1e-2)


def test_packed_model_generates_the_same_tokens():
    plain = tiny_model().to(torch.bfloat16)
    plain.rope_cos, plain.rope_sin = plain.rope_cos.float(), plain.rope_sin.float()
    packed = copy.deepcopy(plain)
    assert pack_cpu_linears(packed) == 2 * 7 + 1  # q k v o w1 w2 w3 per block, and the head
    prompts = {"a": ([3, 14, 15, 9, 26], GREEDY), "b": ([1, 2, 3, 4, 5, 6, 7, 8], GREEDY)}
    cfg = EngineConfig(block_size=4, num_kv_blocks=32)
    want, _ = run_to_end(LLMEngine.from_model(plain, ByteTokenizer(), cfg), prompts)
    got, _ = run_to_end(LLMEngine.from_model(packed, ByteTokenizer(), cfg), prompts)
    assert got == want
