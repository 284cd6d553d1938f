/* A float32 weight quantized to q8_0 in one pass: what `engine.models.quantized_linear.quantize_per_block`
 * computes with torch in seven (abs, amax, divide, clamp, divide, round, clamp and cast), each
 * a pass over the weight: 31% of loading a Q8_0 GGUF file (docs/benchmarks.md), whose blocks are
 * quantized again after being read as floats.
 *
 * Weight: float32 [n, k] row-major, k a multiple of 32. Out: int8 [n, k] and float32 scales
 * [n, k / 32]. Per block of 32 weights: scale = max |w| / 127 (at least 1e-12), q = w / scale
 * rounded half to even, clamped to [-127, 127]. The same float operations in the same order as
 * torch's, so the result is bit for bit torch's: a true division, not a reciprocal's product.
 * The blocks are split in `threads` consecutive runs (see split_threads.h).
 */
#include <math.h>
#include <stdint.h>

#include "split_threads.h"

#define BLOCK 32

struct quantize_job {
    const float *w;
    int8_t *q;
    float *scales;
    long first, end; /* blocks */
};

static void quantize_blocks(const struct quantize_job *job) {
    for (long b = job->first; b < job->end; b++) {
        const float *w = job->w + b * BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; i++)
            amax = fmaxf(amax, fabsf(w[i]));
        float scale = fmaxf(amax / 127.0f, 1e-12f);
        job->scales[b] = scale;
        int8_t *q = job->q + b * BLOCK;
        for (int i = 0; i < BLOCK; i++)
            q[i] = (int8_t)fminf(fmaxf(nearbyintf(w[i] / scale), -127.0f), 127.0f);
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
