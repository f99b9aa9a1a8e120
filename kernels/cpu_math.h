/*
 * Scalar helpers the CPU C kernels share: bf16 <-> float32, a vectorizable exp,
 * element access in either activation dtype, and the RoPE of one token.
 *
 * bf16 is the top half of a float32: widening is a shift; narrowing rounds to
 * nearest even (NaN stays NaN), as torch does. Both are branch-free so that
 * loops over them vectorize. exp_poly is Cephes' expf polynomial after a
 * round-to-nearest range reduction, within about 2 ulp of expf, and, unlike a
 * call to expf, it vectorizes.
 */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* A float32 rounded to the nearest bf16, kept as float32. */
INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

INLINE float exp_poly(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    /* n = round(x / ln 2): adding and taking away 1.5 * 2^23 rounds to an integer. */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Element i of a float32 (dtype 0) or bf16 (dtype 1) array, as float32. Called
 * with a literal dtype, so each op compiles into one loop per dtype. */
INLINE float load(const void *base, int64_t i, int dtype) {
    return dtype == 0 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

INLINE void store(void *base, int64_t i, float v, int dtype) {
    if (dtype == 0) ((float *)base)[i] = v;
    else ((uint16_t *)base)[i] = f32_to_bf16(v);
}

/* In the activation dtype: float32 as is, bf16 rounded. */
INLINE float in_dtype(float v, int dtype) { return dtype == 0 ? v : round_bf16(v); }

/* RoPE of one token, GPT-NeoX half rotation as the reference: x [heads, head_dim]
 * packed, cos/sin [head_dim / 2] -> out, packed: (x1 * c - x2 * s, x2 * c + x1 * s),
 * each product and each sum in the activation dtype. out may be x (each pair is
 * read before it is written). */
INLINE void rotate_token(void *out, const void *x, const void *cos, const void *sin,
                         int64_t heads, int64_t head_dim, int dtype) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t o = h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float c = load(cos, i, dtype), s = load(sin, i, dtype);
            const float x1 = load(x, o + i, dtype), x2 = load(x, o + half + i, dtype);
            store(out, o + i, in_dtype(x1 * c, dtype) - in_dtype(x2 * s, dtype), dtype);
            store(out, o + half + i, in_dtype(x2 * c, dtype) + in_dtype(x1 * s, dtype), dtype);
        }
    }
}

#endif
