/* ukr_impl.h: the GEMM micro-kernel (kernels.h's ukr), C (mr, nr) (+)=
 * A·Bp (+ bias) for mr <= UMR rows and nr <= UNRV vectors of columns,
 * included by kern_impl.h three times per instance: as ukr_S (UMR = MR,
 * UNRV = NRV), as ukr_tail_S with UMR = MR / 2 (the last panel of few
 * rows: at M = 20 rows and MR = 6, the 2 left over took a full 6-row pass)
 * and as ukr_narrow_S with UNRV = 1 (a panel of at most one vector of
 * columns: S = Q·Kᵀ over few keys, P·V with a narrow head, took a full
 * NRV-vector pass; Zen 5, one thread, alternated process by process: SDPA
 * of 256 heads of 10 queries and keys, head size 64, 0.406 -> 0.332 ms).
 * Each C element's sum is the same operations in the same order whatever
 * UMR and UNRV and whichever loop below runs it: an element's bits do not
 * depend on the kernel that computed it.  The
 * includer defines UKR_FN, UMR and UNRV (undefined here at the end).  B's
 * panels stay NR = NRV vectors wide whatever UNRV (ldbk).
 *
 * pin: NULL, or the state an earlier call left for the first steps of the
 * same depth block (once gemm_impl.h's sub-blocks; unused now, see
 * kernels.h: that call wrote its result
 * to a UMR x NR tile, ldc NR, nothing accumulated, no bias): this call
 * goes on from it as if it had run those steps itself, so the sums keep
 * their order and bits.  float: the joined chains (part below; the
 * sub-block starts on a chain boundary, a multiple of UKR_KB); double: the
 * one chain itself. */

/* A row-major A's row reaches a new 64-byte line every UKR_LINE steps of k
 * (16 floats, 8 doubles), and each line is asked for two lines ahead.
 * Asked for every 16 steps for doubles too (every other line), the float64
 * projection ran 4-7% slower: Zen 3, one core, (1024, 1536) with K 512,
 * the two alternated call by call.
 * With a full panel (mr == UMR), the next panel's rows (UMR rows down) are
 * asked for too, each at the line this step reaches: gemm_impl.h runs the
 * row panels one after the other across the same columns, so by the next
 * panel's first call its rows are in L1, a whole call ahead.  Two ahead
 * within the row alone, a panel whose rows came from L3 or memory waited
 * on their first lines (at K 64, Q's rows in S = Q·Kᵀ, the first two of
 * four lines were never asked for ahead).  Zen 5, one core, builds
 * alternated process by process, medians: an input gradient (1024, 512)
 * with K 512 from memory (16 operand sets cycled) 188-205 -> 220-232
 * GFLOP/s, from cache 249 -> 251; S = Q·Kᵀ, then P·V, 48 queries at a
 * time over 192 heads of 384 keys (from memory) 191 -> 217 and 238 ->
 * 231; AVX2 +3-5%.  Module, two threads: BERT (B 16, S 384, E 768) 89.9 ->
 * 86.5 ms and 85.6 -> 83.6, large 118.2 -> 115.9, training step B 8,
 * S 128, E 512 18.8 -> 18.1.  A prefetch past the matrix (the last panel's
 * next) is computed as an integer and never faults. */
#define UKR_LINE (64 / (int64_t)sizeof(T))
/* the farthest apart B's rows may lie for the unrolled, whole-depth and
 * assembly loops (4 KiB and a line; see the unrolled loop's note), a count
 * of scalars */
#define UKR_NEAR_LDB (4160 / (int64_t)sizeof(T))

KATTR static void UKR_FN(int64_t kc, const T *A, int64_t lda, int64_t ak, const T *Bp,
                         int64_t ldbk, T *C, int64_t ldc, int64_t mr, int64_t nr,
                         int accumulate, const T *bias, const T *pin)
{
    VT c[UMR][UNRV];
    T part[UMR][UNRV * VL]; /* the sums of the kb-step chains before */
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
        for (v = 0; v < UNRV; v++)
            c[r][v] = KDOUBLE && pin ? SUF(vload)(pin + r * NR + v * VL) : (VT){0};
    if (pin && !KDOUBLE) {
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < UNRV; v++)
                SUF(vstore)(&part[r][v * VL], SUF(vload)(pin + r * NR + v * VL));
    } else if (kc > kb)
        __builtin_memset(part, 0, sizeof part);
    /* C's tile asked for (prefetcht1) before the sums, so that its lines
     * arrive while the FMAs run: a product too big for L2 (the
     * projections' (B·S, E) outputs, the weight gradients' second depth
     * block, which adds to the first) otherwise waits at the end on each
     * of the tile's lines from L3, longer when other tenants share that
     * L3.  Zen 4, one core, (1024, 512) with K 512, the two builds
     * alternated: float 85-87% -> 89-93% of the peak while the machine was
     * busy, 91-93% both ways while it was quiet; double 85-88% -> 87-91%;
     * a training step at B 8, S 128, E 512 (two threads, medians of 30)
     * 37.4-38.1 -> 36.8-37.6 ms in the quiet rounds, the same in the busy
     * ones.  Not where Aᵀ is read in place (ak > UMR: the weight
     * gradients' TN tiles, whose C stays in L2 between its two depth
     * blocks): 89-90% -> 87%.  Addresses as integers: none past the tile
     * is formed. */
