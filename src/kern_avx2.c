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
/* kern_impl.h's selections as single instructions (vmaxps returns its second
 * operand where either is NaN or both are zero: a > b ? a : b exactly; the
 * generic and/andnot/or form cost four) */
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_MIN(a, b) _mm256_min_ps(a, b)
#define V_WHERE_LT(x, c, a, y) _mm256_blendv_ps(y, a, _mm256_cmp_ps(x, c, _CMP_LT_OQ))
#define V_WHERE_GT(x, c, a, y) _mm256_blendv_ps(y, a, _mm256_cmp_ps(x, c, _CMP_GT_OQ))
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
#define V_MAX(a, b) _mm256_max_pd(a, b)
#define V_MIN(a, b) _mm256_min_pd(a, b)
#define V_WHERE_LT(x, c, a, y) _mm256_blendv_pd(y, a, _mm256_cmp_pd(x, c, _CMP_LT_OQ))
#define V_WHERE_GT(x, c, a, y) _mm256_blendv_pd(y, a, _mm256_cmp_pd(x, c, _CMP_GT_OQ))
#define UKR_FMA_ACC(c, a, b) __asm__("vfmadd231pd %2, %1, %0" : "+x"(c) : "x"(a), "x"(b))
#define SUF(name) name##_f64_avx2
#include "kern_impl.h"
#undef V_FMA
#undef SUF

/* r[i] (row i of an 8 x 8 block) becomes column i: r[k][i] = old r[i][k].
 * Pairs of rows interleaved (unpack), then pairs of pairs (shuffle): u[j]
 * holds rows 0-3 (u[0..3]) or 4-7 (u[4..7]) of columns j and j + 4, one
 * per 128-bit lane; the lane permutes join the two halves of each column. */
