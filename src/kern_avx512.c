/* kern_avx512.c: the kernels for AVX-512F (512-bit vectors), compiled with a
 * target attribute so that the default build stays portable; isa.c uses
 * them only when the CPU has it.  The template is kern_impl.h. */
#include <math.h>
#include <stddef.h>
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
/* float: ukr_impl.h's unrolled loop and its whole-depth form (UKR_WHOLE
 * below); double keeps the generic loop (unrolled, a B read in place ran
 * 10% slower: Intel Xeon, one core, (1024, 512) with K 1024) */
#define UKR_UNROLL 4

#define T float
#define KDOUBLE 0
#define VL 16
typedef int32_t vi32x16 __attribute__((vector_size(64)));
#define VT __m512
#define V_SET1(x) _mm512_set1_ps(x)
#define VI vi32x16
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define UKR_FMA_ACC(c, a, b) __asm__("vfmadd231ps %2, %1, %0" : "+v"(c) : "v"(a), "v"(b))
#define UKR_WHOLE /* ukr_impl.h's whole-depth loop */
/* single instructions for kern_impl.h's selects and exp's 2^n (the same
 * bits: vmaxps returns its second operand for a NaN, as the default's
 * select does; vscalefps rounds p·2^n once, as p·2^(n/2)·2^(n - n/2) does,
 * whose first product is exact) */
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_MIN(a, b) _mm512_min_ps(a, b)
#define V_WHERE_LT(x, c, a, y) _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, c, _CMP_LT_OQ), a)
#define V_WHERE_GT(x, c, a, y) _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, c, _CMP_GT_OQ), a)
#define V_SCALEF(p, n) _mm512_scalef_ps(p, n)
#define V_LOADN(p, n, f) _mm512_mask_loadu_ps(_mm512_set1_ps(f), (__mmask16)((1u << (n)) - 1), p)
#define V_STOREN(p, x, n) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1), x)
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
#undef UKR_FMA_ACC
#undef UKR_WHOLE
#undef UKR_UNROLL
#define V_MAX(a, b) _mm512_max_pd(a, b)
#define V_MIN(a, b) _mm512_min_pd(a, b)
#define V_WHERE_LT(x, c, a, y) _mm512_mask_mov_pd(y, _mm512_cmp_pd_mask(x, c, _CMP_LT_OQ), a)
#define V_WHERE_GT(x, c, a, y) _mm512_mask_mov_pd(y, _mm512_cmp_pd_mask(x, c, _CMP_GT_OQ), a)
#define V_SCALEF(p, n) _mm512_scalef_pd(p, n)
#define V_LOADN(p, n, f) _mm512_mask_loadu_pd(_mm512_set1_pd(f), (__mmask8)((1u << (n)) - 1), p)
#define V_STOREN(p, x, n) _mm512_mask_storeu_pd(p, (__mmask8)((1u << (n)) - 1), x)
#define SUF(name) name##_f64_avx512
#include "kern_impl.h"
#undef V_FMA
#undef SUF

/* r[i] (row i of a 16 x 16 block) becomes column i: r[k][i] = old r[i][k].
 * Pairs of rows interleaved (unpack ps), then pairs of pairs (unpack pd):
 * u[4i+j] holds, in 128-bit lane L, rows 4i..4i+3 of column 4L+j; two
 * rounds of 128-bit lane shuffles gather each column's four lanes. */
