/* Up to 16 float32 rows (a batch of decodes) times a q8_0 weight, reading the weight's int8
 * blocks as they are, once for the whole batch: `engine.models.quantized_linear.q8_0_linear`'s
 * product for a few rows, eagerly through ctypes and in the compiled graphs as the operator
 * `trio_llm::q8_0_rows` (its C shim is at the end of this file; the split over threads and the
 * shim's body are block_rows.h's). Torch has no product of rows with
 * int8 blocks and their scales: it dequantizes the whole weight (to bfloat16, then a matmul), which
 * writes and reads the weight again in a wider type on every step.
 *
 * Weight: int8 [n, k], row-major; scales: float32 [n, k / 32], one per block of 32 weights of a
 * row (GGUF's Q8_0). out[r, o] = sum over blocks b of scales[o, b] * (x[r, block b] . w[o, block
 * b]), in float32 (where the scale is applied, per product or per block, is each path's own
 * choice). The output rows are split in consecutive runs over OpenMP's team.
 * Written with GCC vector extensions (see causal_attention.c): the compiler picks the machine's
 * vectors (-march=native). Where the CPU has AVX-512, the same sums run on its intrinsics instead:
 * GCC turns the extensions' int8-to-float conversion of a whole vector into one scalar conversion
 * per lane, and the kernel read 1.3-2 GB/s of weights; AVX-512's sign extension converts 16
 * weights in one instruction (7-10 GB/s, one thread).
 *
 * Every loop asks for the weight PREFETCH_AHEAD bytes ahead of where it reads. The weight streams
 * from memory once per step, and the core's own prefetchers did not run far enough ahead of four
 * interleaved rows: the 0.5B shape's weights at one row took 36-48 ms on two threads without,
 * 26 ms with (a plain read of the same bytes: 24 ms; docs/benchmarks.md).
 */
#define _GNU_SOURCE /* lent_cpu.h: CPU sets, a thread's affinity */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "block_rows.h" /* BLOCK, MAX_ROWS, fetch_ahead, the split over threads, the C shim */
#include "lent_cpu.h"   /* a helper on the lent CPU, taking chunks of a one-thread call */

/* Input rows the int8 products take (MAX_ROWS at a time): a batch of decodes, and prompt steps of
 * up to 1,024 tokens, stay on the kernel, where a matmul of the dequantized weight would round the
 * rows to bfloat16 on a CPU that multiplies bfloat16 natively (q8_0_rows.py `INT8_MAX_ROWS`). */
#define INT8_MAX_ROWS 1024

struct rows_job {
    const float *x;
    const int8_t *w;
    const float *scales;
    float *out;
    long rows, n, k, first, end;
    const char *packed; /* NULL, or the weight's tiles as `q8_0_pack_tiles` lays them out (int8 products) */
};

#ifndef __AVX512F__
/* GCC vector extensions, for any CPU without AVX-512. */
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }

/* Eight int8 weights as floats: sign-extended to int32, then converted (two vector instructions;
 * int8 straight to float came out as eight scalar conversions). */
static inline v8f widen8(const int8_t *p) {
    v8b v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(__builtin_convertvector(v, v8i), v8f);
}

static inline float sum8(v8f v) {
    return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

/* One input row: its sums kept in one vector register per weight row. */
static void row_times(const struct rows_job *job) {
    long blocks = job->k / BLOCK;
    const float *x = job->x;
    for (long o = job->first; o < job->end; o++) {
        const int8_t *w = job->w + o * job->k;
        const float *s = job->scales + o * blocks;
        v8f total = {0};
        for (long b = 0; b < blocks; b++) {
            const int8_t *wb = w + b * BLOCK;
            const float *xb = x + b * BLOCK;
            fetch_ahead(wb);
            v8f part = load8(xb) * widen8(wb) + load8(xb + 8) * widen8(wb + 8) + load8(xb + 16) * widen8(wb + 16)
                       + load8(xb + 24) * widen8(wb + 24);
            total += part * s[b];
        }
        job->out[o] = sum8(total);
    }
}

static void rows_times(const struct rows_job *job) {
    if (job->rows == 1) {
        row_times(job);
        return;
    }
    long blocks = job->k / BLOCK;
    for (long o = job->first; o < job->end; o++) {
        const int8_t *w = job->w + o * job->k;
        const float *s = job->scales + o * blocks;
        v8f total[MAX_ROWS] = {{0}};
        for (long b = 0; b < blocks; b++) {
            const int8_t *wb = w + b * BLOCK;
            fetch_ahead(wb);
            v8f w0 = widen8(wb), w1 = widen8(wb + 8), w2 = widen8(wb + 16), w3 = widen8(wb + 24);
            for (long r = 0; r < job->rows; r++) {
                const float *xb = job->x + r * job->k + b * BLOCK;
                v8f part = load8(xb) * w0 + load8(xb + 8) * w1 + load8(xb + 16) * w2 + load8(xb + 24) * w3;
                total[r] += part * s[b];
            }
        }
        for (long r = 0; r < job->rows; r++)
            job->out[r * job->n + o] = sum8(total[r]);
    }
}

#else
/* AVX-512 intrinsics. Sixteen int8 weights as floats: */
static inline __m512 widen16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
}

