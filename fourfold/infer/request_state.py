"""The engine's per-request state between steps and the per-token work on it: stop checks, then outputs.

Each step the engine reads a batch of sampled ids back and calls `apply_tokens` (the token goes into
its placeholder slot; the stop conditions are checked in order: a stop token id or eos unless
ignore_eos, a stop string in the detokenized text, max_tokens or a full context), then `build_outputs`
(the text delta and the RequestOutput), which on CUDA runs while the next step computes. The
parameters that the checks need are worked out once, when the request is added (a set of stop ids,
the last output slot), so a token costs a few comparisons. Requests with `detokenize=False` keep no
detokenizer: their outputs carry token ids only.
"""

from __future__ import annotations

from fourfold.infer.detokenizer import IncrementalDetokenizer
from fourfold.infer.requests import RequestOutput
from fourfold.infer.sequence import Sequence, SequenceStatus


class RequestState:
    """One request's engine-side state: its sequence, detokenizer, precomputed stop rules and timings."""

    __slots__ = ("seq", "detok", "stop_ids", "stop_strings", "last_slot", "arrival_time", "last_token_time")

    def __init__(self, seq: Sequence, tokenizer, eos_id: int | None, max_model_len: int, arrival_time: float,
                 decode_cache: dict | None = None):
        p = seq.params
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, p.stop, decode_cache) if p.detokenize else None
        stop_ids = set(p.stop_token_ids)
        if eos_id is not None and not p.ignore_eos:
            stop_ids.add(eos_id)
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = bool(p.stop)
        self.last_slot = min(p.max_tokens, max_model_len - len(seq.prompt_ids)) - 1
        """The output slot whose token ends the request by length (max_tokens, or the context is full)."""
        self.arrival_time = arrival_time
        self.last_token_time: float | None = None

    def final_text(self) -> str:
        """The text not yet emitted, flushed (an aborted request's last output)."""
        return self.detok.delta(finished=True) if self.detok is not None else ""


def apply_tokens(reqs: list[RequestState], slots: list[int], tokens: list[int], logprobs: list,
                 finish) -> list[tuple]:
    """Put each token at its output slot and check the stop conditions; `finish(req, reason, slot)` ends one.

    Returns (req, token, logprobs, finish reason or None, whether the token's text is still to decode)
    for every request not finished before (an aborted one already has its last output).
    """
    applied = []
    finished = SequenceStatus.FINISHED
    for req, slot, token, lp in zip(reqs, slots, tokens, logprobs):
        seq = req.seq
        if seq.status is finished:
            continue
        seq.output_ids[slot] = token
        reason = None
        if token in req.stop_ids:
            pending = False
            reason = "stop"
        elif req.stop_strings:  # the text is needed now; plain text waits for build_outputs
            pending = False
            if req.detok.add(token):
                reason = "stop"
            elif slot >= req.last_slot:
                reason = "length"
        else:
            pending = req.detok is not None
            if slot >= req.last_slot:
                reason = "length"
        if reason is not None:
            finish(req, reason, slot)
        applied.append((req, token, lp, reason, pending))
    return applied


def build_outputs(applied: list[tuple], now: float) -> list[RequestOutput]:
    """The RequestOutput of each token `apply_tokens` took, with its text delta and timing."""
    outputs = []
    for req, token, lp, reason, pending in applied:
        seq, detok, finished = req.seq, req.detok, reason is not None
        text = ""
        if detok is not None:
            if pending:
                detok.add(token)
            if finished:
                detok.flush()
            text = detok.delta(finished)
        last, req.last_token_time = req.last_token_time, now
        outputs.append(RequestOutput(seq.request_id, [token], text, finished, reason, len(seq.prompt_ids),
                                     len(seq.output_ids), [lp] if lp is not None else [], seq.cached_prompt_tokens,
                                     now - req.arrival_time if last is None else None,
                                     None if last is None else now - last))
    return outputs
