/* kernels.h: the per-ISA kernel tables (internal).  One table per
 * (instruction set, dtype), but "amx" shares AVX-512's double table and its
 * float one differs from AVX-512's only in amx_gemm, amx_cut and
 * amx_gemm_cut (amx_impl.h and amx_cut_impl.h, included by kern_avx512.c);
 * kern_portable.c, kern_avx2.c and kern_avx512.c
 * instantiate the one template kern_impl.h (ukr_f32_avx2, exp_sum_f64_portable,
 * ...) and list each instance by name in their tables, and isa.c picks one
 * at run time from the CPU's features (or MHA_EXT_ISA / mha_set_isa).
 *
 * ukr: the GEMM micro-kernel, C (mr, nr) (+)= A · Bp (+ bias), where
 *   A (mr, kc) is read in place, element (r, k) at A[r*lda + k*ak] (mr <=
 *   MR): ak = 1 for a row-major A, lda = 1 and ak = its row length for a
 *   transposed one (mha_gemm_tn); the MR x kc panel stays in cache while the
 *   kernel runs along N;
 *   Bp holds element (k, c) at Bp[k*ldbk + c] for c < NR: a packed panel
 *   (ldbk = NR, zero-padded) or, for a full strip, B itself (ldbk = ldb).
 *   accumulate: C += (else C is never read); bias (nr) added when not NULL;
 *   pin: NULL, or the partial sums of this depth block's earlier steps as
 *   an earlier call wrote them (C then a MR x NR tile, ldc NR, no
 *   accumulate, no bias): the call goes on from them, the same bits as one
 *   call over the whole block (ukr_impl.h).  No caller passes one since
 *   gemm_impl.h's gemm_nest_nb runs each depth block in one call; it stays
 *   because taking it out changed the double kernel's register allocation
 *   (gcc 12: a float64 product (1024, 64) with K 512 ran 0.91x and 1.00x
 *   in two runs; measured before AVX-512's float64 loop went to assembly,
 *   so it holds for the AVX2 and portable kernels and AVX-512's other
 *   panels).
 * ukr_tail: the same for mr <= mr_tail (MR / 2) rows, in half the work (the
 *   last row panel of a product whose M leaves few rows); the same bits.
 * ukr_row: the same for one row (a decode step's query: S = q·Kᵀ and P·V
 *   of one row, which the tail kernel ran as MR / 2 rows); the same bits.
 * ukr_narrow: the same for nr <= nr_narrow (one vector) columns, in
 *   1/NRV of the work (a panel of few columns: S = Q·Kᵀ over few keys, the
 *   last panel of a product whose N leaves few); the same bits.
 * ukr_dot: the same for one row and nr <= nr_narrow columns, in 1/MR of
 *   ukr_narrow's work (a decode step's S = q·Kᵀ over few keys, which the
 *   narrow kernel ran as MR rows: Zen 4, one thread, the SDPA at B 4096,
 *   H 1, L 1, S 1, D 64: 32% of the call in ukr_narrow); the same bits.
 * dot_rows: the forward's projections of at most this many rows (B·Sq and
 *   B·Sk) take dot, not the packed GEMM (the same bits either way: a choice
 *   of speed).  Zen 5, 2 threads, a module call at E768 H12, float32:
 *   AVX-512's dot 0.29 ms at B1 S1, the packed GEMM 0.14 (and 0.30 -> 0.18
 *   at S4, 0.38 -> 0.35 at S16): 0 there; its float64 dot 0.34 against 0.49:
 *   16; AVX2's 0.25 against 0.23 at S1, 0.55 against 0.58 at S16: 16; the
 *   portable one's 0.32 against 0.70: 16.
 * dot: the unpacked small-M form of mha_gemm's C (m, n) = A (m, K)·B (n, K)ᵀ
 *   (+ bias, (+)=), every element the packed GEMM's bits (the same sums in
 *   the same order, depth blocks of MHA_GEMM_KC): rows of A in the lanes.
 * Row kernels for the softmax, over s[0..n):
 *   scale_max: s *= c, returns the largest non-NaN entry (-inf if none)
 *   max:       the largest non-NaN entry (-inf if none)
 *   exp_sum:   s = exp(s - m), returns the sum (NaN in, NaN out; -inf -> 0);
 *              m at least every non-NaN s[j] (the row's maximum)
 *   scale:     s *= c
 *   exp:       s = exp(s), the vector exp (<= 2 ulp for normal results)
 *   softmax_grad: d = p (d - Σ_j p_j d_j) c over p[0..n), d[0..n): the
 *              backward of a softmax row p, scaled by c
 * pack_bt: NULL, or a vector form of gemm's transposed packing for a full
 *   panel: Bp[k*NR + c] = B[c*ldb + k] for c < NR, k < kc (B (NR, kc) rows
 *   of op(B)ᵀ, read in place)
 * transpose: NULL, or a vector form of the strided transpose
 *   y[c*ldy + r] = x[r*ldx + c] for r < R, c < C (K per head in the
 *   forward's projections, the backward's and SDPA's K and V): a copy, the
 *   same bits */
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* the micro-kernels' signature (ukr, ukr_tail, ukr_narrow, ukr_row and ukr_dot above) */
typedef void (*mha_ukr_f32)(int64_t kc, const float *A, int64_t lda, int64_t ak,
                            const float *Bp, int64_t ldbk, float *C, int64_t ldc, int64_t mr,
                            int64_t nr, int accumulate, const float *bias, const float *pin);
