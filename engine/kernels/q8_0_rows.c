/* A few float32 rows times a q8_0 weight, reading the weight's int8 blocks as they are: what
 * `engine.models.quantized_linear.q8_0_linear` runs outside a compiled graph (a first start's
 * eager steps while the graphs compile, `--enforce-eager`). Eagerly torch has no product of a
 * row with int8 blocks and their scales: it would dequantize the whole weight each call.
 *
 * Weight: int8 [n, k], row-major; scales: float32 [n, k / 32], one per block of 32 weights of a
 * row (GGUF's Q8_0). out[r, o] = sum over blocks b of scales[o, b] * (x[r, block b] . w[o, block
 * b]), summed in float32. The output rows are split in `threads` consecutive runs, one per thread:
 * the calling one and threads started for the call (which inherit its CPUs). Each weight row is
 * read once for all the input rows. Written with GCC vector extensions (see causal_attention.c):
 * the compiler picks the machine's vectors (-march=native).
 */
#include <stdint.h>
#include <string.h>

#include "split_threads.h"

#define BLOCK 32
#define MAX_ROWS 8 /* input rows per call: a batch of decodes; more rows dequantize and matmul */

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

struct rows_job {
    const float *x;
    const int8_t *w;
    const float *scales;
    float *out;
    long rows, n, k, first, end;
};

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

static void *rows_thread(void *job) {
    rows_times(job);
    return NULL;
}

/* x: float32 [rows, k]; w, scales as above; out: float32 [rows, n]. Returns 0, or -1 for a shape
 * this kernel does not take (k not a multiple of 32, more than MAX_ROWS rows). */
int q8_0_rows_f32(const float *x, const int8_t *w, const float *scales, float *out, long rows, long n, long k,
                  long threads) {
    if (k % BLOCK != 0 || rows < 1 || rows > MAX_ROWS)
        return -1;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads > n ? n : threads;
    struct rows_job jobs[MAX_THREADS];
    for (long t = 0; t < threads; t++)
        jobs[t] = (struct rows_job){x, w, scales, out, rows, n, k, t * n / threads, (t + 1) * n / threads};
    run_split(rows_thread, jobs, sizeof jobs[0], threads);
    return 0;
}
