"""Config loading: TOML, dotted overrides, presets, validation messages, round trip."""

import tomllib
from dataclasses import fields
from typing import get_type_hints

import pytest

from fourfold.config import SECTIONS, build_config, check_value, load_config, parse_overrides
from fourfold.config_text import describe, to_toml
from fourfold.errors import ConfigError


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npreset = "tiny"\n[train]\nsteps = 7\n')
    cfg = load_config(path, ["--train.steps", "11", "--model.dim=256", "--compute.compile", "true"])
    assert cfg.train.steps == 11 and cfg.model.dim == 256 and cfg.compute.compile is True
    assert cfg.model.n_layers == 4  # from the preset


def test_preset_fills_and_explicit_keys_win():
    cfg = build_config({"model": {"preset": "llama3-8b", "n_layers": 2}})
    assert cfg.model.dim == 4096 and cfg.model.n_layers == 2 and cfg.model.vocab_size == 128256


@pytest.mark.parametrize("overrides, words", [
    ({"train.stepz": "3"}, ["train.stepz", "Did you mean 'train.steps'"]),
    ({"trian.steps": "3"}, ["Did you mean 'train'"]),
    ({"train.steps": "many"}, ["train.steps", "int"]),
    ({"compute.compile": "maybe"}, ["compute.compile", "true or false"]),
    ({"model.preset": "llama3-8"}, ["Did you mean 'llama3-8b'"]),
    ({"compute.precision": "bf15"}, ["bf16"]),
    ({"model.n_heads": "3"}, ["model.dim", "n_heads"]),
    ({"model.n_kv_heads": "3"}, ["n_kv_heads"]),
    ({"train.seq_len": "4096"}, ["max_seq_len"]),
    ({"compute.recompute": "sometimes"}, ["every-N"]),
    ({"compute.compile_scope": "layers"}, ["compute.compile_scope", "blocks, model"]),
    ({"parallel.pp_schedule": "1f1c"}, ["Did you mean '1f1b'"]),
])
def test_bad_input_names_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    for w in words:
        assert w in str(err.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_override_parsing_errors():
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ConfigError, match="Unexpected argument"):
        parse_overrides(["steps"])


def test_round_trip_through_toml():
    cfg = build_config({}, {"model.preset": "llama3.1-8b", "parallel.pp_layers": "[16, 16]", "train.seq_len": "64"})
    assert build_config(tomllib.loads(to_toml(cfg))) == cfg


def test_reference_lists_every_key():
    text = describe()
    cfg = build_config()
    for section, values in cfg.to_dict().items():
        for key in values:
            assert f"`{section}.{key}`" in text


def _numeric_fields():
    for section, cls in SECTIONS.items():
        types = get_type_hints(cls)
        for f in fields(cls):
            if types[f.name] in (int, float):
                yield section, f, types[f.name]


def test_every_numeric_field_declares_its_range():
    missing = [f"{s}.{f.name}" for s, f, _ in _numeric_fields() if "range" not in f.metadata]
    assert not missing, f"give these a setting(..., ge=/gt=/le=/lt=/choices=): {missing}"


@pytest.mark.parametrize("key", [f"{s}.{f.name}" for s, f, t in _numeric_fields() if t is float])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused_everywhere(key, value):
    with pytest.raises(ConfigError, match=f"{key} must be a finite number"):
        build_config({}, {key: value})


@pytest.mark.parametrize("key, value, words", [
    ("optim.lr", "0", "greater than 0"), ("optim.beta2", "1", "in [0, 1)"), ("optim.eps", "-1", "greater than 0"),
    ("log.every", "0", "at least 1"), ("checkpoint.keep", "-1", "at least 0"), ("optim.min_lr_ratio", "2", "[0, 1]"),
    ("model.norm_eps", "0", "greater than 0"), ("model.init_std", "-1", "at least 0"), ("data.max_bytes", "-1", "0"),
])
def test_out_of_range_names_the_key_the_range_and_the_flag(key, value, words):
    with pytest.raises(ConfigError) as err:
        build_config({}, {key: value})
    message = str(err.value)
    assert key in message and words in message and f"Set --{key}" in message


def test_toml_values_are_checked_like_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = nan\n")
    with pytest.raises(ConfigError, match="optim.lr must be a finite number"):
        load_config(path)


def test_reference_shows_each_range():
    rows = {line.split("|")[1].strip(): line for line in describe().splitlines() if line.startswith("| `")}
    assert "in [0, 1)" in rows["`optim.beta2`"]
    assert "greater than 0" in rows["`optim.lr`"]
    assert "fp32, bf16, fp16 or fp64" in rows["`compute.precision`"]


def test_a_directory_or_binary_file_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x89\x00\xff" * 10)
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(binary)


def test_a_lower_level_checks_a_setting_with_the_config_rule():
    check_value("parallel.cp_method", "ring")
    with pytest.raises(ConfigError, match="ring or allgather"):
        check_value("parallel.cp_method", "zigzag")
