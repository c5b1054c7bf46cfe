/* isa.c: which kernel table the fast path uses.
 *
 * The default is the widest instruction set the CPU has (AMX, else
 * AVX-512F, else AVX2 + FMA, else the portable kernels).  "amx" is
 * AVX-512's kernels with the float products (projections and gradients)
 * on the AMX tiles (amx_impl.h); it needs AMX-TILE and AMX-BF16 in CPUID,
 * the tile state enabled by the kernel (XCR0 bits 17 and 18) and, on
 * Linux, the process's leave to use it (arch_prctl ARCH_REQ_XCOMP_PERM,
 * asked once).  The environment variable
 * MHA_EXT_ISA=portable|avx2|avx512|amx, read once at first use, or
 * mha_set_isa() choose a narrower one (tests run every path this way);
 * mha_set_isa refuses one the CPU lacks, while MHA_EXT_ISA naming one (or
 * no known name) is ignored: the widest is used (the Python package warns
 * at import). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static const char *const g_names[MHA_ISA_COUNT] = {"portable", "avx2", "avx512", "amx"};
static atomic_int g_isa = -1; /* -1: not decided yet */
static atomic_int g_amx = -1; /* -1: not asked yet */

/* 1 when the CPU reports AMX-TILE and AMX-BF16 and the kernel enables the
 * tile state (XCR0 bits 17 and 18); asks nothing of the kernel */
static int amx_cpuid(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
    unsigned a, b, c, d, lo, hi;
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    /* EDX 22: AMX-BF16, 24: AMX-TILE; ECX 27: OSXSAVE (leaf 1) */
    if (!(d >> 22 & 1) || !(d >> 24 & 1) || !__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1))
        return 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo >> 17 & 3) == 3;
#else
    return 0;
#endif
}

/* 1 when this process may use the AMX tiles with bfloat16 products: the
 * CPU's and kernel's, and the process's leave for XTILEDATA, asked once
 * (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16) */
static int amx_usable(void)
{
    int v = atomic_load(&g_amx);
    if (v >= 0) return v;
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
    v = amx_cpuid() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    v = 0;
#endif
    {
        int expected = -1;
        atomic_compare_exchange_strong(&g_amx, &expected, v);
    }
    return atomic_load(&g_amx);
}

static int cpu_has(int isa)
{
    if (isa == MHA_ISA_PORTABLE) return 1;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (isa == MHA_ISA_AVX2)
        return mha_kern_avx2_f32_p && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
    if (isa == MHA_ISA_AVX512)
        return mha_kern_avx512_f32_p && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
    if (isa == MHA_ISA_AMX)
        return mha_kern_amx_f32_p && cpu_has(MHA_ISA_AVX512) &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               amx_usable();
#endif
    return 0;
}

static int isa_by_name(const char *name)
{
    int i;
    for (i = 0; i < MHA_ISA_COUNT; i++)
        if (name && strcmp(name, g_names[i]) == 0) return i;
    return -1;
}

static int current(void)
{
    int isa = atomic_load(&g_isa);
    if (isa >= 0) return isa;
    /* first use: the environment, else the best the CPU has */
    {
        int want = isa_by_name(getenv("MHA_EXT_ISA"));
        if (want < 0 || !cpu_has(want)) {
            want = MHA_ISA_AMX;
            while (!cpu_has(want)) want--;
        }
        int expected = -1;
        atomic_compare_exchange_strong(&g_isa, &expected, want);
    }
    return atomic_load(&g_isa);
}

int mha_amx_available(void)
{
    /* the CPU and the build only: sizing the scratch asks no leave of the
     * kernel (that comes with the first use of "amx") */
    static atomic_int avail = -1;
    int v = atomic_load_explicit(&avail, memory_order_relaxed);
    if (v < 0) {
        v = mha_kern_amx_f32_p != NULL && amx_cpuid();
        atomic_store(&avail, v);
    }
    return v;
}

mha_status mha_set_isa(const char *name)
{
    int isa = isa_by_name(name);
    if (isa < 0 || !cpu_has(isa)) return MHA_ERR_ARG;
    atomic_store(&g_isa, isa);
    return MHA_OK;
}

const char *mha_get_isa(void) { return g_names[current()]; }

int mha_isa_available(const char *name)
{
    int isa = isa_by_name(name);
    return isa >= 0 && cpu_has(isa);
}

const mha_kern_f32 *mha_kern_for_f32(int isa)
{
    if (isa < 0 || isa >= MHA_ISA_COUNT || !cpu_has(isa)) return NULL;
    return isa == MHA_ISA_AMX      ? mha_kern_amx_f32_p
         : isa == MHA_ISA_AVX512 ? mha_kern_avx512_f32_p
         : isa == MHA_ISA_AVX2   ? mha_kern_avx2_f32_p
                                 : &mha_kern_portable_f32;
}

const mha_kern_f64 *mha_kern_for_f64(int isa)
{
    if (isa < 0 || isa >= MHA_ISA_COUNT || !cpu_has(isa)) return NULL;
    return isa >= MHA_ISA_AVX512 ? mha_kern_avx512_f64_p /* amx: no double products */
         : isa == MHA_ISA_AVX2   ? mha_kern_avx2_f64_p
                                 : &mha_kern_portable_f64;
}

const mha_kern_f32 *mha_kern_get_f32(void) { return mha_kern_for_f32(current()); }
const mha_kern_f64 *mha_kern_get_f64(void) { return mha_kern_for_f64(current()); }
