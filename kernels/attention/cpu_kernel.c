/*
 * Paged decode attention for CPUs: one query token per sequence, keys and
 * values read once, straight from the paged cache through the block table.
 *
 * Layouts (row-major, contiguous unless a stride is given, in elements):
 *   q             [num_seqs, num_heads, head_dim], sequence stride q_stride (heads packed)
 *   out           [num_seqs, num_heads, head_dim]
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, max_blocks] int32
 *   seq_lens      [num_seqs] int32 (context length, the new token included)
 * dtype: 0 = float32, 1 = bfloat16 (accumulation is always float32; bf16 rows are
 *   widened to float32 on load, the softmax weights rounded to bf16 before they
 *   weight V and divided by their float32 sum at the end, as torch's CPU flash
 *   attention does). Where the CPU has AVX-512 BF16, bf16 q.k dot products use its
 *   dot-product instruction (exact products, float32 sums, subnormals flushed).
 *
 * Work is split over (sequence, KV head); the query heads of a GQA group
 * share each key/value row they read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_math.h" /* bf16 conversions, exp_poly (parallel/kernels/) */

/* Eight floats; the compiler maps it to one AVX register, or two NEON ones. */
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8u __attribute__((vector_size(32), aligned(4))); /* unaligned access */
typedef uint16_t vu16x8u __attribute__((vector_size(16), aligned(2))); /* eight bf16 */
typedef uint32_t vu32x8 __attribute__((vector_size(32)));
#define MAX_HEADS 64 /* most query heads one work item handles */

