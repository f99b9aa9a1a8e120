/*
 * bf16 linears for a few rows (decode at batch 1-8): y = x W^T + b.
 *
 * x [m, k] bf16 (rows ``x_stride`` elements apart), W [n, k] bf16 row-major and
 * contiguous, b [n] bf16 or NULL -> y [m, n] bf16 contiguous, m <= GEMV_MAX_ROWS.
 * At these row counts a linear only streams its weight once, so this kernel is
 * built for the read: each thread takes a contiguous band of W's rows (the
 * output dimension is split over the threads) and reads it front to back, four
 * rows at a time (two past four rows of x, to keep the accumulators in
 * registers), against every row of x. Products and sums are float32 (AVX-512
 * BF16 ``vdpbf16ps``: bf16 products are exact in float32), the bias is added in
 * float32 and the output is rounded once to bf16 (nearest even), as oneDNN does;
 * only the order of the float32 sums differs.
 *
 * Compiled only where the compiler targets AVX-512 BF16 (``-march=native`` on such
 * a CPU); elsewhere ``gemv_available`` returns 0 and the caller keeps oneDNN.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_math.h"

#define GEMV_MAX_ROWS 8
/* Weight rows one pass reads together (one accumulator per row and x row):
 * BLOCK for up to four rows of x, SMALL_BLOCK for more (at most 16 accumulators). */
#define BLOCK 4
#define SMALL_BLOCK 2
/* Below this many weight elements the calling thread reads the weight alone. */
#define PARALLEL_MIN_ELEMENTS 32768
/* How many weight rows ahead the loads are prefetched: each pass reads BLOCK short
 * streams (a row is a few KiB), which the hardware prefetcher barely picks up
 * before the pass moves on; without this a thread reads at about two thirds of
 * the bandwidth. */
#define PREFETCH_ROWS 16

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

int gemv_available(void) { return 1; }

/* 32 bf16 elements from p, the ones past ``mask`` read as zero. */
INLINE __m512bh load_bf16(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* The sums of the 16 lanes of a, b, c and d, in one vector: a tree of adds that
 * shares its shuffles between the four. */
INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(v) _mm256_add_ps(_mm512_castps512_ps256(v), \
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    const __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b));
    const __m256 cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* Rows [row, row + nb) of W against the m rows of x. m and nb are literals at each
 * call and the loops over them are unrolled before GCC's scalar replacement, so
 * the m * nb accumulators live in registers rather than on the stack. */
INLINE void tile(uint16_t *y, int64_t n, const uint16_t *x, int64_t x_stride, const uint16_t *w,
                 const uint16_t *bias, int64_t row, int64_t k, int m, int nb) {
    __m512 acc[GEMV_MAX_ROWS][BLOCK];
    #pragma GCC unroll 8
    for (int i = 0; i < m; i++)
        #pragma GCC unroll 8
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *wr = w + row * k;
    for (int64_t kk = 0; kk < k; kk += 32) {
        const __mmask32 mask = k - kk >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (k - kk)) - 1);
        __m512bh wv[BLOCK];
        #pragma GCC unroll 8
        for (int j = 0; j < nb; j++) {
            _mm_prefetch((const char *)(wr + (PREFETCH_ROWS + j) * k + kk), _MM_HINT_T0);
            wv[j] = load_bf16(wr + j * k + kk, mask);
        }
        #pragma GCC unroll 8
        for (int i = 0; i < m; i++) {
            const __m512bh xv = load_bf16(x + i * x_stride + kk, mask);
            #pragma GCC unroll 8
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < m; i++) {
        float sums[BLOCK];
        if (nb == BLOCK) _mm_storeu_ps(sums, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        else for (int j = 0; j < nb; j++) sums[j] = _mm512_reduce_add_ps(acc[i][j]);
        #pragma GCC unroll 8
        for (int j = 0; j < nb; j++) {
            const float b = bias == NULL ? 0.0f : bf16_to_f32(bias[row + j]);
            y[i * n + row + j] = f32_to_bf16(sums[j] + b);
        }
    }
}

/* Rows [start, end) of W for m rows of x (m a literal). */
INLINE void band(uint16_t *y, int64_t n, const uint16_t *x, int64_t x_stride, const uint16_t *w,
                 const uint16_t *bias, int64_t start, int64_t end, int64_t k, int m) {
    const int block = m > 4 ? SMALL_BLOCK : BLOCK;
    int64_t row = start;
    for (; row + block <= end; row += block) tile(y, n, x, x_stride, w, bias, row, k, m, block);
    for (; row < end; row++) tile(y, n, x, x_stride, w, bias, row, k, m, 1);
}

static void band_rows(uint16_t *y, int64_t n, const uint16_t *x, int64_t x_stride,
                      const uint16_t *w, const uint16_t *bias, int64_t start, int64_t end,
                      int64_t k, int64_t m) {
    switch (m) {
    case 1: band(y, n, x, x_stride, w, bias, start, end, k, 1); break;
    case 2: band(y, n, x, x_stride, w, bias, start, end, k, 2); break;
    case 3: band(y, n, x, x_stride, w, bias, start, end, k, 3); break;
    case 4: band(y, n, x, x_stride, w, bias, start, end, k, 4); break;
    case 5: band(y, n, x, x_stride, w, bias, start, end, k, 5); break;
    case 6: band(y, n, x, x_stride, w, bias, start, end, k, 6); break;
    case 7: band(y, n, x, x_stride, w, bias, start, end, k, 7); break;
    default: band(y, n, x, x_stride, w, bias, start, end, k, 8); break;
    }
}

/* Returns 0, or -1 when m is out of range (nothing written). */
int gemv_bf16(uint16_t *y, const uint16_t *x, int64_t x_stride, const uint16_t *w,
              const uint16_t *bias, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m < 1 || m > GEMV_MAX_ROWS) return -1;
    if (num_threads < 1 || n * k < PARALLEL_MIN_ELEMENTS) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t t = 0, threads = 1;
#endif
        /* Bands of whole blocks, so only the last band has a ragged end. */
        const int64_t blocks = (n + BLOCK - 1) / BLOCK;
        const int64_t start = blocks * t / threads * BLOCK;
        const int64_t stop = blocks * (t + 1) / threads * BLOCK;
        band_rows(y, n, x, x_stride, w, bias, start, stop < n ? stop : n, k, m);
    }
    return 0;
}

#else

int gemv_available(void) { return 0; }

int gemv_bf16(uint16_t *y, const uint16_t *x, int64_t x_stride, const uint16_t *w,
              const uint16_t *bias, int64_t m, int64_t n, int64_t k, int num_threads) {
    (void)y, (void)x, (void)x_stride, (void)w, (void)bias, (void)m, (void)n, (void)k;
    (void)num_threads;
    return -1;
}

#endif
