/* ukr_impl.h: the GEMM micro-kernel (kernels.h's ukr), C (mr, nr) (+)=
 * A·Bp (+ bias) for mr <= UMR rows, included by kern_impl.h twice per
 * instance: as ukr_S with UMR = MR and as ukr_tail_S with UMR = MR / 2 (the
 * last panel of few rows: at M = 20 rows and MR = 6, the 2 left over took a
 * full 6-row pass).  Each C element's sum is the same code whatever UMR: a
 * row's bits do not depend on the kernel that computed it.  The includer
 * defines UKR_FN and UMR (undefined here at the end). */

KATTR static void UKR_FN(int64_t kc, const T *A, int64_t lda, int64_t ak, const T *Bp,
                         int64_t ldbk, T *C, int64_t ldc, int64_t mr, int64_t nr,
                         int accumulate, const T *bias)
{
    VT c[UMR][NRV];
    T part[UMR][NRV * VL]; /* the sums of the kb-step chains before */
    const T *ar[UMR];
    /* float: chains of UKR_KB steps; double: one chain (its error is far
     * below any tolerance already, and it keeps its speed) */
    const int64_t kb = KDOUBLE ? kc : UKR_KB;
    int64_t k, ko, k0;
    int r, v;
    /* rows past mr repeat the last one: computed, never stored */
#pragma GCC unroll 16
    for (r = 0; r < UMR; r++) ar[r] = A + (r < mr ? r : mr - 1) * lda;
#pragma GCC unroll 16
    for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
        for (v = 0; v < NRV; v++) c[r][v] = (VT){0};
    if (kc > kb) __builtin_memset(part, 0, sizeof part);
    for (k0 = 0, ko = 0; k0 < kc; k0 += kb) {
        const int64_t k1 = kc - k0 < kb ? kc : k0 + kb;
        /* every kb steps the partial sums join those of the steps before
         * (in memory, in order) and start again from zero: each C element
         * is a sum of kb-long chains, added in order, closer to the exact
         * sum than one chain of kc (the order depends on k alone) */
        if (k0) {
#pragma GCC unroll 16
            for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
                for (v = 0; v < NRV; v++) {
                    SUF(vstore)(&part[r][v * VL], SUF(vload)(&part[r][v * VL]) + c[r][v]);
                    c[r][v] = (VT){0};
                }
        }
        for (k = k0; k < k1; k++, ko += ak) {
            VT b[NRV];
#pragma GCC unroll 4
            for (v = 0; v < NRV; v++) b[v] = SUF(vload)(Bp + v * VL);
            /* the B panel's row UKR_PF steps ahead (it streams from L2; a
             * prefetch past the panel's end is harmless: it never faults; the address
             * is computed as an integer, no out-of-range pointer is formed) */
#pragma GCC unroll 4
            for (v = 0; v < NRV; v++)
                __builtin_prefetch((const void *)((uintptr_t)(Bp + v * VL) +
                                                  (uintptr_t)(UKR_PF * ldbk) * sizeof(T)));
            /* A's lines ahead of use: a row-major A (ak == 1) reaches a new line
             * of each row every 16 k (ask for the line after next); a transposed
             * one (ak > 1) a new line every k (ask as early as for B's; its UMR
             * entries may straddle two lines) */
            if (ak == 1 && (k & 15) == 0) {
#pragma GCC unroll 16
                for (r = 0; r < UMR; r++)
                    __builtin_prefetch((const void *)((uintptr_t)(ar[r] + ko) + 32 * sizeof(T)));
            } else if (ak > 1) {
                __builtin_prefetch((const void *)((uintptr_t)(ar[0] + ko) +
                                                  (uintptr_t)(UKR_PF * ak) * sizeof(T)));
                __builtin_prefetch((const void *)((uintptr_t)(ar[UMR - 1] + ko) +
                                                  (uintptr_t)(UKR_PF * ak) * sizeof(T)));
            }
#pragma GCC unroll 16
            for (r = 0; r < UMR; r++) {
                VT a = SUF(vset1)(ar[r][ko]);
#pragma GCC unroll 4
                for (v = 0; v < NRV; v++) c[r][v] = V_FMA(a, b[v], c[r][v]);
            }
            Bp += ldbk;
        }
    }
    if (kc > kb) {
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < NRV; v++) c[r][v] = SUF(vload)(&part[r][v * VL]) + c[r][v];
    }
    if (mr == UMR && nr == NR) {
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < NRV; v++) {
                T *cp = C + r * ldc + v * VL;
                VT x = c[r][v];
                if (accumulate) x = SUF(vload)(cp) + x;
                if (bias) x = x + SUF(vload)(bias + v * VL);
                SUF(vstore)(cp, x);
            }
    } else {
        T tile[UMR][NR];
        int64_t i, j;
        for (r = 0; r < UMR; r++)
            for (v = 0; v < NRV; v++) SUF(vstore)(&tile[r][v * VL], c[r][v]);
        for (i = 0; i < mr; i++)
            for (j = 0; j < nr; j++) {
                T x = tile[i][j];
                if (accumulate) x = C[i * ldc + j] + x;
                if (bias) x = x + bias[j];
                C[i * ldc + j] = x;
            }
    }
}

#undef UKR_FN
#undef UMR
