/* A kernel's work split over threads: shared by the kernels of this directory (see native.py,
 * which includes this header in every kernel's build key). */
#ifndef TRIO_LLM_SPLIT_THREADS_H
#define TRIO_LLM_SPLIT_THREADS_H

#include <pthread.h>
#include <stddef.h>

#define MAX_THREADS 64

/* Run `work` on each of `threads` jobs laid out `job_size` bytes apart from `jobs`: job 0 on the
 * calling thread, the others on threads started for the call (which inherit its CPUs), then join
 * them. A thread that cannot be started leaves its job to the calling thread, after its own. */
static void run_split(void *(*work)(void *), void *jobs, size_t job_size, long threads) {
    pthread_t started[MAX_THREADS];
    int running[MAX_THREADS] = {0};
    char *base = jobs;
    for (long t = 1; t < threads; t++)
        running[t] = pthread_create(&started[t], NULL, work, base + t * job_size) == 0;
    work(base);
    for (long t = 1; t < threads; t++) {
        if (running[t])
            pthread_join(started[t], NULL);
        else
            work(base + t * job_size);
    }
}

#endif
