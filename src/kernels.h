/* kernels.h: the per-ISA kernel tables (internal).  One table per
 * (instruction set, dtype); kern_portable.c, kern_avx2.c and kern_avx512.c
 * fill them from the one template kern_impl.h, and isa.c picks one at run
 * time from the CPU's features (or MHA_EXT_ISA / mha_set_isa).
 *
 * ukr: the GEMM micro-kernel, C (mr, nr) (+)= A · Bp (+ bias), where
 *   A (mr, kc) is read in place, element (r, k) at A[r*lda + k*ak] (mr <=
 *   MR): ak = 1 for a row-major A, lda = 1 and ak = its row length for a
 *   transposed one (mha_gemm_tn); the MR x kc panel stays in cache while the
 *   kernel runs along N;
 *   Bp holds element (k, c) at Bp[k*ldbk + c] for c < NR: a packed panel
 *   (ldbk = NR, zero-padded) or, for a full strip, B itself (ldbk = ldb).
 *   accumulate: C += (else C is never read); bias (nr) added when not NULL.
 * dot: the unpacked small-M form of C (m, n) = A (m, K) · B (n, K)ᵀ for
 *   m <= 4, plus bias, (+)= like ukr: dot products along K.
 * Row kernels for the softmax, over s[0..n):
 *   scale_max: s *= c, returns the largest non-NaN entry (-inf if none)
 *   max:       the largest non-NaN entry (-inf if none)
 *   exp_sum:   s = exp(s - m), returns the sum (NaN in, NaN out; -inf -> 0)
 *   scale:     s *= c
 *   exp:       s = exp(s), the vector exp (<= 2 ulp for normal results)
 *   softmax_grad: d = p (d - Σ_j p_j d_j) c over p[0..n), d[0..n): the
 *              backward of a softmax row p, scaled by c
 * pack_bt: NULL, or a vector form of gemm's transposed packing for a full
 *   panel: Bp[k*NR + c] = B[c*ldb + k] for c < NR, k < kc (B (NR, kc) rows
 *   of op(B)ᵀ, read in place) */
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include <stdint.h>

#define MHA_KERN_TABLE(T, SUF)                                                        \
    typedef struct {                                                                  \
        const char *name;                                                             \
        int mr, nr;                                                                   \
        void (*ukr)(int64_t kc, const T *A, int64_t lda, int64_t ak, const T *Bp,     \
                    int64_t ldbk, T *C, int64_t ldc, int64_t mr, int64_t nr,          \
                    int accumulate, const T *bias);                                   \
        void (*dot)(int64_t m, int64_t n, int64_t K, const T *A, int64_t lda,         \
                    const T *B, int64_t ldb, const T *bias, T *C, int64_t ldc,        \
                    int accumulate);                                                  \
        T (*scale_max)(T *s, int64_t n, T c);                                         \
        T (*max)(const T *s, int64_t n);                                              \
        T (*exp_sum)(T *s, int64_t n, T m);                                           \
        void (*scale)(T *s, int64_t n, T c);                                          \
        void (*exp)(T *s, int64_t n);                                                 \
        void (*softmax_grad)(const T *p, T *d, int64_t n, T c);                       \
        void (*pack_bt)(int64_t kc, const T *B, int64_t ldb, T *Bp);                  \
    } mha_kern_##SUF;

MHA_KERN_TABLE(float, f32)
MHA_KERN_TABLE(double, f64)

enum { MHA_ISA_PORTABLE = 0, MHA_ISA_AVX2 = 1, MHA_ISA_AVX512 = 2, MHA_ISA_COUNT };

/* The initialiser of one ISA's table for one dtype: S is the name suffix
 * the kern_impl.h instance was built with (f32_avx2, f64_portable, ...);
 * PACK_BT the table's pack_bt or NULL. */
#define MHA_KERN_FILL(NAME, MR_, NR_, S, PACK_BT)                                  \
    {NAME, MR_, NR_, ukr_##S, dot_##S, scale_max_##S, max_##S, exp_sum_##S, scale_##S,  \
     exp_row_##S, softmax_grad_##S, PACK_BT}

/* the tables, NULL where this build or compiler has none */
extern const mha_kern_f32 mha_kern_portable_f32, *const mha_kern_avx2_f32_p,
    *const mha_kern_avx512_f32_p;
extern const mha_kern_f64 mha_kern_portable_f64, *const mha_kern_avx2_f64_p,
    *const mha_kern_avx512_f64_p;

/* the tables of the ISA in use (isa.c) */
const mha_kern_f32 *mha_kern_get_f32(void);
const mha_kern_f64 *mha_kern_get_f64(void);
/* the tables of one ISA, or NULL when this CPU or build cannot run it */
const mha_kern_f32 *mha_kern_for_f32(int isa);
const mha_kern_f64 *mha_kern_for_f64(int isa);

#endif /* MHA_KERNELS_H */
