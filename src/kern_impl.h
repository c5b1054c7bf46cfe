/* kern_impl.h: the fast kernels, written once over a thin SIMD vocabulary
 * and included by kern_portable.c, kern_avx2.c and kern_avx512.c once per
 * dtype.  The includer defines:
 *   T, SUF(name)     scalar type and name suffix (_f32 / _f64 plus ISA)
 *   KDOUBLE          1 for double (selects the exp constants)
 *   VT, VI, VL       GCC vector types of VL lanes: T and a same-width integer
 *   V_FMA(a, b, c)   a*b + c (one rounding where the ISA has FMA)
 *   V_SET1(x)        x in every lane
 *   MR, NRV, DOT_C   micro-kernel rows, vectors per row (NR = NRV*VL), and
 *                    (unused now) columns per step of the old dot kernel
 *   KATTR            the target attribute of every function here
 * and may define, where the ISA has a single instruction for them (the
 * results must be the same bits as the defaults'):
 *   V_MAX(a, b)      a > b ? a : b lane by lane (b where a is NaN)
 *   V_MIN(a, b)      a < b ? a : b lane by lane
 *   V_WHERE_LT(x, c, a, y), V_WHERE_GT(x, c, a, y)
 *                    a where x < c (x > c), else y
 *   V_SCALEF(p, n)   p · 2^n, n integral in T, rounded once
 *   V_LOADN(p, n, f), V_STOREN(p, x, n)
 *                    the first n <= VL lanes from p, the rest f (the
 *                    lanes past n never read); x's first n lanes to p,
 *                    nothing past them (a row's last part vector without a
 *                    copy through a buffer)
 * and may define, for ukr_impl.h's micro-kernel loops:
 *   UKR_UNROLL       steps of k per pass of its unrolled loop (else the
 *                    generic loop alone), with UKR_FMA_ACC(c, a, b): c =
 *                    a*b + c in c's register
 *   UKR_WHOLE        (with UKR_UNROLL) its whole-depth loop, accumulators
 *                    in registers across the chain joins
 *   UKR_ASM_LOOP(kc, A, lda, Bp, ldbk, acc)
 *                    (double, MR 6, NRV 4) a full panel's whole depth, A
 *                    row-major: each element's one chain to acc (MR rows
 *                    of NR), the generic loop's FMAs in its order
 * T, KDOUBLE, VL, VT, VI, V_SET1, SUF and those seven are undefined at the
 * end of this file; the rest stay the includer's.
 * Each instance defines ukr_S, ukr_tail_S, ukr_narrow_S, ukr_row_S and ukr_dot_S
 * (ukr_impl.h), dot_S, scale_max_S, max_S, exp_sum_S, scale_S, exp_row_S and softmax_grad_S for
 * its suffix S (f32_avx2, f64_portable, ...), which the includer lists by
 * name in its table.
 * Semantics are documented in kernels.h.  Every loop order is fixed: a
 * result never depends on threads or on which tile an element falls in. */

#define NR (NRV * VL)