/* One block of weight row w times the input row's block x, times the block's scale, added to acc. */
static inline __m512 block_times(__m512 acc, const float *x, const int8_t *w, float scale) {
    __m512 high = _mm512_mul_ps(_mm512_loadu_ps(x + 16), widen16(w + 16));
    __m512 part = _mm512_fmadd_ps(_mm512_loadu_ps(x), widen16(w), high);
    return _mm512_fmadd_ps(part, _mm512_set1_ps(scale), acc);
}

/* Sixteen sums at once: lane j of the result is the sum of v[j]'s lanes. Summing each vector on its
 * own (`_mm512_reduce_add_ps`) takes ~8 shuffles and additions a vector, for a product of k = 256
 * (a small model's hidden size) 16 multiply-adds; a tree of pairwise shuffles and additions sums
 * all sixteen in 45 and a permute: two vectors' partial sums per 128-bit quarter at each level,
 * until each quarter holds four whole sums. */
static const int32_t QUARTERS_TO_ORDER[16] __attribute__((aligned(64))) = {0, 4, 8, 12, 1, 5, 9, 13,
                                                                         2, 6, 10, 14, 3, 7, 11, 15};
static inline __m512 sum_each16(const __m512 v[16]) {
    __m512 halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: partial sums of v[2i], 8-15: of v[2i + 1] */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter q: four partial sums of v[4i + q] */
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* quarter q: two partial sums of v[8i + q], then two of v[8i + 4 + q] */
        pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
    /* quarter q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q]; lane 4q + p holds v[q + 4p]'s */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_load_si512((const void *)QUARTERS_TO_ORDER), sums);
}

/* Weight rows [o, o + W) against input rows [first_row, first_row + R), W * R <= 16: one register of
 * sums per pair, summed together by `sum_each16`. Each block of a weight row is dequantized once
 * (times its scale), then two products per input row. W and R are constants at each call
 * (`group_times`), so the loops unroll and the sums stay in registers (16 + a few of AVX-512's 32). */
static inline __attribute__((always_inline)) void tile_times(const struct rows_job *job, long o, long first_row,
                                                             const long W, const long R) {
    long k = job->k, blocks = k / BLOCK;
    __m512 sums[16];
    for (int j = 0; j < 16; j++)
        sums[j] = _mm512_setzero_ps();
    for (long blk = 0; blk < blocks; blk++) {
        for (long w = 0; w < W; w++) {
            const int8_t *weights = job->w + (o + w) * k + blk * BLOCK;
            fetch_ahead(weights);
            __m512 scale = _mm512_set1_ps(job->scales[(o + w) * blocks + blk]);
            __m512 low = _mm512_mul_ps(widen16(weights), scale), high = _mm512_mul_ps(widen16(weights + 16), scale);
            for (long r = 0; r < R; r++) {
                const float *x = job->x + (first_row + r) * k + blk * BLOCK;
                sums[w * R + r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), high,
                                                  _mm512_fmadd_ps(_mm512_loadu_ps(x), low, sums[w * R + r]));
            }
        }
    }
    float total[16];
    _mm512_storeu_ps(total, sum_each16(sums));
    for (long w = 0; w < W; w++)
        for (long r = 0; r < R; r++)
            job->out[(first_row + r) * job->n + o + w] = total[w * R + r];
}

/* The share's weight rows W at a time against input rows [first_row, first_row + R), then any last
 * few one at a time. */
static inline __attribute__((always_inline)) void tiles_times(const struct rows_job *job, long first_row, const long R,
                                                              const long W) {
    long o = job->first;
    for (; o + W <= job->end; o += W)
        tile_times(job, o, first_row, W, R);
    for (; o < job->end; o++)
        tile_times(job, o, first_row, 1, R);
}

/* Input rows [first_row, first_row + rows), 1 <= rows <= 8, against the share's weight rows, as many
 * weight rows at a time as fit 16 sums (eight for two rows ran slower than four: more streams to
 * prefetch). More rows go eight at a time: eight rows of x stay in L1 (a 0.5B model's 4,864
 * features: 156 KB for sixteen rows, 78 for eight), and sixteen sums of one weight row ran no
 * faster on the small model than two groups of eight. */
