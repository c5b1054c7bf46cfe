/* cpu.c: what the CPU says of itself, and the blocking drawn from it.
 *
 * Read once, at first use:
 *   - the cache sizes: CPUID's deterministic cache leaf (4 on Intel,
 *     0x8000001D on AMD and Hygon), else glibc's sysconf, else 32 KiB L1d
 *     and 1 MiB L2;
 *   - the vector FMA width: that of the instruction set in use (isa.c);
 *   - on request only (mha_get_cpu_info), the 512-bit FMAs a core starts per
 *     cycle, measured: n rounds of 24 independent FMAs on 512-bit vectors,
 *     then on 256-bit ones.  n x 24 / p cycles at p FMAs a cycle, so
 *     t256 / t512 = p512 / p256; every x86 core with AVX-512 so far starts
 *     two 256-bit FMAs a cycle, so p512 = 2 t256 / t512: 1 on a core that
 *     splits a 512-bit FMA in two (Zen 4, a Xeon with one 512-bit port), 2
 *     on one with two 512-bit ports (most Xeon Gold/Platinum, Zen 5).
 *
 * The blocking: the packed GEMM's NC (columns of the (KC, NC) block of B
 * that stays in L2 while every row panel of A streams past it) is the
 * largest multiple of 64 with KC x NC scalars in half the L2, in [64, 512]:
 * 256 float / 128 double on a 1 MiB L2 (Zen 4, Skylake-SP), 512 / 256 on a
 * 2 MiB one (Sapphire Rapids).  NC changes no result: every element of C is
 * summed in the same order (gemm_impl.h) whatever NC.  KC is fixed (512):
 * it sets the order of the sums, so results would depend on the machine.
 * The environment variable MHA_EXT_GEMM_NC (a multiple of 64 in [64, 512])
 * overrides the choice (the tests run several this way).
 *
 * The micro-kernels hold 24 accumulators (6 rows x 4 vectors): enough for
 * two FMA ports of latency 4 (8 needed) and more, so the FMA ports pick no
 * kernel: the same one fills Zen 4's one 512-bit pipe and a Xeon's two. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

typedef struct {
    int64_t l1d, l2, l3; /* bytes; 0: unknown */
    int from;            /* 1: CPUID, 2: sysconf, 0: the defaults */
} caches;

static caches g_caches;
static atomic_int g_caches_ok;  /* 0: not read yet */
static atomic_int g_nc_f32, g_nc_f64; /* 0: not chosen yet */

#if defined(__x86_64__) && defined(__GNUC__)
/* one CPUID cache leaf (4 or 0x8000001D): subleaves until type 0 */
static int caches_cpuid(caches *c)
{
    unsigned a, b, cx, d, max_std, max_ext, leaf = 0, i;
    if (!__get_cpuid(0, &max_std, &b, &cx, &d)) return 0;
    const int amd = (b == 0x68747541u /* "Auth"enticAMD */) || (b == 0x6f677948u /* "Hygo"n */);
    max_ext = __get_cpuid_max(0x80000000u, NULL);
    if (amd && max_ext >= 0x8000001Du) {
        __cpuid(0x80000001u, a, b, cx, d);
        if (cx & (1u << 22)) leaf = 0x8000001Du; /* topology extensions */
    } else if (!amd && max_std >= 4) {
        leaf = 4;
    }
    if (!leaf) return 0;
    for (i = 0; i < 16; i++) {
        __cpuid_count(leaf, i, a, b, cx, d);
        const unsigned type = a & 31, level = (a >> 5) & 7;
        if (type == 0) break;
        if (type == 2) continue; /* instructions */
        const int64_t size = (int64_t)((b >> 22) + 1) * (((b >> 12) & 0x3ff) + 1) *
                             ((b & 0xfff) + 1) * ((int64_t)cx + 1);
        if (level == 1) c->l1d = size;
        else if (level == 2) c->l2 = size;
        else if (level == 3) c->l3 = size;
    }
    return c->l1d > 0 && c->l2 > 0;
}
#endif

static const caches *get_caches(void)
{
    if (atomic_load(&g_caches_ok)) return &g_caches;
    caches c = {0, 0, 0, 0};
#if defined(__x86_64__) && defined(__GNUC__)
    if (caches_cpuid(&c)) c.from = 1;
#endif
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    if (!c.from) {
        long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        if (l1 > 0 && l2 > 0) {
            c.l1d = l1;
            c.l2 = l2;
#ifdef _SC_LEVEL3_CACHE_SIZE
            long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
            c.l3 = l3 > 0 ? l3 : 0;
#endif
            c.from = 2;
        }
    }
#endif
    if (!c.from) {
        c.l1d = 32 << 10;
        c.l2 = 1 << 20;
        c.l3 = 0;
    }
    g_caches = c; /* every thread writes the same values */
    atomic_store(&g_caches_ok, 1);
    return &g_caches;
}

