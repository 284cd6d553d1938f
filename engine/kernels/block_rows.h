/* What the block kernels (q8_0_rows.c, q4_rows.c) share: a few float32 rows times a weight held in
 * blocks, the output rows split over OpenMP's team (torch's, which these libraries link), and the C
 * shim by which an AOTInductor package calls the kernel as an operator (engine/kernels/block_rows.py).
 * See native.py, which includes this header in every kernel's build key. */
#ifndef TRIO_LLM_BLOCK_ROWS_H
#define TRIO_LLM_BLOCK_ROWS_H

#include <stdint.h>

#include <omp.h>

#include "aoti_shim.h" /* AtenTensorHandle and torch's C shim functions */

#define BLOCK 32
#define MAX_ROWS 16 /* input rows per call: a batch of decodes; more rows dequantize and matmul */
#define PREFETCH_AHEAD 4096 /* bytes; 1,024 gained a little, 4,096 and 8,192 all of it (q8_0_rows.c) */

/* Ask for the weight bytes PREFETCH_AHEAD past p (a hint: past the end of the weight it reads nothing). */
static inline void fetch_ahead(const void *p) { __builtin_prefetch((const char *)p + PREFETCH_AHEAD, 0, 3); }

/* One thread's share: input rows x [rows, k] times weight rows [first, end) of w (its blocks'
 * `params` beside it), into out [rows, n]. */
typedef void (*rows_share)(const float *x, const void *w, const float *params, float *out, long rows, long n, long k,
                           long first, long end);
/* A whole call, as the kernels export it: returns 0, or -1 for a shape the kernel does not take. */
typedef int (*rows_call)(const float *x, const void *w, const float *params, float *out, long rows, long n, long k,
                         long threads);

/* Rows [first, end) of the output, for thread `t` of `threads`: equal runs, each starting on a
 * multiple of 16 outputs (whole cache lines of `out`, so no two threads write one line). */
static void thread_range(long n, long t, long threads, long *first, long *end) {
    long lines = (n + 15) / 16;
    *first = t * lines / threads * 16;
    *end = (t + 1) * lines / threads * 16;
    if (*end > n)
        *end = n;
}

/* `share` on `threads` threads of OpenMP's team: the one the compiled graphs' own loops run on.
 * Returns 0, or -1 for a shape the kernels do not take (k not a multiple of 32, more than MAX_ROWS rows). */
static int split_rows(rows_share share, const float *x, const void *w, const float *params, float *out, long rows,
                      long n, long k, long threads) {
    if (k % BLOCK != 0 || rows < 1 || rows > MAX_ROWS)
        return -1;
    threads = threads < 1 ? 1 : threads > (n + 15) / 16 ? (n + 15) / 16 : threads;
#pragma omp parallel num_threads(threads)
    {
        long first, end;
        thread_range(n, omp_get_thread_num(), omp_get_num_threads(), &first, &end);
        share(x, w, params, out, rows, n, k, first, end);
    }
    return 0;
}

/* A kernel as an operator of AOTInductor's packages: a package compiled with the op in inductor's
 * `custom_ops_to_c_shims` calls the kernel's shim by name, as it calls torch's own C shims, with no
 * Python and no proxy executor between (so our ctypes runner still runs the package, GIL released).
 * The library is loaded with its symbols global before any package is. Takes float32 rows
 * [rows, k], contiguous; threads: the caller's OpenMP count (torch.set_num_threads, per step). */

static AOTITorchError shim_rows(rows_call call, AtenTensorHandle rows, AtenTensorHandle qweight,
                                AtenTensorHandle params, AtenTensorHandle *ret0) {
    int64_t *row_sizes, *weight_sizes;
    void *x, *w, *p, *out;
    if (aoti_torch_get_sizes(rows, &row_sizes) || aoti_torch_get_sizes(qweight, &weight_sizes))
        return 1;
    int64_t sizes[2] = {row_sizes[0], weight_sizes[0]}, strides[2] = {weight_sizes[0], 1};
    if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, ret0)
        || aoti_torch_get_data_ptr(rows, &x) || aoti_torch_get_data_ptr(qweight, &w)
        || aoti_torch_get_data_ptr(params, &p) || aoti_torch_get_data_ptr(*ret0, &out))
        return 1;
    return call(x, w, p, out, sizes[0], sizes[1], row_sizes[1], omp_get_max_threads()) != 0;
}

#endif
