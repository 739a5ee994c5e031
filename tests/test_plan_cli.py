"""`fourfold plan`: prints a ranked table, writes a TOML the trainer loads, plans inference, calibrates."""

from __future__ import annotations

import pytest
from rich.console import Console

from fourfold.cli.plan import main
from fourfold.config import load_config
from fourfold.errors import ConfigError
from fourfold.layout import validate_layout


def _run(argv):
    console = Console(record=True, width=200)
    assert main(argv, console) == 0
    return console.export_text()


def test_plan_prints_a_ranked_table_and_writes_a_toml_the_trainer_accepts(tmp_path):
    out = tmp_path / "best.toml"
    text = _run(["--model", "tiny", "--gpus", "4", "--gpus-per-node", "2", "--gpu", "h100", "--seq", "128",
                 "--global-batch", "8", "--top", "3", "--toml", str(out)])
    assert "tokens/s/GPU" in text and "MFU" in text and "torchrun --nnodes 2 --nproc-per-node 2" in text
    assert text.count("\n│ ") >= 3 or text.count("│ 3 ") == 1
    cfg = load_config(out)
    validate_layout(cfg, 4)
    assert cfg.model.dim == 128 and cfg.train.seq_len == 128 and cfg.train.global_batch == 8
    assert cfg.parallel.tp <= 2
    overrides = text.split("-m fourfold train ")[1].split("\n")[0].split()
    again = load_config(None, overrides)  # the printed overrides build the same layout
    assert (again.parallel, again.compute, again.quant) == (cfg.parallel, cfg.compute, cfg.quant)


def test_plan_for_inference_prints_capacity_and_speed():
    one_node = _run(["--model", "tiny", "--gpus", "2", "--gpu", "h100", "--seq", "128", "--top", "1"])
    assert "fourfold train --nproc 2 " in one_node
    text = _run(["--inference", "--model", "llama3-70b", "--gpu", "h100", "--context", "8192"])
    assert "max sequences" in text and "tok/s batch 1" in text and "does not fit" in text  # tp1 pp1: 140 GB
    assert "\n│  8 │" in text or "│ 8 " in text


def test_user_mistakes_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="--model"):
        main(["--gpus", "2"], Console())
    with pytest.raises(ConfigError, match="h900"):
        main(["--model", "tiny", "--gpu", "h900"], Console())
    with pytest.raises(ConfigError, match="ib9"):
        main(["--model", "tiny", "--interconnect", "ib9"], Console())
    with pytest.raises(ConfigError, match="gpus-per-node"):
        main(["--model", "tiny", "--gpus", "12", "--gpus-per-node", "8"], Console())
    with pytest.raises(ConfigError, match="No layout"):
        main(["--model", "llama3-70b", "--gpus", "1", "--gpu", "h100", "--seq", "2048"], Console())


@pytest.mark.slow
def test_calibrate_measures_this_machine_and_later_predictions_use_it(tmp_path, monkeypatch):
    from fourfold.plan.hardware import load_hardware

    out = tmp_path / "cal.toml"
    text = _run(["calibrate", "--device", "cpu", "--quick", "--out", str(out)])
    assert "wrote" in text and out.is_file()
    monkeypatch.setenv("FOURFOLD_CALIBRATION", str(out))
    hw = load_hardware()
    assert hw.device("cpu").flops("fp32") != load_hardware(calibration=False).device("cpu").flops("fp32")
    assert hw.link(hw.device("cpu").intra_node).bandwidth > 0


def test_gloo_calibration_keeps_rank_0s_figures_when_a_worker_dies_after_sending_them():
    """A worker that aborts in gloo's shutdown, after rank 0 sent every figure, costs a warning, not the run; one
    that dies before the figures were sent fails the calibration."""
    import queue as queues

    import pytest

    from fourfold.plan.calibrate_gloo import _figures_despite

    died = RuntimeError("process 1 terminated with signal SIGABRT")
    sent = queues.Queue()
    sent.put({"comm_factor": 1.5})
    with pytest.warns(UserWarning, match="died while shutting down"):
        assert _figures_despite(died, sent) == {"comm_factor": 1.5}
    with pytest.raises(RuntimeError, match="SIGABRT"):
        _figures_despite(died, queues.Queue())
