// Tensor-core int4 weight-only GEMV for decode steps of up to 32 token rows (compiled at run time by NVRTC:
// fourfold/quant/int4_mma.py, which documents the weight layout and the arithmetic).
//
// Compile-time settings (-D): WARPS (warps of a block, which split K), MAXQ (most 64-wide K quads a warp
// takes), GS (16-wide k-steps per quantization group), SPLIT (blocks that split K), GATED, NORM, RES, BIAS, PDL
// (0/1 each), NTILE (8-token tiles: token rows 8 * tile + g are the mma's columns of tile `tile`; each weight
// fragment is used once per tile; 1-4), SUBZ (0/1: centred weights, below), NCHAIN (chains of mma sums a tile;
// default 2 for one tile, 1 for more, whose tiles are independent chains already), STAGE (0: a warp's weights wait
// in registers; 1: they are copied into dynamic shared memory with cp.async, one commit group per quad, and x is read
// quad by quad: far fewer registers, so many more blocks of a wide weight are resident and keep loads in flight) and
// MINB (blocks per SM the register budget must allow).
// SPLIT blocks own one 16-row block of the output (GATED: the gate rows and the matching up rows);
// with SPLIT > 1 each stores its float32 sums, and the last to finish (a ticket per row block) adds them in split
// order, so the result does not depend on which finished last, and runs the epilogue. Each warp
// runs mma.m16n8k16 (bf16 in, float32 sums) over its K range: the A operand is the weight, whose 8 nibbles per
// lane and k-step sit in one 32-bit word in fragment order, so each bf16x2 register is one LOP3 (nibble u
// becomes the bf16 128 + u); the B operand is x, token rows as the 8 columns. A second mma with A = ones gives
// sum(x) per group, which removes the 128 + 8 + zero-point offset when a group's scale is applied; with SUBZ the
// offset comes off the A registers instead (one bf16x2 FMA each, exact) and that mma goes. The A registers of a
// k-step are made once and used by every tile.
// (Compiled after int4_mma_common.cuh's helpers.)

#ifndef STAGE
#define STAGE 0
#endif
#ifndef MINB
#define MINB 1
#endif
#ifndef NTILE
#define NTILE 1
#endif
#ifndef SUBZ
#define SUBZ 0
#endif
#ifndef NCHAIN
#define NCHAIN (NTILE > 1 ? 1 : 2)
#endif

#define MAXG ((MAXQ * 4 + GS - 1) / GS)
#define NVAL (4 + 4 * GATED + 2 * NORM)   // sums a lane holds per token tile
#define NRED (NVAL * NTILE)

#if MINB > 1
#define BOUNDS __launch_bounds__(WARPS * 32, MINB)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)
#endif

extern "C" __global__ void BOUNDS
int4_mma_gemv(const uint4* __restrict__ words, const u32* __restrict__ scale_words, const u16* x,
              const u16* __restrict__ norm_weight, const u16* __restrict__ bias, const u16* res, u16* out,
              float* partial, int* tickets,
              int m, int k, int up_rows, int stride_x, int stride_res, int stride_out, float eps) {
#if PDL
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rb = blockIdx.x / SPLIT, split = blockIdx.x % SPLIT;
    const int quads = k >> 6, groups = k / (GS * 16);
    const int unit = GS > 4 ? GS / 4 : 1;                      // quads per group-aligned unit
    const int units = quads / unit;
    // this block's units, then this warp's share of them
    const int u0 = split * units / SPLIT, bunits = (split + 1) * units / SPLIT - u0;
    const int q0 = (u0 + warp * bunits / WARPS) * unit, nq = (u0 + (warp + 1) * bunits / WARPS) * unit - q0;
    const int grp0 = q0 * 4 / GS, ngrp = nq * 4 / GS;
    const int row0 = rb * 16 + g, row1 = row0 + 8;

    // everything that does not depend on the previous kernel is loaded before waiting for it
#if GATED
    const int rbu = rb + up_rows / 16;
#endif
#if STAGE
    // [warp][quad][gate, up][lane]: each lane copies, and later reads back, only its own 16 bytes, so the
    // cp.async waits below need no barrier
    extern __shared__ uint4 staged[];
    const uint4* own = staged + (size_t)warp * MAXQ * (1 + GATED) * 32 + lane;
#pragma unroll
    for (int i = 0; i < MAXQ; ++i) {
        if (i < nq) {
            copy_async16((void*)(own + i * (1 + GATED) * 32), words + ((size_t)rb * quads + q0 + i) * 32 + lane);
#if GATED
            copy_async16((void*)(own + (i * 2 + 1) * 32), words + ((size_t)rbu * quads + q0 + i) * 32 + lane);
#endif
        }
        copy_commit();   // one group per quad (empty past nq), so quad i waits only for its own copies
    }
#else
    uint4 wg[MAXQ];
#if GATED
    uint4 wu[MAXQ];
#endif
#pragma unroll
    for (int i = 0; i < MAXQ; ++i) {
        if (i < nq) {
            wg[i] = load_early_v4(words + ((size_t)rb * quads + q0 + i) * 32 + lane);
#if GATED
            wu[i] = load_early_v4(words + ((size_t)rbu * quads + q0 + i) * 32 + lane);
#endif
        }
    }
#endif
    u32 sg0[MAXG], sg1[MAXG];
#if GATED
    u32 su0[MAXG], su1[MAXG];
#endif
#pragma unroll
    for (int i = 0; i < MAXG; ++i) {
        if (i < ngrp) {
            sg0[i] = load_early(scale_words + (size_t)row0 * groups + grp0 + i);
            sg1[i] = load_early(scale_words + (size_t)row1 * groups + grp0 + i);
#if GATED
            su0[i] = load_early(scale_words + (size_t)(row0 + up_rows) * groups + grp0 + i);
            su1[i] = load_early(scale_words + (size_t)(row1 + up_rows) * groups + grp0 + i);
#endif
        }
    }
#if NORM && !STAGE
    uint4 nwq[MAXQ][2];   // the norm weight at the lane's x positions (load_x_quad)
#pragma unroll
    for (int i = 0; i < MAXQ; ++i) {
        if (i < nq) {
            const u16* p = norm_weight + (q0 + i) * 64 + 8 * t;
            nwq[i][0] = load_early_v4((const uint4*)p);
            nwq[i][1] = load_early_v4((const uint4*)(p + 32));
        }
    }
#endif
#if BIAS
    float bias_v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) bias_v[e] = bf16_to_float(bias[e < 2 ? row0 : row1]);
