/* A helper thread on a lent CPU that takes chunks of a kernel's work whenever it gets to run.
 *
 * Why: the served layout lends the HTTP server's CPU to the compute steps, but OpenMP's teams join
 * at a barrier, so a step on two threads waits for the lent one whenever the HTTP server holds its
 * CPU, and the thread tuner then keeps one (docs/benchmarks.md, "Where the small Llama's served
 * token goes"). Here the calling thread and the helper claim chunks from one counter and the call
 * waits only for chunks the helper has started: a helper that does not get its CPU costs a wake-up
 * write, and one that does takes whatever share it gets (a scratch measurement beside a neighbour
 * busy half the time: 1.49x one thread, where halves joined at a barrier gave 1.05x).
 *
 * The claim word holds the job's number, its chunk count and the next chunk, so a claim can only
 * succeed on the job in flight, while its caller waits for that chunk: the job's description is
 * stable for as long as the helper reads it. The helper spins a little after each job, then
 * sleeps on a futex. It lives as long as the process (as OpenMP's pool does), on the CPUs given to
 * `lent_cpu_start`. Its includer defines _GNU_SOURCE before any include (CPU_SET, pthread_setaffinity_np).
 */
#ifndef TRIO_LLM_LENT_CPU_H
#define TRIO_LLM_LENT_CPU_H

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define LENT_SPIN 4000 /* pause loops before the helper sleeps: ~0.2 ms here, the gaps inside a step */
#define CHUNK_BITS 20

typedef void (*chunk_fn)(const void *ctx, long chunk);

static struct {
    _Atomic uint64_t claim;  /* job << 40 | chunks << 20 | next */
    _Atomic long done;       /* chunks of the job in flight finished (by either thread) */
    _Atomic uint32_t posted; /* the job number the helper waits to change (its futex word) */
    _Atomic int sleeping;
    _Atomic int started;
    atomic_flag busy; /* a second caller meanwhile runs its call alone */
    chunk_fn run;
    const void *ctx;
    uint32_t job;
    cpu_set_t cpus;
    pthread_mutex_t start_lock;
} lent = {.start_lock = PTHREAD_MUTEX_INITIALIZER, .busy = ATOMIC_FLAG_INIT};

static inline void lent_pause(void) { __builtin_ia32_pause(); }

/* Claim the next chunk of job `job`, or -1 when it has none left (or is not the job in flight). */
static long lent_claim(uint32_t job) {
    uint64_t word = atomic_load(&lent.claim);
    for (;;) {
        long chunks = (long)((word >> CHUNK_BITS) & ((1u << CHUNK_BITS) - 1));
        long next = (long)(word & ((1u << CHUNK_BITS) - 1));
        if ((uint32_t)(word >> (2 * CHUNK_BITS)) != job || next >= chunks)
            return -1;
        if (atomic_compare_exchange_weak(&lent.claim, &word, word + 1))
            return next;
    }
}

static void lent_work(uint32_t job) {
    long chunk;
    while ((chunk = lent_claim(job)) >= 0) {
        lent.run(lent.ctx, chunk); /* stable: our claim holds the caller in `lent_run` */
        atomic_fetch_add(&lent.done, 1);
    }
}

static void *lent_helper(void *unused) {
    (void)unused;
    pthread_setaffinity_np(pthread_self(), sizeof lent.cpus, &lent.cpus);
    uint32_t seen = atomic_load(&lent.posted);
    for (;;) {
        uint32_t now = atomic_load(&lent.posted);
        for (int spin = 0; now == seen && spin < LENT_SPIN; spin++) {
            lent_pause();
            now = atomic_load(&lent.posted);
        }
        if (now == seen) {
            atomic_store(&lent.sleeping, 1);
            if (atomic_load(&lent.posted) == seen)
                syscall(SYS_futex, &lent.posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&lent.sleeping, 0);
            continue;
        }
        seen = now;
        lent_work(now);
    }
    return NULL;
}

/* Start the helper on `cpus` (once per process; later calls change nothing); 0 when it runs. */
static int lent_cpu_start(const int *cpus, long count) {
    pthread_mutex_lock(&lent.start_lock);
    int failed = 0;
    if (!atomic_load(&lent.started)) {
        CPU_ZERO(&lent.cpus);
        for (long i = 0; i < count; i++)
            CPU_SET(cpus[i], &lent.cpus);
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        failed = pthread_create(&thread, &attr, lent_helper, NULL) != 0;
        pthread_attr_destroy(&attr);
        if (!failed)
            atomic_store(&lent.started, 1);
    }
    pthread_mutex_unlock(&lent.start_lock);
    return failed ? -1 : 0;
}

/* Run chunks 0..chunks-1 of `run(ctx, chunk)` on the calling thread and the helper, each chunk once;
 * returns once every chunk is done. One caller shares with the helper at a time (the worker's
 * compute thread); another meanwhile runs its chunks alone. */
static void lent_run(chunk_fn run, const void *ctx, long chunks) {
    if (atomic_flag_test_and_set(&lent.busy)) {
        for (long chunk = 0; chunk < chunks; chunk++)
            run(ctx, chunk);
        return;
    }
    uint32_t job = ++lent.job & ((1u << 24) - 1);
    lent.run = run;
    lent.ctx = ctx;
    atomic_store(&lent.done, 0);
    atomic_store(&lent.claim, ((uint64_t)job << (2 * CHUNK_BITS)) | ((uint64_t)chunks << CHUNK_BITS));
    atomic_store(&lent.posted, job);
    if (atomic_load(&lent.sleeping))
        syscall(SYS_futex, &lent.posted, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    lent_work(job);
    while (atomic_load(&lent.done) < chunks)
        lent_pause();
    atomic_flag_clear(&lent.busy);
}

#endif
