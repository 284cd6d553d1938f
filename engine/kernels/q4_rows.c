/* Up to 16 float32 rows (a batch of decodes) times a 4-bit block weight (`q4_0`, `q4_1`, `q4_k`:
 * engine/models/quantized_linear.py), reading the weight's packed steps as they are, once for the
 * whole batch: eagerly through ctypes and in the compiled graphs as the operator
 * `trio_llm::q4_rows` (its C shim is at the end of this file). The 4-bit sibling of q8_0_rows.c,
 * laid out the same way; see that file for why each loop is shaped as it is.
 *
 * Weight: uint8 [n, k / 2], row-major, each block of 32 weights of a row in 16 bytes: byte j holds
 * step j in its low half and step j + 16 in its high half (GGUF's Q4_0 layout, which Q4_1's shares
 * and Q4_K's is rearranged into at load). Params: float32 [n, k / 32, 2], per block (scale, low):
 * weight = scale * step + low. GGUF's Q4_0 (d, -8 d), Q4_1 (d, m) and Q4_K (d * sc, -dmin * m per
 * 32 of its 256) all come to this exactly in float32. out[r, o] = sum over the row of x[r] * w[o],
 * summed in float32. Several input rows form each block's weights once, fma(step, scale, low), for
 * all of them; one input row instead sums each block's steps times x, scales that once, and adds
 * low * (the sum of x's block) as a scalar: one vector multiply-add fewer per 16 weights, which is
 * what this loop is bound by (standalone, one row of the 0.5B shape's weights: 5-20% faster).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "block_rows.h" /* BLOCK, MAX_ROWS, fetch_ahead, the split over threads, the C shim */

#define BLOCK_BYTES 16

struct rows_job {
    const float *x;
    const uint8_t *w;
    const float *params;
    float *out;
    long rows, n, k, first, end;
};

#ifndef __AVX512F__
/* Portable form for CPUs without AVX-512: each block of a weight row dequantized into 32 floats
 * once, then one dot product per input row. */
static void rows_times(const struct rows_job *job) {
    long blocks = job->k / BLOCK;
    for (long o = job->first; o < job->end; o++) {
        const uint8_t *w = job->w + o * (job->k / 2);
        const float *p = job->params + o * blocks * 2;
        float total[MAX_ROWS] = {0};
        for (long b = 0; b < blocks; b++) {
            const uint8_t *wb = w + b * BLOCK_BYTES;
            float weights[BLOCK];
            fetch_ahead(wb);
            for (int j = 0; j < BLOCK_BYTES; j++) {
                weights[j] = (float)(wb[j] & 15) * p[2 * b] + p[2 * b + 1];
                weights[j + 16] = (float)(wb[j] >> 4) * p[2 * b] + p[2 * b + 1];
            }
            for (long r = 0; r < job->rows; r++) {
                const float *xb = job->x + r * job->k + b * BLOCK;
                float sum = 0;
                for (int j = 0; j < BLOCK; j++)
                    sum += xb[j] * weights[j];
                total[r] += sum;
            }
        }
        for (long r = 0; r < job->rows; r++)
            job->out[r * job->n + o] = total[r];
    }
}

#else
/* One block of a weight row as two vectors of 16 weights: the steps widened from their half-bytes,
 * then scale * step + low. */
static inline void block_weights(const uint8_t *w, const float *p, __m512 *first, __m512 *second) {
    __m128i bytes = _mm_loadu_si128((const void *)w), mask = _mm_set1_epi8(15);
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    __m512 scale = _mm512_set1_ps(p[0]), offset = _mm512_set1_ps(p[1]);
    *first = _mm512_fmadd_ps(low, scale, offset);
    *second = _mm512_fmadd_ps(high, scale, offset);
}

/* Input rows [first_row, first_row + ROWS) against weight rows o and o + 1, each block of the two
 * dequantized once (q8_0_rows.c's `pair_times`). */
