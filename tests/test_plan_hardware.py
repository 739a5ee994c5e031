"""Hardware as data: the shipped table loads, user files override key by key, bad values are clear errors."""

from __future__ import annotations

import pytest

from fourfold.errors import ConfigError
from fourfold.plan.hardware import SHIPPED, load_hardware


def test_shipped_table_has_every_device_and_link():
    hw = load_hardware(calibration=False)
    for name in ("h100", "h200", "a100", "b200", "cpu"):
        dev = hw.device(name)
        assert dev.flops("bf16") > 0 and dev.hbm_bandwidth > 0 and dev.memory_bytes > 0
        assert hw.link(dev.intra_node).bandwidth > 0
    for name in ("ib400", "ib200", "eth100", "nvlink4"):
        assert hw.link(name).latency > 0
    assert hw.device("a100").flops("fp8") == 0 and hw.device("h100").flops("fp8") > hw.device("h100").flops("bf16")


def test_a_user_file_overrides_single_keys_and_adds_devices(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[device.h100]\nmemory_gib = 94\n\n[link.ib400]\nbandwidth = 40e9\n\n[efficiency]\nmatmul = 0.5\n'
                 '[device.mygpu]\ndescription = "x"\nmemory_gib = 10\nflops_fp64 = 1e12\nflops_fp32 = 1e12\n'
                 'flops_tf32 = 1e12\nflops_bf16 = 2e12\nflops_fp16 = 2e12\nflops_fp8 = 0\nhbm_bandwidth = 1e11\n'
                 'intra_node = "nvlink4"\n')
    hw = load_hardware([f], calibration=False)
    assert hw.device("h100").memory_gib == 94 and hw.device("h100").flops("bf16") == 989e12
    assert hw.link("ib400").bandwidth == 40e9 and hw.link("ib400").latency == load_hardware(
        calibration=False).link("ib400").latency
    assert hw.efficiency.matmul == 0.5 and hw.device("mygpu").flops("bf16") == 2e12


def test_the_calibration_file_is_read_when_present(tmp_path, monkeypatch):
    f = tmp_path / "cal.toml"
    f.write_text("[device.cpu]\nflops_fp32 = 123e9\n")
    monkeypatch.setenv("FOURFOLD_CALIBRATION", str(f))
    assert load_hardware().device("cpu").flops("fp32") == 123e9
    assert load_hardware(calibration=False).device("cpu").flops("fp32") != 123e9


@pytest.mark.parametrize("text, words", [
    ("[link.ib400]\nbandwidth = -5\n", ["bandwidth", "positive"]),
    ("[link.ib400]\nbandwidth = \"fast\"\n", ["bandwidth", "number"]),
    ("[device.h100]\nmemory_gb = 80\n", ["unknown key 'memory_gb'", "memory_gib"]),
    ("[device.newgpu]\nmemory_gib = 80\n", ["newgpu", "missing", "flops_bf16"]),
    ("[device.h100]\nintra_node = \"warp\"\n", ["warp", "link"]),
    ("[efficiency]\nmatmul = 7\n", ["matmul", "fraction"]),
    ("[efficiency]\nspeed = 1\n", ["unknown key 'speed'"]),
    ("[gpus.h100]\nx = 1\n", ["unknown table", "gpus"]),
    ("[device.h100\n", ["not valid TOML"]),
    ("[device.h100]\nhbm_bandwidth = nan\n", ["hbm_bandwidth", "number"]),
])
def test_bad_values_are_clear_errors(tmp_path, text, words):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_hardware([f], calibration=False)
    for word in words:
        assert word in str(e.value)
    assert str(f) in str(e.value) or "TOML" in str(e.value)


def test_missing_file_and_unknown_names_say_what_exists(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_hardware([tmp_path / "nope.toml"], calibration=False)
    hw = load_hardware(calibration=False)
    with pytest.raises(ConfigError, match="h100"):
        hw.device("h900")
    with pytest.raises(ConfigError, match="ib400"):
        hw.link("ib9000")
    assert SHIPPED.is_file()
