// Experiment: a llama-1b decoder layer's four int4 GEMVs (q|k|v, o, gate|up, down) for one token row as ONE
// persistent kernel over all layers (bench/persistent_layers_check.py compiles it after the helpers of
// fourfold/quant/int4_mma_gemv.cu and times it against the engine's kernel chain).
//
// One block per SM (grid = SM count, ~215 KiB of shared memory each, so never two on an SM). Each phase of a
// layer gives every block a contiguous range of 16-row tiles (gate|up: tile pairs); a block's weights for a
// phase sit in that phase's shared-memory slot, copied with cp.async one layer ahead, so the weight stream runs
// while the dependent chain does. Phases are separated by a grid barrier in global memory. After the barrier the
// block stages x in shared memory, runs the mma sums of the engine's kernel on it (same fragment layout, same
// group arithmetic), sums across warps and writes its rows. Group size 128 only.
// Compile-time: DIM, FFN, QKV_TILES, MAXT_QKV, MAXT_GU (tiles a block may get), and switches for the timing
// variants: FLAG_BARRIER (per-block flag words, else an arrive counter), LITE_BARRIER, STREAM (0: only layer 0's
// weights are copied, later layers reuse stale slots), MATH (0: no sums), BARRIER_ONLY (phases are barriers).
// Result on an H200 (docs/benchmarks.md, eighth session): correct, and 1.6x slower than the engine's kernels,
// because a grid barrier of 132 blocks costs ~2.1-2.4 us against ~0.6-1.1 us for a dependent kernel launch.

#define WARPS 16
#define GS 8                      // k-steps of a 128-wide group
#define TILE_WB(K) ((K) * 8)      // bytes of one 16-row tile's mma words
#define TILE_SB(K) ((K) / 2)      // bytes of one 16-row tile's scale words (16 rows x K/128 words)
#define SLOT_BYTES(K, MAXT, PARTS) ((MAXT) * (PARTS) * (TILE_WB(K) + TILE_SB(K)))

#define SLOT_QKV 0
#define SLOT_O (SLOT_QKV + SLOT_BYTES(DIM, MAXT_QKV, 1))
#define SLOT_GU (SLOT_O + SLOT_BYTES(DIM, 1, 1))
#define SLOT_DOWN (SLOT_GU + SLOT_BYTES(DIM, MAXT_GU, 2))
#define X_STAGE (SLOT_DOWN + SLOT_BYTES(FFN, 1, 1))
#define NW_STAGE (X_STAGE + FFN * 2)
#define SMEM_BYTES (NW_STAGE + DIM * 2)

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

#ifndef FLAG_BARRIER
#define FLAG_BARRIER 1
#endif
#ifndef LITE_BARRIER
#define LITE_BARRIER 0   // no __threadfence before the release store; relaxed polling, one acquire fence after
#endif
#ifndef STREAM
#define STREAM 1
#endif
#ifndef MATH
#define MATH 1
#endif
#ifndef BARRIER_ONLY
#define BARRIER_ONLY 0
#endif