typedef void (*mha_ukr_f64)(int64_t kc, const double *A, int64_t lda, int64_t ak,
                            const double *Bp, int64_t ldbk, double *C, int64_t ldc, int64_t mr,
                            int64_t nr, int accumulate, const double *bias, const double *pin);

/* amx_gemm's signature (amx_impl.h): C (M, N) = A·op(B) (+ bias), or
 * with accumulate C += A·op(B) (+ bias), element (i, k) of A at
 * A[i*a_rs + k*a_cs], op(B)(k, j) at B[j*ldb + k] (trans_b) or
 * B[k*ldb + j]; 0 when done, 1 (C untouched) when the caller's kernels
 * must (too little scratch, an empty product, or with accumulate an
 * infinity, a NaN or a float of |x| >= 3.39e38 in A or B) */
typedef int (*mha_amx_gemm)(int trans_b, int64_t M, int64_t N, int64_t K, const void *A,
                            int64_t a_rs, int64_t a_cs, const void *B, int64_t ldb,
                            const void *bias, void *C, int64_t ldc, int accumulate,
                            void *scratch, size_t scratch_bytes);

/* amx_cut's signature (amx_cut_impl.h): B (K, N), B[k*ldb + j], cut into
 * the tiles' pieces once for many products: column group g of 32 at
 * dst + g*MHA_AMX_GROUP(K), uint32; 1 when B holds a float the tiles
 * cannot carry (an infinity, a NaN, or |x| >= 3.39e38, a float that rounds
 * to infinity in bfloat16): the pieces are then not to be used, and the
 * products that would read them take mha_gemm instead (on amx its
 * amx_gemm, which computes B's columns holding one by float FMAs, or with
 * accumulate leaves the whole product to the float kernels) */
typedef int (*mha_amx_cut)(int64_t K, int64_t N, const void *B, int64_t ldb, void *dst);
/* uint32 of one column group of an amx_cut of depth K: 3 pieces of
 * K rounded up to 32, halved, times 32 columns */
#define MHA_AMX_GROUP(K) ((int64_t)48 * (((K) + 31) / 32 * 32))
/* amx_gemm_cut's (amx_cut_impl.h): C (M, N) = A·B, or with accumulate
 * C += A·B, A's rows lda apart, B's pieces at bp (an amx_cut's, from a
 * column group or a depth that is a multiple of 32 on: K rounded up to
 * 32 is read: rows of the cut past K (real or its zero padding) meet A's zero pieces; its groups gs
 * uint32 apart, its pieces ps apart), B itself at B (B[k*ldb + j]) for the rows of A the
 * tiles cannot carry (an infinity, a NaN, or |x| >= 3.39e38, a float that
 * rounds to infinity in bfloat16: those rows by float FMAs, the others
 * keeping their tile bits); the same bits as amx_gemm's.  0 when done, 1
 * (C untouched) when the caller must use mha_gemm (too little scratch, an
 * empty product, or with accumulate such a float in A: mha_gemm's amx_gemm
 * then refuses it too, and the float kernels take the whole product) */
typedef int (*mha_amx_gemm_cut)(int64_t M, int64_t N, int64_t K, const void *A, int64_t lda,
                                const void *bp, int64_t gs, int64_t ps, const void *B,
                                int64_t ldb, void *C, int64_t ldc, int accumulate,
                                void *scratch, size_t scratch_bytes);