static void group_times(const struct rows_job *job, long first_row, long rows) {
    switch (rows) {
    case 1: tiles_times(job, first_row, 1, 4); break; /* the ninth of nine rows, say */
    case 2: tiles_times(job, first_row, 2, 4); break;
    case 3: tiles_times(job, first_row, 3, 5); break;
    case 4: tiles_times(job, first_row, 4, 4); break;
    case 5: tiles_times(job, first_row, 5, 3); break;
    case 6: tiles_times(job, first_row, 6, 2); break;
    case 7: tiles_times(job, first_row, 7, 2); break;
    default: tiles_times(job, first_row, 8, 2); break;
    }
}

/* One input row against four weight rows at a time, so four independent sums hide the additions'
 * latency: at one row the weight's bytes bound the product (it streams from memory once), and
 * four rows' streams prefetch better than sixteen (0.69 against 0.96 ms for the small Llama's LM
 * head on one thread, sixteen rows summed by `sum_each16`); a last few rows one at a time. */
static void one_row_times(const struct rows_job *job) {
    long blocks = job->k / BLOCK, k = job->k, o = job->first;
    for (; o + 4 <= job->end; o += 4) {
        const int8_t *w = job->w + o * k;
        const float *s = job->scales + o * blocks;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long b = 0; b < blocks; b++) {
            const float *x = job->x + b * BLOCK;
            const int8_t *wb = w + b * BLOCK;
            fetch_ahead(wb);
            fetch_ahead(wb + k);
            fetch_ahead(wb + 2 * k);
            fetch_ahead(wb + 3 * k);
            a0 = block_times(a0, x, wb, s[b]);
            a1 = block_times(a1, x, wb + k, s[blocks + b]);
            a2 = block_times(a2, x, wb + 2 * k, s[2 * blocks + b]);
            a3 = block_times(a3, x, wb + 3 * k, s[3 * blocks + b]);
        }
        job->out[o] = _mm512_reduce_add_ps(a0);
        job->out[o + 1] = _mm512_reduce_add_ps(a1);
        job->out[o + 2] = _mm512_reduce_add_ps(a2);
        job->out[o + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; o < job->end; o++) {
        const int8_t *w = job->w + o * k;
        const float *s = job->scales + o * blocks;
        __m512 total = _mm512_setzero_ps();
        for (long b = 0; b < blocks; b++)
            total = block_times(total, job->x + b * BLOCK, w + b * BLOCK, s[b]);
        job->out[o] = _mm512_reduce_add_ps(total);
    }
}

/* A share of the weight's rows against every input row: eight input rows at a time (`group_times`). */
static void rows_times(const struct rows_job *job) {
    if (job->rows == 1) {
        one_row_times(job);
        return;
    }
    for (long first = 0; first < job->rows; first += 8)
        group_times(job, first, job->rows - first < 8 ? job->rows - first : 8);
}
#endif

/* llama.cpp's arithmetic for a Q8_0 weight (`q8_0_rows_int8`, `--q8-0-activations int8`): each
 * input row rounded to int8 per block of 32 with a float scale of its own (Q8_0 itself), then int8 x
 * int8 products summed in int32 per block, each block's sum times the two scales. At a batch of
 * decodes the float loop above is bound by its FMAs (docs/benchmarks.md); with AVX-512 VNNI this
 * one does a quarter of the instructions. Without VNNI the same sums run one product at a time
 * (the same results, slowly: the option is for machines that have it).
 *
 * The same products in two levels (`q8_0_rows_int8x2`, what `--q8-0-activations auto` runs for a
 * large batch through short rows): each row's remainders after rounding, in 254ths of a step, as a
 * second int8 row, so that the values keep ~16 bits instead of 8, for half the speed of one level.
 *
 * `vpdpbusd` multiplies unsigned bytes by signed ones, each lane summing four products. The lanes
 * are 16 weight rows: a block of 16 rows (32 bytes each, row-major as the file has them) is
 * transposed in registers into 8 vectors of 4 bytes of each row (24 two-source permutes, once for
 * every input row), and made unsigned by adding 128 (so each sum gains 128 x the block's sum of
 * the input's int8 values, subtracted after). */
#define PACKED_BLOCK_BYTES (8 * 64 + 16 * 4) /* a tile's block, packed: 8 vectors of weights, 16 scales */

struct int8_rows {
    const int8_t *xq;    /* [rows, k] the input rows rounded to int8 per block */
    const float *dx;     /* [rows, k / 32] their scales */
    const int32_t *xsum; /* [rows, k / 32] 128 x each block's sum of int8 values */
    const int8_t *low;   /* NULL (one level), or [rows, k]: what xq leaves of each value, in 254ths of a step */
    const int32_t *low_sum; /* [rows, k / 32] 128 x each block's sum of `low` */
};

