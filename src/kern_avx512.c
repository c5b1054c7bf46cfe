/* kern_avx512.c: the kernels for AVX-512F (512-bit vectors), compiled with a
 * target attribute so that the default build stays portable; isa.c uses
 * them only when the CPU has it.  The template is kern_impl.h. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define KATTR __attribute__((target("avx512f,avx512dq,avx2,fma")))
/* 6 rows x 4 vectors: 24 accumulators, 4 loads of B and 6 broadcasts of A
 * per 24 FMAs (12 x 2 needs 12 broadcasts, and its transposed-A panels of
 * 12 scalars straddle cache lines); 7-8% faster at B 4, S 1024, E 1024 */
#define MR 6
#define NRV 4
#define DOT_C 4

#define T float
#define KDOUBLE 0
#define VL 16
typedef int32_t vi32x16 __attribute__((vector_size(64)));
#define VT __m512
#define V_SET1(x) _mm512_set1_ps(x)
#define VI vi32x16
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SUF(name) name##_f32_avx512
#include "kern_impl.h"
#undef V_FMA
#undef SUF

#define T double
#define KDOUBLE 1
#define VL 8
typedef int64_t vi64x8 __attribute__((vector_size(64)));
#define VT __m512d
#define V_SET1(x) _mm512_set1_pd(x)

#define VI vi64x8
#define V_FMA(a, b, c) _mm512_fmadd_pd(a, b, c)
#define SUF(name) name##_f64_avx512
#include "kern_impl.h"
#undef V_FMA
#undef SUF

static const mha_kern_f32 avx512_f32 = MHA_KERN_FILL("avx512", MR, NRV * 16, f32_avx512);
static const mha_kern_f64 avx512_f64 = MHA_KERN_FILL("avx512", MR, NRV * 8, f64_avx512);
const mha_kern_f32 *const mha_kern_avx512_f32_p = &avx512_f32;
const mha_kern_f64 *const mha_kern_avx512_f64_p = &avx512_f64;
#else
const mha_kern_f32 *const mha_kern_avx512_f32_p = 0;
const mha_kern_f64 *const mha_kern_avx512_f64_p = 0;
#endif