#pragma GCC unroll 16
    for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
        for (v = 0; v < UNRV; v++)
            if (ak <= UMR && r < mr && v * VL < nr)
                __builtin_prefetch((const void *)((uintptr_t)C +
                                                  (uintptr_t)(r * ldc + v * VL) * sizeof(T)),
                                   0, 2);
    /* B's prefetch (the loop below): the step from which it asks for the
     * next panel, and its offset from Bp there */
    const int64_t ksw = kc > UKR_PF ? kc - UKR_PF : 0;
    const int64_t dnx = ldbk > NR ? NR - ksw * ldbk : UKR_PF * ldbk;
/* every kb steps the partial sums ACC join those of the steps before (in
 * memory, in order) and start again from zero: each C element is a sum of
 * kb-long chains, added in order, closer to the exact sum than one chain
 * of kc (the order depends on k alone) */
#define UKR_JOIN(ACC)                                                                      \
    do {                                                                                   \
        _Pragma("GCC unroll 16")                                                           \
        for (r = 0; r < UMR; r++)                                                          \
            _Pragma("GCC unroll 4")                                                        \
            for (v = 0; v < UNRV; v++) {                                                   \
                SUF(vstore)(&part[r][v * VL], SUF(vload)(&part[r][v * VL]) + ACC[r][v]);   \
                ACC[r][v] = (VT){0};                                                       \
            }                                                                              \
    } while (0)
#ifdef UKR_UNROLL
/* UKR_PASS(addr, astep, ldb): one pass of UKR_UNROLL steps, addr(r, u) the
 * address of A's element (r, k + u), astep the bytes A's bases advance,
 * ldb the scalars between B's rows (a constant where B is packed) */
#define UKR_PASS(ADDR, ASTEP, LDB)                                                         \
    do {                                                                                   \
        int u;                                                                             \
        _Pragma("GCC unroll 8")                                                            \
        for (u = 0; u < UKR_UNROLL; u++) {                                                 \
            VT b[UNRV];                                                                    \
            _Pragma("GCC unroll 4")                                                        \
            for (v = 0; v < UNRV; v++) b[v] = SUF(vload)(Bp + v * VL);                     \
            /* B's row UKR_PF steps ahead: its first line (a packed panel                  \
             * streams in order, which the hardware follows too) */                        \
            __builtin_prefetch((const void *)((uintptr_t)Bp +                              \
                                              (uintptr_t)(UKR_PF * (LDB)) * sizeof(T)));   \
            _Pragma("GCC unroll 16")                                                       \
            for (r = 0; r < UMR; r++) {                                                    \
                VT a = SUF(vset1)(*(const T *)(ADDR));                                     \
                _Pragma("GCC unroll 4")                                                    \
                for (v = 0; v < UNRV; v++) UKR_FMA_ACC(cc[r][v], a, b[v]);                 \
            }                                                                              \
            Bp += (LDB);                                                                   \
        }                                                                                  \
        a0 += (ASTEP);                                                                     \
        a3 += (ASTEP);                                                                     \
    } while (0)
/* the row-major A's passes over k from k while a whole pass fits before k1
 * (the generic loop takes any steps left), B's rows LDB scalars apart */
#define UKR_LOOP_RM(LDB)                                                                   \
    for (; k + UKR_UNROLL <= k1; k += UKR_UNROLL) {                                        \
        if ((k & (UKR_LINE - 1)) == 0) { /* A's rows: the line after next */               \
            _Pragma("GCC unroll 16")                                                       \
            for (r = 0; r < UMR; r++)                                                      \
                __builtin_prefetch((r < 3 ? a0 : a3) + (r % 3) * L + 128);                 \
            _Pragma("GCC unroll 16")                                                       \
            for (r = 0; r < UMR; r++) /* the next panel's: this line */                    \
                __builtin_prefetch((const void *)((uintptr_t)(r < 3 ? a0 : a3) +           \
                                                  (uintptr_t)((r % 3 + UMR) * L)));        \
        }                                                                                  \
        UKR_PASS((r < 3 ? a0 : a3) + (r % 3) * L + u * sizeof(T), UKR_UNROLL * sizeof(T),  \
                 LDB);                                                                     \
    }