static inline float hsum8(vf8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#define LOAD8(p) (*(const vf8u *)(p))

/* Eight bf16 values widened to float32: a bf16 is the top half of a float32. */
static inline vf8 load8_bf16(const uint16_t *p) {
#ifdef __AVX2__ /* one zero-extending load; GCC 12 splits the generic form in two */
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    const vu32x8 wide = __builtin_convertvector(*(const vu16x8u *)p, vu32x8) << 16;
#endif
    vf8 f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* scores[i] = dot(q_i, k_{i / group}) for the nq query heads, k of type KT read
 * through LOADK. Heads go four at a time with four accumulators held in
 * registers, so four independent FMA chains overlap instead of one chain
 * waiting on each FMA's latency. One definition per cache dtype. */
#define DEFINE_DOTS8(NAME, KT, LOADK)                                                              \
    static inline void NAME(float *scores, const float *qv, const KT *k, int64_t nq,              \
                            int64_t group, int64_t head_dim) {                                    \
        int64_t i = 0;                                                                             \
        for (; i + 4 <= nq; i += 4) {                                                              \
            const float *q0 = qv + i * head_dim, *q1 = q0 + head_dim, *q2 = q1 + head_dim;         \
            const float *q3 = q2 + head_dim;                                                       \
            const KT *k0 = k + (i / group) * head_dim, *k1 = k + ((i + 1) / group) * head_dim;     \
            const KT *k2 = k + ((i + 2) / group) * head_dim, *k3 = k + ((i + 3) / group) * head_dim; \
            vf8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                            \
            for (int64_t d = 0; d < head_dim; d += 8) {                                            \
                a0 += LOAD8(q0 + d) * LOADK(k0 + d);                                               \
                a1 += LOAD8(q1 + d) * LOADK(k1 + d);                                               \
                a2 += LOAD8(q2 + d) * LOADK(k2 + d);                                               \
                a3 += LOAD8(q3 + d) * LOADK(k3 + d);                                               \
            }                                                                                      \
            scores[i] = hsum8(a0);                                                                 \
            scores[i + 1] = hsum8(a1);                                                             \
            scores[i + 2] = hsum8(a2);                                                             \
            scores[i + 3] = hsum8(a3);                                                             \
        }                                                                                          \
        for (; i < nq; i++) {                                                                      \
            const float *qi = qv + i * head_dim;                                                   \
            const KT *kh = k + (i / group) * head_dim;                                             \
            vf8 a = {0};                                                                           \
            for (int64_t d = 0; d < head_dim; d += 8) a += LOAD8(qi + d) * LOADK(kh + d);          \
            scores[i] = hsum8(a);                                                                  \
        }                                                                                          \
    }
DEFINE_DOTS8(dots8, float, LOAD8)
DEFINE_DOTS8(dots8_bf16, uint16_t, load8_bf16)

/* acc_i += w_i * v_{i / group} for the nq query heads (head_dim a multiple of 8). */
#define DEFINE_AXPY8(NAME, VT, LOADV)                                                              \
    static inline void NAME(float *acc, const float *w, const VT *v, int64_t nq, int64_t group,   \
                            int64_t head_dim) {                                                    \
        for (int64_t i = 0; i < nq; i++) {                                                         \
            const VT *vh = v + (i / group) * head_dim;                                             \
            float *ai = acc + i * head_dim;                                                        \
            for (int64_t d = 0; d < head_dim; d += 8)                                              \
                *(vf8u *)(ai + d) = LOAD8(ai + d) + w[i] * LOADV(vh + d);                          \
        }                                                                                          \
    }
DEFINE_AXPY8(axpy8, float, LOAD8)
DEFINE_AXPY8(axpy8_bf16, uint16_t, load8_bf16)

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HAVE_DPBF16 1
/* dots[i] = dot(q_i, k_{i / group}) straight from bf16 q and k (head_dim a multiple
 * of 16): pairs of bf16 products, exact in float32, summed in float32 by the CPU's
 * bf16 dot-product instruction. */
static inline void dots_dpbf16(float *dots, const uint16_t *q, const uint16_t *k, int64_t nq,
                               int64_t group, int64_t head_dim) {
    for (int64_t i = 0; i < nq; i++) {
        const uint16_t *qi = q + i * head_dim, *kh = k + (i / group) * head_dim;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 16)
            acc = _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256((const __m256i *)(qi + d)),
                                   (__m256bh)_mm256_loadu_si256((const __m256i *)(kh + d)));
        vf8 v;
        memcpy(&v, &acc, sizeof v);
        dots[i] = hsum8(v);
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* Row `index` (in elements) of a cache or query tensor, as float32. fp32 data is
 * returned in place; bf16 data is converted into `tmp`. */
static inline const float *row_f32(const void *base, int64_t index, int64_t n, int dtype, float *tmp) {
    if (dtype == 0) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) *(vf8u *)(tmp + i) = load8_bf16(src + i);
    for (; i < n; i++) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

/* dots[i] = dot(q_i, k_{i / group}) for one cached token whose row starts at `index`. */
static inline void key_dots(float *dots, const float *qv, const void *k_cache, int64_t index,
                            int64_t nq, int64_t group, int64_t head_dim, int dtype, float *tmp) {
    if (head_dim % 8 == 0) {
        if (dtype == 0) dots8(dots, qv, (const float *)k_cache + index, nq, group, head_dim);
        else dots8_bf16(dots, qv, (const uint16_t *)k_cache + index, nq, group, head_dim);
        return;
    }
    const float *k = row_f32(k_cache, index, nq / group * head_dim, dtype, tmp);
    for (int64_t i = 0; i < nq; i++) {
        const float *qi = qv + i * head_dim;
        const float *kh = k + (i / group) * head_dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) dot += qi[d] * kh[d];
        dots[i] = dot;
    }
}

/* acc_i += w[i] * v_{i / group} for one cached token whose row starts at `index`. */
static inline void value_sum(float *acc, const float *w, const void *v_cache, int64_t index,
                             int64_t nq, int64_t group, int64_t head_dim, int dtype, float *tmp) {
    if (head_dim % 8 == 0) {
        if (dtype == 0) axpy8(acc, w, (const float *)v_cache + index, nq, group, head_dim);
        else axpy8_bf16(acc, w, (const uint16_t *)v_cache + index, nq, group, head_dim);
        return;
    }
    const float *v = row_f32(v_cache, index, nq / group * head_dim, dtype, tmp);
    for (int64_t i = 0; i < nq; i++) {
        const float *vh = v + (i / group) * head_dim;
        float *ai = acc + i * head_dim;
        for (int64_t d = 0; d < head_dim; d++) ai[d] += w[i] * vh[d];
    }
}

/* Requests the cache lines of the `bytes` from `p` ahead of their use. A serving
 * pool's block tables scatter a sequence's tokens, which the hardware prefetcher
 * (it follows runs of addresses) does not foresee: with this, builtin:small's
 * decode steps on scattered pages took 0.70-0.87x their time at 769 cached
 * tokens a sequence (`pdserve profile`, before against after, docs/results/simulator.md). */
#define PREFETCH_AHEAD 8 /* tokens */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o);
}

