"""The engine loads a Hugging Face directory as it is and an imported copy of it: both give transformers'
greedy tokens; the reply ends at generation_config.json's eos_token_id."""

import json

import pytest
import torch

from fourfold.checkpoint.hf_import import import_hf
from fourfold.infer.llm import LLM
from fourfold.infer.loading import load_model
from fourfold.infer.requests import SamplingParams
from tests.engine_helpers import tiny_model
from tests.test_model import hugging_face_twin

PROMPT = [3, 14, 15, 9, 26, 5]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hf = hugging_face_twin(tiny_model()).float()
    hf.save_pretrained(d)
    return d, hf


@pytest.mark.parametrize("imported", [False, True], ids=["hf directory", "imported"])
def test_greedy_tokens_equal_transformers(hf_dir, tmp_path, imported):
    d, hf = hf_dir
    path = import_hf(d, tmp_path / "imported") if imported else d
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    llm = LLM(path, dtype="fp32", block_size=4, num_kv_blocks=32)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    assert got == expected


def test_the_reply_ends_at_the_generation_configs_eos(hf_dir, tmp_path):
    d, _ = hf_dir
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert load_model(d, torch.device("cpu"), "fp32").eos_id == 7
