/* isa.c: which kernel table the fast path uses.
 *
 * The default is the widest instruction set the CPU has (AVX-512F, else
 * AVX2 + FMA, else the portable kernels).  The environment variable
 * MHA_EXT_ISA=portable|avx2|avx512, read once at first use, or
 * mha_set_isa() choose a narrower one (tests run every path this way);
 * asking for one the CPU lacks is refused. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

static const char *const g_names[MHA_ISA_COUNT] = {"portable", "avx2", "avx512"};
static atomic_int g_isa = -1; /* -1: not decided yet */

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
            want = MHA_ISA_AVX512;
            while (!cpu_has(want)) want--;
        }
        int expected = -1;
        atomic_compare_exchange_strong(&g_isa, &expected, want);
    }
    return atomic_load(&g_isa);
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
    return isa == MHA_ISA_AVX512 ? mha_kern_avx512_f32_p
         : isa == MHA_ISA_AVX2 ? mha_kern_avx2_f32_p : &mha_kern_portable_f32;
}

const mha_kern_f64 *mha_kern_for_f64(int isa)
{
    if (isa < 0 || isa >= MHA_ISA_COUNT || !cpu_has(isa)) return NULL;
    return isa == MHA_ISA_AVX512 ? mha_kern_avx512_f64_p
         : isa == MHA_ISA_AVX2 ? mha_kern_avx2_f64_p : &mha_kern_portable_f64;
}

const mha_kern_f32 *mha_kern_get_f32(void) { return mha_kern_for_f32(current()); }
const mha_kern_f64 *mha_kern_get_f64(void) { return mha_kern_for_f64(current()); }
