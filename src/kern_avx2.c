/* kern_avx2.c: the kernels for AVX2 + FMA (256-bit vectors), compiled with a
 * target attribute so that the default build stays portable; isa.c uses
 * them only when the CPU has both.  The template is kern_impl.h. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define KATTR __attribute__((target("avx2,fma")))
#define MR 6
#define NRV 2
#define DOT_C 2
#define UKR_UNROLL 4 /* ukr_impl.h's unrolled loop (two 256-bit FMA pipes) */

#define T float
#define KDOUBLE 0
#define VL 8
typedef int32_t vi32x8 __attribute__((vector_size(32)));
#define VT __m256
#define V_SET1(x) _mm256_set1_ps(x)
#define VI vi32x8
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
/* c = a*b + c in c's register: GCC, free to pick the form, makes a or b the
 * destination and then moves the accumulators around the unrolled loop */
#define UKR_FMA_ACC(c, a, b) __asm__("vfmadd231ps %2, %1, %0" : "+x"(c) : "x"(a), "x"(b))
#define SUF(name) name##_f32_avx2
#include "kern_impl.h"
#undef V_FMA
#undef SUF

#define T double
#define KDOUBLE 1
#define VL 4
typedef int64_t vi64x4 __attribute__((vector_size(32)));
#define VT __m256d
#define V_SET1(x) _mm256_set1_pd(x)

#define VI vi64x4
#undef UKR_FMA_ACC
#define V_FMA(a, b, c) _mm256_fmadd_pd(a, b, c)
#define UKR_FMA_ACC(c, a, b) __asm__("vfmadd231pd %2, %1, %0" : "+x"(c) : "x"(a), "x"(b))
#define SUF(name) name##_f64_avx2
#include "kern_impl.h"
#undef V_FMA
#undef SUF

static const mha_kern_f32 avx2_f32 = {
    .name = "avx2", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 8,
    .ukr = ukr_f32_avx2,
    .ukr_tail = ukr_tail_f32_avx2,
    .dot = dot_f32_avx2,
    .scale_max = scale_max_f32_avx2,
    .max = max_f32_avx2,
    .exp_sum = exp_sum_f32_avx2,
    .scale = scale_f32_avx2,
    .exp = exp_row_f32_avx2,
    .softmax_grad = softmax_grad_f32_avx2,
    .pack_bt = NULL,
    .transpose = NULL,
};
static const mha_kern_f64 avx2_f64 = {
    .name = "avx2", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 4,
    .ukr = ukr_f64_avx2,
    .ukr_tail = ukr_tail_f64_avx2,
    .dot = dot_f64_avx2,
    .scale_max = scale_max_f64_avx2,
    .max = max_f64_avx2,
    .exp_sum = exp_sum_f64_avx2,
    .scale = scale_f64_avx2,
    .exp = exp_row_f64_avx2,
    .softmax_grad = softmax_grad_f64_avx2,
    .pack_bt = NULL,
    .transpose = NULL,
};
const mha_kern_f32 *const mha_kern_avx2_f32_p = &avx2_f32;
const mha_kern_f64 *const mha_kern_avx2_f64_p = &avx2_f64;
#else
const mha_kern_f32 *const mha_kern_avx2_f32_p = 0;
const mha_kern_f64 *const mha_kern_avx2_f64_p = 0;
#endif