/* Round block b of row r of x [rows, k] (32 values v) to int8: scale = max |v| / 127 (as llama.cpp's
 * quantize_row_q8_0), values v * (127 / max) rounded to nearest, ties to even; with `low`, each
 * value's remainder too, in 254ths of a step (t - q is exact, and |t - q| <= 1/2: at most 127
 * 254ths, an int8). */
static inline void quantize_block(const float *v, float inv, int8_t *xq, int32_t *xsum, int8_t *low, int32_t *low_sum) {
#ifdef __AVX512F__
    int32_t sum = 0, rest = 0;
    for (int half = 0; half < 2; half++) {
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(v + 16 * half), _mm512_set1_ps(inv));
        __m512 q = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128((__m128i *)(xq + 16 * half), _mm512_cvtepi32_epi8(qi));
        sum += _mm512_reduce_add_epi32(qi);
        if (low != NULL) {
            __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t, q), _mm512_set1_ps(254.0f)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i li = _mm512_cvtps_epi32(l);
            _mm_storeu_si128((__m128i *)(low + 16 * half), _mm512_cvtepi32_epi8(li));
            rest += _mm512_reduce_add_epi32(li);
        }
    }
#else
    int32_t sum = 0, rest = 0;
    for (long i = 0; i < BLOCK; i++) {
        float t = v[i] * inv;
        int32_t q = (int32_t)nearbyintf(t);
        xq[i] = (int8_t)q;
        sum += q;
        if (low != NULL) {
            int32_t l = (int32_t)nearbyintf((t - (float)q) * 254.0f);
            low[i] = (int8_t)l;
            rest += l;
        }
    }
#endif
    *xsum = 128 * sum;
    if (low != NULL)
        *low_sum = 128 * rest;
}

/* Every block of x [rows, k] rounded by `quantize_block`; dx: each block's step (over 254 with `low`). */
static void quantize_rows(const float *x, long rows, long k, int8_t *xq, float *dx, int32_t *xsum, int8_t *low,
                          int32_t *low_sum) {
    long blocks = k / BLOCK;
    for (long r = 0; r < rows; r++)
        for (long b = 0; b < blocks; b++) {
            const float *v = x + r * k + b * BLOCK;
            float amax = 0.0f;
            for (long i = 0; i < BLOCK; i++)
                amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            long at = r * blocks + b;
            quantize_block(v, inv, xq + r * k + b * BLOCK, xsum + at, low == NULL ? NULL : low + r * k + b * BLOCK,
                           low_sum == NULL ? NULL : low_sum + at);
            dx[at] = amax / 127.0f / (low != NULL ? 254.0f : 1.0f);
        }
}

/* Weight row o against every input row, one product at a time (a last partial 16, or no VNNI). */
static void int8_one(const struct rows_job *job, const struct int8_rows *in, long o) {
    long k = job->k, blocks = k / BLOCK;
    for (long r = 0; r < job->rows; r++) {
        float total = 0.0f;
        for (long blk = 0; blk < blocks; blk++) {
            int32_t sum = 0, rest = 0;
            for (long i = 0; i < BLOCK; i++) {
                sum += (int32_t)job->w[o * k + blk * BLOCK + i] * in->xq[r * k + blk * BLOCK + i];
                if (in->low != NULL)
                    rest += (int32_t)job->w[o * k + blk * BLOCK + i] * in->low[r * k + blk * BLOCK + i];
            }
            if (in->low != NULL)
                sum = sum * 254 + rest;
            total += (float)sum * (job->scales[o * blocks + blk] * in->dx[r * blocks + blk]);
        }
        job->out[r * job->n + o] = total;
    }
}

#ifdef __AVX512VNNI__
/* The transpose's two-source permutes (`exchange`): for stage `bit`, EXCHANGE[bit][0] picks the new
 * first vector's lanes (those whose lane index bit `bit` is 0 from a, the others from b's lane with
 * that bit cleared), EXCHANGE[bit][1] the second's. */
