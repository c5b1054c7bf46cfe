/* read_probe.c: the machine's memory read bandwidth, measured (a benchmark
 * tool, compiled by bench_decode.py with -O2 and the widest ISA flags the
 * CPU has).
 *
 *   read_probe THREADS MIB  ->  prints "read GB/s"
 *
 * Each thread sums its own slice of a buffer of MIB mebibytes (far larger
 * than the caches) with several independent vector accumulators, so that
 * the loads, not the adds, set the pace; the best of several passes counts
 * (the first touches the pages). */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef __AVX512F__
#define V __m512
#define W 16
#define LOAD _mm512_load_ps
#define ADD _mm512_add_ps
#define ZERO _mm512_setzero_ps
#else
#define V __m256
#define W 8
#define LOAD _mm256_load_ps
#define ADD _mm256_add_ps
#define ZERO _mm256_setzero_ps
#endif

typedef struct {
    const float *p;
    size_t n;
    float sink;
} slice;

static void *run(void *arg)
{
    slice *s = (slice *)arg;
    V a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO();
    size_t i;
    for (i = 0; i + 4 * W <= s->n; i += 4 * W) {
        a0 = ADD(a0, LOAD(s->p + i));
        a1 = ADD(a1, LOAD(s->p + i + W));
        a2 = ADD(a2, LOAD(s->p + i + 2 * W));
        a3 = ADD(a3, LOAD(s->p + i + 3 * W));
    }
    {
        float t[W];
        int l;
        memcpy(t, &a0, sizeof t);
        a0 = ADD(ADD(a0, a1), ADD(a2, a3));
        memcpy(t, &a0, sizeof t);
        s->sink = 0;
        for (l = 0; l < W; l++) s->sink += t[l];
    }
    return NULL;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    int threads = argc > 1 ? atoi(argv[1]) : 1, t, rep;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 512, n, per;
    float *buf;
    double best = 0, sink = 0;
    if (threads < 1 || threads > 256 || mib < 1) return 2;
    n = mib * 1024 * 1024 / sizeof(float);
    if (posix_memalign((void **)&buf, 64, n * sizeof(float))) return 1;
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 7);
    per = n / (size_t)threads / (4 * W) * (4 * W);
    for (rep = 0; rep < 8; rep++) {
        pthread_t th[256];
        slice sl[256];
        double t0 = now(), dt;
        for (t = 0; t < threads; t++) {
            sl[t].p = buf + (size_t)t * per;
            sl[t].n = per;
            pthread_create(&th[t], NULL, run, &sl[t]);
        }
        for (t = 0; t < threads; t++) {
            pthread_join(th[t], NULL);
            sink += sl[t].sink;
        }
        dt = now() - t0;
        if ((double)(per * (size_t)threads * sizeof(float)) / dt / 1e9 > best)
            best = (double)(per * (size_t)threads * sizeof(float)) / dt / 1e9;
    }
    printf("read %.3f\n", best);
    fprintf(stderr, "(sink %g)\n", sink);
    free(buf);
    return 0;
}
