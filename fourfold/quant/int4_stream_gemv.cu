// One-token-row int4 weight-only GEMV that streams its weight through a shared-memory ring, for weights too large
// for int4_mma_gemv.cu's one block per 16 output rows to keep HBM busy (compiled by NVRTC after
// int4_mma_common.cuh's helpers; fourfold/quant/int4_stream.py documents why and when).
//
// Compile-time settings (-D): WARPS (warps of a block), RING (64-wide K quads a warp keeps in flight, a power of
// two), MAXQ (most quads a warp takes of one tile), GS (16-wide k-steps per quantization group), GATED, NORM, RES,
// BIAS, PDL (0/1 each).
// The grid has at most one block per 16-row tile and takes the tiles in grid-stride order (GATED: a tile is the
// gate rows and the matching up rows). In every tile each warp takes the same group-aligned K range as
// int4_mma_gemv's warps (SPLIT = 1, same WARPS), so the sums, their order and the result are the same. A warp's
// weight words for all of its tiles form one stream: each lane copies its 16 bytes of a quad into its own slot of
// the ring with cp.async (one commit group per quad, RING of them in flight; the first RING before the PDL wait)
// and reads back only its own slots, so the ring needs no barrier. x (normed when NORM) is staged once in shared
// memory at the lane positions of load_x_quad, every column of the mma's B equal to the one token row, so the
// column that matters is computed as in int4_mma_gemv; the sums of x per quantization group, which int4_mma_gemv
// takes with a second mma at every k-step, are taken once. A tile's warps meet at one barrier; warp 0 adds their sums
// in warp order and runs the epilogue while the others go on with the next tile (two reduction buffers).

#define MAXG ((MAXQ * 4 + GS - 1) / GS)
#define NRED (4 + 4 * GATED + 2 * NORM)
#define PARTS (1 + GATED)
#ifndef NO_MATH
#define NO_MATH 0
#endif

// the scale words of the lane's rows (g, g + 8; GATED: and their up rows) for its groups of 16-row tile rb
__device__ __forceinline__ void load_tile_scales(u32 (*sc)[MAXG], const u32* scale_words, int rb, int g, int groups,
                                                 int grp0, int ngrp, int up_rows) {
    const int row0 = rb * 16 + g;
#pragma unroll
    for (int i = 0; i < MAXG; ++i) {
        if (i < ngrp) {
            sc[0][i] = load_early(scale_words + (size_t)row0 * groups + grp0 + i);
            sc[1][i] = load_early(scale_words + (size_t)(row0 + 8) * groups + grp0 + i);
#if GATED
            sc[2][i] = load_early(scale_words + (size_t)(row0 + up_rows) * groups + grp0 + i);
            sc[3][i] = load_early(scale_words + (size_t)(row0 + 8 + up_rows) * groups + grp0 + i);
#endif
        }
    }
}

