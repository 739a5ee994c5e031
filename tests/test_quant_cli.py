"""`fourfold train --quant.qat`, `fourfold quantize` and `fourfold eval` end to end on a tiny run, and their bad inputs.

One module-scoped pair of tiny runs (full precision and QAT int4-g32, a few steps each) feeds every case.
Bad inputs must exit 2 before any work: no output directory appears.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fourfold.checkpoint.store import latest_checkpoint, read_meta
from fourfold.cli import main
from fourfold.infer.generate import SamplingOptions, generate, load_for_inference
from fourfold.infer.llm import LLM
from fourfold.infer.requests import SamplingParams
from fourfold.quant.packing import Int4WeightLinear
from tests.trainer_helpers import tiny_config, write_corpus

STEPS = ["--train.steps", "3", "--log.progress", "false", "--checkpoint.every", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant-cli")
    corpus = write_corpus(tmp / "corpus.txt")
    base = tiny_config(tmp)
    flat = ["--data.path", str(corpus), "--data.cache_dir", str(tmp / "cache"), "--compute.device", "cpu",
            "--data.val_fraction", "0.05", "--train.seq_len", "16", "--train.global_batch", "4",
            "--train.micro_batch", "2", "--sample", ""]
    flat += [a for k, v in vars(base.model).items() if k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                             "vocab_size", "max_seq_len")
             for a in (f"--model.{k}", str(v))]
    assert main(["train", "--out", str(tmp / "fp"), *flat, *STEPS]) == 0
    assert main(["train", "--out", str(tmp / "qat"), *flat, *STEPS, "--quant.qat", "int4-g32"]) == 0
    return tmp


def _eval(path, capsys) -> dict:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(path), "--json", "--device", "cpu", "--max-sequences", "8"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_qat_run_trains_fake_quantized_and_converts_to_the_same_function(runs, capsys):
    meta = read_meta(latest_checkpoint(runs / "qat"))
    assert meta["config"]["quant"]["qat"] == "int4-g32"
    assert main(["quantize", "--checkpoint", str(runs / "qat"), "--out", str(runs / "qat-int4")]) == 0
    converted = read_meta(latest_checkpoint(runs / "qat-int4"))
    assert converted["quant"]["scheme"] == "int4-g32" and converted["quant"]["method"] == "qat"
    fake, conv = _eval(runs / "qat", capsys), _eval(runs / "qat-int4", capsys)
    assert fake["model"].startswith("QAT") and conv["model"] == "converted int4-g32"
    assert fake["tokens"] == conv["tokens"] > 0 and fake["words"] == conv["words"] > 0
    assert conv["token_ppl"] == pytest.approx(fake["token_ppl"], rel=1e-5)


def test_ptq_checkpoint_generates_and_evaluates(runs, capsys):
    assert main(["quantize", "--checkpoint", str(runs / "fp"), "--scheme", "8da4w-g32", "--out",
                 str(runs / "fp-8da4w")]) == 0
    model, cfg = load_for_inference(runs / "fp-8da4w", torch.device("cpu"))
    assert isinstance(model.layers["0"].attention.wq, Int4WeightLinear)
    ids = generate(model, [5, 6, 7], SamplingOptions(max_new_tokens=4, temperature=0), torch.device("cpu"))
    assert len(ids) == 4
    engine = LLM(runs / "fp-8da4w", dtype="fp32", block_size=4, num_kv_blocks=16)  # the engine loads it too
    assert isinstance(engine.engine.runner.model.layers["0"].attention.wq, Int4WeightLinear)
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids == ids
    fp, q = _eval(runs / "fp", capsys), _eval(runs / "fp-8da4w", capsys)
    assert fp["model"] == "full precision" and q["token_ppl"] != fp["token_ppl"]
    assert main(["generate", "--checkpoint", str(runs / "fp-8da4w"), "--prompt", "de", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0


@pytest.mark.parametrize("argv,words", [
    (["--scheme", "int4-g100"], ["Unknown quantization scheme", "int4-g128"]),
    (["--scheme", "int4-g64"], ["group size 64", "32 input features"]),
    (["--scheme", "int4-g32", "--method", "obq"], ["--method", "rtn, gptq"]),
    (["--scheme", "int4-g32", "--method", "gptq", "--calibration-sequences", "0"], ["--calibration-sequences"]),
    (["--scheme", "int4-g32", "--method", "gptq", "--data", "/nonexistent/corpus.txt"], ["/nonexistent"]),
    (["--scheme", "int4-g32", "--device", "cuda"], ["--device cuda"]),
    ([], ["needs --scheme"]),
], ids=["unknown", "group-too-big", "method", "calibration-count", "calibration-data", "no-cuda", "no-scheme"])
def test_quantize_refuses_bad_input_before_work(runs, capsys, argv, words):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA GPU")
    out = runs / "never"
    assert main(["quantize", "--checkpoint", str(runs / "fp"), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not out.exists()


def test_gptq_quantize_calibrates_on_the_training_split_and_differs_from_rtn(runs, capsys):
    for method in ("rtn", "gptq"):
        assert main(["quantize", "--checkpoint", str(runs / "fp"), "--scheme", "int4-g32", "--method", method,
                     "--calibration-sequences", "8", "--out", str(runs / f"fp-{method}")]) == 0
    rtn, gptq = (latest_checkpoint(runs / f"fp-{m}") for m in ("rtn", "gptq"))
    assert read_meta(gptq)["quant"]["method"] == "gptq" and read_meta(rtn)["quant"]["method"] == "rtn"
    a, b = (load_file(str(next(c.glob("*.safetensors")))) for c in (rtn, gptq))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    packed = [k for k in a if a[k].dtype in (torch.uint8, torch.int8, torch.int32)]
    assert packed and any(not torch.equal(a[k], b[k]) for k in packed)  # error compensation moved some integers
    assert _eval(runs / "fp-gptq", capsys)["model"] == "converted int4-g32"


def test_quantize_refuses_other_schemes_for_qat_and_requantizing(runs, capsys):
    assert main(["quantize", "--checkpoint", str(runs / "qat"), "--scheme", "int8", "--out", str(runs / "x")]) == 2
    assert "trained with --quant.qat int4-g32" in capsys.readouterr().err
    if not (runs / "qat-int4").exists():
        assert main(["quantize", "--checkpoint", str(runs / "qat"), "--out", str(runs / "qat-int4")]) == 0
    assert main(["quantize", "--checkpoint", str(runs / "qat-int4"), "--scheme", "int8", "--out",
                 str(runs / "x")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_train_refuses_a_scheme_that_does_not_fit_before_work(runs, capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data.path", str(runs / "corpus.txt"), "--model.dim", "32",
                 "--quant.qat", "int4-g64", *STEPS]) == 2
    assert "group size 64" in capsys.readouterr().err and not out.exists()
    assert main(["train", "--out", str(out), "--quant.qat", "int4-g33"]) == 2
    assert "quant.qat" in capsys.readouterr().err


def test_eval_reports_a_missing_checkpoint(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert "No checkpoint found" in capsys.readouterr().err
