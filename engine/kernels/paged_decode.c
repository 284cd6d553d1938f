/* One decode step's attention over the paged KV cache: each sequence's one query per head against
 * its cached positions, read in place through its block table, from a float32, float16 or bfloat16
 * cache (`--kv-cache-dtype`), summed in float32. The (sequence, KV head) pairs are split over
 * OpenMP's team (torch's, which this library links: the compiled graphs' own loops run on it).
 *
 * What `engine.kernels.paged_decode` runs: eagerly through ctypes (`decodes_by_kernel`), and in the
 * compiled decode graphs as the operator `trio_llm::paged_decode`, whose C shim is at the end of
 * this file. Inductor's loops for the same sums (`paged_decode_attention`) read the cache at 8-15
 * GB/s on this project's 2-core machine and did not read a 16-bit cache faster than a float32 one
 * (docs/benchmarks.md, "Decode attention on a kernel of ours").
 *
 * Per pair, the query heads of the KV head a few at a time (HEIGHT), over the positions a chunk of
 * VW at a time with an online softmax (flash decoding's): each key row is read once for all the
 * heads, the chunk's scores are turned into weights against the running maximum (the sums so far
 * rescaled when it grows), and each value row is read once, added into the heads' sums. Nothing
 * is written but the output: no scratch memory, whatever the length.
 */
#include <stdint.h>
#include <string.h>

#include <omp.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "aoti_shim.h"   /* the operator's C shim */
#include "vector_math.h" /* VW, vf, vexp, lane_sum */

enum cache_type { CACHE_FLOAT32 = 0, CACHE_FLOAT16 = 1, CACHE_BFLOAT16 = 2 };
#define HEIGHT 4            /* query heads of one KV head summed together */
#define MAX_DIM 256         /* head sizes this build takes: multiples of VW up to this */
#define MAX_VECTORS (MAX_DIM / VW)

typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

/* VW float16 elements as floats: one conversion instruction with AVX-512 or F16C. */
static inline vf load_float16(const uint16_t *p) {
#if VW == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int l = 0; l < VW; l++)
        v[l] = (float)((const _Float16 *)p)[l];
    return v;
#endif
}

/* VW bfloat16 elements as floats: a bfloat16 is a float32's upper half. */
static inline vf load_bfloat16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline __attribute__((always_inline)) vf load_cached(const char *p, const int type) {
    if (type == CACHE_FLOAT16)
        return load_float16((const uint16_t *)p);
    if (type == CACHE_BFLOAT16)
        return load_bfloat16((const uint16_t *)p);
    return vload((const float *)p);
}

static inline float lane_max(vf x) {
    float top = x[0];
    for (int l = 1; l < VW; l++)
        top = x[l] > top ? x[l] : top;
    return top;
}

struct decode_call {
    const float *q;        /* [batch, q_heads, dim], rows q_stride apart */
    const char *k, *v;     /* caches: [slots, kv_heads, dim] of `type`, rows row_bytes apart */
    float *out;            /* [batch, q_heads, dim], rows out_stride apart */
    const int64_t *table;  /* [batch, >= blocks of the longest] block ids, rows table_stride apart */
    const int64_t *seq_lens;
    long table_stride, block_size, q_heads, kv_heads, dim, q_stride, row_bytes, out_stride;
    float scale;
    long parts; /* each sequence's KV heads are split into this many work items */
};

/* One chunk of `n` consecutive positions (cache rows from byte `row`) for query heads `heads`
 * [rows] of one KV head (its keys from k, values from v): their scores, the online softmax's
 * running maximum `top` and sum `total` moved on, and the weighted values added into the sums
 * `acc` [rows, dim] (kept in memory between chunks, in registers within one). `height` heads are
 * summed, the last one repeated past `rows`; `height`, `type` and `vectors` (the head's size in
 * vectors) are constants where inlined, so a key's or value's vectors and the sums stay in
 * registers (with the size read at run time they went through the stack: half the speed). */