#endif
#if defined(UKR_WHOLE) && !defined(UKR_UNROLL)
#error "UKR_WHOLE needs UKR_UNROLL"
#endif
#if defined(UKR_ASM_LOOP) && !KDOUBLE
#error "UKR_ASM_LOOP sums one chain per element: double only"
#endif
#if defined(UKR_ASM_LOOP) && UMR == MR && UNRV == NRV /* ukr_S, the full panel */
    /* the includer's loop over the whole depth in assembly (kern_avx512.c's
     * float64 one: one chain per element in order, the generic loop's FMAs
     * and bits), for a row-major A's full panels (packed Aᵀ, the float64
     * weight gradients' panels, stay on the generic loop) */
    if (!pin && mr == UMR && ak == 1 && ldbk <= UKR_NEAR_LDB) {
        T acc[UMR][NR] __attribute__((aligned(64)));
        UKR_ASM_LOOP(kc, A, lda, Bp, ldbk, &acc[0][0]);
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < UNRV; v++) c[r][v] = SUF(vload)(&acc[r][v * VL]);
    } else
#endif
#ifdef UKR_WHOLE
    /* all UMR rows real, A row-major, B's rows close together, the depth
     * and the chains a whole number of passes: the whole depth in this
     * block's registers, the chains joined from them (below, the joins
     * and the passes of each chain meet in c[][], which gcc keeps on the
     * stack: on an Intel Xeon with two 512-bit FMA ports the loop's
     * scalar work and those copies take FMA slots).  A packed B (ldbk
     * NR) has its own copy of the loop, its offsets constants.  The same
     * FMAs in the same order per element as the loops below.  Intel Xeon
     * (family 6, model 167), one core, (1024, 1536) with K 512, B packed,
     * the generic loop against this one (with the unrolled loop below
     * where it does not apply): 147-150 -> 158-161 GFLOP/s */
    if (!pin && mr == UMR && ak == 1 && ldbk <= UKR_NEAR_LDB &&
        kc % UKR_UNROLL == 0 && kb % UKR_UNROLL == 0) {
        VT cc[UMR][UNRV];
        const int64_t L = lda * (int64_t)sizeof(T);
        const char *a0 = (const char *)A, *a3 = a0 + (UMR > 3 ? 3 * L : 0);
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < UNRV; v++) cc[r][v] = (VT){0};
        for (k0 = 0; k0 < kc; k0 += kb) {
            const int64_t k1 = kc - k0 < kb ? kc : k0 + kb;
            k = k0;
            if (k0) UKR_JOIN(cc);
            if (ldbk == NR)
                UKR_LOOP_RM(NR)
            else
                UKR_LOOP_RM(ldbk)
        }
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < UNRV; v++) c[r][v] = cc[r][v];
    } else
