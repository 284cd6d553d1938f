/* Each row's argmax of float32 logits, as torch's `max(dim=-1).indices` answers it: the first
 * index of the row's maximum; a NaN counts as the largest (the first NaN's index).
 *
 * Why ours: torch's CPU `max(dim)` and `argmax` track an index per element and do not vectorise:
 * ~40-65 us for one row of 32,000 logits on this project's 2-core Xeon, 2% of a served token of the
 * small Llama at one stream (docs/benchmarks.md). Here each vector lane tracks its maximum and
 * where it first saw it (row_argmax).
 *
 * x: float32 [rows, n] row-major; out: int64 [rows]. Rows run in `threads` consecutive runs
 * (split_threads.h) when there are several.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "split_threads.h"

#define LANES 16

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(float))));

/* One pass: each lane keeps its maximum and the first index it was seen at (a strictly greater
 * value replaces it), then the lanes are joined: the largest value, at the smallest index among
 * the lanes holding it. A NaN never compares greater; a lane that saw one is noted, and such a
 * row (rare) is searched again for its first NaN. */
static int64_t row_argmax(const float *x, long n) {
    long whole = n - n % LANES, i = 0;
    float best = -INFINITY;
    int64_t at = 0;
    int nan = 0;
    if (whole) {
        vf m, v;
        vi seen = {0}, index, first;
        for (int l = 0; l < LANES; l++)
            index[l] = l;
        memcpy(&m, x, sizeof m);
        first = index;
        for (i = LANES; i < whole; i += LANES) {
            index += LANES;
            memcpy(&v, x + i, sizeof v);
            seen |= v != v;
            vi greater = v > m;
            m = (vf)(((vi)v & greater) | ((vi)m & ~greater));
            first = (index & greater) | (first & ~greater);
        }
        seen |= m != m; /* the first vector's own NaNs */
        at = first[0];
        best = m[0];
        for (int l = 0; l < LANES; l++) {
            nan |= seen[l] != 0;
            if (m[l] > best || (m[l] == best && first[l] < at)) {
                best = m[l];
                at = first[l];
            }
        }
        if (best == -INFINITY)
            at = 0; /* every logit so far -inf: the first index, as torch */
    }
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        if (x[i] > best || (i == 0)) {
            best = x[i];
            at = i;
        }
    }
    if (nan)
        for (long j = 0; j < n; j++)
            if (x[j] != x[j])
                return j;
    return at;
}

struct argmax_job {
    const float *x;
    int64_t *out;
    long first, end, n;
};

static void *argmax_run(void *arg) {
    const struct argmax_job *job = arg;
    for (long r = job->first; r < job->end; r++)
        job->out[r] = row_argmax(job->x + r * job->n, job->n);
    return NULL;
}

int argmax_rows_f32(const float *x, int64_t *out, long rows, long n, long threads) {
    if (rows < 1 || n < 1)
        return 1;
    threads = threads < 1 ? 1 : threads > rows ? rows : threads > MAX_THREADS ? MAX_THREADS : threads;
    struct argmax_job jobs[MAX_THREADS];
    for (long t = 0; t < threads; t++)
        jobs[t] = (struct argmax_job){x, out, rows * t / threads, rows * (t + 1) / threads, n};
    run_split(argmax_run, jobs, sizeof jobs[0], threads);
    return 0;
}
