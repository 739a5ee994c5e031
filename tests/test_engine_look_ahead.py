"""Look-ahead stepping (the CUDA path, forced here on CPU) schedules exactly the steps the plain engine does.

A look-ahead step is scheduled while each sequence still holds the previous step's placeholder token, so
a slip in the scheduler or the engine would show up as extra steps, decode steps that leave running
sequences out, or other tokens. The model is a stand-in whose next token is a function of the step's
input token and position (so a placeholder left unfilled changes the output) and costs nothing, which
lets these tests run many sequences (the GPU diagnostic that prompted them ran 256) in a second or two.
"""

import pytest
import torch

from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.requests import SamplingParams
from fourfold.tokenizer import ByteTokenizer

VOCAB = 97
BLOCK = 4


class TokenFunctionRunner(ModelRunner):
    """The runner's real step build, with a 'model' whose greedy next token is (7 * token + position) % VOCAB."""

    def __init__(self, num_blocks: int):
        super().__init__(None, KVPool(1, num_blocks, BLOCK, 1, 1, torch.float32, torch.device("cpu")),
                         torch.device("cpu"), fuse=False)

    def forward(self, st):
        rows = st.logits_for
        nxt = (7 * st.tokens[rows] + st.positions[rows]) % VOCAB  # a placeholder (-1) gives another token
        return torch.nn.functional.one_hot(nxt, VOCAB).float()


def run(requests: dict, num_blocks: int, look_ahead_max_seqs: int | None, budget: int):
    """Run `requests` to the end; (tokens and finish reason per request, per-step chunk lists, engine).

    look_ahead_max_seqs None: the plain engine (no overlap); otherwise the overlapped CUDA path with that cap.
    """
    cfg = EngineConfig(block_size=BLOCK, max_num_seqs=len(requests), max_num_batched_tokens=budget,
                       look_ahead_max_seqs=look_ahead_max_seqs or 0)
    engine = LLMEngine(TokenFunctionRunner(num_blocks), ByteTokenizer(), cfg, 512)
    engine.overlap = look_ahead_max_seqs is not None
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps, schedule = [], engine.scheduler.schedule

    def recorded():
        running = {s.request_id for s in engine.scheduler.running}
        chunks = schedule()
        if chunks:  # the overlapped path asks once more after the last step, to find nothing left
            steps.append((running, [(c.seq.request_id, c.num_tokens) for c in chunks]))
        return chunks
    engine.scheduler.schedule = recorded
    got = {rid: ([], None) for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.token_ids)
            if out.finished:
                got[out.request_id] = (got[out.request_id][0], out.finish_reason)
    assert engine.blocks.num_used == 0 and not engine.requests
    return got, steps, engine


def batch(n: int, prompt_len: int, new_tokens: int, **params) -> dict:
    gen = torch.Generator().manual_seed(n)
    prompts = torch.randint(0, VOCAB, (n, prompt_len), generator=gen).tolist()
    return {f"r{i}": (p, SamplingParams(max_tokens=new_tokens, temperature=0.0, detokenize=False, **params))
            for i, p in enumerate(prompts)}


@pytest.mark.parametrize("pool", ["plenty", "preempting"])
def test_look_ahead_takes_the_plain_engine_s_steps(pool):
    """Many sequences, prefill spread over several steps by the budget: the same steps, chunk for chunk, and
    the same tokens with the look-ahead path as without (also when blocks run out and sequences are preempted)."""
    n, prompt_len, new = 96, 24, 24
    requests = batch(n, prompt_len, new, ignore_eos=True)
    need = n * -(-(prompt_len + new) // BLOCK)
    blocks = need + 8 if pool == "plenty" else need * 3 // 4
    want, plain_steps, plain = run(requests, blocks, None, budget=512)
    got, off_steps, off = run(requests, blocks, 0, budget=512)
    got_la, la_steps, la = run(requests, blocks, n, budget=512)
    assert got == got_la == want and all(len(t) == new and r == "length" for t, r in want.values())
    assert [c for _, c in la_steps] == [c for _, c in off_steps] == [c for _, c in plain_steps]
    # (it is off while preempted sequences wait to be admitted again)
    assert la.look_aheads > (len(la_steps) // 2 if pool == "plenty" else 3) and off.look_aheads == 0
    assert la.scheduler.preemptions == plain.scheduler.preemptions
    assert (la.scheduler.preemptions > 0) == (pool == "preempting")
    if pool == "plenty":  # every step carries every running sequence (decodes first, never left out)
        assert all(running <= {rid for rid, _ in chunks} for running, chunks in la_steps)
        decode_only = [chunks for running, chunks in la_steps if all(k == 1 for _, k in chunks)]
        assert len(decode_only) >= new - 2 and max(len(c) for c in decode_only) == n


def test_look_ahead_keeps_stops_and_lengths_when_a_cap_switches_it_on_and_off():
    """Ragged prompts and lengths, stop token ids met mid-way, and a cap below the batch (look-ahead turns on
    as sequences finish): the same tokens and finish reasons as the plain engine, none past a stop."""
    requests = {rid: (prompt[:3 + i % 7], params) for i, (rid, (prompt, params)) in enumerate(batch(40, 9, 30).items())}
    free_run, _, _ = run(requests, 400, None, budget=64)
    for i, (rid, (prompt, _)) in enumerate(list(requests.items())):
        stops = [free_run[rid][0][4 + i % 9]] if i % 3 == 0 else []  # a token it emits part-way
        requests[rid] = (prompt, SamplingParams(max_tokens=12 if i % 4 == 1 else 30, temperature=0.0,
                                                detokenize=False, stop_token_ids=stops))
    want, _, _ = run(requests, 400, None, budget=64)
    got, _, engine = run(requests, 400, 24, budget=64)
    assert got == want and engine.look_aheads > 5
    assert sum(r == "stop" for _, r in want.values()) == 14 and max(len(t) for t, _ in want.values()) == 30
