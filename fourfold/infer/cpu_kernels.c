/* Fused CPU kernels for fourfold's decode step (fourfold/infer/cpu_decoder.py), compiled at first use.

   fourfold.infer.cpu_kernels compiles this file with the system C compiler (cc -O3 -march=native -shared
   -fPIC -fopenmp), caches the library under ~/.cache/fourfold/ and calls it through ctypes with tensor
   data pointers. PyTorch has no fused CPU decode ops (intel-extension-for-pytorch, which had some, is
   retired), so the small ops of a step (residual add + RMSNorm, rotary + KV-cache write, paged
   attention, SiLU * up) each run here as one pass instead of five to ten eager torch ops.

   Every kernel exists for bfloat16 (suffix _bf16) and float32 (_f32) activations: this file includes
   itself once per type with T (storage type), LD (load as float), RND (round a float to T's precision,
   kept as float) and ST (store a float). Arithmetic is float32; values are rounded to T exactly where
   the model's eager forward rounds (residual adds, rotary products, SiLU and its product), so bf16
   results match torch up to the last bit of an exp or a reduction order, and float32 results up to
   reduction order. OpenMP, when compiled in, is the one libgomp torch already loaded (same soname), so
   these loops share torch's thread pool rather than fighting it. */

#ifndef FF_KERNEL_BODY
#define FF_KERNEL_BODY

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_bits(float f) {  /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_round(float f) {
    uint16_t b = bf16_bits(f);
    return bf16_load(&b);
}

/* exp for float32 (Cephes' polynomial after reducing by ln 2; ~1 ulp), written so compilers vectorize it */
static inline float ff_exp(float x) {
    x = x < -87.0f ? -87.0f : x;  /* ternaries, not fminf/fmaxf: those keep gcc from vectorizing */
    x = x > 88.0f ? 88.0f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest (1.5 * 2^23 trick) */
    float r = fmaf(k, -0.693359375f, x);
    r = fmaf(k, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16, head size 64, G query heads per kv head: the key pass (scores) and the value pass (weighted sum)
   of one query row over one kv head with q, the G accumulators and each key/value row in registers. */
/* Prefetch the rows (128 bytes each, `stride` apart) of the block after p0, if any: blocks are scattered in the
   pool, so the hardware prefetcher cannot see the next one coming. */
static inline void prefetch_next_block(const uint16_t *cache, const int32_t *table, int64_t p0, int64_t len,
                                       int64_t block_size, int64_t stride, int64_t first) {
    int64_t next = p0 + block_size;
    if (next >= len) return;
    const uint16_t *nb = cache + (int64_t)table[next / block_size] * block_size * stride + first;
    int64_t m = len - next < block_size ? len - next : block_size;
    for (int64_t o = 0; o < m; o++) {
        _mm_prefetch((const char *)(nb + o * stride), _MM_HINT_T0);
        _mm_prefetch((const char *)(nb + o * stride + 32), _MM_HINT_T0);
    }
}

/* The lane sums of 16 vectors, as one vector (lane i: the sum of a[i]): a transpose folded into adds. */
static inline __m512 sum16x16(const __m512 *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++)
        u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xEE));
    for (int j = 0; j < 2; j++)
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* bf16, head size 64, G query heads per kv head: the key pass (scores) and the value pass (weighted sum)
   of one query row over one kv head. Scores go 16 keys at a time (one pair of bf16 dot products per key
   and head, then one transposing reduction for all 16); values with q's G accumulators in registers. */
static inline __attribute__((always_inline)) void bf16_d64_scores(const uint16_t *q, const uint16_t *k_cache,
        const int32_t *table, int64_t len, int64_t block_size, int64_t stride, int64_t first, float scale,
        float *scores, const int G) {
    __m512bh q0[4], q1[4];
    for (int g = 0; g < G; g++) {
        q0[g] = (__m512bh)_mm512_loadu_si512(q + g * 64);
        q1[g] = (__m512bh)_mm512_loadu_si512(q + g * 64 + 32);
    }
    __m512 a[16];
    for (int64_t p0 = 0; p0 < len; p0 += block_size) {
        const uint16_t *kb = k_cache + (int64_t)table[p0 / block_size] * block_size * stride + first;
        int64_t m = len - p0 < block_size ? len - p0 : block_size;
        prefetch_next_block(k_cache, table, p0, len, block_size, stride, first);
        for (int64_t c = 0; c < m; c += 16) {
            int64_t n = m - c < 16 ? m - c : 16;
            for (int g = 0; g < G; g++) {
                for (int64_t o = 0; o < 16; o++) {
                    if (o < n) {
                        const uint16_t *k = kb + (c + o) * stride;
                        a[o] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0[g],
                                                                 (__m512bh)_mm512_loadu_si512(k)),
                                                q1[g], (__m512bh)_mm512_loadu_si512(k + 32));
                    } else {
                        a[o] = _mm512_setzero_ps();
                    }
                }
                _mm512_mask_storeu_ps(scores + g * len + p0 + c, (__mmask16)((1u << n) - 1u),
                                      _mm512_mul_ps(_mm512_set1_ps(scale), sum16x16(a)));
            }
        }
    }
}

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __attribute__((always_inline)) void bf16_d64_values(const uint16_t *v_cache, const int32_t *table,
        int64_t len, int64_t block_size, int64_t stride, int64_t first, const float *probs, float *acc_out,
        const int G) {
    __m512 acc[4][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < len; p0 += block_size) {
        const uint16_t *vb = v_cache + (int64_t)table[p0 / block_size] * block_size * stride + first;
        int64_t m = len - p0 < block_size ? len - p0 : block_size;
        prefetch_next_block(v_cache, table, p0, len, block_size, stride, first);
        for (int64_t o = 0; o < m; o++) {
            __m512 v[4];
            for (int i = 0; i < 4; i++) v[i] = bf16x16_to_f32(vb + o * stride + 16 * i);
            for (int g = 0; g < G; g++) {
                __m512 w = _mm512_set1_ps(probs[g * len + p0 + o]);
                for (int i = 0; i < 4; i++) acc[g][i] = _mm512_fmadd_ps(w, v[i], acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc_out + g * 64 + 16 * i, acc[g][i]);
}

/* Both passes for G = group (1..4, each a specialised copy); returns 0 when the shape is not covered. */
static int bf16_d64_attend(int pass, const uint16_t *q, const uint16_t *cache, const int32_t *table, int64_t len,
                           int64_t block_size, int64_t stride, int64_t first, float scale, float *scores,
                           float *acc, int64_t group) {
#define FF_CASE(G) case G: if (pass == 0) bf16_d64_scores(q, cache, table, len, block_size, stride, first, scale, \
                                                         scores, G); \
                           else bf16_d64_values(cache, table, len, block_size, stride, first, scores, acc, G); \
                           return 1;
    switch (group) { FF_CASE(1) FF_CASE(2) FF_CASE(3) FF_CASE(4) default: return 0; }
#undef FF_CASE
}
#endif

#define FF_PARALLEL_MIN 16384 /* elements below which a row loop stays on the calling thread (each parallel
                                 region is a barrier that a busy shared machine can stall) */

int ff_version(void) { return 1; }

int ff_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#define FF_IS_BF16 1
#define T uint16_t
#define SUF(name) name##_bf16
#define LD(p) bf16_load(p)
#define RND(x) bf16_round(x)
#define ST(p, x) (*(p) = bf16_bits(x))
#include "cpu_kernels.c"
#undef T
#undef SUF
#undef LD
#undef RND
#undef ST
#undef FF_IS_BF16

#define FF_IS_BF16 0
#define T float
#define SUF(name) name##_f32
#define LD(p) (*(p))
#define RND(x) (x)
#define ST(p, x) (*(p) = (x))
#include "cpu_kernels.c"

#else /* the kernels, once per activation type */

/* residual += add (rounded to T, as the model's residual adds are; skipped when add is NULL), then
   out = T(rms_norm(float(residual)) * weight) with weight in float32: `rows` rows of `dim`. */
void SUF(ff_add_rms_norm)(T *residual, const T *add, const float *weight, T *out, int64_t rows, int64_t dim,
                          float eps) {
#pragma omp parallel for if (rows * dim >= FF_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        T *x = residual + r * dim;
        T *o = out + r * dim;
        float ss = 0.0f;
        if (add) {
            const T *a = add + r * dim;
#pragma omp simd reduction(+ : ss)
            for (int64_t j = 0; j < dim; j++) {
                float v = RND(LD(x + j) + LD(a + j));
                ST(x + j, v);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t j = 0; j < dim; j++) {
                float v = LD(x + j);
                ss += v * v;
            }
        }
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) ST(o + j, LD(x + j) * inv * weight[j]);
    }
}

