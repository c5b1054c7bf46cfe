/* fma_probe.c: the machine's fp32/fp64 FMA peak, measured (a benchmark tool,
 * compiled by bench.py with -O2 and the widest ISA flags the CPU has).
 *
 *   fma_probe THREADS SECONDS  ->  prints "f32 GFLOPS" and "f64 GFLOPS"
 *
 * Each thread runs NACC independent accumulator chains of vector FMAs
 * (acc = acc * m + a), enough to cover the FMA latency on every current
 * x86 core, kept in registers (the chain loop is fully unrolled); the best
 * of several repetitions counts. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NACC 12
#ifdef __AVX512F__
#define VS __m512
#define VD __m512d
#define WS 16
#define WD 8
#define SET1S _mm512_set1_ps
#define SET1D _mm512_set1_pd
#define FMAS _mm512_fmadd_ps
#define FMAD _mm512_fmadd_pd
#define SUMS(v) _mm512_reduce_add_ps(v)
#define SUMD(v) _mm512_reduce_add_pd(v)
#else
#define VS __m256
#define VD __m256d
#define WS 8
#define WD 4
#define SET1S _mm256_set1_ps
#define SET1D _mm256_set1_pd
#define FMAS _mm256_fmadd_ps
#define FMAD _mm256_fmadd_pd
static float SUMS(__m256 v) { float t[8]; _mm256_storeu_ps(t, v); return t[0] + t[7]; }
static double SUMD(__m256d v) { double t[4]; _mm256_storeu_pd(t, v); return t[0] + t[3]; }
#endif

static long g_iters;
static int g_f64;
static volatile double g_sink;

static void *run(void *arg)
{
    long i;
    int r;
    (void)arg;
    if (!g_f64) {
        VS acc[NACC], m = SET1S(0.999999f), a = SET1S(1e-7f);
        for (r = 0; r < NACC; r++) acc[r] = SET1S((float)r);
        for (i = 0; i < g_iters; i++)
#pragma GCC unroll 16
            for (r = 0; r < NACC; r++) acc[r] = FMAS(acc[r], m, a);
        float s = 0;
        for (r = 0; r < NACC; r++) s += SUMS(acc[r]);
        g_sink = s;
    } else {
        VD acc[NACC], m = SET1D(0.999999), a = SET1D(1e-7);
        for (r = 0; r < NACC; r++) acc[r] = SET1D((double)r);
        for (i = 0; i < g_iters; i++)
#pragma GCC unroll 16
            for (r = 0; r < NACC; r++) acc[r] = FMAD(acc[r], m, a);
        double s = 0;
        for (r = 0; r < NACC; r++) s += SUMD(acc[r]);
        g_sink = s;
    }
    return NULL;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static double measure(int threads, int f64)
{
    pthread_t tid[64];
    int t, rep;
    double best = 0;
    g_f64 = f64;
    for (rep = 0; rep < 7; rep++) {
        double t0 = now();
        for (t = 0; t < threads; t++) pthread_create(&tid[t], NULL, run, NULL);
        for (t = 0; t < threads; t++) pthread_join(tid[t], NULL);
        double dt = now() - t0;
        double flops = 2.0 * NACC * (f64 ? WD : WS) * (double)g_iters * threads;
        if (flops / dt > best) best = flops / dt;
    }
    return best / 1e9;
}

int main(int argc, char **argv)
{
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    g_iters = argc > 2 ? atol(argv[2]) : 20000000L;
    if (threads < 1 || threads > 64) threads = 1;
    printf("f32 %.2f\n", measure(threads, 0));
    printf("f64 %.2f\n", measure(threads, 1));
    return 0;
}