KATTR static inline VT SUF(vload)(const T *p)
{
    VT v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
KATTR static inline void SUF(vstore)(T *p, VT v) { __builtin_memcpy(p, &v, sizeof v); }
KATTR static inline VT SUF(vset1)(T x) { return V_SET1(x); }
/* where m (all ones / zeros per lane): a, else b */
KATTR static inline VT SUF(vselect)(VI m, VT a, VT b) { return (VT)((m & (VI)a) | (~m & (VI)b)); }
#ifndef V_MAX
#define V_MAX(a, b) SUF(vselect)((a) > (b), (a), (b))
#endif
#ifndef V_MIN
#define V_MIN(a, b) SUF(vselect)((a) < (b), (a), (b))
#endif
#ifndef V_WHERE_LT
#define V_WHERE_LT(x, c, a, y) SUF(vselect)((x) < (c), (a), (y))
#endif
#ifndef V_WHERE_GT
#define V_WHERE_GT(x, c, a, y) SUF(vselect)((x) > (c), (a), (y))
#endif
/* the larger of x and m; m when x is NaN */
KATTR static inline VT SUF(vmax)(VT x, VT m) { return V_MAX(x, m); }
KATTR static inline T SUF(hsum)(VT v)
{
    T s = v[0];
    int l;
    for (l = 1; l < VL; l++) s += v[l];
    return s;
}
KATTR static inline T SUF(hmax)(VT v)
{
    T m = v[0];
    int l;
    for (l = 1; l < VL; l++)
        if (v[l] > m) m = v[l];
    return m;
}

/* exp(x) lane by lane: x = n·ln2 + r, |r| <= ln2/2, exp(r) by a polynomial,
 * times 2^n applied as two factors 2^(n/2) so that results down to the
 * subnormals are right.  NaN gives NaN, -inf 0, +inf +inf.
 * n is taken from x clamped to [lo, hi] (NaN to lo): outside that range the
 * result is 0 or +inf anyway (selected at the end from x itself), and the
 * clamp keeps n's integer arithmetic in range for every x (unclamped, an x
 * of -1e7 in float or -6e15 in double overflowed the conversion: signed
 * overflow, undefined behaviour).  Inside the range nothing changes.
 * vexp_core computes it from x and xc, x clamped as above (V_SCALEF:
 * n stays in floating point, no conversion to fear; see vexp_neg) and
 * without the final selections. */
#if KDOUBLE
#define EXP_LO (-745.2)
#define EXP_HI 709.79
#else
#define EXP_LO (-103.98f)
#define EXP_HI 88.73f
#endif
KATTR static inline VT SUF(vexp_core)(VT x, VT xc)
{
#if KDOUBLE
    const T magic = 6755399441055744.0; /* 1.5 * 2^52 */
    const T c1 = 6.93145751953125E-1, c2 = 1.42860682030941723212E-6;
    VT t = V_FMA(xc, SUF(vset1)(1.4426950408889634074), SUF(vset1)(magic));
    VT n = t - magic;
    VT r = V_FMA(n, SUF(vset1)(-c1), x);
    r = V_FMA(n, SUF(vset1)(-c2), r);
    /* Taylor to r^13: the truncation is below 1e-17 for |r| <= ln2/2 */
    VT p = SUF(vset1)(1.0 / 6227020800.0);
    p = V_FMA(p, r, SUF(vset1)(1.0 / 479001600.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 39916800.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 3628800.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 362880.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 40320.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 5040.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 720.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 120.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 24.0));
    p = V_FMA(p, r, SUF(vset1)(1.0 / 6.0));
    p = V_FMA(p, r, SUF(vset1)(0.5));
    p = V_FMA(p, r * r, r + 1.0);
#ifdef V_SCALEF
    return V_SCALEF(p, n);
#else
    VI ni = (VI)t - (int64_t)0x4338000000000000LL;
    VI n1 = ni >> 1, n2 = ni - n1;
    VT s1 = (VT)((n1 + 1023) << 52), s2 = (VT)((n2 + 1023) << 52);
    return p * s1 * s2;
#endif
#else
    const T magic = 12582912.0f; /* 1.5 * 2^23 */
    const T c1 = 0.693359375f, c2 = -2.12194440e-4f;
    VT t = V_FMA(xc, SUF(vset1)(1.44269504088896341f), SUF(vset1)(magic));
    VT n = t - magic;
    VT r = V_FMA(n, SUF(vset1)(-c1), x);
    r = V_FMA(n, SUF(vset1)(-c2), r);
    /* Cephes' expf polynomial.  Degree 6 in Estrin's form instead (one
     * FMA fewer, a chain of 3 instead of 6; its coefficients would need a
     * fit): exp_sum 2.05 -> 1.81 ns a vector (Zen 5, one core, a row of
     * 512 in L1), the module at B 1, S 4096, E 1024 0.9% faster (4 pairs
     * alternated process by process); it changes the bits of every
     * softmax, so this one stays */
    VT p = SUF(vset1)(1.9875691500E-4f);
    p = V_FMA(p, r, SUF(vset1)(1.3981999507E-3f));
    p = V_FMA(p, r, SUF(vset1)(8.3334519073E-3f));
    p = V_FMA(p, r, SUF(vset1)(4.1665795894E-2f));
    p = V_FMA(p, r, SUF(vset1)(1.6666665459E-1f));
    p = V_FMA(p, r, SUF(vset1)(5.0000001201E-1f));
    p = V_FMA(p, r * r, r + 1.0f);
#ifdef V_SCALEF
    return V_SCALEF(p, n);
#else
    VI ni = (VI)t - 0x4B400000;
    VI n1 = ni >> 1, n2 = ni - n1;
    VT s1 = (VT)((n1 + 127) << 23), s2 = (VT)((n2 + 127) << 23);
    return p * s1 * s2;
#endif
#endif
}

KATTR static inline VT SUF(vexp)(VT x)
{
    VT xc = V_MAX(x, SUF(vset1)(EXP_LO)); /* NaN -> lo too */
    VT y = SUF(vexp_core)(x, V_MIN(xc, SUF(vset1)(EXP_HI)));
    y = V_WHERE_LT(x, SUF(vset1)(EXP_LO), SUF(vset1)(0), y);
    return V_WHERE_GT(x, SUF(vset1)(EXP_HI), SUF(vset1)((T)INFINITY), y);
}

/* vexp's bits for x <= 0 or NaN (a score minus its row's maximum: exp_sum)
 * in fewer instructions: such an x never reaches the upper clamp or the
 * +inf selection, and with V_SCALEF the lower clamp only ever changed
 * lanes that the final selection sets to 0 (a NaN lane stays NaN through
 * r either way).  exp_sum's AVX-512 loop: 25 -> 22 vector instructions
 * (float), 31 -> 28 (double).  Where every 512-bit operation takes one of
 * the two FMA ports (Intel) that is time the FMAs lose; Zen 4 runs the
 * others beside its FMAs: an SDPA at (8, 8, 128, 64), one core, the same
 * 3.5-3.6 ms (float) either way.  The same bits (avx512, avx2, portable:
 * 312 forward, weight, gradient and SDPA arrays with -inf, -1e30 and
 * finfo.min masks, NaN inputs, scores past 1e4). */
KATTR static inline VT SUF(vexp_neg)(VT x)
{
#ifdef V_SCALEF
    VT y = SUF(vexp_core)(x, x);
#else
    VT y = SUF(vexp_core)(x, V_MAX(x, SUF(vset1)(EXP_LO)));
#endif
    return V_WHERE_LT(x, SUF(vset1)(EXP_LO), SUF(vset1)(0), y);
}
#undef EXP_LO
#undef EXP_HI

#ifndef UKR_PF
#define UKR_PF 16
#endif
#ifndef UKR_KB
#define UKR_KB 128
#endif
#define UKR_FN SUF(ukr)
#define UMR MR
#define UNRV NRV
#include "ukr_impl.h"
#define UKR_FN SUF(ukr_tail)
#define UMR (MR / 2)
#define UNRV NRV
#include "ukr_impl.h"
#define UKR_FN SUF(ukr_narrow)
#define UMR MR
#define UNRV 1
#include "ukr_impl.h"
#define UKR_FN SUF(ukr_row)
#define UMR 1
#define UNRV NRV
#include "ukr_impl.h"
#define UKR_FN SUF(ukr_dot)
#define UMR 1
#define UNRV 1
#include "ukr_impl.h"

/* C (m, n) = A (m, K)·B (n, K)ᵀ (+ bias), B read in place (no packing):
 * the projections of few rows (a decode step's token).  Each element is
 * summed exactly as the packed GEMM sums it (gemm_impl.h and ukr: per depth
 * block of DOT_KC, c = 0 then c = V_FMA(A[i][k], B[j][k], c) in k order, in
 * float chains of UKR_KB steps joined in order; C = c,
 * or C + c for a later block or with accumulate; the bias added after the
 * last block), so a row's bits never depend on which of the two ran: the
 * lanes hold DOT_R rows of A (transposed once per block into at), and
 * DOT_J columns of B are summed at once (independent chains). */
#define DOT_KC 512   /* MHA_GEMM_KC: the packed GEMM's depth block */
#define DOT_J 8
KATTR static void SUF(dot)(int64_t m, int64_t n, int64_t K, const T *A, int64_t lda,
                           const T *B, int64_t ldb, const T *bias, T *C, int64_t ldc,
                           int accumulate)
{
    T at[DOT_KC * VL];
    int64_t i0, j0, pc, k, mr, nj;
    int r, u;
    for (i0 = 0; i0 < m; i0 += VL) {
        mr = m - i0 < VL ? m - i0 : VL;
        for (pc = 0; pc < K; pc += DOT_KC) {
            const int64_t kc = K - pc < DOT_KC ? K - pc : DOT_KC;
            const int last = pc + kc >= K, acc = accumulate || pc > 0;
            for (k = 0; k < kc; k++) /* lane r: row i0 + r of A (0 past m) */
                for (r = 0; r < VL; r++) at[k * VL + r] = r < mr ? A[(i0 + r) * lda + pc + k] : 0;
            for (j0 = 0; j0 < n; j0 += DOT_J) {
                const T *b[DOT_J];
                VT c[DOT_J];
                T lane[VL];
                nj = n - j0 < DOT_J ? n - j0 : DOT_J;
                for (u = 0; u < DOT_J; u++) {
                    b[u] = B + (j0 + (u < nj ? u : nj - 1)) * ldb + pc;
                    c[u] = SUF(vset1)(0);
                }
                {   /* float: chains of UKR_KB steps joined in order, as ukr sums */
                    const int64_t kb = KDOUBLE ? kc : UKR_KB;
                    int64_t k0;
                    VT part[DOT_J];
                    for (u = 0; u < DOT_J; u++) part[u] = SUF(vset1)(0);
                    for (k0 = 0; k0 < kc; k0 += kb) {
                        const int64_t k1 = kc - k0 < kb ? kc : k0 + kb;
                        if (k0)
                            for (u = 0; u < DOT_J; u++) {
                                part[u] = part[u] + c[u];
                                c[u] = SUF(vset1)(0);
                            }
                        for (k = k0; k < k1; k++) {
                            const VT a = SUF(vload)(at + k * VL);
#pragma GCC unroll 8
                            for (u = 0; u < DOT_J; u++)
                                c[u] = V_FMA(a, SUF(vset1)(b[u][k]), c[u]);
                        }
                    }
                    if (kc > kb)
                        for (u = 0; u < DOT_J; u++) c[u] = part[u] + c[u];
                }
                for (u = 0; u < nj; u++) {
                    SUF(vstore)(lane, c[u]);
                    for (r = 0; r < mr; r++) {
                        T *cp = C + (i0 + r) * ldc + j0 + u, x = lane[r];
                        if (acc) x = *cp + x;
                        if (last && bias) x = x + bias[j0 + u];
                        *cp = x;
                    }
                }
            }
        }
    }
}
#undef DOT_KC
#undef DOT_J

KATTR static T SUF(scale_max)(T *s, int64_t n, T c)
{
    VT vm = SUF(vset1)(-(T)INFINITY), vc = SUF(vset1)(c);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) {
        VT x = SUF(vload)(s + j) * vc;
        SUF(vstore)(s + j, x);
        vm = SUF(vmax)(x, vm);
    }
    T m = SUF(hmax)(vm);
    for (; j < n; j++) {
        s[j] *= c;
        if (s[j] > m) m = s[j];
    }
    return m;
}

