/* kern_avx512.c: the kernels for AVX-512F (512-bit vectors), compiled with a
 * target attribute so that the default build stays portable; isa.c uses
 * them only when the CPU has it.  The template is kern_impl.h. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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
 * below); double: the assembly loop below for full panels of a row-major
 * A (UKR_ASM_LOOP), the generic loop for the rest (gcc's unrolled loop
 * for double ran 10-18% slower than the generic one) */
#define UKR_UNROLL 4

/* The float64 micro-kernel's loop over the whole depth for a full panel
 * (6 rows of a row-major A, 4 vectors of B's columns), in assembly: from
 * ukr_impl.h's C, gcc 12 kept some of the 24 accumulators on the stack
 * and copied others at every step, in its unrolled loop (57% of a core)
 * and less so in the generic one (68%).  acc (6 rows of 32) receives each
 * element's one chain over k in order, c = a·b + c (vfmadd231pd: one
 * rounding, the C loops' _mm512_fmadd_pd), so the bits are the generic
 * loop's.  A pass is 8 steps, a new line of each of A's rows: each pass
 * asks for each row's line after next and for the next panel's rows (6
 * down) at this line, and each step for B's row 16 steps ahead, as
 * ukr_impl.h's loops do; a last pass of kc % 8 single steps.  Registers:
 * zmm0-3 B's row, zmm4-5 A's broadcasts, zmm8-31 the accumulators.
 * Intel Xeon (family 6, model 167), one core, medians, the generic loop
 * against this one, builds alternated: (1024, 1536) with K 512, B packed,
 * 71.6-73.4 -> 76.4-76.7 GFLOP/s; (1024, 512) with K 1024, B in place,
 * 69.0-71.6 -> 74.0-77.1; the kernel alone at a depth of 512 (B from L2)
 * 80 -> 85, at 64 (L1) 69 -> 78.  Without A's prefetches it ran 1-5%
 * faster on that Xeon; they stay, as ukr_impl.h measured them on Zen 5.
 * Not yet timed on Zen 4 or 5, which take this path too; it asks for the
 * first line of B's row 16 steps ahead, as the float loops do (the generic
 * loop asked for all four, and for an in-place B's next panel over its
 * last 16 steps). */
#if MR != 6 || NRV != 4
#error "ukr_loop_f64_avx512 is written for 6 rows of 4 vectors"
#endif
#define F64_ROW(R, A) "vbroadcastsd " A ", %%zmm" #R "\n\t"
#define F64_FMA4(R, C0, C1, C2, C3)                                                        \
    "vfmadd231pd %%zmm0, %%zmm" #R ", %%zmm" #C0 "\n\t"                                     \
    "vfmadd231pd %%zmm1, %%zmm" #R ", %%zmm" #C1 "\n\t"                                     \
    "vfmadd231pd %%zmm2, %%zmm" #R ", %%zmm" #C2 "\n\t"                                     \
    "vfmadd231pd %%zmm3, %%zmm" #R ", %%zmm" #C3 "\n\t"