#endif
    for (k0 = 0, ko = 0; k0 < kc; k0 += kb) {
        const int64_t k1 = kc - k0 < kb ? kc : k0 + kb;
        k = k0;
        if (k0) UKR_JOIN(c);
#ifdef UKR_UNROLL
        /* all UMR rows real, A row-major (ak 1) or a packed panel (lda 1,
         * ak UMR: gemm_impl.h's Aᵀ), B's rows close together: the same FMAs
         * in the same order per element, UKR_UNROLL steps of k per pass,
         * A's element (r, k) at a base plus constants (row-major: two bases,
         * rows 0-2 and 3-5, plus one or two row strides), so that a step
         * costs its loads and FMAs and almost no pointer arithmetic (on a
         * core with two 256-bit FMA pipes the generic loop below spends as
         * many instructions on bookkeeping as on FMAs).  B's rows at most
         * 4 KiB apart (packed, V's rows of a head, Kᵀ's at Sk 128 or 384, a
         * weight's at E 768; B's rows a multiple of 2 KiB apart are packed
         * on AVX2, of 4 KiB on AVX-512: gemm_impl.h's pack_far).  Zen 3, one core, the two loops
         * alternated call by call: (48, 64) with K 256 (P·V), B's rows
         * 512 B to 4 KiB apart, 1.24-1.37x (float and double); (48, 256)
         * with K 64 (Kᵀ at Sk 384) 1.18-1.27x; (512, 768) with K 768
         * 1.05-1.20x; rows 6 KiB apart 0.84-0.99x, so the generic loop
         * stays past 4 KiB and a line (the forward's workspace sets Kᵀ's
         * rows 4 KiB + 64 B apart at Sk 1024: forward_impl.h).  (The
         * limit was 4·NR scalars: 256 B, which left double's V and
         * float's Kᵀ at Sk 128 on the generic loop.)
         * Keep the limit a constant count of scalars: written as bytes,
         * ldbk * sizeof(T) <= 4096, the same test made gcc 12 move loop
         * bounds to the stack and copy accumulators in the double kernel's
         * unrolled loop, 1.17-1.40x slower (the code below compiles to the
         * fast variant's instructions, a disassembly diff of 0 lines). */
        if (mr == UMR && ldbk <= UKR_NEAR_LDB &&
            (ak == 1 || (lda == 1 && ak == UMR))) {
            VT cc[UMR][UNRV]; /* the accumulators, in this block's registers */
            const int64_t L = ak == 1 ? lda * (int64_t)sizeof(T) : 0;
            const char *a0 = (const char *)(A + ko), *a3 = a0 + (UMR > 3 ? 3 * L : 0);
#pragma GCC unroll 16
            for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
                for (v = 0; v < UNRV; v++) cc[r][v] = c[r][v];
            if (ak == 1) {
                UKR_LOOP_RM(ldbk)
            } else { /* the packed panel streams in order from L1 */
                for (; k + UKR_UNROLL <= k1; k += UKR_UNROLL)
                    UKR_PASS(a0 + (r + u * UMR) * sizeof(T), UKR_UNROLL * UMR * sizeof(T),
                             ldbk);
            }
#pragma GCC unroll 16
            for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
                for (v = 0; v < UNRV; v++) c[r][v] = cc[r][v];
            ko = k * ak;
        }
#if !KDOUBLE
        else if (ak == 1 && ldbk <= UKR_NEAR_LDB) {
            /* fewer rows than UMR (a product's last panel: at M = 20 and MR
             * 6 the last 2 rows, on the half-height kernel): the same loop,
             * rows past mr repeating the last as ar[] does, each row at its
             * own offset (the loop above keeps its constants).  Zen 3, one
             * core, (mr, 64) with K 512, B in place, the two alternated call
             * by call: mr 1, 2, 4, 5 1.02-1.05x on a quiet machine, 1.10-1.55x
             * while the other vCPU is busy; the generic loop below spends
             * more instructions per FMA.  Not for double: its kernels' code
             * stays as it was (see the limit's note above) */
            VT cc[UMR][UNRV];
            const int64_t L = lda * (int64_t)sizeof(T);
            const int64_t O1 = mr > 1 ? L : 0, O2 = mr > 2 ? 2 * L : O1;
            const int64_t H1 = mr > 4 ? L : 0, H2 = mr > 5 ? 2 * L : H1;
            const char *a0 = (const char *)(A + ko);
            const char *a3 = a0 + (UMR > 3 ? (mr > 3 ? 3 : mr - 1) * L : 0);
#define UKR_ROW(r) ((r) < 3 ? a0 + ((r) == 0 ? 0 : (r) == 1 ? O1 : O2) \
                            : a3 + ((r) == 3 ? 0 : (r) == 4 ? H1 : H2))
#pragma GCC unroll 16
            for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
                for (v = 0; v < UNRV; v++) cc[r][v] = c[r][v];
            for (; k + UKR_UNROLL <= k1; k += UKR_UNROLL) {
                if ((k & (UKR_LINE - 1)) == 0) {
#pragma GCC unroll 16
                    for (r = 0; r < UMR; r++) __builtin_prefetch(UKR_ROW(r) + 128);
                }
                UKR_PASS(UKR_ROW(r) + u * sizeof(T), UKR_UNROLL * sizeof(T), ldbk);
            }
#undef UKR_ROW
#pragma GCC unroll 16
            for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
                for (v = 0; v < UNRV; v++) c[r][v] = cc[r][v];
            ko = k;
        }