/* acc_i = sum_t w_it * v_{t, i / group} (head_dim a multiple of 64), 64 dims at a
 * time held in eight registers over all tokens; the same sums, in the same order,
 * as value_sum token by token. w: [nq, len]; rows[t]: token t's row in the cache. */
#define DEFINE_WEIGHTED_VALUES64(NAME, VT, LOADV)                                                  \
    static void NAME(float *acc, const float *w, const void *v_cache, const int64_t *rows,         \
                     int64_t len, int64_t nq, int64_t group, int64_t head_dim) {                   \
        const VT *v = (const VT *)v_cache;                                                         \
        for (int64_t i = 0; i < nq; i++) {                                                         \
            const float *wi = w + i * len;                                                         \
            const int64_t head = (i / group) * head_dim;                                           \
            for (int64_t d = 0; d < head_dim; d += 64) {                                           \
                vf8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0}; \
                for (int64_t t = 0; t < len; t++) {                                                \
                    const VT *p = v + rows[t] + head + d;                                          \
                    const float wt = wi[t];                                                        \
                    if (t + PREFETCH_AHEAD < len)                                                  \
                        prefetch_span(v + rows[t + PREFETCH_AHEAD] + head + d, 64 * sizeof(VT));   \
                    a0 += wt * LOADV(p);                                                           \
                    a1 += wt * LOADV(p + 8);                                                       \
                    a2 += wt * LOADV(p + 16);                                                      \
                    a3 += wt * LOADV(p + 24);                                                      \
                    a4 += wt * LOADV(p + 32);                                                      \
                    a5 += wt * LOADV(p + 40);                                                      \
                    a6 += wt * LOADV(p + 48);                                                      \
                    a7 += wt * LOADV(p + 56);                                                      \
                }                                                                                  \
                float *ai = acc + i * head_dim + d;                                                \
                *(vf8u *)ai = a0;                                                                  \
                *(vf8u *)(ai + 8) = a1;                                                            \
                *(vf8u *)(ai + 16) = a2;                                                           \
                *(vf8u *)(ai + 24) = a3;                                                           \
                *(vf8u *)(ai + 32) = a4;                                                           \
                *(vf8u *)(ai + 40) = a5;                                                           \
                *(vf8u *)(ai + 48) = a6;                                                           \
                *(vf8u *)(ai + 56) = a7;                                                           \
            }                                                                                      \
        }                                                                                          \
    }
DEFINE_WEIGHTED_VALUES64(weighted_values64, float, LOAD8)
DEFINE_WEIGHTED_VALUES64(weighted_values64_bf16, uint16_t, load8_bf16)