static const int32_t EXCHANGE[3][2][16] __attribute__((aligned(64))) = {
    {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
     {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
    {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
     {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
    {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
     {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
};

/* One stage of the transpose: vectors a and b (vector index bit `bit` 0 and 1) exchange the lanes
 * whose lane index bit `bit` differs, so that bit moves from the vector index to the lane's. */
static inline void exchange(__m512i *a, __m512i *b, int bit) {
    __m512i na = _mm512_permutex2var_epi32(*a, _mm512_load_si512(EXCHANGE[bit][0]), *b);
    __m512i nb = _mm512_permutex2var_epi32(*a, _mm512_load_si512(EXCHANGE[bit][1]), *b);
    *a = na;
    *b = nb;
}

/* Block `blk` of weight rows [o, o + 16) as 8 vectors, vector t holding bytes 4t..4t+3 of every row
 * (lane i: row o + i), plus 128. Loaded as rows o + j and o + j + 8 in vector j, so that after the
 * three stages lane i is row o + i. */
static inline void transposed_block(const int8_t *w, long k, long o, long blk, __m512i t[8]) {
    for (int j = 0; j < 8; j++) {
        const int8_t *low = w + (o + j) * k + blk * BLOCK, *high = low + 8 * k;
        fetch_ahead(low);
        fetch_ahead(high);
        t[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const void *)low)),
                                  _mm256_loadu_si256((const void *)high), 1);
    }
    for (int bit = 0; bit < 3; bit++)
        for (int j = 0; j < 8; j++)
            if (!((j >> bit) & 1))
                exchange(&t[j], &t[j | (1 << bit)], bit);
    for (int j = 0; j < 8; j++)
        t[j] = _mm512_xor_si512(t[j], _mm512_set1_epi8((char)0x80));
}

/* `q8_0_pack_tiles`' layout, for weight rows [16 t, 16 t + 16) and block b at ((t * blocks) + b) *
 * PACKED_BLOCK_BYTES: `transposed_block`'s 8 vectors (128 added), then the 16 rows' scales. */
int q8_0_pack_tiles(const void *w, const float *scales, long n, long k, void *packed) {
    long blocks = k / BLOCK;
    for (long tile = 0; tile < n / 16; tile++)
        for (long blk = 0; blk < blocks; blk++) {
            char *at = (char *)packed + (tile * blocks + blk) * PACKED_BLOCK_BYTES;
            __m512i t[8];
            transposed_block(w, k, tile * 16, blk, t);
            for (int j = 0; j < 8; j++)
                _mm512_storeu_si512((void *)(at + 64 * j), t[j]);
            for (int i = 0; i < 16; i++)
                ((float *)(at + 512))[i] = scales[(tile * 16 + i) * blocks + blk];
        }
    return 0;
}

/* Every input row against weight rows [o, o + 16), the rows in `levels` (1 or 2) int8 parts. */
static inline __attribute__((always_inline)) void int8_sixteen(const struct rows_job *job, const struct int8_rows *in,
                                                               long o, const int levels) {
    long k = job->k, blocks = k / BLOCK, rows = job->rows;
    __m512 acc[MAX_ROWS];
    for (long r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    __m512i scale_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)blocks));
    for (long blk = 0; blk < blocks; blk++) {
        __m512i t[8];
        __m512 dw;
        if (job->packed != NULL) { /* laid out once at load: no permutes, no gather */
            const char *tile = job->packed + ((o / 16) * blocks + blk) * PACKED_BLOCK_BYTES;
            fetch_ahead(tile);
            fetch_ahead(tile + 256);
            for (int j = 0; j < 8; j++)
                t[j] = _mm512_loadu_si512((const void *)(tile + 64 * j));
            dw = _mm512_loadu_ps((const float *)(tile + 512));
        } else {
            transposed_block(job->w, k, o, blk, t);
            dw = _mm512_i32gather_ps(scale_at, job->scales + o * blocks + blk, 4);
        }
        for (long r = 0; r < rows; r++) {
            const int32_t *xr = (const int32_t *)(in->xq + r * k + blk * BLOCK);
            /* Each sum in two chains of four products (integers: the same sums), whose latencies
             * overlap: 0.94-0.95x the time of one chain of eight at 16 rows on a Zen 4. */
            __m512i sum = _mm512_set1_epi32(-in->xsum[r * blocks + blk]), half = _mm512_setzero_si512();
            for (int u = 0; u < 4; u++) {
                sum = _mm512_dpbusd_epi32(sum, t[u], _mm512_set1_epi32(xr[u]));
                half = _mm512_dpbusd_epi32(half, t[u + 4], _mm512_set1_epi32(xr[u + 4]));
            }
            sum = _mm512_add_epi32(sum, half);
            if (levels == 2) { /* the remainders: 254ths of a step, summed apart (independent chains) */
                const int32_t *lr = (const int32_t *)(in->low + r * k + blk * BLOCK);
                __m512i rest = _mm512_set1_epi32(-in->low_sum[r * blocks + blk]), other = _mm512_setzero_si512();
                for (int u = 0; u < 4; u++) {
                    rest = _mm512_dpbusd_epi32(rest, t[u], _mm512_set1_epi32(lr[u]));
                    other = _mm512_dpbusd_epi32(other, t[u + 4], _mm512_set1_epi32(lr[u + 4]));
                }
                rest = _mm512_add_epi32(rest, other);
                /* 254 x sum + rest: |254 x sum| <= 32 * 127 * 127 * 254, well inside int32 */
                sum = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(sum, 8), _mm512_slli_epi32(sum, 1)), rest);
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(in->dx[r * blocks + blk])),
                                     acc[r]);
        }
    }
    for (long r = 0; r < rows; r++)
        _mm512_storeu_ps(job->out + r * job->n + o, acc[r]);
}