#if GATED
    float bias_u[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) bias_u[e] = bf16_to_float(bias[(e < 2 ? row0 : row1) + up_rows]);
#endif
#endif
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

#if !STAGE
    // all of the warp's x at once, each token tile's (STAGE reads it quad by quad in the main loop); written out
    // rather than through load_x_quad, which gave this form slightly different machine code
    u32 xb[NTILE][MAXQ * 4][2];
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt) {
#pragma unroll
        for (int i = 0; i < MAXQ; ++i) {
            uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
            if (i < nq && 8 * tt + g < m) {
                const u16* p = x + (size_t)(8 * tt + g) * stride_x + (q0 + i) * 64 + 8 * t;
                lo = *(const uint4*)p;
                hi = *(const uint4*)(p + 32);
            }
            u32 (*b)[2] = xb[tt] + i * 4;
            b[0][0] = lo.x; b[0][1] = lo.y; b[1][0] = lo.z; b[1][1] = lo.w;
            b[2][0] = hi.x; b[2][1] = hi.y; b[3][0] = hi.z; b[3][1] = hi.w;
        }
    }
#endif
#if RES
    float res_v[NTILE][4];
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * tt + 2 * t + (e & 1);
            res_v[tt][e] = warp == 0 && col < m ? bf16_to_float(res[(size_t)col * stride_res + (e < 2 ? row0 : row1)])
                                                : 0.f;
        }
    }
#endif
#if NORM
    float sq[NTILE][4];   // squares of x per token
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sq[tt][e] = 0.f;
#if !STAGE
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt) {
#pragma unroll
        for (int i = 0; i < MAXQ; ++i) {
            if (i < nq) norm_quad(xb[tt] + i * 4, nwq[i][0], nwq[i][1], sq[tt]);
        }
    }
#endif
#endif

    // NCHAIN chains of mma sums (k-step j adds to chain j % NCHAIN) so consecutive mmas do not wait for each other;
    // with two tiles or more the tiles' sums are independent chains already
    float tot[NTILE][4], acc[NTILE][NCHAIN][4];
#if !SUBZ
    float xs[NTILE][NCHAIN][4];
#endif
#if GATED
    float totu[NTILE][4], accu[NTILE][NCHAIN][4];
#endif
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            tot[tt][e] = 0.f;
#if GATED
            totu[tt][e] = 0.f;
#endif
        }