__device__ __forceinline__ u32 load_relaxed(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// every block's writes before it are visible to every block after it. FLAG_BARRIER: block b publishes the
// barrier's number in bar[b] and its first gridDim.x threads each wait for one block's word (`epoch`: the number
// every word held when the kernel started, plus the barriers passed); else one arrive counter (bar[0]) and a
// generation word (bar[1])
__device__ __forceinline__ void grid_barrier(u32* bar, u32& epoch) {
    asm volatile("cp.async.wait_group 3;" ::: "memory");   // this phase's weights (issued a layer ago) landed
    __syncthreads();
#if FLAG_BARRIER
    ++epoch;
    if (threadIdx.x == 0) {
        if (!LITE_BARRIER) __threadfence();
        store_release(bar + blockIdx.x, epoch);
    }
    if (threadIdx.x < gridDim.x) {
#if LITE_BARRIER
        while ((int)(load_relaxed(bar + threadIdx.x) - epoch) < 0) {}
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
        while ((int)(load_acquire(bar + threadIdx.x) - epoch) < 0) {}
#endif
    }
    __syncthreads();
    return;
#endif
    if (threadIdx.x == 0) {
        const u32 gen = load_acquire(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (load_acquire(bar + 1) == gen) {}
        }
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ void tile_range(int tiles, int& t0, int& nt) {
    t0 = (int)((long long)blockIdx.x * tiles / gridDim.x);
    nt = (int)((long long)(blockIdx.x + 1) * tiles / gridDim.x) - t0;
}

// cp.async this block's tiles of one phase (gate|up: each gate tile and its up tile, `tiles` rows of tiles apart)
template <int K, int PARTS, int MAXT>
__device__ void issue_weights(char* slot, const char* words, const char* scales, int tiles) {
    int t0, nt;
    tile_range(tiles, t0, nt);
    constexpr int WC = TILE_WB(K) / 16, SC = TILE_SB(K) / 16;
    for (int c = threadIdx.x; c < nt * PARTS * WC; c += blockDim.x) {
        const int idx = c / WC, off = c - idx * WC;
        const int tile = t0 + idx / PARTS + (idx % PARTS) * tiles;
        cp_async16(slot + (size_t)idx * TILE_WB(K) + off * 16, words + (size_t)tile * TILE_WB(K) + off * 16);
    }
    char* sslot = slot + MAXT * PARTS * TILE_WB(K);
    for (int c = threadIdx.x; c < nt * PARTS * SC; c += blockDim.x) {
        const int idx = c / SC, off = c - idx * SC;
        const int tile = t0 + idx / PARTS + (idx % PARTS) * tiles;
        cp_async16(sslot + (size_t)idx * TILE_SB(K) + off * 16, scales + (size_t)tile * TILE_SB(K) + off * 16);
    }
}

// one phase: out[rows of this block's tiles] = W x (NORM: x RMS-normalised and times nw; GATED: silu(gate) * up;
// RES: + res), everything as the engine's int4_mma_gemv computes it for one token row
template <int K, int GATED, int NORM, int RES, int MAXT>
__device__ void run_phase(char* smem, char* slot, u32* bar, int tiles, const u16* x, const u16* nw, const u16* res,
                          u16* out, float eps, unsigned long long* stamp, u32& epoch) {
    constexpr int PARTS = 1 + GATED, GROUPS = K / 128, NRED = 4 + 4 * GATED + 2 * NORM;
    u16* xs = (u16*)(smem + X_STAGE);
    u16* nws = (u16*)(smem + NW_STAGE);
    int t0, nt;
    tile_range(tiles, t0, nt);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wpt = nt > 0 ? WARPS / nt : WARPS;              // warps per tile
    const int tg = warp / wpt, lw = warp - tg * wpt;        // this warp's tile and its place among the tile's warps
    const bool active = tg < nt;
    if (NORM) {   // the norm weight does not depend on the previous phase: staged before the barrier
        for (int c = threadIdx.x; c < K / 8; c += blockDim.x) ((uint4*)nws)[c] = ((const uint4*)nw)[c];
    }
    grid_barrier(bar, epoch);
    if (stamp != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {   // when the barrier let block 0 go
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        *stamp = now;
    }
    if (BARRIER_ONLY) return;
    float res_v[2] = {0.f, 0.f};
    if (RES && active && lw == 0 && t == 0) {
        const int row0 = 16 * (t0 + tg) + g;
        res_v[0] = bf16_to_float(res[row0]);
        res_v[1] = bf16_to_float(res[row0 + 8]);
    }
    for (int c = threadIdx.x; c < K / 8; c += blockDim.x) ((uint4*)xs)[c] = ((const uint4*)x)[c];
    __syncthreads();

    float tot[4] = {0.f, 0.f, 0.f, 0.f}, sq[4] = {0.f, 0.f, 0.f, 0.f}, sq2[4] = {0.f, 0.f, 0.f, 0.f};
    float totu[4] = {0.f, 0.f, 0.f, 0.f};
    if (MATH && active) {
        const uint4* wg = (const uint4*)(slot + (size_t)(tg * PARTS) * TILE_WB(K));
        const uint4* wu = (const uint4*)(slot + (size_t)(tg * PARTS + GATED) * TILE_WB(K));
        const u32* sbase = (const u32*)(slot + MAXT * PARTS * TILE_WB(K));
        const u32* sg = sbase + (size_t)(tg * PARTS) * (TILE_SB(K) / 4);
        const u32* su = sbase + (size_t)(tg * PARTS + GATED) * (TILE_SB(K) / 4);
        const int grp0 = lw * GROUPS / wpt, grp1 = (lw + 1) * GROUPS / wpt;
        for (int grp = grp0; grp < grp1; ++grp) {
            float acc[2][4] = {}, xsum[2][4] = {}, accu[2][4] = {};
#pragma unroll
            for (int qq = 0; qq < 2; ++qq) {
                const int q = grp * 2 + qq;
                uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
                if (g == 0) {
                    lo = *(const uint4*)(xs + q * 64 + 8 * t);
                    hi = *(const uint4*)(xs + q * 64 + 32 + 8 * t);
                }
                u32 b[4][2] = {{lo.x, lo.y}, {lo.z, lo.w}, {hi.x, hi.y}, {hi.z, hi.w}};
                if (NORM) {
                    const uint4 n0 = *(const uint4*)(nws + q * 64 + 8 * t);
                    const uint4 n1 = *(const uint4*)(nws + q * 64 + 32 + 8 * t);
                    const u32 nwv[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        mma_bf16((j & 1) ? sq2 : sq, b[j][0], 0u, b[j][1], 0u, b[j][0], b[j][1]);
                        b[j][0] = mul_bf16x2(b[j][0], nwv[2 * j]);
                        b[j][1] = mul_bf16x2(b[j][1], nwv[2 * j + 1]);
                    }
                }
                const uint4 wq = wg[q * 32 + lane];
                const u32 w4[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    mma_int4(acc[j & 1], w4[j], b[j]);
                    mma_bf16(xsum[j & 1], ONES, ONES, ONES, ONES, b[j][0], b[j][1]);
                }
                if (GATED) {
                    const uint4 uq = wu[q * 32 + lane];
                    const u32 u4[4] = {uq.x, uq.y, uq.z, uq.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) mma_int4(accu[j & 1], u4[j], b[j]);
                }
            }
            flush_group(tot, acc, xsum, sg[g * GROUPS + grp], sg[(g + 8) * GROUPS + grp]);
            if (GATED) flush_group(totu, accu, xsum, su[g * GROUPS + grp], su[(g + 8) * GROUPS + grp]);
        }
    }

    // sum the warps of each tile; the scratch reuses the phase's weight slot (every warp is done with it)
#pragma unroll
    for (int e = 0; e < 4; ++e) sq[e] += sq2[e];
    __syncthreads();
    float* red = (float*)slot;   // red[tile][value][warp of the tile][lane]
    if (active) {
        float* r = red + (size_t)tg * NRED * WARPS * 32 + lw * 32 + lane;
        r[0 * WARPS * 32] = tot[0];
        r[1 * WARPS * 32] = tot[1];
        r[2 * WARPS * 32] = tot[2];
        r[3 * WARPS * 32] = tot[3];
        if (GATED) {
            r[4 * WARPS * 32] = totu[0];
            r[5 * WARPS * 32] = totu[1];
            r[6 * WARPS * 32] = totu[2];
            r[7 * WARPS * 32] = totu[3];
        }
        if (NORM) {
            r[(4 + 4 * GATED) * WARPS * 32] = sq[0];
            r[(5 + 4 * GATED) * WARPS * 32] = sq[1];
        }
    }
    __syncthreads();
    if (active && lw == 0) {
        float v[NRED];
#pragma unroll
        for (int e = 0; e < NRED; ++e) {
            float s = 0.f;
#pragma unroll
            for (int w2 = 0; w2 < WARPS; ++w2) {   // unrolled so the loads overlap
                if (w2 < wpt) s += red[((size_t)tg * NRED + e) * WARPS * 32 + w2 * 32 + lane];
            }
            v[e] = s;
        }
        float rstd = 1.f;
        if (NORM) rstd = rsqrtf(__shfl_sync(0xFFFFFFFFu, v[4 + 4 * GATED], 0) / K + eps);
        if (t == 0) {
            const int row0 = 16 * (t0 + tg) + g;
#pragma unroll
            for (int h = 0; h < 2; ++h) {   // e = 0 (row0) and e = 2 (row0 + 8): token column 0
                float y = v[2 * h];
                if (NORM) y *= rstd;
                if (GATED) {
                    float up = v[4 + 2 * h];
                    if (NORM) up *= rstd;
                    const float gr = round_bf16(y);
                    y = round_bf16(gr / (1.f + __expf(-gr))) * round_bf16(up);
                }
                if (RES) y = round_bf16(y) + res_v[h];
                out[row0 + 8 * h] = float_to_bf16(y);
            }
        }
    }
    __syncthreads();   // the slot is free again
}

// table: per layer, int64 pointers {qkv words, qkv scales, o words, o scales, gate|up words, gate|up scales,
// down words, down scales, attention norm weight, ffn norm weight}; stamps: none, or 4 per layer + 1 (global
// timer when block 0 leaves each phase's barrier, and at the end)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
persistent_layers(const long long* table, u16* h, u16* h_mid, u16* qkv_out, const u16* att, u16* act, u32* bar,
                  unsigned long long* stamps, int layers, float eps) {
    extern __shared__ uint4 smem_v4[];
    char* smem = (char*)smem_v4;
    u32 epoch = FLAG_BARRIER ? load_acquire(bar + blockIdx.x) : 0u;   // every word holds it between launches
    const char* const* tab = (const char* const*)table;
#define ISSUE(l, P)                                                                                              \
    do {                                                                                                         \
        if ((l) < layers && ((l) == 0 || STREAM)) {                                                              \
            const char* const* e = tab + (size_t)(l) * 10;                                                       \
            if (P == 0) issue_weights<DIM, 1, MAXT_QKV>(smem + SLOT_QKV, e[0], e[1], QKV_TILES);                 \
            if (P == 1) issue_weights<DIM, 1, 1>(smem + SLOT_O, e[2], e[3], DIM / 16);                          \
            if (P == 2) issue_weights<DIM, 2, MAXT_GU>(smem + SLOT_GU, e[4], e[5], FFN / 16);                   \
            if (P == 3) issue_weights<FFN, 1, 1>(smem + SLOT_DOWN, e[6], e[7], DIM / 16);                       \
        }                                                                                                        \
        asm volatile("cp.async.commit_group;" ::: "memory");                                                    \
    } while (0)

    ISSUE(0, 0);
    ISSUE(0, 1);
    ISSUE(0, 2);
    ISSUE(0, 3);
    for (int l = 0; l < layers; ++l) {
        const char* const* e = tab + (size_t)l * 10;
        run_phase<DIM, 0, 1, 0, MAXT_QKV>(smem, smem + SLOT_QKV, bar, QKV_TILES, h, (const u16*)e[8], nullptr,
                                          qkv_out, eps, stamps ? stamps + 4 * l : nullptr, epoch);
        ISSUE(l + 1, 0);
        run_phase<DIM, 0, 0, 1, 1>(smem, smem + SLOT_O, bar, DIM / 16, att, nullptr, h, h_mid, eps,
                                   stamps ? stamps + 4 * l + 1 : nullptr, epoch);
        ISSUE(l + 1, 1);
        run_phase<DIM, 1, 1, 0, MAXT_GU>(smem, smem + SLOT_GU, bar, FFN / 16, h_mid, (const u16*)e[9], nullptr,
                                         act, eps, stamps ? stamps + 4 * l + 2 : nullptr, epoch);
        ISSUE(l + 1, 2);
        run_phase<FFN, 0, 0, 1, 1>(smem, smem + SLOT_DOWN, bar, DIM / 16, act, nullptr, h_mid, h, eps,
                                   stamps ? stamps + 4 * l + 3 : nullptr, epoch);
        ISSUE(l + 1, 3);
    }
    if (stamps != nullptr) {
        grid_barrier(bar, epoch);
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            unsigned long long now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            stamps[4 * layers] = now;
        }
    }
}
