/* A float32 weight quantized to q8_0 in one pass: what `engine.models.quantized_linear.quantize_per_block`
 * computes with torch in seven (abs, amax, divide, clamp, divide, round, clamp and cast), each
 * a pass over the weight: 31% of loading a Q8_0 GGUF file (docs/benchmarks.md), whose blocks are
 * quantized again after being read as floats.
 *
 * Weight: float32 [n, k] row-major, k a multiple of 32. Out: int8 [n, k] and float32 scales
 * [n, k / 32]. Per block of 32 weights: scale = max |w| / 127 (at least 1e-12), q = w / scale
 * rounded half to even, clamped to [-127, 127]. The same float operations in the same order as
 * torch's, so the result is bit for bit torch's: a true division, not a reciprocal's product.
 * (Vectorised with GCC's vector extensions, as q8_0_rows.c: a scalar loop took 0.71 s for the
 * 0.5B shape's LM head, torch's passes 1.13 s.)
 * The blocks are split in `threads` consecutive runs (see split_threads.h).
 */
#include <stdint.h>
#include <string.h>

#include "split_threads.h"

#define BLOCK 32

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));

struct quantize_job {
    const float *w;
    int8_t *q;
    float *scales;
    long first, end; /* blocks */
};

/* Lane-wise selects by comparison masks (C has no vector ?:); abs clears the sign bit. */
static inline v8f pick(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }
static inline v8f vmax(v8f a, v8f b) { return pick(a > b, a, b); }
static inline v8f vmin(v8f a, v8f b) { return pick(a < b, a, b); }
static inline v8f vabs(v8f a) { return (v8f)((v8i)a & 0x7fffffff); }

/* Round half to even, as torch.round (nearbyint): adding and taking away 1.5 * 2^23 leaves the
 * nearest integer in the default rounding mode, exactly, for |x| < 2^22 (here |x| <= 127 and a
 * bit; the sum's last bit is the integer's, 1.5 * 2^23 being even, so ties go to even). Our build
 * flags allow no reassociation that could fold it. Written so because it vectorises. */
static inline v8f round_even(v8f x) {
    const v8f magic = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                       12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f};
    return (x + magic) - magic;
}

static void quantize_blocks(const struct quantize_job *job) {
    const v8f zero = {0}, top = zero + 127.0f, bottom = zero - 127.0f;
    for (long b = job->first; b < job->end; b++) {
        v8f w[4];
        memcpy(w, job->w + b * BLOCK, sizeof w);
        v8f m = vmax(vmax(vabs(w[0]), vabs(w[1])), vmax(vabs(w[2]), vabs(w[3])));
        float amax = 0.0f;
        for (int i = 0; i < 8; i++)
            amax = m[i] > amax ? m[i] : amax;
        float scale = amax / 127.0f;
        scale = scale > 1e-12f ? scale : 1e-12f;
        job->scales[b] = scale;
        for (int part = 0; part < 4; part++) {
            v8f q = vmin(vmax(round_even(w[part] / scale), bottom), top);
            v8b out = __builtin_convertvector(__builtin_convertvector(q, v8i), v8b);
            memcpy(job->q + b * BLOCK + part * 8, &out, sizeof out);
        }
    }
}

static void *quantize_thread(void *job) {
    quantize_blocks(job);
    return NULL;
}

/* Returns 0, or -1 for a shape this kernel does not take (k not a multiple of 32). */
int q8_0_quantize_f32(const float *w, int8_t *q, float *scales, long n, long k, long threads) {
    if (k % BLOCK != 0 || n < 0)
        return -1;
    long blocks = n * (k / BLOCK);
    if (blocks == 0)
        return 0;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads > blocks ? blocks : threads;
    struct quantize_job jobs[MAX_THREADS];
    for (long t = 0; t < threads; t++)
        jobs[t] = (struct quantize_job){w, q, scales, t * blocks / threads, (t + 1) * blocks / threads};
    run_split(quantize_thread, jobs, sizeof jobs[0], threads);
    return 0;
}
