/* Causal self-attention over one sequence's prompt chunk, float32, on the calling thread or with
 * its query heads split over threads started for the call.
 *
 * What `engine.models.attention.causal_prompt_attention` runs for a float32 prompt (see
 * engine/kernels/native.py for how this file is built and loaded, and docs/decisions.md, "A causal
 * attention kernel of our own"). torch's CPU flash kernel skips masked work only 512 keys at a
 * time, so a causal prompt of up to 512 tokens costs it what full attention does; this computes
 * each query row against its own keys only (rounded up to a chunk of 2 vectors).
 *
 * The chunk's queries may follow positions already cached: keys and values are read through a
 * map from position to row (the KV cache's slots), or straight from the step's rows when fresh.
 * (A step's decodes, one query per sequence over its cached blocks, are paged_decode.c's.)
 *
 * Per KV head: its keys are copied once, scaled and transposed, into [dim, tokens] rows, so a
 * chunk of keys' scores is a sum of broadcast query elements times key vectors. Then, for each of
 * the head's query heads, a block of RB query rows at a time: the rows' scores against every key
 * up to the block's last row, an exact softmax over each row (the rows fit in cache: no online
 * rescaling), and the weighted sum of value rows. Written with GCC vector extensions, so the
 * compiler picks the machine's vector registers (-march=native); 16 lanes with AVX-512, else 8.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "split_threads.h"
#include "vector_math.h" /* VW, vf, vexp, lane_sum */

/* Register blocking: a block's scores keep RB x 2 vectors of sums in registers, its weighted
 * sum RB x DC. With AVX-512's 32 vector registers, 6 rows and 4 vectors (64 floats of a head) ran
 * fastest of the shapes tried at 256-1,024 tokens (docs/benchmarks.md); AVX2 has 16 registers. */
#if defined(__AVX512F__)
#define DC 4 /* value vectors per row in the weighted sum */
#define RB 6 /* query rows per block */
#else
#define DC 2
#define RB 4
#endif
#define KC (2 * VW) /* keys per score chunk */

/* The head dimensions this build takes: multiples of this (one vector). */
long causal_attention_dim_multiple(void) { return VW; }

/* Floats of scratch memory `causal_attention_f32` needs for `tokens` positions of `dim`. */
long causal_attention_scratch_floats(long tokens, long dim) {
    return (dim + RB) * round_up(tokens, KC);
}

/* The row of k or v holding position p: rows[p], or p itself without a row map. */
static inline long row_of(const int64_t *rows, long p) { return rows ? rows[p] : p; }

static void transpose_scaled(const float *k, long k_stride, const int64_t *rows, long keys, long dim,
                             long padded, float scale, float *kt) {
    for (long t = 0; t < keys; t++) {
        const float *key = k + row_of(rows, t) * k_stride;
        for (long d = 0; d < dim; d++)
            kt[d * padded + t] = key[d] * scale;
    }
    for (long d = 0; d < dim; d++)
        for (long t = keys; t < padded; t++)
            kt[d * padded + t] = 0.0f;
}

/* Scores of RB query rows against keys [0, num_keys) rounded up to KC, into rows of `scores`. */
static void block_scores(const float *const rows[RB], const float *kt, long dim, long padded,
                         long num_keys, float *scores) {
    for (long c = 0; c < num_keys; c += KC) {
        vf acc[RB][2];
        for (int r = 0; r < RB; r++)
            acc[r][0] = acc[r][1] = vsplat(0.0f);
        const float *keys = kt + c;
        for (long d = 0; d < dim; d++) {
            vf k0 = vload(keys + d * padded), k1 = vload(keys + d * padded + VW);
            for (int r = 0; r < RB; r++) {
                vf qd = vsplat(rows[r][d]);
                acc[r][0] += qd * k0;
                acc[r][1] += qd * k1;
            }
        }
        for (int r = 0; r < RB; r++) {
            vstore(scores + r * padded + c, acc[r][0]);
            vstore(scores + r * padded + c + VW, acc[r][1]);
        }
    }
}