#endif

#ifndef __AVX512VNNI__
int q8_0_pack_tiles(const void *w, const float *scales, long n, long k, void *packed) {
    (void)w, (void)scales, (void)n, (void)k, (void)packed;
    return -1; /* the tiles are VNNI's layout: nothing reads them without it */
}
#endif

/* Rows [first, first + count) of the rounded input: the same arrays from that row on. */
static struct int8_rows int8_rows_from(const struct int8_rows *in, long first, long k) {
    long blocks = k / BLOCK;
    struct int8_rows part = {in->xq + first * k, in->dx + first * blocks, in->xsum + first * blocks,
                             in->low != NULL ? in->low + first * k : NULL,
                             in->low_sum != NULL ? in->low_sum + first * blocks : NULL};
    return part;
}

/* Weight rows [job->first, job->end) against every input row, MAX_ROWS input rows at a time (a
 * batch of up to INT8_MAX_ROWS decodes reads the weight once per MAX_ROWS of them). */
static void int8_share(const struct rows_job *job, const struct int8_rows *in) {
    for (long first = 0; first < job->rows; first += MAX_ROWS) {
        struct rows_job part = *job;
        part.rows = job->rows - first < MAX_ROWS ? job->rows - first : MAX_ROWS;
        part.x = job->x + first * job->k;
        part.out = job->out + first * job->n;
        struct int8_rows rows = int8_rows_from(in, first, job->k);
        long o = job->first;
#ifdef __AVX512VNNI__
        for (; o + 16 <= job->end; o += 16)
            if (rows.low != NULL)
                int8_sixteen(&part, &rows, o, 2);
            else
                int8_sixteen(&part, &rows, o, 1);
#endif
        for (; o < job->end; o++)
            int8_one(&part, &rows, o);
    }
}

/* A one-thread call's rows in chunks for `lent_run`: whole tiles of 16 (the last chunk takes the
 * tail) of about LENT_CHUNK_BYTES of weight, so that a claim is a small part of one and a wide
 * weight of few rows (a 0.5B model's down projection: 896 rows of 4,864 features) is shared too.
 * Past 16 input rows (prompts) a chunk holds 16 / rows of that, so that it costs what a batch of
 * decodes' chunk does and a small model's narrow layers (256-512 weight rows) are shared as well:
 * the small Llama's layers at 128 rows took 0.72x the time (0.93x beside a neighbour busy 2 ms of
 * every 5 on the helper's CPU). Decodes keep whole 128 KB chunks: sharing narrow layers there too
 * measured 0.95x alone but 1.27x beside that neighbour (docs/benchmarks.md). */
#define LENT_CHUNK_BYTES (128 * 1024)

static long lent_chunk_rows(long k, long input_rows) {
    long bytes = input_rows > 16 ? LENT_CHUNK_BYTES * 16 / input_rows : LENT_CHUNK_BYTES;
    long rows = bytes / (k + k / BLOCK * 4) / 16 * 16;
    return rows < 16 ? 16 : rows;
}

/* How many chunks a one-thread call of `input_rows` rows through an n x k weight is shared in with
 * the helper: 1 (not shared) below two whole chunks. */
long q8_0_lent_chunks(long n, long k, long input_rows) {
    long chunk_rows = lent_chunk_rows(k, input_rows);
    return n >= 2 * chunk_rows ? (n + chunk_rows - 1) / chunk_rows : 1;
}

struct int8_chunks {
    const struct rows_job *whole;
    const struct int8_rows *in;
    long rows; /* a chunk's */
};

static void int8_chunk(const void *ctx, long chunk) {
    const struct int8_chunks *c = ctx;
    struct rows_job job = *c->whole;
    job.first = chunk * c->rows;
    job.end = job.first + c->rows < job.n ? job.first + c->rows : job.n;
    int8_share(&job, c->in);
}