/* the scratch bytes an amx_gemm needs (amx_impl.h's layout, 64 aligned) */
#define MHA_AMX_SCRATCH ((int64_t)960 * 1024)

/* the table for float */
typedef struct {
    const char *name;
    int mr, nr, mr_tail, nr_narrow;
    int dot_rows; /* projections of at most this many rows take dot (0: none) */
    mha_ukr_f32 ukr, ukr_tail, ukr_narrow, ukr_row, ukr_dot;
    void (*dot)(int64_t m, int64_t n, int64_t K, const float *A, int64_t lda, const float *B,
                int64_t ldb, const float *bias, float *C, int64_t ldc, int accumulate);
    float (*scale_max)(float *s, int64_t n, float c);
    float (*max)(const float *s, int64_t n);
    float (*exp_sum)(float *s, int64_t n, float m);
    void (*scale)(float *s, int64_t n, float c);
    void (*exp)(float *s, int64_t n);
    void (*softmax_grad)(const float *p, float *d, int64_t n, float c);
    void (*pack_bt)(int64_t kc, const float *B, int64_t ldb, float *Bp);
    void (*transpose)(int64_t R, int64_t C, const float *x, int64_t ldx, float *y,
                      int64_t ldy);
    mha_amx_gemm amx_gemm;
    mha_amx_cut amx_cut;           /* with amx_gemm: B cut once for many products; 1, no
                                      pieces, where B holds an inf, a NaN or |x| >= 3.39e38
                                      (its products then take mha_gemm) */
    mha_amx_gemm_cut amx_gemm_cut; /* ... and a product from such pieces: A's rows holding
                                      one by float FMAs, or with accumulate 1 (mha_gemm,
                                      whose amx_gemm leaves it to the float kernels) */
} mha_kern_f32;

/* the same for double */
typedef struct {
    const char *name;
    int mr, nr, mr_tail, nr_narrow;
    int dot_rows;
    mha_ukr_f64 ukr, ukr_tail, ukr_narrow, ukr_row, ukr_dot;
    void (*dot)(int64_t m, int64_t n, int64_t K, const double *A, int64_t lda, const double *B,
                int64_t ldb, const double *bias, double *C, int64_t ldc, int accumulate);
    double (*scale_max)(double *s, int64_t n, double c);
    double (*max)(const double *s, int64_t n);
    double (*exp_sum)(double *s, int64_t n, double m);
    void (*scale)(double *s, int64_t n, double c);
    void (*exp)(double *s, int64_t n);
    void (*softmax_grad)(const double *p, double *d, int64_t n, double c);
    void (*pack_bt)(int64_t kc, const double *B, int64_t ldb, double *Bp);
    void (*transpose)(int64_t R, int64_t C, const double *x, int64_t ldx, double *y,
                      int64_t ldy);
    mha_amx_gemm amx_gemm; /* always NULL: the tiles multiply bfloat16 pieces of floats */
    mha_amx_cut amx_cut;   /* NULL */
    mha_amx_gemm_cut amx_gemm_cut; /* NULL */
} mha_kern_f64;

enum { MHA_ISA_PORTABLE = 0, MHA_ISA_AVX2 = 1, MHA_ISA_AVX512 = 2, MHA_ISA_AMX = 3, MHA_ISA_COUNT };

/* the tables, NULL where this build or compiler has none */
extern const mha_kern_f32 mha_kern_portable_f32, *const mha_kern_avx2_f32_p,
    *const mha_kern_avx512_f32_p, *const mha_kern_amx_f32_p;
extern const mha_kern_f64 mha_kern_portable_f64, *const mha_kern_avx2_f64_p,
    *const mha_kern_avx512_f64_p;

/* cpu.c's FMA probe (kern_avx512.c; NULL without it): n rounds of 24
 * independent FMAs on 512-bit vectors (wide) or 256-bit ones, the sums to
 * out[0..16) */
extern void (*const mha_fma_loop_avx512_p)(int64_t n, int wide, float *out);

/* the tables of the ISA in use (isa.c) */
const mha_kern_f32 *mha_kern_get_f32(void);
const mha_kern_f64 *mha_kern_get_f64(void);
/* the tables of one ISA, or NULL when this CPU or build cannot run it */
const mha_kern_f32 *mha_kern_for_f32(int isa);
const mha_kern_f64 *mha_kern_for_f64(int isa);

#endif /* MHA_KERNELS_H */