static inline __attribute__((always_inline)) void pair_times(const struct rows_job *job, long o, long first_row,
                                                             const long ROWS) {
    long k = job->k, blocks = k / BLOCK;
    const uint8_t *w0 = job->w + o * (k / 2), *w1 = w0 + k / 2;
    const float *p0 = job->params + o * blocks * 2, *p1 = p0 + blocks * 2;
    __m512 a[8], b[8];
    for (long r = 0; r < ROWS; r++)
        a[r] = b[r] = _mm512_setzero_ps();
    for (long blk = 0; blk < blocks; blk++) {
        fetch_ahead(w0 + blk * BLOCK_BYTES);
        fetch_ahead(w1 + blk * BLOCK_BYTES);
        __m512 a0, a1, b0, b1;
        block_weights(w0 + blk * BLOCK_BYTES, p0 + 2 * blk, &a0, &a1);
        block_weights(w1 + blk * BLOCK_BYTES, p1 + 2 * blk, &b0, &b1);
        for (long r = 0; r < ROWS; r++) {
            const float *x = job->x + (first_row + r) * k + blk * BLOCK;
            __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
            a[r] = _mm512_fmadd_ps(x1, a1, _mm512_fmadd_ps(x0, a0, a[r]));
            b[r] = _mm512_fmadd_ps(x1, b1, _mm512_fmadd_ps(x0, b0, b[r]));
        }
    }
    for (long r = 0; r < ROWS; r++) {
        job->out[(first_row + r) * job->n + o] = _mm512_reduce_add_ps(a[r]);
        job->out[(first_row + r) * job->n + o + 1] = _mm512_reduce_add_ps(b[r]);
    }
}

static void pairs_times(const struct rows_job *job, long o) {
    for (long first = 0; first < job->rows; first += 8) {
        switch (job->rows - first < 8 ? job->rows - first : 8) {
        case 1: pair_times(job, o, first, 1); break;
        case 2: pair_times(job, o, first, 2); break;
        case 3: pair_times(job, o, first, 3); break;
        case 4: pair_times(job, o, first, 4); break;
        case 5: pair_times(job, o, first, 5); break;
        case 6: pair_times(job, o, first, 6); break;
        case 7: pair_times(job, o, first, 7); break;
        default: pair_times(job, o, first, 8); break;
        }
    }
}

/* One block of weight row w (scale s) times the input row's block x (x0, x1), its steps' products
 * scaled once and added to acc; the block's low times the sum of x's block is added by the caller
 * (`rows_times`), a scalar per block: one multiply-add fewer per 16 weights than dequantizing. */
static inline __m512 steps_times(__m512 acc, __m512 x0, __m512 x1, const uint8_t *w, float scale) {
    __m128i bytes = _mm_loadu_si128((const void *)w), mask = _mm_set1_epi8(15);
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    return _mm512_fmadd_ps(_mm512_fmadd_ps(x1, high, _mm512_mul_ps(x0, low)), _mm512_set1_ps(scale), acc);
}

/* One block of weight row w (params p) times the input row's block x, added to acc. */
static inline __m512 block_times(__m512 acc, const float *x, const uint8_t *w, const float *p) {
    __m512 first, second;
    block_weights(w, p, &first, &second);
    return _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), second, _mm512_fmadd_ps(_mm512_loadu_ps(x), first, acc));
}

/* One input row against four weight rows at a time (four independent sums); several input rows
 * against two weight rows at a time; a last odd weight row against every input row. */