/* KC x NC scalars in half the L2, NC a multiple of 64 in [64, 512]; or
 * MHA_EXT_GEMM_NC when it holds such a multiple */
static int choose_nc(size_t scalar)
{
    const char *env = getenv("MHA_EXT_GEMM_NC");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end == '\0' && v >= 64 && v <= MHA_GEMM_NC_MAX && v % 64 == 0) return (int)v;
    }
    int64_t nc = get_caches()->l2 / 2 / (MHA_GEMM_KC * (int64_t)scalar) / 64 * 64;
    return nc < 64 ? 64 : nc > MHA_GEMM_NC_MAX ? MHA_GEMM_NC_MAX : (int)nc;
}

int64_t mha_gemm_nc(size_t scalar)
{
    atomic_int *g = scalar == sizeof(double) ? &g_nc_f64 : &g_nc_f32;
    int nc = atomic_load_explicit(g, memory_order_relaxed), expected = 0;
    if (nc) return nc;
    atomic_compare_exchange_strong(g, &expected, choose_nc(scalar));
    return atomic_load(g);
}

/* seconds for n rounds of the probe at one width */
static double fma_seconds(void (*loop)(int64_t, int, float *), int64_t n, int wide)
{
    struct timespec t0, t1;
    float sink[16];
    clock_gettime(CLOCK_MONOTONIC, &t0);
    loop(n, wide, sink);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

/* time(256-bit) / time(512-bit) for the same count of FMAs: the fastest of
 * 11 runs at each width (the least disturbed), the widths alternated so that
 * a change of clock or a neighbour's load reaches both alike.  (The fastest
 * of 5 runs at one width, then of 5 at the other, read 0.73-0.79 at times on
 * a loaded Zen 4, which starts one 512-bit FMA a cycle.)
 *
 * Above FMA_TWO counts as two 512-bit FMAs a cycle.  Read over the runs in
 * benchmarks/RESULTS.md and the README: Zen 4 0.45-0.70 quiet, 0.76 once on
 * a loaded host (2026-12-04: then reported as two under the former
 * threshold, 0.75), 40 calls in a row there 0.58-0.71; Zen 5 and the Intel
 * Xeon (family 6, model 167), two 512-bit FMAs a cycle, 1.04-1.12. */
#define FMA_TWO 0.9
static double fma_ratio(void (*loop)(int64_t, int, float *))
{
    const int64_t n = 200000; /* 2e5 rounds of 24 FMAs: ~1.5 ms per width on Zen 4 */
    double t512 = 1e30, t256 = 1e30;
    int rep;
    loop(n / 10, 1, (float[16]){0}); /* wake the 512-bit units */
    for (rep = 0; rep < 11; rep++) {
        double s512 = fma_seconds(loop, n, 1), s256 = fma_seconds(loop, n, 0);
        if (s512 < t512) t512 = s512;
        if (s256 < t256) t256 = s256;
    }
    return t256 / t512;
}

mha_status mha_get_cpu_info(mha_cpu_info *out)
{
    const caches *c;
    const char *isa;
    if (!out) return MHA_ERR_ARG;
    memset(out, 0, sizeof *out);
    c = get_caches();
    out->l1d_bytes = c->l1d;
    out->l2_bytes = c->l2;
    out->l3_bytes = c->l3;
    out->cache_source = c->from == 1 ? "cpuid" : c->from == 2 ? "sysconf" : "default";
    isa = mha_get_isa();
    out->fma_bits = strcmp(isa, "avx512") == 0 || strcmp(isa, "amx") == 0 ? 512 : strcmp(isa, "avx2") == 0 ? 256 : 0;
    out->gemm_kc = MHA_GEMM_KC;
    out->gemm_nc_f32 = mha_gemm_nc(sizeof(float));
    out->gemm_nc_f64 = mha_gemm_nc(sizeof(double));
    out->tn_pack_f32 = mha_tn_pack_f32(mha_kern_get_f32());
    out->tn_pack_f64 = mha_tn_pack_f64(mha_kern_get_f64());
    out->fma512_per_cycle = 0;
    if (mha_isa_available("avx512") && mha_fma_loop_avx512_p) {
        out->fma_ratio = fma_ratio(mha_fma_loop_avx512_p);
        out->fma512_per_cycle = out->fma_ratio > FMA_TWO ? 2 : 1;
    }
    return MHA_OK;
}