/* Rotary embedding of q and k (Hugging Face's rotate-half layout) and the pool write of k and v.
   qkv: (rows, (hq + 2 hkv) d) the fused projection; cos, sin_signed: (rows, d) in T for each row's
   position, sin_signed = [-sin first half, sin second half]; q_out: (rows, hq, d); k_cache, v_cache:
   (slots, hkv, d) with slots[r] the row's flat slot. Rounds like cpu_decoder's torch ops:
   T(T(x cos) + T(swap(x) sin)). */
void SUF(ff_rope_write_kv)(const T *qkv, int64_t rows, int64_t hq, int64_t hkv, int64_t d, const T *cos,
                           const T *sin_signed, const int64_t *slots, T *q_out, T *k_cache, T *v_cache) {
    int64_t half = d / 2, width = (hq + 2 * hkv) * d;
#pragma omp parallel for if (rows * width >= FF_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const T *row = qkv + r * width, *c = cos + r * d, *s = sin_signed + r * d;
        T *kdst = k_cache + slots[r] * hkv * d, *vdst = v_cache + slots[r] * hkv * d;
        for (int64_t h = 0; h < hq + hkv; h++) {
            const T *x = row + h * d;
            T *dst = h < hq ? q_out + (r * hq + h) * d : kdst + (h - hq) * d;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                float lo = LD(x + j), hi = LD(x + j + half);
                ST(dst + j, RND(RND(lo * LD(c + j)) + RND(hi * LD(s + j))));
                ST(dst + j + half, RND(RND(hi * LD(c + j + half)) + RND(lo * LD(s + j + half))));
            }
        }
        memcpy(vdst, row + (hq + hkv) * d, (size_t)(hkv * d) * sizeof(T));
    }
}

