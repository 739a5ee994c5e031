"""Decode attention in two kernels (rotary + KV write + split-KV attention; the combine) against the three-kernel path.

The old path is fused_ops.rotary_kv_write (its Triton kernel, forced on CPU tensors too) and
attention_gpu.paged_attention; without a GPU all of them run in Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py). The pool after the call must equal the old path's bit for bit; so must the output
under the interpreter, where both split the KV range alike and run the same arithmetic in one order (on a GPU
the compiled kernels differ, so there the outputs are compared with a tolerance). The half-precision cases
run in bfloat16 on a GPU and in float16 under the interpreter (Triton 3.6's interpreter gets bfloat16
conversions wrong: its rotary kernel already disagrees with torch there, and its attention outputs garbage).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import DEVICE, require_triton_runtime

require_triton_runtime()
from fourfold.config import build_config  # noqa: E402 - after the checks above
from fourfold.infer import attention_gpu, decode_attention_gpu, fused_decoder, fused_ops  # noqa: E402
from fourfold.infer.cuda_graphs import StaticDecodeInputs  # noqa: E402
from fourfold.infer.kv_pool import KVPool  # noqa: E402
from fourfold.infer.model_runner import ModelRunner  # noqa: E402
from fourfold.infer.scheduler import ScheduledChunk  # noqa: E402
from fourfold.infer.sequence import Sequence  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402
from tests.engine_helpers import GREEDY  # noqa: E402
from tests.test_attention_gpu import reference  # noqa: E402

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.fixture(autouse=True)
def triton_rotary(monkeypatch):
    """The old path's rotary is its Triton kernel on CPU tensors too (the interpreter runs it)."""
    monkeypatch.setattr(fused_ops, "_use_triton", lambda x: True)


