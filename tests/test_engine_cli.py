"""`fourfold generate` on the engine: a trained tiny checkpoint continues a prompt exactly as the contiguous-cache
generator does (greedy), a prompts file gives one JSONL result per line in order, --chat renders the template."""

import json

import pytest
import torch

from fourfold.chat import ChatTemplate
from fourfold.cli import main
from fourfold.infer.generate import SamplingOptions, generate_text
from fourfold.infer.llm import LLM
from fourfold.infer.requests import SamplingParams
from fourfold.testing.runs import tiny_config
from fourfold.train.trainer import train

GREEDY_FLAGS = ["--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    train(tiny_config(tmp, **{"train.steps": "2", "checkpoint.save_final": "true"}), tmp / "run")
    return tmp / "run"


def test_prompt_continues_like_the_contiguous_cache_generator(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def f", *GREEDY_FLAGS]) == 0
    printed = capsys.readouterr().out
    expected = generate_text(run_dir, "def f", SamplingOptions(12, 0.0), torch.device("cpu"))
    assert printed == "def f" + expected + "\n"


def test_prompts_file_writes_results_in_order(run_dir, tmp_path):
    prompts = [{"prompt": "ab"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "class "}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    assert main(["generate", "--checkpoint", str(run_dir), "--prompts-file", str(src), "--output", str(dst),
                 *GREEDY_FLAGS]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    chat = ChatTemplate().render(prompts[1]["messages"])
    assert [r["prompt"] for r in rows] == ["ab", chat, "class "]
    llm = LLM(run_dir)
    want = llm.generate(["ab", chat, "class "], SamplingParams(max_tokens=12, temperature=0.0), progress=False)
    assert [r["text"] for r in rows] == [w.text for w in want]
    assert all(r["finish_reason"] in ("stop", "length") and r["completion_tokens"] >= 1 for r in rows)


def test_chat_flag_renders_the_prompt_as_a_user_message(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "hello", "--chat", *GREEDY_FLAGS]) == 0
    printed = capsys.readouterr().out
    rendered = ChatTemplate().render([{"role": "user", "content": "hello"}])
    want = LLM(run_dir).generate(rendered, SamplingParams(max_tokens=12, temperature=0.0), progress=False)[0]
    assert printed == want.text + "\n"


def test_bad_prompts_file_is_refused(run_dir, tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert main(["generate", "--checkpoint", str(run_dir), "--prompts-file", str(src)]) == 2
    assert "line 2" in capsys.readouterr().err