KATTR static T SUF(max)(const T *s, int64_t n)
{
    VT vm = SUF(vset1)(-(T)INFINITY);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) vm = SUF(vmax)(SUF(vload)(s + j), vm);
    T m = SUF(hmax)(vm);
    for (; j < n; j++)
        if (s[j] > m) m = s[j];
    return m;
}

KATTR static T SUF(exp_sum)(T *s, int64_t n, T m)
{
    VT vs = (VT){0}, vmv = SUF(vset1)(m);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) {
        VT x = SUF(vexp_neg)(SUF(vload)(s + j) - vmv);
        SUF(vstore)(s + j, x);
        vs = vs + x;
    }
    if (j < n) { /* the tail through one padded vector: exp(-inf) adds 0 */
#ifdef V_LOADN
        VT x = SUF(vexp_neg)(V_LOADN(s + j, n - j, -(T)INFINITY) - vmv);
        V_STOREN(s + j, x, n - j);
        vs = vs + x;
#else
        T tmp[VL];
        int64_t t;
        for (t = 0; t < VL; t++) tmp[t] = j + t < n ? s[j + t] : -(T)INFINITY;
        VT x = SUF(vexp_neg)(SUF(vload)(tmp) - vmv);
        SUF(vstore)(tmp, x);
        for (t = 0; j + t < n; t++) s[j + t] = tmp[t];
        vs = vs + x;
#endif
    }
    return SUF(hsum)(vs);
}

