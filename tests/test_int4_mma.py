"""The tensor-core int4 GEMV's weight layout and scale words (fourfold.quant.int4_mma), checked on CPU by playing
the mma's fragment rules over the packed words; the kernel itself runs where CUDA and cuda-bindings are."""

import pytest
import torch

from fourfold.ops import nvrtc_launch
from fourfold.quant import int4_mma
from fourfold.quant.fake_quant import dequantize_weight, quantize_weight
from fourfold.quant.packing import Int4WeightLinear, pack_int4
from fourfold.quant.schemes import scheme_by_name


def _bf16_pair(reg: int) -> tuple[float, float]:
    """The two bf16 numbers of a 32-bit register (low half first), as floats."""
    t = torch.tensor([reg & 0xFFFF, reg >> 16], dtype=torch.int32) << 16
    return tuple(t.view(torch.float32).tolist())


def _emulated_gemv(words: torch.Tensor, sw: torch.Tensor, x: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """y = x @ W.T computed the kernel's way: per lane and k-step, the LOP3 registers as the mma's A fragment,
    x at the lane's slots as B, the m16n8k16 fragment rules, then each group's s * (sum - (136 + z) * sum x)."""
    m, k = x.shape
    w = words.to(torch.int64).reshape(n // 16, k // 64, 32, 4) & 0xFFFFFFFF
    v = sw.to(torch.int64) & 0xFFFFFFFF
    scale = ((v >> 16) << 16).to(torch.int32).view(torch.float32).double()
    offset = (v & 0xFFFF).double()
    y = torch.zeros(m, n, dtype=torch.float64)
    for b in range(n // 16):
        for q in range(k // 64):
            for j in range(4):
                dot = torch.zeros(16, m, dtype=torch.float64)    # D rows (weight rows) x columns (tokens)
                xsum = torch.zeros(m, dtype=torch.float64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    word = int(w[b, q, lane, j])
                    regs = [_bf16_pair(((word >> (4 * i)) & 0x000F000F) | 0x43004300) for i in range(4)]
                    base = 64 * q + 32 * (j >> 1) + 8 * t + 4 * (j & 1)   # b0: x[base, base+1], b1: x[base+2, +3]
                    for kl in range(2):
                        # A: reg0 (row g, slot 2t+kl), reg1 (row g+8, 2t+kl), reg2 (g, 2t+8+kl), reg3 (g+8, 2t+8+kl)
                        for reg, row, xk in ((0, g, base + kl), (1, g + 8, base + kl),
                                             (2, g, base + 2 + kl), (3, g + 8, base + 2 + kl)):
                            dot[row] += regs[reg][kl] * x[:, xk].double()
                        if g == 0:
                            xsum += x[:, base + kl].double() + x[:, base + 2 + kl].double()
                grp = (64 * q + 32 * (j >> 1)) // group
                rows = torch.arange(16 * b, 16 * b + 16)
                y[:, rows] += (scale[rows, grp, None] * (dot - offset[rows, grp, None] * xsum[None, :])).T
    return y


@pytest.mark.parametrize("scheme", ["int4-g32", "int4-g64-asym", "int4-g128"])
def test_fragment_emulation_matches_the_dequantized_matmul(scheme):
    torch.manual_seed(0)
    n, k, m = 32, 128, 3
    s = scheme_by_name(scheme)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    q, scales, zeros = quantize_weight(weight, s)
    words = int4_mma.repack_mma(pack_int4((q.to(torch.int16) + 8)))
    sw = int4_mma.scale_words(scales.to(torch.bfloat16), zeros)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    ref = x.double() @ dequantize_weight(q, scales, zeros, s).double().T
    got = _emulated_gemv(words, sw, x, n, s.group_size)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_repack_round_trips_and_places_each_nibble():
    torch.manual_seed(1)
    u = torch.randint(0, 16, (48, 192), dtype=torch.uint8)
    words = int4_mma.repack_mma(pack_int4(u))
    assert words.shape == (3, 3 * 128) and words.dtype == torch.int32
    assert torch.equal(int4_mma.unpack_mma(words, 48, 192), u)
    word = int(words.view(3, 3, 32, 4)[2, 1, 4 * 5 + 3, 2]) & 0xFFFFFFFF    # block 2, quad 1, g 5, t 3, k-step 2
    for p in range(8):
        row = 32 + 5 + 8 * (p & 1)
        col = 64 + 32 + 8 * 3 + 2 * ((p >> 1) & 1) + (p >> 2)
        assert (word >> (4 * p)) & 0xF == u[row, col]


def test_scale_words_hold_the_bf16_scale_and_the_offset():
    scales = torch.tensor([[0.0123, 3.5], [-0.25, 1e-3]]).to(torch.bfloat16)
    zeros = torch.tensor([[0, -8], [7, 3]], dtype=torch.int8)
    v = int4_mma.scale_words(scales, zeros).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(((v >> 16) << 16).to(torch.int32).view(torch.float32), scales.float())
    assert torch.equal((v & 0xFFFF) - 136, zeros.to(torch.int64))
    with pytest.raises(ValueError, match="bf16 scales"):
        int4_mma.scale_words(scales.float(), zeros)


def test_bad_shapes_and_unsupported_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        int4_mma.repack_mma(torch.zeros(24, 64, dtype=torch.uint8))
    scales = torch.ones(32, 1, dtype=torch.bfloat16)
    assert not int4_mma.supports(torch.zeros(1, 128, dtype=torch.bfloat16), scales, 128, 32)     # CPU tensor
    assert int4_mma.config(2048, 128) == (16, 2, 1) and int4_mma.config(5632, 128, gated=False) == (16, 6, 1)
    assert int4_mma.config(2048, 128, gated=True) == (8, 4, 1) and int4_mma.config(2048, 256, warps=32) == (32, 4, 1)
    # llama3-8b's down projection (K 14336): 14 quads a warp in one 16-warp block would spill, so K splits over
    # 10 blocks of 4 warps; its gate|up (K 4096, gated) over 3
    assert int4_mma.config(14336, 128) == (4, 6, 10) and int4_mma.config(14336, 128, split=2) == (16, 8, 2)
    assert int4_mma.config(4096, 128, gated=True) == (4, 6, 3) and int4_mma.config(4096, 128) == (16, 4, 1)
    with pytest.raises(ValueError, match="workspace"):
        int4_mma.int4_mma_gemv(torch.zeros(1, 14336, dtype=torch.bfloat16), torch.zeros(2, 224 * 128, dtype=torch.int32),
                               torch.zeros(32, 112, dtype=torch.int32), 128)


def test_multi_tile_configs():
    # 9-16 token rows: two tiles of x; the gated form then takes 4 warps of at most 4 quads (K over 2 blocks)
    assert int4_mma.MAX_ROWS == int4_mma.MAX_TILES * int4_mma.TILE_ROWS == 32
    assert int4_mma.config(5632, 128, rows=16) == int4_mma.config(5632, 128, rows=8) == (16, 6, 1)
    assert int4_mma.config(2048, 128, rows=12) == (16, 2, 1)
    assert int4_mma.config(2048, 128, True, rows=16) == (4, 4, 2) and int4_mma.config(2048, 128, True) == (8, 4, 1)
    # 17-32 rows run staged (MANY_TILES_STAGED: llama-1b's down 8 warps of 6 quads over 2 blocks, gate|up 4 of 8);
    # the register form's fallback takes 2 quads a warp (gated: 4 warps, so that their sums fit)
    assert int4_mma.use_staged(2048, 5632, 17) and int4_mma.use_staged(2560, 2048, 32)
    assert int4_mma.staged_config(5632, 128, rows=32) == (8, 6, 2)
    assert int4_mma.staged_config(2048, 128, True, rows=24) == (4, 8, 1)
    assert int4_mma.staged_config(2048, 128, True, rows=8) == int4_mma.staged_config(2048, 128, True) == (8, 4, 1)
    assert int4_mma.use_staged(2048, 5632, 9) and not int4_mma.use_staged(2048, 5632, 8)
    assert int4_mma.config(5632, 128, rows=32) == (16, 2, 3) and int4_mma.config(2048, 128, True, rows=24) == (4, 2, 4)


def test_centred_weights_rule_and_reduction_limit(monkeypatch):
    monkeypatch.setattr(int4_mma, "CENTERED_MODE", "auto")   # one tile: the sum-of-x mma; more: centred weights
    assert not int4_mma.centered(8) and int4_mma.centered(9) and int4_mma.centered(32)
    monkeypatch.setattr(int4_mma, "CENTERED_MODE", "0")
    assert not int4_mma.centered(32)
    # the warps' sums of a gated, normed launch at 4 tiles: 40 floats a lane, so 16 warps exceed 48 KiB
    assert int4_mma.reduction_bytes(16, 32, gated=True, norm=True) == 40 * 16 * 32 * 4 > int4_mma.MAX_REDUCTION_BYTES
    assert int4_mma.reduction_bytes(16, 32, gated=False, norm=True) <= int4_mma.MAX_REDUCTION_BYTES
    with pytest.raises(ValueError, match="fewer warps"):
        int4_mma.int4_mma_gemv(torch.zeros(32, 2048, dtype=torch.bfloat16), torch.zeros(16, 32 * 128, dtype=torch.int32),
                               torch.zeros(256, 16, dtype=torch.int32), 128, gated=True,
                               norm_weight=torch.ones(2048, dtype=torch.bfloat16), launch_config=(16, 2, 1))


def test_staged_configs_and_their_shared_memory():
    # weights through shared memory: 8 warps of at most 8 quads, K split past that (llama3-8b's down: 4 blocks)
    assert int4_mma.staged_config(4096, 128, gated=True) == (8, 8, 1)
    assert int4_mma.staged_config(14336, 128) == (8, 8, 4) and int4_mma.staged_config(2048, 128) == (8, 4, 1)
    assert int4_mma.staged_config(14336, 128, warps=4, max_quads=16) == (4, 14, 4)
    assert int4_mma.staged_shared_bytes(8, 8, gated=True) == 8 * 8 * 2 * 512
    assert int4_mma.min_blocks(8) == 2 and int4_mma.min_blocks(4) == 4 and int4_mma.min_blocks(32) == 1
    with pytest.raises(ValueError, match="shared memory"):
        int4_mma.int4_mma_gemv(torch.zeros(1, 16384, dtype=torch.bfloat16), torch.zeros(2, 256 * 128, dtype=torch.int32),
                               torch.zeros(32, 128, dtype=torch.int32), 128, gated=True, staged=True,
                               launch_config=(8, 32, 1))


def test_staged_rule_follows_the_mode(monkeypatch):
    monkeypatch.setattr(int4_mma, "STAGE_MODE", "auto")   # 2-8 rows, every weight of a model of width 4096
    assert int4_mma.use_staged(28672, 4096, 8) and int4_mma.use_staged(4096, 14336, 2)
    assert int4_mma.use_staged(6144, 4096, 8) and int4_mma.use_staged(4096, 4096, 3)
    assert not int4_mma.use_staged(28672, 4096, 1) and not int4_mma.use_staged(11264, 2048, 8)
    assert not int4_mma.use_staged(2048, 5632, 8)
    monkeypatch.setattr(int4_mma, "STAGE_MODE", "0")
    assert not int4_mma.use_staged(28672, 4096, 8)
    monkeypatch.setattr(int4_mma, "STAGE_MODE", "1")
    assert int4_mma.use_staged(2560, 2048, 1)


@pytest.mark.skipif(not nvrtc_launch.available(), reason="needs cuda-bindings (NVRTC)")
@pytest.mark.parametrize("split,stage,ntile,subz", [(1, 0, 1, 0), (3, 0, 1, 0), (1, 1, 1, 0), (3, 1, 1, 0), (1, 0, 2, 0),
                                                    (3, 1, 2, 1), (1, 0, 1, 1), (3, 0, 4, 1), (1, 1, 3, 1)])
def test_kernel_compiles_for_hopper_without_a_gpu(split, stage, ntile, subz):
    defines = {"WARPS": 16 if ntile < 3 else 4, "MAXQ": 2, "GS": 8, "SPLIT": split, "GATED": 1, "NORM": 1, "RES": 1,
               "BIAS": 1, "PDL": 1, "STAGE": stage, "MINB": 2 if stage else 1, "NTILE": ntile, "SUBZ": subz}
    try:
        cubin = nvrtc_launch.compile_cubin(int4_mma._source(), "int4_mma_gemv", defines, "sm_90")
    except Exception as e:  # noqa: BLE001 - cuda-bindings without the NVRTC library
        pytest.skip(f"NVRTC unavailable: {e}")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(not (torch.cuda.is_available() and nvrtc_launch.available()), reason="needs CUDA + cuda-bindings")
@pytest.mark.parametrize("rows", [1, 5, 8, 12, 16, 20, 32])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("centred", [False, True])
def test_kernel_matches_the_dequantized_matmul_on_gpu(rows, split, staged, centred):
    torch.manual_seed(2)
    s = scheme_by_name("int4-g128-asym")
    lin = torch.nn.Linear(1024, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = Int4WeightLinear.from_float(lin, s).cuda()
    q, scales, zeros = quantize_weight(lin.weight, s)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize_weight(q, scales, zeros, s).float().T + r.float()
    launch = (int4_mma.staged_config(1024, 128, split=split) if staged
              else int4_mma.config(1024, 128, split=split, rows=rows))
    y = int4_mma.int4_mma_gemv(x, *mod.mma_words(), 128, residual=r, launch_config=launch,
                               workspace=mod.mma_workspace(split), staged=staged, centered_weights=centred)
    assert (y.float() - ref).norm() / ref.norm() < 1e-2
