"""Bad command lines, each refused before any work: exit code 2, one paragraph, no traceback, and a message
that names the key or flag and what to change.

Every case runs in this process through `fourfold.cli.main(argv)`. Training, the torchrun launch and text
generation are replaced by tripwires, so a bad input that slips through fails its case instead of running.
Train cases start from a valid tiny run (BASE) and add the bad part; later flags win. Placeholders in an
argv: {file} a text file, {bin} a binary file, {dir} a directory, {tmp} the test's folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from fourfold.cli import train as cli_train
from fourfold.cli import main
from tests.trainer_helpers import TINY_MODEL, write_corpus

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
HAS_PROC = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (a place even root cannot write)")


def case(name, argv, *words, marks=()):
    return pytest.param(argv, words, id=name, marks=marks)


TRAIN = [
    # ----- a value outside its range (each config field's range, checked by the one validator)
    case("lr-zero", ["--optim.lr", "0"], "optim.lr", "greater than 0"),
    case("lr-negative", ["--optim.lr", "-1e-3"], "optim.lr", "greater than 0"),
    case("lr-inf", ["--optim.lr", "inf"], "optim.lr", "finite"),
    case("lr-nan", ["--optim.lr", "nan"], "optim.lr", "finite"),
    case("beta1-one", ["--optim.beta1", "1"], "optim.beta1", "in [0, 1)"),
    case("beta1-negative", ["--optim.beta1", "-0.1"], "optim.beta1", "in [0, 1)"),
    case("beta2-above-one", ["--optim.beta2", "1.5"], "optim.beta2", "in [0, 1)"),
    case("eps-negative", ["--optim.eps", "-1e-8"], "optim.eps", "greater than 0"),
    case("eps-zero", ["--optim.eps", "0"], "optim.eps", "greater than 0"),
    case("min-lr-ratio-above-one", ["--optim.min_lr_ratio", "1.5"], "optim.min_lr_ratio", "in [0, 1]"),
    case("min-lr-ratio-negative", ["--optim.min_lr_ratio", "-0.1"], "optim.min_lr_ratio", "in [0, 1]"),
    case("warmup-negative", ["--optim.warmup_steps", "-1"], "optim.warmup_steps", "at least 0"),
    case("grad-clip-negative", ["--optim.grad_clip", "-1"], "optim.grad_clip", "at least 0"),
    case("weight-decay-negative", ["--optim.weight_decay", "-0.1"], "optim.weight_decay", "at least 0"),
    case("log-every-zero", ["--log.every", "0"], "log.every", "at least 1"),
    case("checkpoint-every-negative", ["--checkpoint.every", "-1"], "checkpoint.every", "at least 0"),
    case("checkpoint-keep-negative", ["--checkpoint.keep", "-1"], "checkpoint.keep", "at least 0"),
    case("val-every-negative", ["--train.val_every", "-5"], "train.val_every", "at least 0"),
    case("val-batches-negative", ["--train.val_batches", "-1"], "train.val_batches", "at least 0"),
    case("steps-zero", ["--train.steps", "0"], "train.steps", "at least 1"),
    case("global-batch-zero", ["--train.global_batch", "0"], "train.global_batch", "at least 1"),
    case("micro-batch-negative", ["--train.micro_batch", "-2"], "train.micro_batch", "at least 1"),
    case("seq-len-zero", ["--train.seq_len", "0"], "train.seq_len", "at least 1"),
    case("seed-negative", ["--train.seed", "-1"], "train.seed", "in [0, 2^63)"),
    case("max-bytes-negative", ["--data.max_bytes", "-1"], "data.max_bytes", "at least 0"),
    case("val-fraction-one", ["--data.val_fraction", "1"], "data.val_fraction", "in [0, 1)"),
    case("norm-eps-zero", ["--model.norm_eps", "0"], "model.norm_eps", "greater than 0"),
    case("init-std-negative", ["--model.init_std", "-0.02"], "model.init_std", "at least 0"),
    case("rope-theta-zero", ["--model.rope_theta", "0"], "model.rope_theta", "greater than 0"),
    case("dim-zero", ["--model.dim", "0"], "model.dim", "at least 1"),
    case("compile-budget-zero", ["--compute.compile_memory_budget", "0"], "compute.compile_memory_budget", "(0, 1]"),
    case("loss-chunk-negative", ["--compute.loss_chunk", "-1"], "compute.loss_chunk", "at least 0"),
    case("bucket-zero", ["--parallel.bucket_mb", "0"], "parallel.bucket_mb", "greater than 0"),
    case("pp-microbatches-negative", ["--parallel.pp_microbatches", "-1"], "parallel.pp_microbatches", "at least 0"),
    case("tp-zero", ["--parallel.tp", "0"], "parallel.tp", "at least 1"),
    # ----- a value that is not one of the choices, or not of the key's type
    case("precision-typo", ["--compute.precision", "bf15"], "compute.precision", "Did you mean 'bf16'"),
    case("device-unknown", ["--compute.device", "tpu"], "compute.device", "auto, cpu or cuda"),
    case("compile-scope-unknown", ["--compute.compile_scope", "layers"], "compute.compile_scope", "blocks or model"),
    case("schedule-typo", ["--parallel.pp_schedule", "1f1c"], "parallel.pp_schedule", "Did you mean '1f1b'"),
    case("zero-four", ["--parallel.zero", "4"], "parallel.zero", "1, 2 or 3"),
    case("cp-method-unknown", ["--parallel.cp_method", "zigzag"], "parallel.cp_method", "ring or allgather"),
    case("param-dtype-unknown", ["--parallel.param_dtype", "fp8"], "parallel.param_dtype", "fp32, bf16 or fp16"),
    case("recompute-unknown", ["--compute.recompute", "sometimes"], "compute.recompute", "every-N"),
    case("steps-not-a-number", ["--train.steps", "many"], "train.steps", "int"),
    case("bool-not-a-bool", ["--compute.compile", "maybe"], "compute.compile", "true or false"),
    case("rope-scaling-flat", ["--model.rope_scaling", "{'factor': 8.0, 'low_freq_factor': 2.0, 'high_freq_factor': "
                                                       "2.0, 'original_max_seq_len': 64}"],
         "model.rope_scaling.high_freq_factor", "greater than"),
    case("pp-layers-not-whole", ["--parallel.pp_layers", "[2, 'x']"], "parallel.pp_layers", "whole numbers"),
    # ----- keys, sections and flags that do not exist
    case("unknown-key", ["--train.stepz", "3"], "train.stepz", "Did you mean 'train.steps'"),
    case("unknown-section", ["--trian.steps", "3"], "trian", "Did you mean 'train'"),
    case("moved-key", ["--train.lr", "1e-3"], "train.lr", "--optim.lr"),
    case("unknown-preset", ["--model.preset", "llama3-8"], "preset", "Did you mean 'llama3-8b'"),
    case("override-without-value", ["--train.steps"], "--train.steps", "needs a value"),
    case("stray-argument", ["steps"], "steps", "--section.key value"),
    # ----- model shapes that do not fit together
    case("heads-vs-dim", ["--model.n_heads", "3"], "model.dim", "model.n_heads"),
    case("kv-heads-vs-heads", ["--model.n_kv_heads", "3"], "model.n_kv_heads", "divide"),
    case("seq-len-vs-max", ["--train.seq_len", "4096"], "train.seq_len", "raise model.max_seq_len"),
    case("float8-needs-bf16", ["--quant.float8", "true"], "quant.float8", "--compute.precision bf16"),
    case("vocab-below-tokenizer", ["--model.vocab_size", "100"], "model.vocab_size", "at least 257"),
    # ----- layouts under --nproc N: checked against N before torchrun is launched
    case("nproc-world-mismatch", ["--nproc", "2", "--parallel.tp", "3"], "parallel.pp * dp * fsdp * cp * tp",
         "--nproc 3"),
    case("nproc-tp-vs-kv-heads", ["--nproc", "4", "--parallel.tp", "4"], "parallel.tp", "model.n_kv_heads"),
    case("nproc-cp-vs-seq", ["--nproc", "3", "--parallel.cp", "3"], "train.seq_len", "multiple of 6"),
    case("nproc-pp-vs-layers", ["--nproc", "8", "--parallel.pp", "8"], "model.n_layers", "lower parallel.pp"),
    case("nproc-vpp-needs-interleaved", ["--nproc", "2", "--parallel.pp", "2", "--parallel.vpp", "2"],
         "parallel.vpp", "--parallel.pp_schedule interleaved-1f1b"),
    case("nproc-pp-tied", ["--nproc", "2", "--parallel.pp", "2", "--model.tie_embeddings", "true"],
         "model.tie_embeddings", "--parallel.pp 1"),
    case("nproc-zero1-with-tp", ["--nproc", "4", "--parallel.fsdp", "2", "--parallel.tp", "2", "--parallel.zero", "1"],
         "parallel.zero", "--parallel.zero 3"),
    case("nproc-zero1-with-dp", ["--nproc", "4", "--parallel.fsdp", "2", "--parallel.dp", "2", "--parallel.zero", "1"],
         "parallel.zero", "ZeRO-3"),
    case("nproc-zero1-with-cp", ["--nproc", "4", "--parallel.fsdp", "2", "--parallel.cp", "2", "--parallel.zero", "1"],
         "parallel.zero", "parallel.cp"),
    case("nproc-param-dtype-ddp", ["--nproc", "2", "--parallel.dp", "2", "--parallel.param_dtype", "bf16"],
         "parallel.param_dtype", "--parallel.fsdp N"),
    case("nproc-batch-vs-ranks", ["--nproc", "8", "--parallel.fsdp", "8"], "train.global_batch", "train.micro_batch"),
    case("nproc-uneven-stages", ["--nproc", "3", "--parallel.pp", "3"], "model.n_layers", "parallel.pp_layers"),
    case("nproc-pp-layers-sum", ["--nproc", "2", "--parallel.pp", "2", "--parallel.pp_layers", "[1, 2]"],
         "parallel.pp_layers", "summing to model.n_layers"),
    case("nproc-compile-model-fsdp", ["--nproc", "2", "--parallel.fsdp", "2", "--compute.compile", "true",
                                      "--compute.compile_scope", "model"], "compute.compile_scope", "blocks"),
    case("nproc-hierarchical-per-node", ["--nproc", "4", "--parallel.dp", "4", "--parallel.hierarchical_allreduce",
                                         "true", "--parallel.gpus_per_node", "3"], "parallel.gpus_per_node",
         "parallel.dp"),
    case("nproc-hierarchical-with-fsdp", ["--nproc", "2", "--parallel.fsdp", "2", "--parallel.hierarchical_allreduce",
                                          "true"], "parallel.hierarchical_allreduce", "false"),
    case("nproc-cpu-offload-with-ddp", ["--nproc", "2", "--parallel.dp", "2", "--parallel.cpu_offload", "true"],
         "parallel.cpu_offload", "--parallel.fsdp N"),
    case("pp-layers-without-pp", ["--parallel.pp_layers", "[2, 2]"], "parallel.pp_layers", "--parallel.pp 2"),
    case("nproc-zero", ["--nproc", "0"], "--nproc", "at least 1"),
    case("nproc-negative", ["--nproc", "-2"], "--nproc", "at least 1"),
    case("nproc-not-a-number", ["--nproc", "two"], "--nproc", "invalid int value"),
    case("nproc-cuda-without-gpu", ["--nproc", "2", "--parallel.fsdp", "2", "--compute.device", "cuda"],
         "--compute.device", "cpu", marks=NO_GPU),
    case("cuda-without-gpu", ["--compute.device", "cuda"], "--compute.device", "cpu", marks=NO_GPU),
    # ----- folders the run writes, the config file, the data
    case("out-is-a-file", ["--out", "{file}"], "--out", "is a file"),
    case("out-under-a-file", ["--out", "{file}/run"], "--out", "which is a file"),
    case("out-not-writable", ["--out", "/proc/fourfold-run"], "--out", "not writable", marks=HAS_PROC),
    case("cache-is-a-file", ["--data.cache_dir", "{file}"], "--data.cache_dir", "is a file"),
    case("cache-under-a-file", ["--data.cache_dir", "{file}/cache"], "--data.cache_dir", "which is a file"),
    case("cache-not-writable", ["--data.cache_dir", "/proc/fourfold-cache"], "--data.cache_dir", "not writable",
         marks=HAS_PROC),
    case("config-is-a-directory", ["--config", "{dir}"], "--config", "is a directory"),
    case("config-missing", ["--config", "{tmp}/nope.toml"], "nope.toml", "configs/tiny.toml"),
    case("config-binary", ["--config", "{bin}"], "blob.bin", "UTF-8"),
    case("config-bad-toml", ["--config", "{file}"], "not valid TOML", "corpus.txt"),
    case("data-binary-file", ["--data.path", "{bin}"], "data.path", "binary"),
    case("data-glob-only-binary", ["--data.path", "{tmp}/*.bin"], "data.path", "binary"),
    case("data-missing", ["--data.path", "{tmp}/missing.txt"], "data.path", "does not exist"),
    case("data-empty-directory", ["--data.path", "{dir}"], "data.path", "no text files"),
    case("tokenizer-missing", ["--data.tokenizer", "{tmp}/tok.json"], "data.tokenizer", "--data.tokenizer byte"),
]

GENERATE = [
    case("empty-prompt", ["--prompt", ""], "--prompt", "give the text"),
    case("temperature-negative", ["--temperature", "-1"], "--temperature", "at least 0"),
    case("temperature-nan", ["--temperature", "nan"], "--temperature", "finite"),
    case("temperature-inf", ["--temperature", "inf"], "--temperature", "finite"),
    case("temperature-not-a-number", ["--temperature", "hot"], "--temperature", "invalid float value"),
    case("top-p-zero", ["--top-p", "0"], "--top-p", "(0, 1]"),
    case("top-p-above-one", ["--top-p", "1.5"], "--top-p", "(0, 1]"),
    case("top-p-nan", ["--top-p", "nan"], "--top-p", "(0, 1]"),
    case("top-k-negative", ["--top-k", "-1"], "--top-k", "at least 0"),
    case("max-new-tokens-zero", ["--max-new-tokens", "0"], "--max-new-tokens", "at least 1"),
    case("max-new-tokens-negative", ["--max-new-tokens", "-5"], "--max-new-tokens", "at least 1"),
    case("seed-negative", ["--seed", "-1"], "--seed", "[0, 2^63)"),
    case("device-unknown", ["--device", "mps"], "--device", "auto, cpu, cuda"),
    case("device-cuda-without-gpu", ["--device", "cuda"], "--device", "--device cpu", marks=NO_GPU),
    case("missing-checkpoint", ["--checkpoint", "{tmp}/no-run"], "No checkpoint found", "checkpoints/step_N"),
]

OTHER = [
    case("generate-without-prompt", ["generate", "--checkpoint", "{tmp}"], "--prompt", "fourfold generate --help"),
    case("unknown-command", ["trian"], "trian", "Did you mean 'train'"),
    case("config-extra-argument", ["config", "--all"], "--all", "fourfold config --help"),
]


@pytest.fixture
def places(tmp_path):
    """The files the placeholders name, and the flags of a valid tiny training run."""
    corpus = write_corpus(tmp_path / "corpus.txt", 4_000)
    (tmp_path / "blob.bin").write_bytes(b"\x89PNG\x00\x01\x02" * 50)
    (tmp_path / "empty").mkdir()
    fill = {"{file}": str(corpus), "{bin}": str(tmp_path / "blob.bin"), "{dir}": str(tmp_path / "empty"),
            "{tmp}": str(tmp_path)}
    base = ["--out", str(tmp_path / "run"), "--data.path", str(corpus), "--data.cache_dir", str(tmp_path / "cache"),
            "--compute.device", "cpu", "--train.global_batch", "8", "--train.micro_batch", "2",
            "--train.seq_len", "16", "--log.progress", "false"]
    for key, value in TINY_MODEL.items():
        base += [f"--model.{key}", str(value)]
    return fill, base, tmp_path


@pytest.fixture
def tripwires(monkeypatch):
    """Fail the case if the command gets as far as training, launching torchrun or generating."""

    def reached(what):
        def tripwire(*args, **kwargs):
            raise AssertionError(f"a bad input was accepted: the command went on to {what}")
        return tripwire

    monkeypatch.setattr("fourfold.train.trainer.train", reached("train"))
    monkeypatch.setattr("fourfold.cli.train._launch_torchrun", reached("launch torchrun"))
    monkeypatch.setattr("fourfold.infer.generate.generate_text", reached("generate"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _filled(argv, fill):
    out = []
    for a in argv:
        for k, v in fill.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def _refused(argv, words, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err  # one paragraph
    for w in words:
        assert w in captured.err, f"{w!r} not in {captured.err!r}"


@pytest.mark.parametrize("argv, words", TRAIN)
def test_bad_train_input_is_refused_before_any_work(argv, words, places, tripwires, capsys):
    fill, base, tmp = places
    _refused(["train", *base, *_filled(argv, fill)], words, capsys)
    assert not (tmp / "run").exists() and not (tmp / "cache").exists()


@pytest.mark.parametrize("argv, words", GENERATE)
def test_bad_generate_input_is_refused_before_loading(argv, words, places, tripwires, capsys):
    fill, _, tmp = places
    _refused(["generate", "--checkpoint", str(tmp), "--prompt", "def ", *_filled(argv, fill)], words, capsys)


@pytest.mark.parametrize("argv, words", OTHER)
def test_bad_command_line_is_refused(argv, words, places, tripwires, capsys):
    fill, _, _ = places
    _refused(_filled(argv, fill), words, capsys)


def test_the_table_is_large_enough():
    assert len(TRAIN) + len(GENERATE) + len(OTHER) >= 60


def test_the_base_run_itself_is_accepted(places, tripwires, capsys):
    """The cases are refused for their bad part: BASE alone goes on to train (and so meets the tripwire)."""
    _, base, _ = places
    with pytest.raises(AssertionError, match="went on to train"):
        main(["train", *base])
    with pytest.raises(AssertionError, match="went on to launch torchrun"):
        main(["train", *base, "--nproc", "2", "--parallel.fsdp", "2"])


def test_a_worker_stopping_on_a_user_error_exits_2_without_torchrun_traceback(monkeypatch, capsys):
    """Errors only a worker can see (e.g. a checkpoint to resume) keep exit 2: torchrun's failure is not re-raised."""

    def workers_failed(args):
        raise ChildFailedError("fourfold", {1: ProcessFailure(1, 4242, 2, "<N/A>")})

    monkeypatch.setattr("torch.distributed.run.run", workers_failed)
    assert cli_train._launch_torchrun(2, ["--parallel.fsdp", "2", "--out", "run"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_config_into_a_closed_pipe_is_quiet():
    """`fourfold config | head`: the reader closes the pipe early; no BrokenPipe traceback, exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "fourfold", "config"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    proc.stdout.close()  # before it writes anything, so the write must meet a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err