/* One row's scores over its `length` keys -> unnormalised weights, zero from `length` to `span`
 * (a multiple of VW); returns 1 / their sum. */
static float row_softmax(float *row, long length, long span) {
    long whole = length / VW * VW;
    float top = row[0];
    if (whole > 0) {
        vf best = vload(row);
        for (long j = VW; j < whole; j += VW) {
            vf x = vload(row + j);
            vi more = x > best;
            best = (vf)(((vi)x & more) | ((vi)best & ~more));
        }
        for (int l = 0; l < VW; l++)
            top = best[l] > top ? best[l] : top;
    }
    for (long j = whole; j < length; j++)
        top = row[j] > top ? row[j] : top;
    for (long j = length; j < span; j++)
        row[j] = -1e30f; /* exp() of it is ~2^-126: zeroed below */
    vf total = vsplat(0.0f);
    for (long j = 0; j < span; j += VW) {
        vf w = vexp(vload(row + j) - top);
        vstore(row + j, w);
    }
    for (long j = length; j < span; j++)
        row[j] = 0.0f;
    for (long j = 0; j < span; j += VW)
        total += vload(row + j);
    return 1.0f / lane_sum(total);
}

/* Rows `outs` of the output, columns [d0, d0 + width * VW): weights x value rows [0, num_keys),
 * scaled by each row's 1 / sum; `height` rows summed (at least `rows`), `rows` stored. Inlined
 * with a constant width and height, so the sums stay in registers. */
