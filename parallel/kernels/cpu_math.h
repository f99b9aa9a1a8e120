/*
 * Scalar helpers the CPU C kernels share: bf16 <-> float32 and a vectorizable exp.
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

#endif