static inline __attribute__((always_inline)) void
chunk_of_heads(const struct decode_call *c, const float *const *heads, float *acc, float *top, float *total,
               const char *k, const char *v, long row, long n, int rows, const int height, const int type,
               const long vectors) {
    const long element = type == CACHE_FLOAT32 ? 4 : 2;
    vf sums[HEIGHT][MAX_VECTORS];
    float scores[HEIGHT][VW] __attribute__((aligned(64)));
    for (long j = 0; j < n; j++) {
        vf key[MAX_VECTORS];
        for (long u = 0; u < vectors; u++)
            key[u] = load_cached(k + row + j * c->row_bytes + u * VW * element, type);
        for (int r = 0; r < height; r++) {
            const float *query = heads[r < rows ? r : rows - 1];
            vf sum = vload(query) * key[0];
            for (long u = 1; u < vectors; u++)
                sum += vload(query + u * VW) * key[u];
            scores[r][j] = lane_sum(sum);
        }
    }
    vi lane, past;
    for (int l = 0; l < VW; l++)
        lane[l] = l;
    past = lane >= (vi){0} + (int)n; /* lanes past the chunk's positions */
    for (int r = 0; r < height; r++) {
        int kept_row = r < rows ? r : rows - 1;
        vf s = vload(scores[r]) * c->scale;
        s = (vf)(((vi)s & ~past) | ((vi)vsplat(-1e30f) & past));
        float best = lane_max(s);
        best = best > top[kept_row] ? best : top[kept_row];
        float kept = vexp(vsplat(top[kept_row] - best))[0]; /* the sums so far, against the new maximum */
        vf w = (vf)((vi)vexp(s - best) & ~past);
        vstore(scores[r], w);
        for (long u = 0; u < vectors; u++)
            sums[r][u] = vload(acc + kept_row * c->dim + u * VW) * kept;
        if (r < rows) {
            total[r] = total[r] * kept + lane_sum(w);
            top[r] = best;
        }
    }
    for (long j = 0; j < n; j++) {
        vf value[MAX_VECTORS];
        for (long u = 0; u < vectors; u++)
            value[u] = load_cached(v + row + j * c->row_bytes + u * VW * element, type);
        for (int r = 0; r < height; r++) {
            vf w = vsplat(scores[r][j]);
            for (long u = 0; u < vectors; u++)
                sums[r][u] += w * value[u];
        }
    }
    for (int r = 0; r < rows; r++)
        for (long u = 0; u < vectors; u++)
            vstore(acc + r * c->dim + u * VW, sums[r][u]);
}

/* Work item `item`: sequence b's query heads of KV heads [first_kv, end_kv) over its cached
 * positions, a chunk of up to VW at a time (within one block), every KV head of the range within
 * each chunk: the chunk's cache rows are read whole, one after another (a pair of one sequence and
 * one KV head read every row's part of it, 2 KV heads' rows half at a time, and the kernel ran
 * at half the speed; docs/benchmarks.md). */
static inline __attribute__((always_inline)) void
item_of_size(const struct decode_call *c, long item, const int type, const long vectors) {
    const long element = type == CACHE_FLOAT32 ? 4 : 2, group = c->q_heads / c->kv_heads;
    long b = item / c->parts, part = item % c->parts;
    long first_kv = part * c->kv_heads / c->parts, end_kv = (part + 1) * c->kv_heads / c->parts;
    long count = (end_kv - first_kv) * group, first_head = first_kv * group;
    float acc[count * c->dim] __attribute__((aligned(64)));
    float top[count], total[count];
    const float *heads[count];
    for (long h = 0; h < count; h++) {
        heads[h] = c->q + b * c->q_stride + (first_head + h) * c->dim;
        top[h] = -1e30f;
        total[h] = 0.0f;
    }
    memset(acc, 0, sizeof acc);
    const long length = c->seq_lens[b];
    const int64_t *table = c->table + b * c->table_stride;
    for (long start = 0; start < length;) {
        long offset = start % c->block_size, n = c->block_size - offset;
        n = n < VW ? n : VW;
        n = n < length - start ? n : length - start;
        long row = (table[start / c->block_size] * c->block_size + offset) * c->row_bytes;
        for (long hk = first_kv; hk < end_kv; hk++) {
            const char *k = c->k + hk * c->dim * element, *v = c->v + hk * c->dim * element;
            for (long h = (hk - first_kv) * group; h < (hk - first_kv + 1) * group; h += HEIGHT) {
                long left = (hk - first_kv + 1) * group - h;
                int rows = left < HEIGHT ? (int)left : HEIGHT;
                if (rows <= 2)
                    chunk_of_heads(c, heads + h, acc + h * c->dim, top + h, total + h, k, v, row, n, rows, 2,
                                   type, vectors);
                else
                    chunk_of_heads(c, heads + h, acc + h * c->dim, top + h, total + h, k, v, row, n, rows,
                                   HEIGHT, type, vectors);
            }
        }
        start += n;
    }
    for (long h = 0; h < count; h++) {
        float *out = c->out + b * c->out_stride + (first_head + h) * c->dim;
        float inverse = total[h] > 0.0f ? 1.0f / total[h] : 0.0f; /* no positions: zeros */
        for (long u = 0; u < vectors; u++)
            vstore(out + u * VW, vload(acc + h * c->dim + u * VW) * inverse);
    }
}