KATTR static inline void transpose16_f32(__m512 r[16])
{
    __m512 t[16], u[16];
    int i, j;
    for (i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (j = 0; j < 4; j++) {
        __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
        __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
        __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
}

/* kernels.h's pack_bt for NR = 64: 16 x 16 blocks through the registers,
 * the last kc % 16 columns one by one.  Each group of 16 rows of B is
 * walked along k to its end before the next: 16 sequential streams, which
 * the prefetchers follow (k outer read 64 rows' lines at a time, 2 KiB
 * apart, at L3 latency: the packing was 22% of a call at B 2, S 10, E 512;
 * that call 0.354 -> 0.322 ms) */
KATTR static void pack_bt_f32_avx512(int64_t kc, const float *B, int64_t ldb, float *Bp)
{
    const int64_t NR = NRV * 16;
    int64_t k0, cg, k, c;
    __m512 r[16];
    int i;
    for (cg = 0; cg < NR; cg += 16)
        for (k0 = 0; k0 + 16 <= kc; k0 += 16) {
            for (i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(B + (cg + i) * ldb + k0);
            transpose16_f32(r);
            for (i = 0; i < 16; i++) _mm512_storeu_ps(Bp + (k0 + i) * NR + cg, r[i]);
        }
    k0 = kc - kc % 16;
    for (k = k0; k < kc; k++)
        for (c = 0; c < NR; c++) Bp[k * NR + c] = B[c * ldb + k];
}

/* r[i] (row i of an 8 x 8 block of doubles) becomes column i: r[k][i] =
 * old r[i][k].  Pairs of rows interleaved (unpack pd: t[2i] holds rows
 * 2i, 2i+1 of the even columns, t[2i+1] of the odd ones), then 128-bit
 * lanes gathered twice: u holds rows 0-3 (u[0..3]) or 4-7 (u[4..7]) of
 * columns {0,4}, {2,6}, {1,5}, {3,7}; the last shuffle joins the halves. */
KATTR static inline void transpose8_f64(__m512d r[8])
{
    __m512d t[8], u[8];
    int i;
    for (i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_pd(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_pd(r[2 * i], r[2 * i + 1]);
    }
    for (i = 0; i < 2; i++) { /* rows 4i..4i+3 */
        u[4 * i] = _mm512_shuffle_f64x2(t[4 * i], t[4 * i + 2], 0x88);     /* columns 0, 4 */
        u[4 * i + 1] = _mm512_shuffle_f64x2(t[4 * i], t[4 * i + 2], 0xdd); /* 2, 6 */
        u[4 * i + 2] = _mm512_shuffle_f64x2(t[4 * i + 1], t[4 * i + 3], 0x88); /* 1, 5 */
        u[4 * i + 3] = _mm512_shuffle_f64x2(t[4 * i + 1], t[4 * i + 3], 0xdd); /* 3, 7 */
    }
    r[0] = _mm512_shuffle_f64x2(u[0], u[4], 0x88);
    r[4] = _mm512_shuffle_f64x2(u[0], u[4], 0xdd);
    r[2] = _mm512_shuffle_f64x2(u[1], u[5], 0x88);
    r[6] = _mm512_shuffle_f64x2(u[1], u[5], 0xdd);
    r[1] = _mm512_shuffle_f64x2(u[2], u[6], 0x88);
    r[5] = _mm512_shuffle_f64x2(u[2], u[6], 0xdd);
    r[3] = _mm512_shuffle_f64x2(u[3], u[7], 0x88);
    r[7] = _mm512_shuffle_f64x2(u[3], u[7], 0xdd);
}

/* kernels.h's pack_bt for NR = 32 doubles: 8 x 8 blocks through the
 * registers (the scalar packing was 3.6% of a float64 call at B 8, S 128,
 * E 512), rows of B in groups of 8 walked along k as for float, the last
 * kc % 8 columns one by one */
KATTR static void pack_bt_f64_avx512(int64_t kc, const double *B, int64_t ldb, double *Bp)
{
    const int64_t NR = NRV * 8;
    int64_t k0, cg, k, c;
    __m512d r[8];
    int i;
    for (cg = 0; cg < NR; cg += 8)
        for (k0 = 0; k0 + 8 <= kc; k0 += 8) {
            for (i = 0; i < 8; i++) r[i] = _mm512_loadu_pd(B + (cg + i) * ldb + k0);
            transpose8_f64(r);
            for (i = 0; i < 8; i++) _mm512_storeu_pd(Bp + (k0 + i) * NR + cg, r[i]);
        }
    k0 = kc - kc % 8;
    for (k = k0; k < kc; k++)
        for (c = 0; c < NR; c++) Bp[k * NR + c] = B[c * ldb + k];
}

/* kernels.h's transpose, float: 16 x 16 blocks through the registers
 * (16 rows of x walked along c, one store run of 16 per column), then
 * the ragged columns and rows one by one */
KATTR static void transpose_f32_avx512(int64_t R, int64_t C, const float *x, int64_t ldx,
                                       float *y, int64_t ldy)
{
    int64_t r0, c0, r, c;
    __m512 v[16];
    int i;
    for (r0 = 0; r0 + 16 <= R; r0 += 16) {
        for (c0 = 0; c0 + 16 <= C; c0 += 16) {
            for (i = 0; i < 16; i++) v[i] = _mm512_loadu_ps(x + (r0 + i) * ldx + c0);
            transpose16_f32(v);
            for (i = 0; i < 16; i++) _mm512_storeu_ps(y + (c0 + i) * ldy + r0, v[i]);
        }
        for (c = c0; c < C; c++)
            for (r = r0; r < r0 + 16; r++) y[c * ldy + r] = x[r * ldx + c];
    }
    for (c = 0; c < C; c++)
        for (r = r0; r < R; r++) y[c * ldy + r] = x[r * ldx + c];
}

/* the same for double: 8 x 8 blocks */
KATTR static void transpose_f64_avx512(int64_t R, int64_t C, const double *x, int64_t ldx,
                                       double *y, int64_t ldy)
{
    int64_t r0, c0, r, c;
    __m512d v[8];
    int i;
    for (r0 = 0; r0 + 8 <= R; r0 += 8) {
        for (c0 = 0; c0 + 8 <= C; c0 += 8) {
            for (i = 0; i < 8; i++) v[i] = _mm512_loadu_pd(x + (r0 + i) * ldx + c0);
            transpose8_f64(v);
            for (i = 0; i < 8; i++) _mm512_storeu_pd(y + (c0 + i) * ldy + r0, v[i]);
        }
        for (c = c0; c < C; c++)
            for (r = r0; r < r0 + 8; r++) y[c * ldy + r] = x[r * ldx + c];
    }
    for (c = 0; c < C; c++)
        for (r = r0; r < R; r++) y[c * ldy + r] = x[r * ldx + c];
}

static const mha_kern_f32 avx512_f32 = {
    .name = "avx512", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 16, .nr_narrow = 16,
    .ukr = ukr_f32_avx512,
    .ukr_tail = ukr_tail_f32_avx512,
    .ukr_narrow = ukr_narrow_f32_avx512,
    .ukr_row = ukr_row_f32_avx512,
    .dot_rows = 0,
    .dot = dot_f32_avx512,
    .scale_max = scale_max_f32_avx512,
    .max = max_f32_avx512,
    .exp_sum = exp_sum_f32_avx512,
    .scale = scale_f32_avx512,
    .exp = exp_row_f32_avx512,
    .softmax_grad = softmax_grad_f32_avx512,
    .pack_bt = pack_bt_f32_avx512,
    .transpose = transpose_f32_avx512,
};
static const mha_kern_f64 avx512_f64 = {
    .name = "avx512", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 8, .nr_narrow = 8,
    .ukr = ukr_f64_avx512,
    .ukr_tail = ukr_tail_f64_avx512,
    .ukr_narrow = ukr_narrow_f64_avx512,
    .ukr_row = ukr_row_f64_avx512,
    .dot_rows = 16,
    .dot = dot_f64_avx512,
    .scale_max = scale_max_f64_avx512,
    .max = max_f64_avx512,
    .exp_sum = exp_sum_f64_avx512,
    .scale = scale_f64_avx512,
    .exp = exp_row_f64_avx512,
    .softmax_grad = softmax_grad_f64_avx512,
    .pack_bt = pack_bt_f64_avx512,
    .transpose = transpose_f64_avx512,
};

/* kernels.h's FMA probe: n rounds of 24 independent FMA chains on 512-bit
 * vectors (wide) or 256-bit ones; the sums go to out[0..16) (kept live).
 * The rounds unrolled, so that the 24 chains stay in registers: rolled,
 * gcc kept them in memory, and each FMA waited on a load and a store, at
 * a rate that said nothing of the FMA units (Zen 5, two 512-bit FMAs a
 * cycle: fma_ratio 0.71, reported as one; unrolled 1.08, two) */
KATTR static void fma_loop_avx512(int64_t n, int wide, float *out)
{
    int64_t r;
    int i;
    if (wide) {
        __m512 acc[24], x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
        for (i = 0; i < 24; i++) acc[i] = _mm512_set1_ps((float)i);
        for (r = 0; r < n; r++)
#pragma GCC unroll 24
            for (i = 0; i < 24; i++) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
        for (i = 1; i < 24; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
        _mm512_storeu_ps(out, acc[0]);
    } else {
        __m256 acc[24], x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-3f);
        for (i = 0; i < 24; i++) acc[i] = _mm256_set1_ps((float)i);
        for (r = 0; r < n; r++)
#pragma GCC unroll 24
            for (i = 0; i < 24; i++) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
        for (i = 1; i < 24; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
        _mm256_storeu_ps(out, acc[0]);
    }
}

const mha_kern_f32 *const mha_kern_avx512_f32_p = &avx512_f32;
const mha_kern_f64 *const mha_kern_avx512_f64_p = &avx512_f64;
void (*const mha_fma_loop_avx512_p)(int64_t, int, float *) = fma_loop_avx512;
#else
const mha_kern_f32 *const mha_kern_avx512_f32_p = 0;
const mha_kern_f64 *const mha_kern_avx512_f64_p = 0;
void (*const mha_fma_loop_avx512_p)(int64_t, int, float *) = 0;
#endif
