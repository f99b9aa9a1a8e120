/*
 * The fused layer ops for CPUs, each one pass over its rows: RMSNorm with the
 * residual add before it, RoPE, and silu(gate) * up.
 *
 * dtype: 0 = float32, 1 = bfloat16. Every op computes what the torch reference
 * (parallel/kernels/reference.py) computes, rounding included: bf16 values are
 * widened to float32, each step the reference takes in bf16 is rounded back to
 * bf16 (round to nearest even) where the reference rounds, and the RMSNorm
 * statistics are float32. Only the order of the float32 sum of squares and the
 * exp in silu (``exp_poly`` of cpu_math.h) differ from torch.
 * Rows are split over OpenMP threads only when there are enough elements for
 * the fork to pay; a decode step at batch 1 runs on the calling thread.
 *
 * Strides are in elements; the last dimension is contiguous throughout.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

#define PARALLEL_MIN_ELEMENTS 65536

/* h = x + residual (residual may be NULL); out = norm(h) * weight; res_out = h
 * (not written when residual is NULL: the caller keeps x). One row, all contiguous. */
INLINE void norm_row(void *out, void *res_out, const void *x, const void *residual,
                     const void *weight, int64_t width, float eps, int dtype) {
    float sum = 0.0f;
    const void *h = x;
    if (residual != NULL) {
        for (int64_t i = 0; i < width; i++)
            store(res_out, i, in_dtype(load(x, i, dtype) + load(residual, i, dtype), dtype), dtype);
        h = res_out;
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; i++) sum += load(h, i, dtype) * load(h, i, dtype);
    const float inv = 1.0f / sqrtf(sum / (float)width + eps);
    for (int64_t i = 0; i < width; i++) {
        const float normed = in_dtype(load(h, i, dtype) * inv, dtype);
        store(out, i, normed * load(weight, i, dtype), dtype);
    }
}

/* x [rows, width] with row stride x_stride, residual with row stride r_stride;
 * out, res_out [rows, width] and weight [width] contiguous. */
int rms_norm_residual(void *out, void *res_out, const void *x, int64_t x_stride,
                      const void *residual, int64_t r_stride, const void *weight, int64_t rows,
                      int64_t width, float eps, int dtype, int num_threads) {
    const int64_t size = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        char *o = (char *)out + r * width * size;
        char *ro = res_out == NULL ? NULL : (char *)res_out + r * width * size;
        const char *xr = (const char *)x + r * x_stride * size;
        const char *rr = residual == NULL ? NULL : (const char *)residual + r * r_stride * size;
        if (dtype == 0) norm_row(o, ro, xr, rr, weight, width, eps, 0);
        else norm_row(o, ro, xr, rr, weight, width, eps, 1);
    }
    return 0;
}

/* GPT-NeoX half rotation: x [tokens, heads, head_dim] (token stride x_stride, heads
 * packed), cos/sin [tokens, head_dim / 2] contiguous -> out [tokens, heads, head_dim]
 * contiguous. As the reference: (x1 * c - x2 * s, x2 * c + x1 * s), each product
 * and each sum in the activation dtype. */
int rotate(void *out, const void *x, int64_t x_stride, const void *cos, const void *sin,
           int64_t tokens, int64_t heads, int64_t head_dim, int dtype, int num_threads) {
    const int64_t size = dtype == 0 ? 4 : 2, half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        char *o = (char *)out + t * heads * head_dim * size;
        const char *xt = (const char *)x + t * x_stride * size;
        const char *c = (const char *)cos + t * half * size, *s = (const char *)sin + t * half * size;
        if (dtype == 0) rotate_token(o, xt, c, s, heads, head_dim, 0);
        else rotate_token(o, xt, c, s, heads, head_dim, 1);
    }
    return 0;
}

/* One row: silu(gate) * up, silu rounded to the activation dtype before the product. */
INLINE void silu_row(void *out, const void *gate, const void *up, int64_t inter, int dtype) {
    for (int64_t i = 0; i < inter; i++) {
        const float g = load(gate, i, dtype);
        const float silu = in_dtype(g / (1.0f + exp_poly(-g)), dtype);
        store(out, i, silu * load(up, i, dtype), dtype);
    }
}

/* gate_up [rows, 2 * inter] (row stride in_stride) -> out [rows, inter] contiguous. */
int silu_and_mul(void *out, const void *gate_up, int64_t in_stride, int64_t rows, int64_t inter,
                 int dtype, int num_threads) {
    const int64_t size = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        char *o = (char *)out + r * inter * size;
        const char *g = (const char *)gate_up + r * in_stride * size;
        if (dtype == 0) silu_row(o, g, g + inter * size, inter, 0);
        else silu_row(o, g, g + inter * size, inter, 1);
    }
    return 0;
}