/* The common head sizes (64 and 128) compiled for their size; others read it at run time. */
static inline __attribute__((always_inline)) void item_of_type(const struct decode_call *c, long item, const int type) {
    if (c->dim == 64)
        item_of_size(c, item, type, 64 / VW);
    else if (c->dim == 128)
        item_of_size(c, item, type, 128 / VW);
    else
        item_of_size(c, item, type, c->dim / VW);
}

static void one_item(const struct decode_call *c, long item, int type) {
    if (type == CACHE_FLOAT16)
        item_of_type(c, item, CACHE_FLOAT16);
    else if (type == CACHE_BFLOAT16)
        item_of_type(c, item, CACHE_BFLOAT16);
    else
        item_of_type(c, item, CACHE_FLOAT32);
}

/* The head sizes this build takes: multiples of this (one vector), up to `paged_decode_max_dim`. */
long paged_decode_dim_multiple(void) { return VW; }
long paged_decode_max_dim(void) { return MAX_DIM; }

/* A helper thread on a lent CPU (engine/kernels/lent_cpu.h, started by q8_0_rows.c, whose
 * `q8_0_lent_share` this points to once the worker lends it; NULL: none): a one-thread call's work
 * items are then claimed by the calling thread and the helper from one counter, the call waiting
 * only for items the helper started. */
typedef void (*item_fn)(const void *ctx, long item);
static int (*lent_share)(item_fn run, const void *ctx, long items);
/* Cached rows (positions x KV heads) a call reads before it is shared: below, waking the helper
 * cost more than its share (one sequence of ~200 positions: 1.3x the time alone; sixteen of up
 * to 200 0.64-0.98x, of up to 1,000 0.46-0.59x; docs/benchmarks.md). */
#define LENT_MIN_ROWS 2048

static long cached_rows(const int64_t *seq_lens, long batch, long kv_heads) {
    long rows = 0;
    for (long b = 0; b < batch; b++)
        rows += seq_lens[b];
    return rows * kv_heads;
}

/* Share one-thread calls with the helper behind `share` (q8_0_rows.c `q8_0_lent_share`). */
int paged_decode_share_with(void *share) {
    lent_share = (int (*)(item_fn, const void *, long))share;
    return 0;
}

struct typed_call {
    const struct decode_call *call;
    int type;
};

static void shared_item(const void *ctx, long item) {
    const struct typed_call *typed = ctx;
    one_item(typed->call, item, typed->type);
}

/* One decode step's attention (see the top of the file). Caches: element type `type` (an enum
 * cache_type), rows `cache_stride` elements apart, each row's heads dense. `threads`: OpenMP's team
 * size for the call. Returns 0, or -1 for a shape or type this build does not take. */
