/* pool.c: a persistent pool of worker threads.
 *
 * One job at a time runs on the pool: a caller that finds it busy (another
 * Python thread is computing) runs its tasks on its own thread instead, so
 * concurrent calls never wait on each other and never deadlock.  Tasks are
 * handed out through one atomic counter; each thread has a fixed slot
 * number so callers can give it private scratch memory.
 *
 * Between jobs a thread spins briefly (SPIN pauses, some tens of
 * microseconds) before it sleeps: one call runs several parallel passes
 * back to back, and a futex wake-up at each would cost more than the spin.
 *
 * fork() waits for nothing: the child starts with no workers and fresh
 * locks, whatever job ran.  (Waiting for a running job to end deadlocked:
 * os.fork holds the GIL, and the job's caller takes the GIL to poll for
 * signals.)  A job the forking thread itself was running (os.fork in a
 * signal handler that its poll ran) has lost its workers' tasks in the
 * child: there it returns "stopped". */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define MAX_THREADS 256

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_busy;  /* held by the caller whose job runs */
static pthread_mutex_t g_lock;  /* guards everything below */
static pthread_cond_t g_wake;   /* workers wait here for a job */
static pthread_cond_t g_done;   /* the caller waits here for the workers */
static int g_nthreads;          /* what mha_set_num_threads asked for */
static int g_nworkers;          /* worker threads started */
static atomic_uint_least64_t g_generation; /* bumped for every job (under g_lock) */
static uint64_t g_birth[MAX_THREADS]; /* g_generation when worker i started */

static mha_task_fn g_fn;
static void *g_ctx;
static int64_t g_ntasks;
static atomic_llong g_next;
static int g_job_workers;       /* workers 0 .. g_job_workers-1 join the job */
static pthread_t g_caller;      /* the thread that posted the job */
static int g_lost;              /* a fork child: the job of this thread lost tasks */
static atomic_int g_pending;    /* of those, how many have not finished (under g_lock) */

#define SPIN 4000 /* pauses before a waiting thread sleeps */
static inline void cpu_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static int default_threads(void)
{
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n < MAX_THREADS ? n : MAX_THREADS;
    }
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    return n < MAX_THREADS ? (int)n : MAX_THREADS;
}

/* MHA_EXT_NUM_THREADS, when it holds a positive integer (and nothing
 * else; MAX_THREADS from there on, also past a long's range), else 0: the
 * caller then takes the CPUs.  OMP_NUM_THREADS is not
 * read: this pool is mha_ext's own, not OpenMP's. */
static int env_threads(void)
{
    const char *s = getenv("MHA_EXT_NUM_THREADS");
    char *end;
    long n;
    if (!s || *s == '\0') return 0;
    errno = 0;
    n = strtol(s, &end, 10);
    while (*end == ' ' || *end == '\t' || *end == '\n') end++;
    if (errno == ERANGE && n == LONG_MAX && *end == '\0') return MAX_THREADS; /* past long */
    if (errno != 0 || *end != '\0' || n < 1) return 0;
    return n < MAX_THREADS ? (int)n : MAX_THREADS;
}

static void init_locks(void)
{
    pthread_mutex_init(&g_busy, NULL);
    pthread_mutex_init(&g_lock, NULL);
    pthread_cond_init(&g_wake, NULL);
    pthread_cond_init(&g_done, NULL);
}

static void before_fork(void) { pthread_mutex_lock(&g_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&g_lock); }
static void after_fork_child(void)
{
    g_lost = g_job_workers > 0 && pthread_equal(g_caller, pthread_self());
    init_locks();
    if (g_lost) pthread_mutex_lock(&g_busy); /* its caller releases it */
    g_nworkers = 0;
    g_job_workers = 0;
    g_pending = 0;
}