// flush_group for the one token row (the mma's column 0: registers 0 and 2) with the group's sum of x given:
// the same operations on the same values as flush_group, so the same result
__device__ __forceinline__ void flush_group_row(float* tot, const float (*acc)[4], float xsum, u32 sc_lo, u32 sc_hi) {
    const float s0 = __uint_as_float(sc_lo & 0xFFFF0000u), c0 = (float)(sc_lo & 0xFFFFu);
    const float s1 = __uint_as_float(sc_hi & 0xFFFF0000u), c1 = (float)(sc_hi & 0xFFFFu);
    const float a0 = acc[0][0] + acc[1][0], a2 = acc[0][2] + acc[1][2];
    tot[0] += s0 * (a0 - c0 * xsum);
    tot[2] += s1 * (a2 - c1 * xsum);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
int4_stream_gemv(const uint4* __restrict__ words, const u32* __restrict__ scale_words, const u16* x,
                 const u16* __restrict__ norm_weight, const u16* __restrict__ bias, const u16* res, u16* out,
                 int k, int up_rows, float eps) {
#if PDL
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int quads = k >> 6, groups = k / (GS * 16);
    const int unit = GS > 4 ? GS / 4 : 1;                      // quads per group-aligned unit
    const int units = quads / unit;
    const int q0 = (warp * units / WARPS) * unit, nq = ((warp + 1) * units / WARPS) * unit - q0;
    const int grp0 = q0 * 4 / GS, ngrp = nq * 4 / GS;
    const int tiles = up_rows >> 4;
    const int my_tiles = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int total = my_tiles * nq;                           // quads in this warp's stream

    extern __shared__ uint4 dyn[];
    uint4* const own = dyn + (size_t)warp * RING * PARTS * 32 + lane;   // this lane's ring slots
    uint4* const xstage = dyn + (size_t)WARPS * RING * PARTS * 32;       // [quad][t][2]: x at lane t's positions

    // the stream, issued in order: slot s holds quad s % nq of the warp's tile s / nq
    int issued = 0, next_tile = 0, next_q = 0;
    auto issue = [&]() {
        if (issued < total) {
            const size_t rb = blockIdx.x + (size_t)next_tile * gridDim.x;
            uint4* slot = own + (issued & (RING - 1)) * PARTS * 32;
            copy_async16(slot, words + (rb * quads + q0 + next_q) * 32 + lane);
#if GATED
            copy_async16(slot + 32, words + ((rb + tiles) * quads + q0 + next_q) * 32 + lane);
#endif
            if (++next_q == nq) {
                next_q = 0;
                ++next_tile;
            }
        }
        ++issued;
        copy_commit();   // one group per slot, empty past the stream's end, so the wait below is a constant
    };
#pragma unroll
    for (int i = 0; i < RING; ++i) issue();
    u32 sc[2 * PARTS][MAXG], next_sc[2 * PARTS][MAXG];
    load_tile_scales(next_sc, scale_words, blockIdx.x, g, groups, grp0, ngrp, up_rows);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

    // x once: the warp's quads, normed; lanes g == 0 store them, every lane reads its t's words. The sum of x over
    // each of the warp's groups is the same in every tile: taken here once, by int4_mma_gemv's mma with A = ones
    float sq[4] = {0.f, 0.f, 0.f, 0.f};   // squares of x (NORM)
    float xsum[MAXG], xs[2][4];
#pragma unroll
    for (int i = 0; i < MAXQ; ++i) {
        if (i < nq) {
            u32 xq[4][2];
            load_x_quad(xq, x, 0, 0, t, 1, (q0 + i) * 64);
#if NORM
            const uint4* nwp = (const uint4*)(norm_weight + (q0 + i) * 64 + 8 * t);
            norm_quad(xq, nwp[0], nwp[4], sq);   // nwp[4]: 32 bf16 further
#endif
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int step = i * 4 + j;
                if (step % GS == 0) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) xs[0][e] = xs[1][e] = 0.f;
                }
                mma_bf16(xs[j & 1], ONES, ONES, ONES, ONES, xq[j][0], xq[j][1]);
                if ((step + 1) % GS == 0) xsum[step / GS] = xs[0][0] + xs[1][0];
            }
            if (g == 0) {
                xstage[((q0 + i) * 4 + t) * 2] = make_uint4(xq[0][0], xq[0][1], xq[1][0], xq[1][1]);
                xstage[((q0 + i) * 4 + t) * 2 + 1] = make_uint4(xq[2][0], xq[2][1], xq[3][0], xq[3][1]);
            }
        }
    }
    __syncwarp();

    __shared__ float red[2][NRED][WARPS][32];   // a tile's sums per warp; two, so one barrier a tile suffices
    int s = 0;
    for (int ti = 0; ti < my_tiles; ++ti) {
        const int rb = blockIdx.x + ti * gridDim.x;
#pragma unroll
        for (int a = 0; a < 2 * PARTS; ++a) {
#pragma unroll
            for (int i = 0; i < MAXG; ++i) sc[a][i] = next_sc[a][i];
        }
        if (ti + 1 < my_tiles) load_tile_scales(next_sc, scale_words, rb + gridDim.x, g, groups, grp0, ngrp, up_rows);
        float res_v[2] = {0.f, 0.f}, bias_v[2 * PARTS];
        if (warp == 0) {   // the epilogue's inputs, read early
#if RES
            res_v[0] = bf16_to_float(res[rb * 16 + g]);
            res_v[1] = bf16_to_float(res[rb * 16 + g + 8]);
#endif
#if BIAS
            bias_v[0] = bf16_to_float(bias[rb * 16 + g]);
            bias_v[1] = bf16_to_float(bias[rb * 16 + g + 8]);
#if GATED
            bias_v[2] = bf16_to_float(bias[rb * 16 + g + up_rows]);
            bias_v[3] = bf16_to_float(bias[rb * 16 + g + 8 + up_rows]);
#endif
#endif
        }

        // two chains of mma sums (even and odd k-steps), as int4_mma_gemv
        float tot[4] = {0.f, 0.f, 0.f, 0.f}, acc[2][4];
#if GATED
        float totu[4] = {0.f, 0.f, 0.f, 0.f}, accu[2][4];
#endif
#pragma unroll
        for (int i = 0; i < MAXQ; ++i) {
            if (i < nq) {
                asm volatile("cp.async.wait_group %0;" :: "n"(RING - 1) : "memory");   // slot s has landed
                const uint4* slot = own + (s & (RING - 1)) * PARTS * 32;
                const uint4 wgi = slot[0];
#if GATED
                const uint4 wui = slot[32];
#endif
                const uint4 xlo = xstage[((q0 + i) * 4 + t) * 2], xhi = xstage[((q0 + i) * 4 + t) * 2 + 1];
                const u32 xb[4][2] = {{xlo.x, xlo.y}, {xlo.z, xlo.w}, {xhi.x, xhi.y}, {xhi.z, xhi.w}};
#if NO_MATH   // timing probe: the stream without the sums
                tot[0] += __uint_as_float((wgi.x ^ wgi.y ^ wgi.z ^ wgi.w ^ xb[0][0]) & 0x3FFFFFu);
                issue();
                ++s;
                continue;
#endif
                const u32 wq[4] = {wgi.x, wgi.y, wgi.z, wgi.w};
#if GATED
                const u32 uq[4] = {wui.x, wui.y, wui.z, wui.w};
#endif
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int step = i * 4 + j;   // k-step within the warp's range (which starts on a group)
                    if (step % GS == 0) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
#pragma unroll
                            for (int c = 0; c < 2; ++c) {
                                acc[c][e] = 0.f;
#if GATED
                                accu[c][e] = 0.f;
#endif
                            }
                        }
                    }
                    const u32 w = wq[j];
                    mma_int4(acc[j & 1], w, xb[j]);
#if GATED
                    const u32 v = uq[j];
                    mma_int4(accu[j & 1], v, xb[j]);
#endif
                    if ((step + 1) % GS == 0) {
                        flush_group_row(tot, acc, xsum[step / GS], sc[0][step / GS], sc[1][step / GS]);
#if GATED
                        flush_group_row(totu, accu, xsum[step / GS], sc[2][step / GS], sc[3][step / GS]);
#endif
                    }
                }
                issue();   // the slot just read takes the quad RING ahead (its words are in registers by now)
                ++s;
            }
        }

        float (*r)[WARPS][32] = red[ti & 1];
        const float sums[NRED] = {tot[0], tot[1], tot[2], tot[3],
#if GATED
                                  totu[0], totu[1], totu[2], totu[3],
#endif
#if NORM
                                  sq[0], sq[1],
#endif
        };
        store_warp_sums<NRED, WARPS>(r, sums, warp, lane);
        __syncthreads();
        if (warp != 0) continue;
        float v[NRED];
        add_warp_sums<NRED, WARPS>(v, r, lane);
#if NORM
        const float rstd = rsqrtf(__shfl_sync(0xFFFFFFFFu, v[4 + 4 * GATED], 0) / k + eps);   // token 0: lane 0
#endif
        if (t != 0) continue;   // the token row is the mma's column 0: registers 0 (row g) and 2 (row g + 8)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float y = v[2 * h];
#if NORM
            y *= rstd;
#endif
#if BIAS
            y += bias_v[h];
#endif
#if GATED
            float up = v[4 + 2 * h];
#if NORM
            up *= rstd;
#endif
#if BIAS
            up += bias_v[2 + h];
#endif
            y = silu_mul_rounded(y, up);
#endif
#if RES
            y = round_bf16(y) + res_v[h];
#endif
            out[rb * 16 + g + 8 * h] = float_to_bf16(y);
        }
    }
}