#endif
#endif
        while (k < k1) {
            /* the B panel's row UKR_PF steps ahead (it streams from L2), and
             * over the panel's last UKR_PF steps, where that row would lie
             * past the panel, an in-place B's next panel (NR columns on: the
             * call gemm_impl.h makes next, along the same rows) from its first
             * row: dpf, B's prefetch offset from Bp, is one constant over each
             * of the two stretches.  (A packed panel's next follows in memory:
             * its offset does not change.)  A prefetch past the matrix is
             * harmless: it never faults; the address is computed as an
             * integer, no out-of-range pointer is formed.  Zen 5, one core,
             * builds alternated process by process, medians: S = Q·Kᵀ over 48
             * queries and 512 keys at a time, K 64, Kᵀ's rows 4112 floats
             * apart (long's heads) 203.5 -> 213.4 GFLOP/s; with P·V after it
             * at Sk 384 (BERT's) 201.0 -> 206.3, P·V unchanged; an input
             * gradient (1024, 512) with K 512, B in place, 226.4 -> 230.5
             * (237.9 -> 236.7 in a second pair).  A packed B, whose
             * prefetch addresses do not change: BERT's projection loop
             * 226.5 -> 227.8, but (1024, 1536) with K 512 236 -> 229 and
             * 230 -> 226 (that harness spreads over 225-239 run to run).
             * Module, two threads: long (B 1, S 4096, E 1024) 262.7 ->
             * 259.4 ms and 270.4 -> 265.2; BERT, large, medium within 1%.
             * The same bits. */
            const int64_t ke = k < ksw && ksw < k1 ? ksw : k1;
            const uintptr_t dpf = (uintptr_t)(k < ksw ? UKR_PF * ldbk : dnx) * sizeof(T);
            for (; k < ke; k++, ko += ak) {
                VT b[UNRV];
#pragma GCC unroll 4
                for (v = 0; v < UNRV; v++) b[v] = SUF(vload)(Bp + v * VL);
#pragma GCC unroll 4
                for (v = 0; v < UNRV; v++)
                    __builtin_prefetch((const void *)((uintptr_t)(Bp + v * VL) + dpf));
                /* A's lines ahead of use: a row-major A (ak == 1) reaches a new line
                 * of each row every UKR_LINE k (ask for the line after next); a
                 * transposed one (ak > 1) a new line every k (ask as early as for
                 * B's; its UMR entries may straddle two lines) */
                if (ak == 1 && (k & (UKR_LINE - 1)) == 0) {
#pragma GCC unroll 16
                    for (r = 0; r < UMR; r++)
                        __builtin_prefetch((const void *)((uintptr_t)(ar[r] + ko) + 128));
                    if (mr == UMR) /* the next panel's rows: this line (see above) */
#pragma GCC unroll 16
                        for (r = 0; r < UMR; r++)
                            __builtin_prefetch((const void *)((uintptr_t)(ar[r] + ko) +
                                                              (uintptr_t)(UMR * lda) * sizeof(T)));
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
                    for (v = 0; v < UNRV; v++) c[r][v] = V_FMA(a, b[v], c[r][v]);
                }
                Bp += ldbk;
            }
        }
    }
    if (kc > kb || (pin && !KDOUBLE)) {
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < UNRV; v++) c[r][v] = SUF(vload)(&part[r][v * VL]) + c[r][v];
    }
    if (mr == UMR && nr == UNRV * VL) {
#pragma GCC unroll 16
        for (r = 0; r < UMR; r++)
#pragma GCC unroll 4
            for (v = 0; v < UNRV; v++) {
                T *cp = C + r * ldc + v * VL;
                VT x = c[r][v];
                if (accumulate) x = SUF(vload)(cp) + x;
                if (bias) x = x + SUF(vload)(bias + v * VL);
                SUF(vstore)(cp, x);
            }
    } else {
        T tile[UMR][UNRV * VL];
        int64_t i, j;
        for (r = 0; r < UMR; r++)
            for (v = 0; v < UNRV; v++) SUF(vstore)(&tile[r][v * VL], c[r][v]);
#ifdef V_LOADN
        /* a part tile: each row's vectors with their lanes past nr masked
         * off, the scalar loop's sums lane by lane (with exp_sum's masked
         * tail, the SDPA above 0.332 -> 0.316 ms) */
        for (i = 0; i < mr; i++)
            for (j = 0; j < nr; j += VL) {
                const int w = nr - j < VL ? (int)(nr - j) : VL;
                T *cp = C + i * ldc + j;
                VT x = SUF(vload)(&tile[i][j]);
                if (accumulate) x = V_LOADN(cp, w, 0) + x;
                if (bias) x = x + V_LOADN(bias + j, w, 0);
                V_STOREN(cp, x, w);
            }
#else
        for (i = 0; i < mr; i++)
            for (j = 0; j < nr; j++) {
                T x = tile[i][j];
                if (accumulate) x = C[i * ldc + j] + x;
                if (bias) x = x + bias[j];
                C[i * ldc + j] = x;
            }
#endif
    }
}

#ifdef UKR_UNROLL
#undef UKR_PASS
#undef UKR_LOOP_RM
#endif
#undef UKR_JOIN
#undef UKR_FN
#undef UMR
#undef UNRV
#undef UKR_LINE
#undef UKR_NEAR_LDB