int paged_decode_f32(const float *q, const void *k_cache, const void *v_cache, float *out, long batch,
                     const int64_t *block_table, long table_stride, const int64_t *seq_lens, long block_size,
                     long q_heads, long kv_heads, long dim, long q_stride, long cache_stride, long out_stride,
                     float scale, int type, long threads) {
    if (dim % VW != 0 || dim > MAX_DIM || kv_heads < 1 || q_heads % kv_heads != 0 || block_size < 1
        || type < CACHE_FLOAT32 || type > CACHE_BFLOAT16)
        return -1;
    threads = threads < 1 ? 1 : threads;
    /* With the helper, one thread's call of enough rows is shared as if by two. */
    int shared = threads == 1 && lent_share != NULL && cached_rows(seq_lens, batch, kv_heads) >= LENT_MIN_ROWS;
    long sharers = shared ? 2 : threads;
    /* A sequence's KV heads in one item where there are sequences enough for every thread twice
     * over (whole rows read); else split, so that every thread has work. */
    long parts = batch >= 2 * sharers ? 1 : (2 * sharers + batch - 1) / (batch > 0 ? batch : 1);
    parts = parts > kv_heads ? kv_heads : parts;
    long element = type == CACHE_FLOAT32 ? 4 : 2, items = batch * parts;
    struct decode_call call = {q, k_cache, v_cache, out, block_table, seq_lens, table_stride, block_size, q_heads,
                               kv_heads, dim, q_stride, cache_stride * element, out_stride, scale, parts};
    if (shared && items > 1) {
        struct typed_call typed = {&call, type};
        lent_share(shared_item, &typed, items);
        return 0;
    }
    threads = threads > items ? (items > 0 ? items : 1) : threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long item = 0; item < items; item++)
        one_item(&call, item, type);
    return 0;
}

/* The operator's C shim (engine/kernels/paged_decode.py): q float32 [B, Hq, D] already scaled,
 * each row's heads dense; the caches as blocks [num_blocks, block_size, Hkv, D], rows dense; the
 * block table int64 [B, nb] (rows dense); seq_lens int64 [B]. Out: float32 [B, Hq, D]. */
AOTITorchError aoti_torch_cpu_paged_decode(AtenTensorHandle q, AtenTensorHandle k_blocks, AtenTensorHandle v_blocks,
                                           AtenTensorHandle block_table, AtenTensorHandle seq_lens,
                                           AtenTensorHandle *ret0) {
    int64_t *q_sizes, *q_strides, *cache_sizes, *k_strides, *v_strides, *table_strides, *len_strides;
    int32_t dtype;
    void *qp, *kp, *vp, *tp, *lp, *op;
    if (aoti_torch_get_sizes(q, &q_sizes) || aoti_torch_get_strides(q, &q_strides)
        || aoti_torch_get_sizes(k_blocks, &cache_sizes) || aoti_torch_get_strides(k_blocks, &k_strides)
        || aoti_torch_get_strides(v_blocks, &v_strides) || aoti_torch_get_strides(block_table, &table_strides)
        || aoti_torch_get_strides(seq_lens, &len_strides) || aoti_torch_get_dtype(k_blocks, &dtype))
        return 1;
    int64_t batch = q_sizes[0], q_heads = q_sizes[1], dim = q_sizes[2], block_size = cache_sizes[1];
    int64_t kv_heads = cache_sizes[2], row = k_strides[1];
    int type = dtype == aoti_torch_dtype_float32() ? CACHE_FLOAT32
             : dtype == aoti_torch_dtype_float16() ? CACHE_FLOAT16
             : dtype == aoti_torch_dtype_bfloat16() ? CACHE_BFLOAT16 : -1;
    if (q_strides[2] != 1 || q_strides[1] != dim || k_strides[3] != 1 || k_strides[2] != dim
        || k_strides[0] != block_size * row || v_strides[1] != row || v_strides[0] != k_strides[0]
        || v_strides[2] != dim || v_strides[3] != 1 || (batch > 0 && table_strides[1] != 1)
        || (batch > 1 && len_strides[0] != 1))
        return 1;
    int64_t sizes[3] = {batch, q_heads, dim}, strides[3] = {q_heads * dim, dim, 1};
    if (aoti_torch_empty_strided(3, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, ret0)
        || aoti_torch_get_data_ptr(q, &qp) || aoti_torch_get_data_ptr(k_blocks, &kp)
        || aoti_torch_get_data_ptr(v_blocks, &vp) || aoti_torch_get_data_ptr(block_table, &tp)
        || aoti_torch_get_data_ptr(seq_lens, &lp) || aoti_torch_get_data_ptr(*ret0, &op))
        return 1;
    return paged_decode_f32(qp, kp, vp, op, batch, tp, table_strides[0], lp, block_size, q_heads, kv_heads, dim,
                            q_strides[0], row, q_heads * dim, 1.0f, type, omp_get_max_threads()) != 0;
}