def rope(d: int, length: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(length).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def make_case(seq_lens, *, hq=4, hkv=2, d=16, block_size=4, extra_blocks=1, dtype=torch.float32, seed=0):
    """A decode step: one new token per sequence at position seq_len - 1, pages shuffled, a scratch last block."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    width = max(needed) + extra_blocks
    num_blocks = sum(needed) + 2  # the last one is scratch: table padding
    scratch = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=gen)
    tables = torch.full((len(seq_lens), width), scratch, dtype=torch.int32)
    used = 0
    for i, count in enumerate(needed):
        tables[i, :count] = order[used:used + count].int()
        used += count
    positions = torch.tensor(seq_lens, dtype=torch.long) - 1
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                          for i, p in enumerate(positions.tolist())], dtype=torch.long)
    cos, sin = rope(d)
    return dict(qkv=torch.randn(len(seq_lens), (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE),
                positions=positions.to(DEVICE), cos=cos, sin=sin,
                k_cache=torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE),
                v_cache=torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE),
                slot_mapping=slots.to(DEVICE), block_tables=tables.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                scale=d ** -0.5, n_heads=hq, n_kv_heads=hkv)


def torch_rotary_pool(c):
    """The pool after rotary_kv_write's plain torch arithmetic (its CPU path), an independent rounding check."""
    k, v = c["k_cache"].clone().cpu(), c["v_cache"].clone().cpu()
    fused_ops.rotary_kv_write(*(x.cpu() for x in (c["qkv"], c["positions"], c["cos"], c["sin"])), k, v,
                              c["slot_mapping"].cpu(), c["n_heads"], c["n_kv_heads"])
    return k, v


def old_path(c):
    """(out, torch reference out, k_cache, v_cache) of rotary_kv_write + paged_attention on copies of the pool."""
    k, v = c["k_cache"].clone(), c["v_cache"].clone()
    q = fused_ops.rotary_kv_write(c["qkv"], c["positions"], c["cos"], c["sin"], k, v, c["slot_mapping"],
                                  c["n_heads"], c["n_kv_heads"])
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    out = attention_gpu.paged_attention(q, k, v, c["block_tables"], c["seq_lens"], starts, c["scale"])
    expected = reference(q.cpu(), k.cpu(), v.cpu(), c["block_tables"].cpu(), c["seq_lens"].cpu(), starts.cpu(),
                         c["scale"])
    return out, expected, k, v


def new_path(c, splits=None):
    """(out, k_cache, v_cache) of decode_attention on copies of the pool. Its torch.empty buffers (output,
    partials) start as NaN: a freed buffer of the old path could otherwise hand it the right partials."""
    k, v = c["k_cache"].clone(), c["v_cache"].clone()
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = poisoned
    try:
        out = decode_attention_gpu.decode_attention(c["qkv"], c["positions"], c["cos"], c["sin"], k, v,
                                                    c["slot_mapping"], c["block_tables"], c["seq_lens"], c["scale"],
                                                    c["n_heads"], c["n_kv_heads"], splits=splits)
    finally:
        torch.empty = empty
    return out, k, v


CASES = [  # (seq_lens, hq, hkv, d, block_size, splits (None: the shapes' default), dtype)
    ([1], 4, 4, 16, 4, None, torch.float32),                      # group 1, one position: the new k/v alone
    ([5, 33, 64, 17], 4, 2, 32, 16, 4, torch.float32),           # group 2; lengths across block and chunk edges
    ([1, 9, 32, 33, 70], 8, 2, 64, 4, 8, HALF),                  # group 4, five sequences, splits past their chunks
    ([40, 3], 4, 2, 16, 4, 1, HALF),                             # one split: no partials, no combine
    ([97], 4, 1, 32, 16, None, torch.float32),                   # default: 8 splits from the table width, 3 empty
]


def split_counts(monkeypatch, forced=None):
    """Record the split count each path allocates for (attention_gpu.split_buffers); `forced` sets the old path's."""
    seen = []
    for module in (attention_gpu, decode_attention_gpu):
        original = module.split_buffers
        monkeypatch.setattr(module, "split_buffers",
                            lambda out, splits, f=original: seen.append(splits) or f(out, splits))
    if forced is not None:
        monkeypatch.setattr(attention_gpu, "decode_splits", lambda programs, max_kv: forced)
    return seen


@pytest.mark.parametrize("seq_lens, hq, hkv, d, block_size, splits, dtype", CASES)
def test_same_pool_and_output_as_rotary_then_paged_attention(seq_lens, hq, hkv, d, block_size, splits, dtype,
                                                             monkeypatch):
    c = make_case(seq_lens, hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype, extra_blocks=3)
    seen = split_counts(monkeypatch, forced=splits)
    want, exact, k_old, v_old = old_path(c)
    got, k_new, v_new = new_path(c, splits)
    assert len(seen) == 2 and seen[0] == seen[1], seen  # the shapes' split rule is attention_gpu's
    assert torch.equal(k_new, k_old) and torch.equal(v_new, v_old)  # rotary and write bit for bit
    with monkeypatch.context() as m:
        m.setattr(fused_ops, "_use_triton", lambda x: False)
        k_torch, v_torch = torch_rotary_pool(c)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    if DEVICE == "cpu" or dtype == torch.bfloat16:   # bf16 products rounded by bit operations, never fused
        assert torch.equal(k_new.cpu(), k_torch) and torch.equal(v_new.cpu(), v_torch)
    else:  # compiled, float32 products may fuse into FMAs: one rounding step of the dtype apart at most
        torch.testing.assert_close(k_new.cpu(), k_torch, **tol)
        torch.testing.assert_close(v_new.cpu(), v_torch, **tol)
    assert got.shape == want.shape and got.dtype == want.dtype
    if DEVICE == "cpu":
        assert torch.equal(got, want)  # same split count: the old path's arithmetic
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), **tol)
    if DEVICE == "cuda" and dtype == torch.float32:
        tol = dict(atol=2e-3, rtol=2e-3)  # float32 tl.dot runs in TF32 on the GPU; the reference in float32
    torch.testing.assert_close(got.cpu().float(), exact.float(), **tol)