#define F64_STEP(O)                                                                        \
    "vmovupd (%[b]), %%zmm0\n\t"                                                           \
    "vmovupd 64(%[b]), %%zmm1\n\t"                                                         \
    "vmovupd 128(%[b]), %%zmm2\n\t"                                                        \
    "vmovupd 192(%[b]), %%zmm3\n\t"                                                        \
    "prefetcht0 (%[b],%[pf])\n\t"                                                          \
    F64_ROW(4, #O "(%[a0])") F64_FMA4(4, 8, 9, 10, 11)                                     \
    F64_ROW(5, #O "(%[a0],%[L])") F64_FMA4(5, 12, 13, 14, 15)                              \
    F64_ROW(4, #O "(%[a0],%[L],2)") F64_FMA4(4, 16, 17, 18, 19)                            \
    F64_ROW(5, #O "(%[a3])") F64_FMA4(5, 20, 21, 22, 23)                                   \
    F64_ROW(4, #O "(%[a3],%[L])") F64_FMA4(4, 24, 25, 26, 27)                              \
    F64_ROW(5, #O "(%[a3],%[L],2)") F64_FMA4(5, 28, 29, 30, 31)                            \
    "add %[ldb], %[b]\n\t"
#define F64_ZERO(C) "vpxord %%zmm" #C ", %%zmm" #C ", %%zmm" #C "\n\t"
#define F64_STORE4(C0, C1, C2, C3, O)                                                      \
    "vmovupd %%zmm" #C0 ", " #O "(%[acc])\n\t"                                              \
    "vmovupd %%zmm" #C1 ", 64+" #O "(%[acc])\n\t"                                           \
    "vmovupd %%zmm" #C2 ", 128+" #O "(%[acc])\n\t"                                          \
    "vmovupd %%zmm" #C3 ", 192+" #O "(%[acc])\n\t"
#define F64_PF(X) "prefetcht0 " X "\n\t"
KATTR static void ukr_loop_f64_avx512(int64_t kc, const double *A, int64_t lda,
                                      const double *Bp, int64_t ldbk, double *acc)
{
    const int64_t L = lda * 8, ldb = ldbk * 8, pf = 16 * ldb;
    /* a6, a9: the next panel's rows, maybe past A (prefetched only, never
     * read), so integers */
    const char *a0 = (const char *)A, *a3 = a0 + 3 * L, *b = (const char *)Bp;
    uintptr_t a6 = (uintptr_t)A + (uintptr_t)(6 * L), a9 = (uintptr_t)A + (uintptr_t)(9 * L);
    int64_t n8 = kc / 8, n1 = kc % 8;
    __asm__ volatile(
        F64_ZERO(8) F64_ZERO(9) F64_ZERO(10) F64_ZERO(11) F64_ZERO(12) F64_ZERO(13)
        F64_ZERO(14) F64_ZERO(15) F64_ZERO(16) F64_ZERO(17) F64_ZERO(18) F64_ZERO(19)
        F64_ZERO(20) F64_ZERO(21) F64_ZERO(22) F64_ZERO(23) F64_ZERO(24) F64_ZERO(25)
        F64_ZERO(26) F64_ZERO(27) F64_ZERO(28) F64_ZERO(29) F64_ZERO(30) F64_ZERO(31)
        "test %[n8], %[n8]\n\t"
        "jz 2f\n\t"
        ".p2align 5\n"
        "1:\n\t"
        F64_PF("128(%[a0])") F64_PF("128(%[a0],%[L])") F64_PF("128(%[a0],%[L],2)")
        F64_PF("128(%[a3])") F64_PF("128(%[a3],%[L])") F64_PF("128(%[a3],%[L],2)")
        F64_PF("(%[a6])") F64_PF("(%[a6],%[L])") F64_PF("(%[a6],%[L],2)")
        F64_PF("(%[a9])") F64_PF("(%[a9],%[L])") F64_PF("(%[a9],%[L],2)")
        F64_STEP(0) F64_STEP(8) F64_STEP(16) F64_STEP(24)
        F64_STEP(32) F64_STEP(40) F64_STEP(48) F64_STEP(56)
        "add $64, %[a0]\n\t"
        "add $64, %[a3]\n\t"
        "add $64, %[a6]\n\t"
        "add $64, %[a9]\n\t"
        "dec %[n8]\n\t"
        "jnz 1b\n"
        "2:\n\t"
        "test %[n1], %[n1]\n\t"
        "jz 4f\n"
        "3:\n\t"
        F64_STEP(0)
        "add $8, %[a0]\n\t"
        "add $8, %[a3]\n\t"
        "dec %[n1]\n\t"
        "jnz 3b\n"
        "4:\n\t"
        F64_STORE4(8, 9, 10, 11, 0) F64_STORE4(12, 13, 14, 15, 256)
        F64_STORE4(16, 17, 18, 19, 512) F64_STORE4(20, 21, 22, 23, 768)
        F64_STORE4(24, 25, 26, 27, 1024) F64_STORE4(28, 29, 30, 31, 1280)
        : [a0] "+r"(a0), [a3] "+r"(a3), [a6] "+r"(a6), [a9] "+r"(a9), [b] "+r"(b),
          [n8] "+r"(n8), [n1] "+r"(n1)
        : [L] "r"(L), [ldb] "r"(ldb), [pf] "r"(pf), [acc] "r"(acc)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18",
          "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27",
          "xmm28", "xmm29", "xmm30", "xmm31");
}

#undef F64_ROW
#undef F64_FMA4
#undef F64_STEP
#undef F64_ZERO
#undef F64_STORE4
#undef F64_PF

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
#define UKR_ASM_LOOP ukr_loop_f64_avx512 /* ukr_impl.h: the loop above */
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
#undef UKR_ASM_LOOP

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

/* the AVX-512 float table's entries but its name (the AMX one shares them) */
#define AVX512_F32_TABLE                                                       \
    .mr = MR, .mr_tail = MR / 2, .nr = NRV * 16, .nr_narrow = 16,              \
    .ukr = ukr_f32_avx512,                                                     \
    .ukr_tail = ukr_tail_f32_avx512,                                           \
    .ukr_narrow = ukr_narrow_f32_avx512,                                       \
    .ukr_row = ukr_row_f32_avx512,                                             \
    .ukr_dot = ukr_dot_f32_avx512,                                             \
    .dot_rows = 0,                                                             \
    .dot = dot_f32_avx512,                                                     \
    .scale_max = scale_max_f32_avx512,                                         \
    .max = max_f32_avx512,                                                     \
    .exp_sum = exp_sum_f32_avx512,                                             \
    .scale = scale_f32_avx512,                                                 \
    .exp = exp_row_f32_avx512,                                                 \
    .softmax_grad = softmax_grad_f32_avx512,                                   \
    .pack_bt = pack_bt_f32_avx512,                                             \
    .transpose = transpose_f32_avx512
static const mha_kern_f32 avx512_f32 = {.name = "avx512", AVX512_F32_TABLE};

/* AMX needs gcc 11 or clang 12, and an assembler that knows the tile
 * instructions (binutils 2.36): setup.py compiles a probe and defines
 * MHA_NO_AMX where it fails; the table is then absent (isa.c: no "amx") */
#if !defined(MHA_NO_AMX) && \
        ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include "amx_impl.h"
#include "amx_cut_impl.h"

/* AVX-512's float table, its products on the AMX tiles (isa.c's "amx") */
static const mha_kern_f32 amx_f32 = {.name = "amx", AVX512_F32_TABLE, .amx_gemm = amx_gemm_f32,
                                    .amx_cut = amx_cut_f32, .amx_gemm_cut = amx_gemm_cut_f32};
#define MHA_AMX_TABLE (&amx_f32)
#else
#define MHA_AMX_TABLE 0
#endif

static const mha_kern_f64 avx512_f64 = {
    .name = "avx512", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 8, .nr_narrow = 8,
    .ukr = ukr_f64_avx512,
    .ukr_tail = ukr_tail_f64_avx512,
    .ukr_narrow = ukr_narrow_f64_avx512,
    .ukr_row = ukr_row_f64_avx512,
    .ukr_dot = ukr_dot_f64_avx512,
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
const mha_kern_f32 *const mha_kern_amx_f32_p = MHA_AMX_TABLE;
void (*const mha_fma_loop_avx512_p)(int64_t, int, float *) = fma_loop_avx512;
#else
const mha_kern_f32 *const mha_kern_avx512_f32_p = 0;
const mha_kern_f64 *const mha_kern_avx512_f64_p = 0;
const mha_kern_f32 *const mha_kern_amx_f32_p = 0;
void (*const mha_fma_loop_avx512_p)(int64_t, int, float *) = 0;
#endif