KATTR static inline void transpose8_f32(__m256 r[8])
{
    __m256 t[8], u[8];
    int i;
    for (i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (i = 0; i < 2; i++) { /* rows 4i..4i+3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);         /* columns 0, 4 */
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);     /* 1, 5 */
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44); /* 2, 6 */
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee); /* 3, 7 */
    }
    for (i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

/* the same for a 4 x 4 block of doubles: t[0], t[1] hold rows 0-1 of the
 * even and odd columns, t[2], t[3] rows 2-3; the permutes join them */
KATTR static inline void transpose4_f64(__m256d r[4])
{
    const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
    const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
    r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
    r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
    r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
}

/* kernels.h's pack_bt for NR = 16 floats: 8 x 8 blocks through the
 * registers, each group of 8 rows of B walked along k to its end (8
 * sequential streams), the last kc % 8 columns one by one (the scalar
 * packing of W was most of a call at B 2, S 10, E 512 on Zen 3) */
KATTR static void pack_bt_f32_avx2(int64_t kc, const float *B, int64_t ldb, float *Bp)
{
    const int64_t NR = NRV * 8;
    int64_t k0, cg, k, c;
    __m256 r[8];
    int i;
    for (cg = 0; cg < NR; cg += 8)
        for (k0 = 0; k0 + 8 <= kc; k0 += 8) {
            for (i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(B + (cg + i) * ldb + k0);
            transpose8_f32(r);
            for (i = 0; i < 8; i++) _mm256_storeu_ps(Bp + (k0 + i) * NR + cg, r[i]);
        }
    k0 = kc - kc % 8;
    for (k = k0; k < kc; k++)
        for (c = 0; c < NR; c++) Bp[k * NR + c] = B[c * ldb + k];
}

/* the same for NR = 8 doubles: 4 x 4 blocks */
KATTR static void pack_bt_f64_avx2(int64_t kc, const double *B, int64_t ldb, double *Bp)
{
    const int64_t NR = NRV * 4;
    int64_t k0, cg, k, c;
    __m256d r[4];
    int i;
    for (cg = 0; cg < NR; cg += 4)
        for (k0 = 0; k0 + 4 <= kc; k0 += 4) {
            for (i = 0; i < 4; i++) r[i] = _mm256_loadu_pd(B + (cg + i) * ldb + k0);
            transpose4_f64(r);
            for (i = 0; i < 4; i++) _mm256_storeu_pd(Bp + (k0 + i) * NR + cg, r[i]);
        }
    k0 = kc - kc % 4;
    for (k = k0; k < kc; k++)
        for (c = 0; c < NR; c++) Bp[k * NR + c] = B[c * ldb + k];
}

/* kernels.h's transpose: 8 x 8 (float) or 4 x 4 (double) blocks through
 * the registers, then the ragged columns and rows one by one */
#define TRANSPOSE_AVX2(NAME, TT, W, VTT, LOAD, STORE, BLOCK)                               \
    KATTR static void NAME(int64_t R, int64_t C, const TT *x, int64_t ldx, TT *y,          \
                           int64_t ldy)                                                    \
    {                                                                                      \
        int64_t r0, c0, r, c;                                                              \
        VTT v[W];                                                                          \
        int i;                                                                             \
        for (r0 = 0; r0 + W <= R; r0 += W) {                                               \
            for (c0 = 0; c0 + W <= C; c0 += W) {                                           \
                for (i = 0; i < W; i++) v[i] = LOAD(x + (r0 + i) * ldx + c0);              \
                BLOCK(v);                                                                  \
                for (i = 0; i < W; i++) STORE(y + (c0 + i) * ldy + r0, v[i]);              \
            }                                                                              \
            for (c = c0; c < C; c++)                                                       \
                for (r = r0; r < r0 + W; r++) y[c * ldy + r] = x[r * ldx + c];             \
        }                                                                                  \
        for (c = 0; c < C; c++)                                                            \
            for (r = r0; r < R; r++) y[c * ldy + r] = x[r * ldx + c];                      \
    }
TRANSPOSE_AVX2(transpose_f32_avx2, float, 8, __m256, _mm256_loadu_ps, _mm256_storeu_ps,
               transpose8_f32)
TRANSPOSE_AVX2(transpose_f64_avx2, double, 4, __m256d, _mm256_loadu_pd, _mm256_storeu_pd,
               transpose4_f64)
#undef TRANSPOSE_AVX2

static const mha_kern_f32 avx2_f32 = {
    .name = "avx2", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 8, .nr_narrow = 8,
    .ukr = ukr_f32_avx2,
    .ukr_tail = ukr_tail_f32_avx2,
    .ukr_narrow = ukr_narrow_f32_avx2,
    .ukr_row = ukr_row_f32_avx2,
    .ukr_dot = ukr_dot_f32_avx2,
    .dot_rows = 16,
    .dot = dot_f32_avx2,
    .scale_max = scale_max_f32_avx2,
    .max = max_f32_avx2,
    .exp_sum = exp_sum_f32_avx2,
    .scale = scale_f32_avx2,
    .exp = exp_row_f32_avx2,
    .softmax_grad = softmax_grad_f32_avx2,
    .pack_bt = pack_bt_f32_avx2,
    .transpose = transpose_f32_avx2,
};
static const mha_kern_f64 avx2_f64 = {
    .name = "avx2", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 4, .nr_narrow = 4,
    .ukr = ukr_f64_avx2,
    .ukr_tail = ukr_tail_f64_avx2,
    .ukr_narrow = ukr_narrow_f64_avx2,
    .ukr_row = ukr_row_f64_avx2,
    .ukr_dot = ukr_dot_f64_avx2,
    .dot_rows = 16,
    .dot = dot_f64_avx2,
    .scale_max = scale_max_f64_avx2,
    .max = max_f64_avx2,
    .exp_sum = exp_sum_f64_avx2,
    .scale = scale_f64_avx2,
    .exp = exp_row_f64_avx2,
    .softmax_grad = softmax_grad_f64_avx2,
    .pack_bt = pack_bt_f64_avx2,
    .transpose = transpose_f64_avx2,
};
const mha_kern_f32 *const mha_kern_avx2_f32_p = &avx2_f32;
const mha_kern_f64 *const mha_kern_avx2_f64_p = &avx2_f64;
#else
const mha_kern_f32 *const mha_kern_avx2_f32_p = 0;
const mha_kern_f64 *const mha_kern_avx2_f64_p = 0;
#endif