/* Whether this build multiplies int8 rows with AVX-512 VNNI (`q8_0_rows_int8` runs everywhere): 1 or 0. */
int q8_0_rows_int8_fast(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

/* As `q8_0_rows_f32`, with the input rows rounded to int8 per block first, in `levels` parts: one
 * (llama.cpp's Q8_0 x Q8_0 arithmetic, above), or two: each value's remainder after the first, in
 * 254ths of its step, as a second int8 row (`q8_0_rows_int8x2`). Two levels hold each value to
 * within 1/508 of its block's step (max |x| / 127), 1/64,516 of the block's largest value: about
 * float16's precision for the largest values, where one level's error is 254 times that. The two
 * sums of a block are independent chains of VNNI products, joined as 254 x the first plus the
 * second. Returns 0, or -1 for a shape this kernel does not take. */
static int int8_rows_times(const float *x, const void *w, const float *scales, float *out, long rows, long n, long k,
                           long threads, int levels, const void *packed) {
    if (k % BLOCK != 0 || rows < 1 || rows > INT8_MAX_ROWS)
        return -1;
    long scales_per_row = k / BLOCK;
    char *memory = malloc(levels * (rows * k + rows * scales_per_row * sizeof(int32_t)) + rows * scales_per_row * sizeof(float));
    if (memory == NULL)
        return -1;
    float *dx = (float *)memory; /* k is a multiple of 32: everything after stays aligned */
    int32_t *xsum = (int32_t *)(dx + rows * scales_per_row);
    int32_t *low_sum = levels == 2 ? xsum + rows * scales_per_row : NULL;
    int8_t *xq = (int8_t *)(xsum + levels * rows * scales_per_row);
    int8_t *low = levels == 2 ? xq + rows * k : NULL;
    quantize_rows(x, rows, k, xq, dx, xsum, low, low_sum);
    struct int8_rows in = {xq, dx, xsum, low, low_sum};
    threads = threads < 1 ? 1 : threads > (n + 15) / 16 ? (n + 15) / 16 : threads;
    struct rows_job whole = {x, w, scales, out, rows, n, k, 0, n, packed};
    long shared_chunks = q8_0_lent_chunks(n, k, rows);
    if (threads == 1 && atomic_load(&lent.started) && shared_chunks > 1) {
        struct int8_chunks chunks = {&whole, &in, lent_chunk_rows(k, rows)};
        lent_run(int8_chunk, &chunks, shared_chunks);
    } else {
#pragma omp parallel num_threads(threads)
        {
            struct rows_job job = whole;
            thread_range(n, omp_get_thread_num(), omp_get_num_threads(), &job.first, &job.end);
            int8_share(&job, &in);
        }
    }
    free(memory);
    return 0;
}

/* Start the helper that takes chunks of one-thread calls of a large weight (lent_cpu.h) on `cpus`;
 * 0 when it runs. Once per process. */
int q8_0_lend_cpus(const int *cpus, long count) { return count < 1 ? -1 : lent_cpu_start(cpus, count); }

/* Chunks 0..chunks-1 of `run(ctx, chunk)`, shared with the helper where it runs (else all on the
 * calling thread): for other kernels' one-thread calls (paged_decode.c). Returns 0. */
int q8_0_lent_share(chunk_fn run, const void *ctx, long chunks) {
    if (atomic_load(&lent.started))
        lent_run(run, ctx, chunks);
    else
        for (long chunk = 0; chunk < chunks; chunk++)
            run(ctx, chunk);
    return 0;
}

int q8_0_rows_int8(const float *x, const void *w, const float *scales, float *out, long rows, long n, long k,
                   long threads) {
    return int8_rows_times(x, w, scales, out, rows, n, k, threads, 1, NULL);
}

int q8_0_rows_int8x2(const float *x, const void *w, const float *scales, float *out, long rows, long n, long k,
                     long threads) {
    return int8_rows_times(x, w, scales, out, rows, n, k, threads, 2, NULL);
}

/* One thread's share of a call (block_rows.h `split_rows`). */
static void share(const float *x, const void *w, const float *scales, float *out, long rows, long n, long k, long first,
                  long end) {
    struct rows_job job = {x, w, scales, out, rows, n, k, first, end, NULL};
    rows_times(&job);
}

/* x: float32 [rows, k]; w, scales as above; out: float32 [rows, n]; on `threads` threads of
 * OpenMP's team. Returns 0, or -1 for a shape this kernel does not take. */
int q8_0_rows_f32(const float *x, const void *w, const float *scales, float *out, long rows, long n, long k,
                  long threads) {
    return split_rows(share, x, w, scales, out, rows, n, k, threads);
}

/* `--q8-0-activations auto` (the default): float32 rows (`q8_0_rows_f32`), but a batch of at least
 * TWO_LEVELS_FROM_ROWS rows through a weight of at most TWO_LEVELS_UP_TO_K features in two int8
 * levels (`q8_0_rows_int8x2`) where the CPU has AVX-512 VNNI. There the float kernel's sums are
 * short (k / 32 blocks each, 8 at k = 256) and each costs as many instructions as it has products;
 * the int8 levels took 0.66-0.78x its time at 10-16 rows on the small Llama's LM head and its
 * 256-feature layers, and 0.9-1.1x at k = 768-896 (a 0.5B model's), where they are not used
 * (docs/benchmarks.md, "Two int8 levels"). */
#define TWO_LEVELS_FROM_ROWS 10
#define TWO_LEVELS_UP_TO_K 512
int q8_0_rows_auto(const float *x, const void *w, const float *scales, float *out, long rows, long n, long k,
                   long threads) {
#ifdef __AVX512VNNI__
    if (rows >= TWO_LEVELS_FROM_ROWS && k <= TWO_LEVELS_UP_TO_K)
        return int8_rows_times(x, w, scales, out, rows, n, k, threads, 2, NULL);
#endif
    return q8_0_rows_f32(x, w, scales, out, rows, n, k, threads);
}

/* `q8_0_rows_auto` for a weight whose whole tiles are also laid out by `q8_0_pack_tiles` (`packed`):
 * the two levels read them instead of transposing each tile's blocks at every call, and then win
 * at every row count, one included (the small Llama's LM head 0.53-0.73x the float kernel's time
 * at 1-16 rows, its 256-feature layers about half; at one row the 0.5B shape's 896-feature layers
 * and head 0.41-0.61x on one thread, near memory speed where the float kernel is bound by its
 * instructions; docs/benchmarks.md), so every batch of decodes takes them: a request's arithmetic
 * no longer depends on how many share its step. */
int q8_0_rows_auto_packed(const float *x, const void *w, const float *scales, const void *packed, float *out,
                          long rows, long n, long k, long threads) {
#ifdef __AVX512VNNI__
    return int8_rows_times(x, w, scales, out, rows, n, k, threads, 2, packed);
#endif
    return q8_0_rows_f32(x, w, scales, out, rows, n, k, threads);
}

/* The kernel as the operator `trio_llm::q8_0_rows` (engine/kernels/q8_0_rows.py; block_rows.h). */
AOTITorchError aoti_torch_cpu_q8_0_rows(AtenTensorHandle rows, AtenTensorHandle qweight, AtenTensorHandle params,
                                     AtenTensorHandle *ret0) {
    return shim_rows(q8_0_rows_f32, rows, qweight, params, ret0);
}

/* `q8_0_rows_auto` as the operator `trio_llm::q8_0_rows_auto` (`--q8-0-activations auto`). */
AOTITorchError aoti_torch_cpu_q8_0_rows_auto(AtenTensorHandle rows, AtenTensorHandle qweight, AtenTensorHandle params,
                                          AtenTensorHandle *ret0) {
    return shim_rows(q8_0_rows_auto, rows, qweight, params, ret0);
}

/* `q8_0_rows_auto_packed` as the operator `trio_llm::q8_0_rows_packed` (auto, with packed tiles). */
AOTITorchError aoti_torch_cpu_q8_0_rows_packed(AtenTensorHandle rows, AtenTensorHandle qweight, AtenTensorHandle params,
                                            AtenTensorHandle packed, AtenTensorHandle *ret0) {
    int64_t *row_sizes, *weight_sizes;
    void *x, *w, *p, *t, *out;
    if (aoti_torch_get_sizes(rows, &row_sizes) || aoti_torch_get_sizes(qweight, &weight_sizes))
        return 1;
    int64_t sizes[2] = {row_sizes[0], weight_sizes[0]}, strides[2] = {weight_sizes[0], 1};
    if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, ret0)
        || aoti_torch_get_data_ptr(rows, &x) || aoti_torch_get_data_ptr(qweight, &w)
        || aoti_torch_get_data_ptr(params, &p) || aoti_torch_get_data_ptr(packed, &t)
        || aoti_torch_get_data_ptr(*ret0, &out))
        return 1;
    return q8_0_rows_auto_packed(x, w, p, t, out, sizes[0], sizes[1], row_sizes[1], omp_get_max_threads()) != 0;
}

/* `q8_0_rows_int8` as the operator `trio_llm::q8_0_rows_int8` (`--q8-0-activations int8`). */
AOTITorchError aoti_torch_cpu_q8_0_rows_int8(AtenTensorHandle rows, AtenTensorHandle qweight, AtenTensorHandle params,
                                          AtenTensorHandle *ret0) {
    return shim_rows(q8_0_rows_int8, rows, qweight, params, ret0);
}
