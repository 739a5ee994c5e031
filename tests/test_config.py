"""Config loading: TOML, dotted overrides, presets, validation messages, round trip."""

import tomllib

import pytest

from fourfold.config import build_config, describe, load_config, parse_overrides, to_toml
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
