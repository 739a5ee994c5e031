"""Incremental detokenization: deltas add up to the full decode, a character split across tokens waits for its
last byte, and a stop string cuts the text exactly, with no part of it ever emitted; logprobs reach outputs."""

import pytest

from fourfold.infer.detokenizer import IncrementalDetokenizer
from fourfold.infer.requests import SamplingParams
from fourfold.tokenizer import ByteTokenizer
from tests.engine_helpers import Twin, run_to_end


def feed(text: str, stop: list[str]):
    """Feed `text`'s bytes one token at a time; (deltas while running, final delta, whether a stop hit)."""
    detok = IncrementalDetokenizer(ByteTokenizer(), stop)
    deltas = []
    for b in text.encode("utf-8"):
        if detok.add(b):
            return deltas, detok.delta(finished=True), True
        deltas.append(detok.delta(finished=False))
    detok.flush()
    return deltas, detok.delta(finished=True), False


def test_deltas_add_up_and_split_characters_wait():
    deltas, last, stopped = feed("añb€c", [])
    assert "".join(deltas) + last == "añb€c" and not stopped
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "ñ"  # the first byte of ñ waits for the second


@pytest.mark.parametrize("text, stop, want", [
    ("hello world", ["wor"], "hello "),
    ("abcabd", ["abd", "zz"], "abc"),
    ("xé!yz", ["!y"], "xé"),
    ("no stop here", ["stop!"], "no stop here"),
])
def test_stop_strings_cut_exactly_and_are_never_emitted(text, stop, want):
    deltas, last, stopped = feed(text, stop)
    assert "".join(deltas) + last == want
    assert stopped == (want != text)
    streamed = ""
    for d in deltas:
        streamed += d
        assert want.startswith(streamed)


def test_engine_stops_on_a_stop_string_and_returns_logprobs():
    twin = Twin()
    engine = twin.engine()
    greedy = twin.hf_greedy([3, 14, 15, 9, 26], 10)
    stop_text = ByteTokenizer().decode(greedy[4:6])
    if not stop_text or "\ufffd" in stop_text:
        pytest.skip("the greedy tokens here are not printable bytes")
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_text], logprobs=2, ignore_eos=True)
    _, steps = run_to_end(engine, {"s": ([3, 14, 15, 9, 26], params)})
    outs = [o for step in steps for o in step]
    text = "".join(o.text_delta for o in outs)
    assert outs[-1].finish_reason == "stop" and stop_text not in text
    assert text == ByteTokenizer().decode(greedy[:6]).split(stop_text)[0]
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top) == 2 for o in outs)
    assert all(o.logprobs[0].token_id == o.token_ids[0] for o in outs)
