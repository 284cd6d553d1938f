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
 * A second entry point, `paged_decode_attention_f32` (at the end), takes a step's decodes: one
 * query per sequence over its cached blocks, read in place.
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

/* Register blocking: a block's scores keep RB x 2 vectors of sums in registers, its weighted
 * sum RB x DC. With AVX-512's 32 vector registers, 6 rows and 4 vectors (64 floats of a head) ran
 * fastest of the shapes tried at 256-1,024 tokens (docs/benchmarks.md); AVX2 has 16 registers. */
#if defined(__AVX512F__)
#define VW 16 /* floats per vector */
#define DC 4  /* value vectors per row in the weighted sum */
#define RB 6  /* query rows per block */
#else
#define VW 8
#define DC 2
#define RB 4
#endif
#define KC (2 * VW) /* keys per score chunk */

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

static long round_up(long n, long m) { return (n + m - 1) / m * m; }

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
 * then one at a time; two or four rows summed where no more are asked (a decode's query heads
 * of one KV head are often two). */
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

/* Scores of up to RB query heads (`rows` of them; the rest repeat the last) against keys
 * [0, num_keys), read through `kv_rows`: one pass over the keys, each key row loaded once. */
static void decode_scores(const float *const heads[RB], int rows, const float *k, long k_stride,
                          const int64_t *kv_rows, long dim, long num_keys, float scale, long padded,
                          float *scores) {
    for (long j = 0; j < num_keys; j++) {
        const float *key = k + kv_rows[j] * k_stride;
        for (int r = 0; r < rows; r++) {
            vf acc = vsplat(0.0f);
            for (long d = 0; d < dim; d += VW)
                acc += vload(heads[r] + d) * vload(key + d);
            scores[r * padded + j] = lane_sum(acc) * scale;
        }
    }
}

/* Floats of scratch memory `paged_decode_attention_f32` needs for sequences of up to
 * `max_len` positions (their slots are kept there too, as int64). */
long paged_decode_scratch_floats(long max_len) {
    return (RB + 2) * round_up(max_len, KC);
}

/* One decode step's attention: each of `batch` sequences' one query [q_heads, dim] (row b of q,
 * stride q_stride) against its seq_lens[b] cached positions, whose keys and values lie in the
 * caches' rows (stride cache_stride, heads dense within a row) at the slots its block table
 * (row b of block_table, stride table_stride) gives. out: [batch, q_heads, dim]. Returns 0, or
 * -1 for a dim this build does not take. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                               long batch, const int64_t *block_table, long table_stride,
                               const int64_t *seq_lens, long block_size, long q_heads, long kv_heads,
                               long dim, long q_stride, long cache_stride, long out_stride, float scale,
                               float *scratch) {
    if (dim % VW != 0 || q_heads % kv_heads != 0)
        return -1;
    long group = q_heads / kv_heads, max_len = 0;
    for (long b = 0; b < batch; b++)
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    long padded = round_up(max_len, KC);
    float *scores = scratch;
    int64_t *slots = (int64_t *)(scratch + RB * padded); /* two floats' room per slot */
    for (long b = 0; b < batch; b++) {
        long length = seq_lens[b];
        const int64_t *table = block_table + b * table_stride;
        for (long p = 0; p < length; p++)
            slots[p] = table[p / block_size] * block_size + p % block_size;
        for (long hk = 0; hk < kv_heads; hk++) {
            for (long first = hk * group; first < (hk + 1) * group; first += RB) {
                int rows = (hk + 1) * group - first < RB ? (int)((hk + 1) * group - first) : RB;
                const float *heads[RB];
                float *outs[RB];
                float inverse[RB];
                for (int r = 0; r < RB; r++) {
                    long h = first + (r < rows ? r : rows - 1);
                    heads[r] = q + b * q_stride + h * dim;
                    outs[r] = out + b * out_stride + h * dim;
                }
                decode_scores(heads, rows, k_cache + hk * dim, cache_stride, slots, dim, length, scale,
                              padded, scores);
                for (int r = 0; r < rows; r++)
                    inverse[r] = row_softmax(scores + r * padded, length, round_up(length, VW));
                for (int r = rows; r < RB; r++) /* rows past the group's heads: summed, never stored */
                    inverse[r] = 0.0f;
                block_values(scores, padded, v_cache + hk * dim, cache_stride, slots, dim, length, inverse,
                             outs, rows);
            }
        }
    }
    return 0;
}