/* scores[g] = scale * q_g . k for the `group` query heads q (group, d) of one kv head and one key row k. */
static inline void SUF(group_scores)(const T *q, const T *k, int64_t group, int64_t d, float scale, float *scores) {
#if FF_IS_BF16 && defined(__AVX512BF16__)
    if (d % 32 == 0 && group <= 8) {  /* bf16 pair dot products on the raw bf16 values, float32 sums */
        __m512 acc[8];
        for (int64_t g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 32) {
            __m512bh kv = (__m512bh)_mm512_loadu_si512(k + j);
            for (int64_t g = 0; g < group; g++)
                acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_loadu_si512(q + g * d + j), kv);
        }
        for (int64_t g = 0; g < group; g++) scores[g] = scale * _mm512_reduce_add_ps(acc[g]);
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++) {
        const T *qg = q + g * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < d; j++) s += LD(qg + j) * LD(k + j);
        scores[g] = scale * s;
    }
}

/* Paged attention of every query row of a step over the pool (keys/values already written), GQA-aware:
   the hq / hkv query heads of one kv head share each key and value read. q: (rows, hq, d); out likewise;
   k_cache, v_cache: (slots, hkv, d); tables: (n_seqs, table_stride) block ids; seq_lens: tokens cached
   per sequence after the step; query_start: (n_seqs + 1) row offsets. Query j of a sequence's n rows sits
   at position len - n + j and sees keys 0..that position (causal). Softmax in float32 over the exact
   maximum (scores kept per row: one pass over the keys, one over the values). */
