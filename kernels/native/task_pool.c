/* Task pool and per-thread scratch for every native kernel (declared in paged_attention.h; each
 * feature's library links its own copy, kernels/native/features.py). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <omp.h>

#include "paged_attention.h"

/* ---- task pool -------------------------------------------------------------------------
 * The calling thread and num_threads - 1 helper threads claim task indices from one atomic
 * counter; the caller returns once every claimed task is done. Unlike an OpenMP region there is
 * no join: a helper that the OS has not scheduled yet (the cores are shared with the engine's
 * other processes) is simply not waited for, and the caller runs the tasks itself. Measured on
 * the 2-core box with one other busy process: an OpenMP team of 2 took 360-540 ms per 30 decode
 * layers against 80 ms for one thread alone, because every region waited for the descheduled
 * thread to reach its barrier. Correctness never depends on a helper running (after a fork
 * there are none, and the caller does everything). The counter's high 32 bits carry the job's
 * generation so that a helper waking late cannot claim a task of a later job. */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static int pool_helpers = 0;
static uint64_t pool_gen = 0;
static task_fn pool_fn;
static void *pool_ctx;
static int64_t pool_ntasks;
static _Atomic uint64_t pool_next;
static _Atomic int64_t pool_done;
static pid_t pool_pid = 0;

static void claim_and_run(uint64_t gen, task_fn fn, void *ctx, int64_t ntasks) {
    for (;;) {
        uint64_t v = atomic_load(&pool_next);
        if ((v >> 32) != (gen & 0xffffffffu) || (int64_t)(v & 0xffffffffu) >= ntasks) return;
        if (!atomic_compare_exchange_weak(&pool_next, &v, v + 1)) continue;
        fn(ctx, (int64_t)(v & 0xffffffffu));
        atomic_fetch_add(&pool_done, 1);
    }
}

static void *pool_helper(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (pool_gen == seen) pthread_cond_wait(&pool_cv, &pool_mu);
        seen = pool_gen;
        const task_fn fn = pool_fn;
        void *const ctx = pool_ctx;
        const int64_t ntasks = pool_ntasks;
        pthread_mutex_unlock(&pool_mu);
        claim_and_run(seen, fn, ctx, ntasks);
        pthread_mutex_lock(&pool_mu);
    }
    return NULL;
}

/* Run fn(ctx, 0..ntasks-1) on the caller and up to num_threads - 1 helpers. One job at a time
 * (callers hold pool_run's lock): the worker calls the kernels from one thread. */
static void pool_run(int num_threads, task_fn fn, void *ctx, int64_t ntasks) {
    static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;
    if (ntasks <= 0) return;
    if (num_threads <= 1 || ntasks == 1) {
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&run_mu);
    pthread_mutex_lock(&pool_mu);
    if (pool_pid != getpid()) { pool_helpers = 0; pool_pid = getpid(); }  /* forked: none left */
    while (pool_helpers < num_threads - 1 && pool_helpers < 63) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, pool_helper, NULL) != 0) break;
        pthread_detach(thread);
        pool_helpers++;
    }
    const uint64_t gen = ++pool_gen;
    pool_fn = fn;
    pool_ctx = ctx;
    pool_ntasks = ntasks;
    atomic_store(&pool_done, 0);
    atomic_store(&pool_next, (gen & 0xffffffffu) << 32);
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    claim_and_run(gen, fn, ctx, ntasks);
    for (int spins = 0; atomic_load(&pool_done) < ntasks; spins++)
        if (spins > 1000) sched_yield();   /* let a preempted helper finish its task */
    pthread_mutex_unlock(&run_mu);
}

/* Where torch's OpenMP team is at least as large as the call wants, the tasks run on it instead
 * (dynamically scheduled): its threads are awake and spinning right after torch's previous op,
 * and a second pool would fight them for the cores (measured, 2 torch threads, batch 256 x 512:
 * 365 ms per 30 layers with linears in between on the OpenMP team vs ~490 ms on the pool). The
 * worker gives torch and this kernel the same threads (--cpu-threads), so it runs on the team;
 * the pool serves callers that ask for more threads than torch has. */
void pa_run_tasks(int num_threads, task_fn fn, void *ctx, int64_t ntasks) {
    if (num_threads <= 1 || ntasks <= 1) {
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t);
    } else if (num_threads <= omp_get_max_threads()) {
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")
        for (int64_t t = 0; t < ntasks; t++) fn(ctx, t);
    } else {
        pool_run(num_threads, fn, ctx, ntasks);
    }
}

/* Per-thread scratch for one task (query rows and scores), grown on demand. */
float *pa_thread_scratch(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        free(buffer);
        buffer = malloc(sizeof(float) * floats);
        capacity = buffer ? floats : 0;
    }
    return buffer;
}

/* Decode: one query row per sequence at position context_lens[b] - 1.
 * workspace: num_seqs * max_parts * Hq * (D + 2) floats, max_parts = ceil(max ctx / part).
 * Returns 0, or a negative code for arguments the wrapper should have rejected. */