KATTR static void SUF(scale)(T *s, int64_t n, T c)
{
    VT vc = SUF(vset1)(c);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) SUF(vstore)(s + j, SUF(vload)(s + j) * vc);
    for (; j < n; j++) s[j] *= c;
}

KATTR static void SUF(exp_row)(T *s, int64_t n)
{
    int64_t j = 0;
    for (; j + VL <= n; j += VL) SUF(vstore)(s + j, SUF(vexp)(SUF(vload)(s + j)));
    if (j < n) {
        T tmp[VL];
        int64_t t;
        for (t = 0; t < VL; t++) tmp[t] = j + t < n ? s[j + t] : 0;
        SUF(vstore)(tmp, SUF(vexp)(SUF(vload)(tmp)));
        for (t = 0; j + t < n; t++) s[j + t] = tmp[t];
    }
}

KATTR static void SUF(softmax_grad)(const T *p, T *d, int64_t n, T c)
{
    VT vs = (VT){0}, vdot, vc = SUF(vset1)(c);
    int64_t j = 0;
    T dot;
    for (; j + VL <= n; j += VL) vs = V_FMA(SUF(vload)(p + j), SUF(vload)(d + j), vs);
    dot = SUF(hsum)(vs);
    for (; j < n; j++) dot += p[j] * d[j];
    vdot = SUF(vset1)(dot);
    for (j = 0; j + VL <= n; j += VL)
        SUF(vstore)(d + j, SUF(vload)(p + j) * (SUF(vload)(d + j) - vdot) * vc);
    for (; j < n; j++) d[j] = p[j] * (d[j] - dot) * c;
}

#undef NR
/* the per-dtype parameters end here, so the includer can define the next set */
#undef T
#undef KDOUBLE
#undef VL
#undef VT
#undef VI
#undef V_SET1
#undef SUF
#undef V_MAX
#undef V_MIN
#undef V_WHERE_LT
#undef V_WHERE_GT
#undef V_SCALEF
#undef V_LOADN
#undef V_STOREN