def test_the_current_position_is_never_read_from_the_pool():
    # Other splits may run before split 0's pool write lands, so the kernel takes the current position's key
    # and value from registers. Send the write to another slot and poison the one the table points at.
    c = make_case([7, 45, 64], hq=4, hkv=2, d=16, block_size=4)
    want, _, _ = new_path(c, splits=4)
    scratch = c["k_cache"].shape[0] - 1
    poisoned = dict(c, k_cache=c["k_cache"].clone(), v_cache=c["v_cache"].clone(),
                    slot_mapping=torch.full_like(c["slot_mapping"], scratch * 4))
    for slot in c["slot_mapping"].tolist():
        poisoned["k_cache"].view(-1, 2, 16)[slot] = float("nan")
        poisoned["v_cache"].view(-1, 2, 16)[slot] = float("nan")
    got, _, _ = new_path(poisoned, splits=4)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_padded_graph_rows_leave_the_real_rows_alone():
    # Two real sequences in a captured batch of 4, padded as fourfold.infer.cuda_graphs pads them.
    c = make_case([13, 38], hq=4, hkv=2, d=16, block_size=4)
    width = c["block_tables"].shape[1]
    scratch = c["k_cache"].shape[0] - 1
    static = StaticDecodeInputs(4, width, scratch, 4, torch.device(DEVICE))
    step = type("Step", (), dict(tokens=torch.zeros(2, dtype=torch.long, device=DEVICE), positions=c["positions"],
                                 slot_mapping=c["slot_mapping"], block_tables=c["block_tables"],
                                 seq_lens=c["seq_lens"]))
    assert static.load(step) == 2
    padded = dict(c, qkv=torch.cat([c["qkv"], torch.full_like(c["qkv"], 1e4)]), positions=static.positions,
                  slot_mapping=static.slot_mapping, block_tables=static.block_tables, seq_lens=static.seq_lens)
    want, k_want, v_want = new_path(c, splits=4)
    got, k_got, v_got = new_path(padded, splits=4)
    torch.testing.assert_close(got[:2], want, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(got[2:]).all()
    assert torch.equal(k_got[:scratch], k_want[:scratch]) and torch.equal(v_got[:scratch], v_want[:scratch])


def test_split_count_depends_on_shapes_only(monkeypatch):
    # attention_gpu.decode_splits: powers of two up to MAX_SPLITS, about SPLIT_TARGET_PROGRAMS programs in all.
    assert attention_gpu.decode_splits(1 * 4, 2048) == attention_gpu.MAX_SPLITS
    assert attention_gpu.decode_splits(1 * 4, 5 * 32) == 8  # the next power of two of the 5 chunks
    assert attention_gpu.decode_splits(1 * 4, 1) == 1
    assert attention_gpu.decode_splits(64 * 4, 2048) == attention_gpu.SPLIT_TARGET_PROGRAMS // (64 * 4)
    # decode_attention follows the table width, not the sequence lengths: a longer sequence splits alike.
    seen = split_counts(monkeypatch)
    new_path(make_case([2, 5], hq=4, hkv=2, d=16, block_size=4, extra_blocks=30))
    new_path(make_case([100, 5], hq=4, hkv=2, d=16, block_size=4, extra_blocks=7))
    assert seen == [attention_gpu.decode_splits(2 * 2, 32 * 4)] * 2 == [4, 4]
    assert not decode_attention_gpu.supports(24, 4, 2) and not decode_attention_gpu.supports(16, 6, 4)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors through Triton's interpreter; on a GPU the same path runs "
                    "end to end in bench/engine_parity_gpu.py")
def test_fused_decoder_decode_step_through_with_rotary(monkeypatch):
    # The runner's with_rotary (normally attached on CUDA) gives the fused decoder the same logits and pool.
    torch.manual_seed(0)
    cfg = build_config({"model": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=32,
                                      max_seq_len=64, init_std=0.4), "train": {"seq_len": 32}}).model
    model = Llama(cfg).eval()
    pool = KVPool(cfg.n_layers, 16, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, pool, torch.device("cpu"), fuse=True)
    seqs = [Sequence(str(i), p, GREEDY, i) for i, p in enumerate([[1, 2, 3, 4, 5, 6], [7, 8]])]
    for i, seq in enumerate(seqs):
        seq.block_table = [4 * i, 4 * i + 1]
    runner.forward(runner.prepare([ScheduledChunk(s, len(s.prompt_ids), True) for s in seqs]))  # prefill
    for s in seqs:
        s.num_computed = len(s.prompt_ids)
        s.output_ids.append(9)
    st = runner.prepare([ScheduledChunk(s, 1, True) for s in seqs])
    before = pool.keys.clone(), pool.values.clone()
    want = runner.fused(st, pool, runner._attend_fn(st))
    want_pool = pool.keys.clone(), pool.values.clone()
    pool.keys.copy_(before[0])
    pool.values.copy_(before[1])
    calls = []
    attend = runner._attend_fn(st)
    with_rotary = ModelRunner._decode_attend_fn(st, attend)
    attend.with_rotary = lambda *a: calls.append(a[0]) or with_rotary(*a)
    monkeypatch.setattr(fused_decoder, "FUSED_DECODE_ATTENTION", True)   # off by default (see fused_decoder)
    got = runner.fused(st, pool, attend)
    assert calls == [0, 1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool.keys[0], want_pool[0][0]) and torch.equal(pool.values[0], want_pool[1][0])
    torch.testing.assert_close(pool.keys, want_pool[0], atol=1e-4, rtol=1e-4)  # layer 1's input moved a little
    monkeypatch.setattr(fused_decoder, "FUSED_DECODE_ATTENTION", False)  # the A/B switch: old path
    runner.fused(st, pool, attend)
    assert calls == [0, 1]