static void rows_times(const struct rows_job *job) {
    long blocks = job->k / BLOCK, k = job->k, bytes = k / 2, o = job->first;
    if (job->rows > 1)
        for (; o + 2 <= job->end; o += 2)
            pairs_times(job, o);
    if (job->rows == 1) {
        float sums[blocks]; /* each block of the row summed, for the lows */
        for (long b = 0; b < blocks; b++)
            sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(job->x + b * BLOCK),
                                                         _mm512_loadu_ps(job->x + b * BLOCK + 16)));
        for (; o + 4 <= job->end; o += 4) {
            const uint8_t *w = job->w + o * bytes;
            const float *p0 = job->params + o * blocks * 2, *p1 = p0 + 2 * blocks, *p2 = p1 + 2 * blocks,
                        *p3 = p2 + 2 * blocks;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            float l0 = 0, l1 = 0, l2 = 0, l3 = 0;
            for (long b = 0; b < blocks; b++) {
                const float *x = job->x + b * BLOCK;
                const uint8_t *wb = w + b * BLOCK_BYTES;
                if ((b & 3) == 0) { /* a cache line holds four blocks of a row */
                    fetch_ahead(wb);
                    fetch_ahead(wb + bytes);
                    fetch_ahead(wb + 2 * bytes);
                    fetch_ahead(wb + 3 * bytes);
                }
                __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
                a0 = steps_times(a0, x0, x1, wb, p0[2 * b]);
                a1 = steps_times(a1, x0, x1, wb + bytes, p1[2 * b]);
                a2 = steps_times(a2, x0, x1, wb + 2 * bytes, p2[2 * b]);
                a3 = steps_times(a3, x0, x1, wb + 3 * bytes, p3[2 * b]);
                l0 += p0[2 * b + 1] * sums[b];
                l1 += p1[2 * b + 1] * sums[b];
                l2 += p2[2 * b + 1] * sums[b];
                l3 += p3[2 * b + 1] * sums[b];
            }
            job->out[o] = _mm512_reduce_add_ps(a0) + l0;
            job->out[o + 1] = _mm512_reduce_add_ps(a1) + l1;
            job->out[o + 2] = _mm512_reduce_add_ps(a2) + l2;
            job->out[o + 3] = _mm512_reduce_add_ps(a3) + l3;
        }
    }
    for (; o < job->end; o++) {
        const uint8_t *w = job->w + o * bytes;
        const float *p = job->params + o * blocks * 2;
        __m512 total[MAX_ROWS];
        for (long r = 0; r < job->rows; r++)
            total[r] = _mm512_setzero_ps();
        for (long b = 0; b < blocks; b++) {
            fetch_ahead(w + b * BLOCK_BYTES);
            __m512 first, second;
            block_weights(w + b * BLOCK_BYTES, p + 2 * b, &first, &second);
            for (long r = 0; r < job->rows; r++) {
                const float *x = job->x + r * k + b * BLOCK;
                total[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), second,
                                           _mm512_fmadd_ps(_mm512_loadu_ps(x), first, total[r]));
            }
        }
        for (long r = 0; r < job->rows; r++)
            job->out[r * job->n + o] = _mm512_reduce_add_ps(total[r]);
    }
}
#endif

/* One thread's share of a call (block_rows.h `split_rows`). */
static void share(const float *x, const void *w, const float *params, float *out, long rows, long n, long k, long first,
                  long end) {
    struct rows_job job = {x, w, params, out, rows, n, k, first, end};
    rows_times(&job);
}

/* x: float32 [rows, k]; w, params as above; out: float32 [rows, n]; on `threads` threads of
 * OpenMP's team. Returns 0, or -1 for a shape this kernel does not take. */
int q4_rows_f32(const float *x, const void *w, const float *params, float *out, long rows, long n, long k,
                long threads) {
    return split_rows(share, x, w, params, out, rows, n, k, threads);
}

/* The kernel as the operator `trio_llm::q4_rows` (engine/kernels/q4_rows.py; block_rows.h). */
AOTITorchError aoti_torch_cpu_q4_rows(AtenTensorHandle rows, AtenTensorHandle qweight, AtenTensorHandle params,
                                   AtenTensorHandle *ret0) {
    return shim_rows(q4_rows_f32, rows, qweight, params, ret0);
}