static inline __attribute__((always_inline)) void
values_pass(const float *weights, long padded, const float *v, long v_stride, const int64_t *kv_rows,
            long num_keys, const float *inverse, float *const *outs, int rows, long d0, const int width,
            const int height) {
    vf acc[RB][DC];
    for (int r = 0; r < height; r++)
        for (int u = 0; u < width; u++)
            acc[r][u] = vsplat(0.0f);
    for (long j = 0; j < num_keys; j++) {
        const float *value = v + row_of(kv_rows, j) * v_stride + d0;
        vf vv[DC];
        for (int u = 0; u < width; u++)
            vv[u] = vload(value + u * VW);
        for (int r = 0; r < height; r++) {
            vf w = vsplat(weights[r * padded + j]);
            for (int u = 0; u < width; u++)
                acc[r][u] += w * vv[u];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < width; u++)
            vstore(outs[r] + d0 + u * VW, acc[r][u] * inverse[r]);
}

static inline __attribute__((always_inline)) void
values_of_height(const float *weights, long padded, const float *v, long v_stride, const int64_t *kv_rows,
                 long dim, long num_keys, const float *inverse, float *const *outs, int rows,
                 const int height) {
    long d0 = 0;
    for (; d0 + VW * DC <= dim; d0 += VW * DC)
        values_pass(weights, padded, v, v_stride, kv_rows, num_keys, inverse, outs, rows, d0, DC, height);
    for (; d0 < dim; d0 += VW)
        values_pass(weights, padded, v, v_stride, kv_rows, num_keys, inverse, outs, rows, d0, 1, height);
}

/* The weighted sum of up to RB rows (`rows` of them) over every column: DC vectors at a time,
 * then one at a time; two or four rows summed where no more are asked (a KV head's query heads
 * are often two). */
static void block_values(const float *weights, long padded, const float *v, long v_stride,
                         const int64_t *kv_rows, long dim, long num_keys, const float *inverse,
                         float *const *outs, int rows) {
    if (rows <= 2)
        values_of_height(weights, padded, v, v_stride, kv_rows, dim, num_keys, inverse, outs, rows, 2);
    else if (rows <= 4)
        values_of_height(weights, padded, v, v_stride, kv_rows, dim, num_keys, inverse, outs, rows, 4);
    else
        values_of_height(weights, padded, v, v_stride, kv_rows, dim, num_keys, inverse, outs, rows, RB);
}

/* One prompt chunk's attention for query heads [first_head, end_head): what a thread of
 * `causal_attention_f32` does, with scratch of its own. */
struct prompt_job {
    const float *q, *k, *v;
    float *out;
    long queries, past;
    const int64_t *kv_rows;
    long q_heads, kv_heads, dim, q_stride, k_stride, v_stride, out_stride;
    float scale;
    float *scratch;
    long first_head, end_head;
};

static void prompt_heads(const struct prompt_job *job) {
    long dim = job->dim, keys = job->past + job->queries, padded = round_up(keys, KC);
    long group = job->q_heads / job->kv_heads, transposed = -1;
    float *kt = job->scratch, *scores = job->scratch + dim * padded;
    for (long hq = job->first_head; hq < job->end_head; hq++) {
        long hk = hq / group;
        if (hk != transposed) { /* a thread's heads are consecutive: each KV head copied once */
            transpose_scaled(job->k + hk * dim, job->k_stride, job->kv_rows, keys, dim, padded, job->scale, kt);
            transposed = hk;
        }
        for (long first = 0; first < job->queries; first += RB) {
            int rows = job->queries - first < RB ? (int)(job->queries - first) : RB;
            long num_keys = job->past + first + rows;
            const float *q_rows[RB];
            float *outs[RB];
            float inverse[RB];
            for (int r = 0; r < RB; r++) { /* a short last block repeats its last row */
                long t = first + (r < rows ? r : rows - 1);
                q_rows[r] = job->q + t * job->q_stride + hq * dim;
                outs[r] = job->out + t * job->out_stride + hq * dim;
            }
            block_scores(q_rows, kt, dim, padded, num_keys, scores);
            for (int r = 0; r < RB; r++)
                inverse[r] = row_softmax(scores + r * padded, job->past + first + (r < rows ? r : rows - 1) + 1,
                                         round_up(num_keys, VW));
            block_values(scores, padded, job->v + hk * dim, job->v_stride, job->kv_rows, dim, num_keys, inverse,
                         outs, rows);
        }
    }
}

static void *prompt_thread(void *job) {
    prompt_heads(job);
    return NULL;
}

/* q: [queries, q_heads, dim], the queries of positions past .. past + queries - 1 of one sequence;
 * out: the same shape. k and v: rows of [kv_heads, dim], position p's in row kv_rows[p] (or row p
 * if kv_rows is NULL), for every position up to the last query's. Each tensor has its own stride
 * between rows (in floats), heads laid out densely within a row. Query position i attends to
 * positions 0 .. i; query head h reads KV head h / (q_heads / kv_heads). The query heads are split
 * in `threads` consecutive runs, one per thread: the calling one and threads started for the call
 * (which inherit its CPUs); at most one per query head. Returns 0, or -1 for a dim this build
 * does not take (`causal_attention_dim_multiple`). `scratch`: `threads` times
 * `causal_attention_scratch_floats(past + queries, dim)` floats. */
int causal_attention_f32(const float *q, const float *k, const float *v, float *out, long queries,
                         long past, const int64_t *kv_rows, long q_heads, long kv_heads, long dim,
                         long q_stride, long k_stride, long v_stride, long out_stride, float scale,
                         long threads, float *scratch) {
    if (dim % VW != 0 || q_heads % kv_heads != 0)
        return -1;
    threads = threads < 1 ? 1 : threads > q_heads ? q_heads : threads > MAX_THREADS ? MAX_THREADS : threads;
    long per_thread = causal_attention_scratch_floats(past + queries, dim);
    struct prompt_job jobs[MAX_THREADS];
    for (long t = 0; t < threads; t++)
        jobs[t] = (struct prompt_job){q, k, v, out, queries, past, kv_rows, q_heads, kv_heads, dim,
                                      q_stride, k_stride, v_stride, out_stride, scale,
                                      scratch + t * per_thread, t * q_heads / threads,
                                      (t + 1) * q_heads / threads};
    run_split(prompt_thread, jobs, sizeof jobs[0], threads);
    return 0;
}
