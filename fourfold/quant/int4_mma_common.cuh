// Device helpers shared by fourfold's int4 tensor-core GEMV kernels (int4_mma_gemv.cu, int4_stream_gemv.cu):
// loads before the PDL wait, cp.async, nibble-to-bf16 fragments, the mma, x fragments, the fused RMSNorm's
// squares and a quantization group's scale; fourfold/quant/int4_mma.py documents the layout. NVRTC gets this
// text in front of the kernel's (no include paths).

typedef unsigned int u32;
typedef unsigned short u16;

#define ONES 0x3F803F80u   // two bf16 1.0

// Loads issued before griddepcontrol.wait must stay there: as volatile asm the compiler cannot sink them past it
__device__ __forceinline__ uint4 load_early_v4(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 load_early(const void* p) {
    u32 r;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared without passing through registers (completes at a cp.async wait)
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((u32)__cvta_generic_to_shared(smem)), "l"(gmem) : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// wait until at most `pending` of this thread's cp.async groups are still in flight (`pending` <= N; a constant
// once the caller's loop is unrolled, so the chain folds to one instruction)
template <int N>
__device__ __forceinline__ void copy_wait(int pending) {
    if constexpr (N > 0) {
        if (pending >= N) {
            asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
            return;
        }
        copy_wait<N - 1>(pending);
    } else {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
}

__device__ __forceinline__ u32 nibble_pair(u32 v) {
    // (v & 0x000F000F) | 0x43004300: bf16 values 128 + (bits 0..3) and 128 + (bits 16..19)
    u32 r;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the A operand of one k-step from the lane's word: registers 0 and 2 hold row g, 1 and 3 row g + 8 (bf16 128 + u)
__device__ __forceinline__ void weight_fragment(u32* a, u32 w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = nibble_pair(w >> (4 * i));
}

// one k-step of a 16-row tile: A from the lane's packed word (its 8 nibbles in fragment order), B = x fragments b
__device__ __forceinline__ void mma_int4(float* d, u32 w, const u32* b) {
    u32 a[4];
    weight_fragment(a, w);
    mma_bf16(d, a[0], a[1], a[2], a[3], b[0], b[1]);
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {   // rounded to nearest, as a bf16 multiply
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 float_to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// silu(gate) * up from finished sums, rounded where the eager SwiGLU rounds (each matmul output, the silu, the product)
__device__ __forceinline__ float silu_mul_rounded(float gate, float up) {
    const float gr = round_bf16(gate);
    return round_bf16(gr / (1.f + __expf(-gr))) * round_bf16(up);
}

// B fragments of token row g (zero past m) for one 64-wide quad starting at column c: the lane holds
// x[c + 8t .. +7] and x[c + 32 + 8t .. +7] (two 16-byte loads); k-step j takes 4 of them, the weight layout matching
__device__ __forceinline__ void load_x_quad(u32 (*b)[2], const u16* x, int stride_x, int g, int t, int m, int c) {
    uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
    if (g < m) {
        const u16* p = x + (size_t)g * stride_x + c + 8 * t;
        lo = *(const uint4*)p;
        hi = *(const uint4*)(p + 32);
    }
    b[0][0] = lo.x; b[0][1] = lo.y; b[1][0] = lo.z; b[1][1] = lo.w;
    b[2][0] = hi.x; b[2][1] = hi.y; b[3][0] = hi.z; b[3][1] = hi.w;
}

// RMSNorm prologue of one quad: the squares of x into sq (X X^T's diagonal: A = the x rows as a 16-row tile whose
// rows 8..15 are zero), then x times the norm weight at the lane's positions (nw: the two 16-byte pieces)
__device__ __forceinline__ void norm_quad(u32 (*b)[2], uint4 nw_lo, uint4 nw_hi, float* sq) {
    const u32 nw[8] = {nw_lo.x, nw_lo.y, nw_lo.z, nw_lo.w, nw_hi.x, nw_hi.y, nw_hi.z, nw_hi.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        mma_bf16(sq, b[j][0], 0u, b[j][1], 0u, b[j][0], b[j][1]);
        b[j][0] = mul_bf16x2(b[j][0], nw[2 * j]);
        b[j][1] = mul_bf16x2(b[j][1], nw[2 * j + 1]);
    }
}

// a group's sums of NC chains into tot: scale times (sum (128 + u) x - (136 + z) sum x); scale words: bf16 scale in
// the high half, 136 + zero point in the low half (rows g and g + 8)
template <int NC = 2>
__device__ __forceinline__ void flush_group(float* tot, const float (*acc)[4], const float (*xs)[4], u32 sc_lo,
                                            u32 sc_hi) {
    const float s0 = __uint_as_float(sc_lo & 0xFFFF0000u), c0 = (float)(sc_lo & 0xFFFFu);
    const float s1 = __uint_as_float(sc_hi & 0xFFFF0000u), c1 = (float)(sc_hi & 0xFFFFu);
    float a[4], x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        a[e] = acc[0][e];
        x[e] = xs[0][e];
#pragma unroll
        for (int c = 1; c < NC; ++c) {
            a[e] += acc[c][e];
            x[e] += xs[c][e];
        }
    }
    tot[0] += s0 * (a[0] - c0 * x[0]);
    tot[1] += s0 * (a[1] - c0 * x[1]);
    tot[2] += s1 * (a[2] - c1 * x[2]);
    tot[3] += s1 * (a[3] - c1 * x[3]);
}

// 136 + zero point of a scale word as two equal bf16 (exact: at most 151)
__device__ __forceinline__ u32 offset_pair(u32 sc) {
    const u32 h = __float_as_uint((float)(sc & 0xFFFFu)) >> 16;
    return h | (h << 16);
}

// the fragment's 128 + u minus 136 + z (rows g and g + 8): u - 8 - z, exact in bf16, so the mma sums the
// centred weights and no sum of x is needed
__device__ __forceinline__ void center_fragment(u32* a, u32 sc_lo, u32 sc_hi) {
    const u32 c0 = offset_pair(sc_lo) ^ 0x80008000u, c1 = offset_pair(sc_hi) ^ 0x80008000u;   // negated
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a[i]) : "r"(a[i]), "r"(ONES), "r"(i & 1 ? c1 : c0));
    }
}

// a group's sums of centred weights (center_fragment) from NC chains into tot: scale times the sum
template <int NC>
__device__ __forceinline__ void flush_centered(float* tot, const float (*acc)[4], u32 sc_lo, u32 sc_hi) {
    const float s0 = __uint_as_float(sc_lo & 0xFFFF0000u), s1 = __uint_as_float(sc_hi & 0xFFFF0000u);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        float a = acc[0][e];
#pragma unroll
        for (int c = 1; c < NC; ++c) a += acc[c][e];
        tot[e] += (e < 2 ? s0 : s1) * a;
    }
}

// A block's warps add their per-lane sums through shared memory red[value][warp][lane]: each warp stores its NV
// values, then (after a barrier) one warp adds them in warp order, so the result does not depend on timing
template <int NV, int NW>
__device__ __forceinline__ void store_warp_sums(float (*red)[NW][32], const float (&vals)[NV], int warp, int lane) {
#pragma unroll
    for (int e = 0; e < NV; ++e) red[e][warp][lane] = vals[e];
}

template <int NV, int NW>
__device__ __forceinline__ void add_warp_sums(float (&v)[NV], const float (*red)[NW][32], int lane) {
#pragma unroll
    for (int e = 0; e < NV; ++e) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) sum += red[e][w][lane];
        v[e] = sum;
    }
}