/* Attention of query heads [h0 * group, h1 * group) of sequence s. */
static int attend(void *out, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                  const int32_t *table, int64_t len, int64_t s, int64_t h0, int64_t h1,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t group, float scale, int dtype) {
    const int64_t nq = (h1 - h0) * group;  /* query heads handled here */
    const int64_t width = (h1 - h0) * head_dim; /* K/V elements of one token used here */
    int64_t *rows = malloc((size_t)len * sizeof(int64_t) +
                           (size_t)(nq * len + 2 * nq * head_dim + width + nq) * sizeof(float));
    if (rows == NULL) return 1;
    /* rows[t]: where token t's K/V for these heads start in the caches, in elements */
    for (int64_t t = 0, b = 0; t < len; b++)
        for (int64_t j = 0; j < block_size && t < len; j++, t++)
            rows[t] = (((int64_t)table[b] * block_size + j) * num_kv_heads + h0) * head_dim;
    float *scratch = (float *)(rows + len);
    float *scores = scratch;          /* [nq, len] */
    float *qv = scores + nq * len;    /* [nq, head_dim] */
    float *acc = qv + nq * head_dim;  /* [nq, head_dim] */
    float *tmp = acc + nq * head_dim; /* [width] */
    float *maxs = tmp + width;        /* [nq] */
    for (int64_t i = 0; i < nq; i++) {
        const float *qi = row_f32(q, s * q_stride + (h0 * group + i) * head_dim, head_dim, dtype, tmp);
        memcpy(qv + i * head_dim, qi, (size_t)head_dim * sizeof(float));
        maxs[i] = -INFINITY;
    }
    const int use_dp = HAVE_DPBF16 && dtype == 1 && head_dim % 16 == 0;
    const int64_t elem = dtype == 0 ? 4 : 2;
    for (int64_t t = 0; t < len; t++) {
        float dots[MAX_HEADS];
        if (t + PREFETCH_AHEAD < len)
            prefetch_span((const char *)k_cache + rows[t + PREFETCH_AHEAD] * elem, width * elem);
#if HAVE_DPBF16
        if (use_dp)
            dots_dpbf16(dots, (const uint16_t *)q + s * q_stride + h0 * group * head_dim,
                        (const uint16_t *)k_cache + rows[t], nq, group, head_dim);
        else
#endif
            key_dots(dots, qv, k_cache, rows[t], nq, group, head_dim, dtype, tmp);
        for (int64_t i = 0; i < nq; i++) {
            const float dot = dots[i] * scale;
            scores[i * len + t] = dot;
            if (dot > maxs[i]) maxs[i] = dot;
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        float sum = 0.0f;
        float *si = scores + i * len;
        const float m = maxs[i];
        for (int64_t t = 0; t < len; t++) si[t] = exp_poly(si[t] - m);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) sum += si[t];
        maxs[i] = 1.0f / sum; /* from here on: the reciprocal of the softmax sum */
        if (dtype == 0) {
            for (int64_t t = 0; t < len; t++) si[t] *= maxs[i];
        } else {
            /* As torch's CPU flash attention: the unnormalised weights are rounded to
             * bf16 before they weight V; the float32 sum divides at the end. */
            for (int64_t t = 0; t < len; t++) si[t] = bf16_to_f32(f32_to_bf16(si[t]));
        }
    }
    if (head_dim % 64 == 0) {
        if (dtype == 0) weighted_values64(acc, scores, v_cache, rows, len, nq, group, head_dim);
        else weighted_values64_bf16(acc, scores, v_cache, rows, len, nq, group, head_dim);
    } else {
        memset(acc, 0, (size_t)(nq * head_dim) * sizeof(float));
        for (int64_t t = 0; t < len; t++) {
            float w[MAX_HEADS];
            for (int64_t i = 0; i < nq; i++) w[i] = scores[i * len + t];
            value_sum(acc, w, v_cache, rows[t], nq, group, head_dim, dtype, tmp);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const int64_t o = (s * num_heads + h0 * group + i) * head_dim;
        if (dtype == 0) {
            memcpy((float *)out + o, acc + i * head_dim, (size_t)head_dim * sizeof(float));
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int64_t d = 0; d < head_dim; d++) dst[d] = f32_to_bf16(acc[i * head_dim + d] * maxs[i]);
        }
    }
    free(rows);
    return 0;
}

/* Query-head splits per sequence: whole rows per sequence read best, so the
 * fewest splits that give every thread an equal share of work items. */
