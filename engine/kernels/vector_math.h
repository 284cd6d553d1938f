/* Float vectors of the machine's width and the arithmetic the attention kernels share
 * (causal_attention.c, paged_decode.c), written with GCC vector extensions so the compiler picks
 * the machine's vector registers (-march=native): 16 lanes with AVX-512, else 8. */
#ifndef TRIO_LLM_VECTOR_MATH_H
#define TRIO_LLM_VECTOR_MATH_H

#include <string.h>

#if defined(__AVX512F__)
#define VW 16 /* floats per vector */
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int vi __attribute__((vector_size(VW * 4)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){0} + x; }

/* exp(x) for x <= 0 (a score minus its row's maximum): 2^n e^r with |r| <= ln2 / 2 and Cephes'
 * expf polynomial for e^r. Below -87.3 it returns 2^-126 instead of underflowing. */
static inline vf vexp(vf x) {
    const vf lowest = vsplat(-87.33f);
    vi below = x < lowest;
    x = (vf)(((vi)x & ~below) | ((vi)lowest & below));
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf t = x * 1.44269504088896341f + magic;
    vf n = t - magic;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f; /* x - n ln2, ln2 in two parts */
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi two_n = (((vi)t - 0x4B400000) + 127) << 23;
    return p * (vf)two_n;
}

static inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

/* The sum of a vector's lanes, by halving (a tree, not a chain of dependent adds). */
static inline float lane_sum(vf x) {
#if VW == 16
    x += __builtin_shuffle(x, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return x[0];
}

#endif
