"""`fourfold serve` refuses bad flags with one paragraph and exit code 2, before loading anything."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fourfold.cli import main  # noqa: E402


@pytest.mark.parametrize("flags, words", [
    (["--max-num-seqs", "0"], "--max-num-seqs 0 is out of range"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 is out of range"),
    (["--port", "70000"], "--port 70000 is not a port"),
    (["--max-requests", "0"], "--max-requests"),
    (["--block-size", "many"], "invalid int value"),
    (["--prefill-graph-seqs", "-1"], "--prefill-graph-seqs -1 is out of range"),
])
def test_bad_serve_flags_exit_2_with_a_message(model_dir, capsys, flags, words):
    assert main(["serve", "--model", str(model_dir), *flags]) == 2
    assert words in capsys.readouterr().err.replace("\n", " ")


def test_a_missing_model_directory_is_named(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