#pragma unroll
    for (int i = 0; i < MAXQ; ++i) {
        if (i < nq) {
#if STAGE
            u32 xq[NTILE][4][2];
#pragma unroll
            for (int tt = 0; tt < NTILE; ++tt)
                load_x_quad(xq[tt], x + (size_t)8 * tt * stride_x, stride_x, g, t, m - 8 * tt, (q0 + i) * 64);
#if NORM
            const uint4* nwp = (const uint4*)(norm_weight + (q0 + i) * 64 + 8 * t);
#pragma unroll
            for (int tt = 0; tt < NTILE; ++tt) norm_quad(xq[tt], nwp[0], nwp[4], sq[tt]);   // nwp[4]: 32 bf16 further
#endif
            copy_wait<MAXQ - 1>(MAXQ - 1 - i);
            const uint4 wgi = own[i * (1 + GATED) * 32];
#if GATED
            const uint4 wui = own[(i * 2 + 1) * 32];
#endif
#else
            const uint4 wgi = wg[i];
#if GATED
            const uint4 wui = wu[i];
#endif
#endif
            const u32 wq[4] = {wgi.x, wgi.y, wgi.z, wgi.w};
#if GATED
            const u32 uq[4] = {wui.x, wui.y, wui.z, wui.w};
#endif
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int step = i * 4 + j;   // k-step within the warp's range (which starts on a group)
                const int grp = step / GS;
                // the A operand once for all token tiles: bf16 128 + u, or with SUBZ u - 8 - z (the group's offset
                // taken off in the operand, exact: small integers)
                u32 a[4];
                weight_fragment(a, wq[j]);
#if SUBZ
                center_fragment(a, sg0[grp], sg1[grp]);
#endif
#if GATED
                u32 au[4];
                weight_fragment(au, uq[j]);
#if SUBZ
                center_fragment(au, su0[grp], su1[grp]);
#endif
#endif
#pragma unroll
                for (int tt = 0; tt < NTILE; ++tt) {
                    if (step % GS == 0) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
#pragma unroll
                            for (int c = 0; c < NCHAIN; ++c) {
                                acc[tt][c][e] = 0.f;
#if !SUBZ
                                xs[tt][c][e] = 0.f;
#endif
#if GATED
                                accu[tt][c][e] = 0.f;
#endif
                            }
                        }
                    }
#if STAGE
                    const u32* b = xq[tt][j];
#else
                    const u32* b = xb[tt][step];
#endif
                    const int ch = j % NCHAIN;
                    mma_bf16(acc[tt][ch], a[0], a[1], a[2], a[3], b[0], b[1]);
#if !SUBZ
                    mma_bf16(xs[tt][ch], ONES, ONES, ONES, ONES, b[0], b[1]);
#endif
#if GATED
                    mma_bf16(accu[tt][ch], au[0], au[1], au[2], au[3], b[0], b[1]);
#endif
                    if ((step + 1) % GS == 0) {
#if SUBZ
                        flush_centered<NCHAIN>(tot[tt], acc[tt], sg0[grp], sg1[grp]);
#if GATED
                        flush_centered<NCHAIN>(totu[tt], accu[tt], su0[grp], su1[grp]);
#endif
#else
                        flush_group<NCHAIN>(tot[tt], acc[tt], xs[tt], sg0[grp], sg1[grp]);
#if GATED
                        flush_group<NCHAIN>(totu[tt], accu[tt], xs[tt], su0[grp], su1[grp]);
#endif
#endif
                    }
                }
            }
        }
    }

    // sum the warps' partial results
    __shared__ float red[NRED][WARPS][32];
    float sums[NRED];   // per token tile: the sums, the up sums, the squares
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            sums[tt * NVAL + e] = tot[tt][e];
#if GATED
            sums[tt * NVAL + 4 + e] = totu[tt][e];
#endif
        }
#if NORM
        sums[tt * NVAL + 4 + 4 * GATED] = sq[tt][0];
        sums[tt * NVAL + 5 + 4 * GATED] = sq[tt][1];
#endif
    }
    store_warp_sums<NRED, WARPS>(red, sums, warp, lane);
    __syncthreads();
    if (warp != 0) return;
    float v[NRED];
    add_warp_sums<NRED, WARPS>(v, red, lane);
#if SPLIT > 1
    // partial[rb][split][value][lane]; the ticket's last taker adds the SPLIT partials in split order
    float* mine = partial + ((size_t)(rb * SPLIT + split) * NRED) * 32 + lane;
#pragma unroll
    for (int e = 0; e < NRED; ++e) mine[e * 32] = v[e];
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(tickets + rb, 1) == SPLIT - 1;
    if (!__shfl_sync(0xFFFFFFFFu, last, 0)) return;
    __threadfence();
    const float* all = partial + (size_t)rb * SPLIT * NRED * 32 + lane;
#pragma unroll
    for (int e = 0; e < NRED; ++e) {
        float s = 0.f;
        for (int sp = 0; sp < SPLIT; ++sp) s += sp == split ? v[e] : __ldcg(all + (sp * NRED + e) * 32);
        v[e] = s;
    }
    if (lane == 0) tickets[rb] = 0;   // ready for the next launch
#endif
#pragma unroll
    for (int tt = 0; tt < NTILE; ++tt) {
        const float* vt = v + tt * NVAL;
#if NORM
        // token c's sum of squares is element (c, c): lane 4c + c/2, register c % 2
        const float sq_even = __shfl_sync(0xFFFFFFFFu, vt[4 + 4 * GATED], 9 * t);
        const float sq_odd = __shfl_sync(0xFFFFFFFFu, vt[5 + 4 * GATED], 9 * t + 4);
        const float rstd[2] = {rsqrtf(sq_even / k + eps), rsqrtf(sq_odd / k + eps)};
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * tt + 2 * t + (e & 1);   // token row
            const int row = (e < 2) ? row0 : row1;       // output feature
            if (col >= m) continue;
            float y = vt[e];
#if NORM
            y *= rstd[e & 1];
#endif
#if BIAS
            y += bias_v[e];
#endif
#if GATED
            float up = vt[4 + e];
#if NORM
            up *= rstd[e & 1];
#endif
#if BIAS
            up += bias_u[e];
#endif
            y = silu_mul_rounded(y, up);
#endif
#if RES
            y = round_bf16(y) + res_v[tt][e];
#endif
            out[(size_t)col * stride_out + row] = float_to_bf16(y);
        }
    }
}
