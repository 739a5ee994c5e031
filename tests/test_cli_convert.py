"""`fourfold convert`: each source kind goes where --to says, and each user mistake is a one-paragraph error (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from fourfold.checkpoint.store import load_checkpoint, save_checkpoint
from fourfold.cli import main
from fourfold.config import build_config
from fourfold.models.llama import Llama

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "vocab_size": 64, "max_seq_len": 32}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with one checkpoint of a tiny fourfold model trained with a tokenizer.json of its own."""
    torch.manual_seed(0)
    cfg = build_config({"model": TINY, "train": {"seq_len": 16}})
    model = Llama(cfg.model)
    config = {"model": TINY, "train": {"seq_len": 16}}
    save_checkpoint(tmp_path / "run", 3, model, None, {"config": config}, keep=1, writer=True,
                    extra_files={"tokenizer_config.json": json.dumps({"chat_template": "{{ x }}"}).encode()})
    return tmp_path / "run", model


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_run_directory_exports_to_hf_and_back(tmp_path, run_dir, capsys):
    run, model = run_dir
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "Hugging Face directory" in capsys.readouterr().out
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), atol=1e-5, rtol=1e-5)
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = Llama(build_config(json.loads((tmp_path / "back" / "meta.json").read_text())["config"]).model)
    load_checkpoint(tmp_path / "back", back)
    torch.testing.assert_close(logits(back, ids), logits(model, ids), atol=1e-5, rtol=1e-5)


def test_fourfold_checkpoint_is_consolidated_with_its_files(tmp_path, run_dir):
    run, model = run_dir
    assert main(["convert", str(run), str(tmp_path / "one")]) == 0
    copy = Llama(model.cfg)
    load_checkpoint(tmp_path / "one", copy)
    for (name, a), b in zip(model.state_dict().items(), copy.state_dict().values()):
        assert torch.equal(a, b), name
    assert (tmp_path / "one" / "tokenizer_config.json").is_file()


def test_dtype_casts_the_exported_weights(tmp_path, run_dir):
    run, _ = run_dir
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf", "--dtype", "bf16"]) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def error_of(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_missing_source(tmp_path, capsys):
    assert "does not exist" in error_of(["convert", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)


def test_unknown_source_file_and_directory(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04junk")
    assert "not a GGUF" in error_of(["convert", str(tmp_path / "weights.bin"), str(tmp_path / "out")], capsys)
    (tmp_path / "empty").mkdir()
    assert "neither a Hugging Face" in error_of(["convert", str(tmp_path / "empty"), str(tmp_path / "out")], capsys)


def test_non_empty_destination_needs_force(tmp_path, run_dir, capsys):
    run, _ = run_dir
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert "not empty" in error_of(["convert", str(run), str(tmp_path / "out"), "--to", "hf"], capsys)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert main(["convert", str(run), str(tmp_path / "out"), "--to", "hf", "--force"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").is_file()


def test_destination_inside_source_is_refused(tmp_path, run_dir, capsys):
    run, _ = run_dir
    assert "overlaps" in error_of(["convert", str(run), str(run / "hf"), "--to", "hf"], capsys)


def test_hf_source_cannot_go_to_hf(tmp_path, capsys):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4)).save_pretrained(tmp_path / "hf")
    assert "--to hf exports fourfold" in error_of(["convert", str(tmp_path / "hf"), str(tmp_path / "x"), "--to", "hf"],
                                                  capsys)


def test_unsupported_hf_architecture_is_named(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    assert "mixtral" in error_of(["convert", str(tmp_path / "hf"), str(tmp_path / "out")], capsys)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_dtype_and_missing_arguments(tmp_path, run_dir, capsys):
    run, _ = run_dir
    assert "invalid choice" in error_of(["convert", str(run), str(tmp_path / "o"), "--dtype", "int4"], capsys)
    assert "required" in error_of(["convert", str(run)], capsys)