static int64_t head_splits(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int num_threads) {
    int64_t splits = 1;
    if (num_seqs < 2 * num_threads) {
        while (splits < num_kv_heads &&
               (num_kv_heads % splits || num_seqs * splits < num_threads ||
                (num_seqs * splits) % num_threads))
            splits++;
    }
    while (num_heads / splits > MAX_HEADS) splits *= 2; /* keep work items within MAX_HEADS */
    if (splits > num_kv_heads || num_kv_heads % splits) splits = num_kv_heads;
    return splits;
}

int paged_decode_attention(void *out, const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, const int32_t *block_tables,
                           const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, float scale, int dtype, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t splits = head_splits(num_seqs, num_heads, num_kv_heads, num_threads);
    const int64_t per_split = num_kv_heads / splits;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed) \
    if (num_threads > 1 && num_seqs * splits > 1)
    for (int64_t item = 0; item < num_seqs * splits; item++) {
        const int64_t s = item / splits;
        const int64_t h0 = (item % splits) * per_split;
        failed |= attend(out, q, q_stride, k_cache, v_cache, block_tables + s * max_blocks,
                         seq_lens[s], s, h0, h0 + per_split, num_heads, num_kv_heads, head_dim,
                         block_size, group, scale, dtype);
    }
    return failed;
}

/* k/v [tokens, row] (token strides k_stride, v_stride; row = num_kv_heads * head_dim
 * elements, packed) into the caches' slots [tokens] (int64). */
int write_kv(void *k_cache, void *v_cache, const void *k, int64_t k_stride, const void *v,
             int64_t v_stride, const int64_t *slots, int64_t tokens, int64_t row, int dtype) {
    const size_t size = dtype == 0 ? 4 : 2, bytes = (size_t)row * size;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy((char *)k_cache + slots[t] * bytes, (const char *)k + t * k_stride * size, bytes);
        memcpy((char *)v_cache + slots[t] * bytes, (const char *)v + t * v_stride * size, bytes);
    }
    return 0;
}

/* A decode-only step in one call: write_kv for the step's num_seqs tokens (one
 * per sequence), then paged_decode_attention. */
int paged_decode_step(void *out, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                      const void *v, int64_t v_stride, const int64_t *slots, void *k_cache,
                      void *v_cache, const int32_t *block_tables, const int32_t *seq_lens,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float scale, int dtype,
                      int num_threads) {
    write_kv(k_cache, v_cache, k, k_stride, v, v_stride, slots, num_seqs, num_kv_heads * head_dim,
             dtype);
    return paged_decode_attention(out, q, q_stride, k_cache, v_cache, block_tables, seq_lens,
                                  num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                  max_blocks, scale, dtype, num_threads);
}

/* A decode-only step from the fused q/k/v projection, in one call: qkv [num_seqs,
 * num_heads + 2 * num_kv_heads, head_dim] (sequence stride qkv_stride, heads packed)
 * has its q and k heads rotated in place by RoPE (cos/sin [num_seqs, head_dim / 2]
 * contiguous; rotate_token of cpu_math.h, the reference's arithmetic), then k and v
 * are written and q attends as in paged_decode_step. */
int paged_decode_rope_step(void *out, void *qkv, int64_t qkv_stride, const void *cos,
                           const void *sin, const int64_t *slots, void *k_cache, void *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int dtype,
                           int num_threads) {
    const int64_t size = dtype == 0 ? 4 : 2, half = head_dim / 2;
    for (int64_t s = 0; s < num_seqs; s++) {
        char *x = (char *)qkv + s * qkv_stride * size;
        const char *c = (const char *)cos + s * half * size, *sn = (const char *)sin + s * half * size;
        if (dtype == 0) rotate_token(x, x, c, sn, num_heads + num_kv_heads, head_dim, 0);
        else rotate_token(x, x, c, sn, num_heads + num_kv_heads, head_dim, 1);
    }
    const char *k = (const char *)qkv + num_heads * head_dim * size;
    const char *v = k + num_kv_heads * head_dim * size;
    return paged_decode_step(out, qkv, qkv_stride, k, qkv_stride, v, qkv_stride, slots, k_cache,
                             v_cache, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
                             head_dim, block_size, max_blocks, scale, dtype, num_threads);
}