void SUF(ff_paged_attention)(const T *q, const T *k_cache, const T *v_cache, const int32_t *tables,
                             int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,
                             int64_t n_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
                             T *out) {
    int64_t rows = query_start[n_seqs], group = hq / hkv, items = rows * hkv;
    int64_t work = 0;
    for (int64_t i = 0; i < n_seqs; i++) work += (query_start[i + 1] - query_start[i]) * (int64_t)seq_lens[i];
#pragma omp parallel for schedule(dynamic, 1) if (work * hq * d > 200000)
    for (int64_t item = 0; item < items; item++) {
        int64_t t = item / hkv, h = item % hkv;
        int64_t lo = 0, hi = n_seqs;  /* the sequence whose rows hold t */
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (query_start[mid] <= t) lo = mid; else hi = mid;
        }
        int64_t seq = lo, n = query_start[seq + 1] - query_start[seq];
        int64_t len = seq_lens[seq] - n + (t - query_start[seq]) + 1;
        if (len <= 0) continue;
        const int32_t *table = tables + seq * table_stride;
        float stack[4096], sc[group];
        float *scores = group * (len + d) <= 4096 ? stack : malloc(sizeof(float) * (size_t)(group * (len + d)));
        float *acc = scores + group * len;
        const T *qh = q + (t * hq + h * group) * d;
        int fast = 0;
#if FF_IS_BF16 && defined(__AVX512BF16__)
        fast = d == 64 && bf16_d64_attend(0, qh, k_cache, table, len, block_size, hkv * d, h * d, scale, scores, acc,
                                          group);
#endif
        for (int64_t p0 = 0; p0 < len && !fast; p0 += block_size) {  /* block by block: no division per key */
            const T *kb = k_cache + ((int64_t)table[p0 / block_size] * block_size * hkv + h) * d;
            int64_t m = len - p0 < block_size ? len - p0 : block_size;
            for (int64_t o = 0; o < m; o++) {
                SUF(group_scores)(qh, kb + o * hkv * d, group, d, scale, sc);
                for (int64_t g = 0; g < group; g++) scores[g * len + p0 + o] = sc[g];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *sg = scores + g * len, mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
            for (int64_t p = 0; p < len; p++) mx = sg[p] > mx ? sg[p] : mx;
#pragma omp simd reduction(+ : sum)
            for (int64_t p = 0; p < len; p++) {
                float e = ff_exp(sg[p] - mx);
                sg[p] = e;
                sum += e;
            }
            float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t p = 0; p < len; p++) sg[p] *= inv;
        }
        memset(acc, 0, sizeof(float) * (size_t)(group * d));
#if FF_IS_BF16 && defined(__AVX512BF16__)
        if (fast) bf16_d64_attend(1, qh, v_cache, table, len, block_size, hkv * d, h * d, scale, scores, acc, group);
#endif
        for (int64_t p0 = 0; p0 < len && !fast; p0 += block_size) {
            const T *vb = v_cache + ((int64_t)table[p0 / block_size] * block_size * hkv + h) * d;
            int64_t m = len - p0 < block_size ? len - p0 : block_size;
            for (int64_t o = 0; o < m; o++) {
                const T *v = vb + o * hkv * d;
                for (int64_t g = 0; g < group; g++) {
                    float w = scores[g * len + p0 + o], *a = acc + g * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) a[j] += w * LD(v + j);
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            T *o = out + (t * hq + h * group + g) * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) ST(o + j, acc[g * d + j]);
        }
        if (scores != stack) free(scores);
    }
}

/* out = T(T(silu(gate)) * up) for gate_up (rows, 2 ffn) = [gate | up]; out (rows, ffn). */
void SUF(ff_silu_mul)(const T *gate_up, int64_t rows, int64_t ffn, T *out) {
#pragma omp parallel for if (rows * ffn >= FF_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float buf[256];
        const T *g = gate_up + r * 2 * ffn, *u = g + ffn;
        T *o = out + r * ffn;
        for (int64_t j0 = 0; j0 < ffn; j0 += 256) {
            int64_t n = ffn - j0 < 256 ? ffn - j0 : 256;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) buf[j] = LD(g + j0 + j);
#pragma omp simd
            for (int64_t j = 0; j < n; j++) buf[j] = RND(buf[j] / (1.0f + ff_exp(-buf[j])));
#pragma omp simd
            for (int64_t j = 0; j < n; j++) ST(o + j0 + j, buf[j] * LD(u + j0 + j));
        }
    }
}

#endif