static void pool_init(void)
{
    init_locks();
    g_nthreads = env_threads();
    if (g_nthreads == 0) g_nthreads = default_threads();
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* ---- the call's poll ----
 * The coarse clock where there is one: a few nanoseconds a read (no
 * rdtsc), ticks of a few milliseconds, plenty for MHA_POLL_MS. */
static int64_t now_ms(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC_COARSE
    if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0)
#endif
        clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void mha_poll_start(mha_poll_state *ps, mha_poll_fn fn, void *ctx)
{
    ps->fn = fn;
    ps->ctx = ctx;
    ps->stopped = 0;
    ps->next_ms = fn ? now_ms() + MHA_POLL_MS : 0;
}

/* on the calling thread, after each of its tasks: nonzero to stop */
static int poll_says_stop(mha_poll_state *ps)
{
    int64_t now;
    if (!ps || !ps->fn) return 0;
    if (__atomic_load_n(&ps->stopped, __ATOMIC_RELAXED)) return 1; /* told already */
    now = now_ms();
    if (now < ps->next_ms) return 0;
    if (ps->fn(ps->ctx)) __atomic_store_n(&ps->stopped, 1, __ATOMIC_RELAXED);
    ps->next_ms = now_ms() + MHA_POLL_MS; /* the poll itself may take a while */
    return ps->stopped;
}

int mha_task_stopped(mha_poll_state *ps, int slot)
{
    if (!ps) return 0;
    if (slot == 0) return poll_says_stop(ps);
    return __atomic_load_n(&ps->stopped, __ATOMIC_RELAXED);
}

/* Take tasks until none is left.  ps (the caller's thread only): when it
 * says stop, the counter is moved past the end, so that no thread takes
 * another task. */
static void run_tasks(int slot, mha_poll_state *ps)
{
    int64_t t;
    while ((t = (int64_t)atomic_fetch_add(&g_next, 1)) < g_ntasks) {
        g_fn(g_ctx, t, slot);
        if (poll_says_stop(ps)) {
            atomic_store(&g_next, g_ntasks);
            break;
        }
    }
}

static void *worker_main(void *arg)
{
    int index = (int)(intptr_t)arg;
    uint64_t seen;
    pthread_mutex_lock(&g_lock);
    seen = g_birth[index]; /* a job posted while we started is still ours */
    for (;;) {
        if (g_generation == seen) { /* the next job often comes within microseconds */
            int i;
            pthread_mutex_unlock(&g_lock);
            for (i = 0; i < SPIN && atomic_load(&g_generation) == seen; i++) cpu_pause();
            pthread_mutex_lock(&g_lock);
        }
        while (g_generation == seen) pthread_cond_wait(&g_wake, &g_lock);
        seen = g_generation;
        if (index >= g_job_workers) continue;
        pthread_mutex_unlock(&g_lock);
        run_tasks(index + 1, NULL);
        pthread_mutex_lock(&g_lock);
        if (--g_pending == 0) pthread_cond_signal(&g_done);
    }
    return NULL;
}

/* Start workers until `want` exist; returns how many there are. g_lock held. */
static int start_workers(int want)
{
    while (g_nworkers < want) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_birth[g_nworkers] = g_generation;
        int rc = pthread_create(&tid, &attr, worker_main, (void *)(intptr_t)g_nworkers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer workers: still correct, just slower */
        g_nworkers++;
    }
    return g_nworkers;
}

int mha_parallel_for(int64_t n_tasks, int max_slots, mha_task_fn fn, void *ctx,
                     mha_poll_state *ps)
{
    int64_t t;
    int workers, lost;
    if (ps && ps->stopped) return 1;
    if (n_tasks <= 0) return 0;
    pthread_once(&g_once, pool_init);
    if (max_slots > 1 && n_tasks > 1 && pthread_mutex_trylock(&g_busy) == 0) {
        pthread_mutex_lock(&g_lock);
        workers = g_nthreads < max_slots ? g_nthreads - 1 : max_slots - 1;
        if (workers > n_tasks - 1) workers = (int)(n_tasks - 1);
        if (workers > 0) {
            int have = start_workers(workers);
            if (have < workers) workers = have;
        }
        if (workers > 0) {
            g_fn = fn;
            g_ctx = ctx;
            g_ntasks = n_tasks;
            atomic_store(&g_next, 0);
            g_job_workers = workers;
            g_caller = pthread_self();
            g_pending = workers;
            g_generation++;
            pthread_cond_broadcast(&g_wake);
            pthread_mutex_unlock(&g_lock);
            run_tasks(0, ps);
            { /* the workers' last tasks usually end within microseconds */
                int i;
                for (i = 0; i < SPIN && atomic_load(&g_pending) > 0; i++) cpu_pause();
            }
            pthread_mutex_lock(&g_lock);
            while (g_pending > 0) pthread_cond_wait(&g_done, &g_lock);
            g_job_workers = 0;
            lost = g_lost;
            g_lost = 0;
            pthread_mutex_unlock(&g_lock);
            pthread_mutex_unlock(&g_busy);
            if (lost && ps) ps->stopped = 1;
            return lost || (ps && ps->stopped);
        }
        pthread_mutex_unlock(&g_lock);
        pthread_mutex_unlock(&g_busy);
    }
    for (t = 0; t < n_tasks; t++) {
        fn(ctx, t, 0);
        if (poll_says_stop(ps)) return 1;
    }
    return 0;
}

void mha_set_num_threads(int n)
{
    pthread_once(&g_once, pool_init);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&g_lock);
    g_nthreads = n;
    pthread_mutex_unlock(&g_lock);
}

int mha_get_num_threads(void)
{
    int n;
    pthread_once(&g_once, pool_init);
    pthread_mutex_lock(&g_lock);
    n = g_nthreads;
    pthread_mutex_unlock(&g_lock);
    return n;
}
