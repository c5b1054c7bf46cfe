/* gemm_impl.h: the matrix-multiply loop nest, written once for T = float and
 * T = double (included twice by gemm.c with T, SUF, KT and UKR_T, the
 * micro-kernel's type, defined).
 *
 * BLIS's structure: for each block of NC columns (mha_gemm_nc: from the
 * L2), for each block of KC of the inner dimension, pack that (KC, NC)
 * block of op(B) into NR-wide panels (zero-padded: the micro-kernel always
 * runs full tiles); then for
 * each MR-row panel of A, read in place (it stays in L1 across the panels
 * of B), run the ISA's micro-kernel over the NR-wide panels.
 * When op(B) = B (K, N) is row-major, a full NR strip is read in place
 * (ldbk = ldb) and only a ragged last strip is packed (unless the product
 * asks for packing: pack_all, a tile of many rows); except under a
 * transposed A (mha_gemm_tn), where B is packed too: there its rows are
 * the long side's (tokens, a power-of-two stride apart that maps them onto
 * few cache sets), and a strip packed once serves every row of a tall
 * tile (the weight gradients: 17% faster at B 4, S 1024, E 1024 on Zen 4).
 *
 * mha_gemm_tn takes A transposed, A (K, M), read in place too: the
 * micro-kernel broadcasts element (i, k) from A[k*lda + i], MR neighbours
 * per k (the weight gradients dW = dYᵀ·X and the attention's dV = Aᵀ·dctx
 * without a transposed copy of the left side); on a narrow kernel (NR
 * scalars in one cache line: AVX2), and on a wide one where A's rows lie a
 * multiple of 4 KiB apart and mha_tn_pack measured packing faster
 * (mha_tn_packs, tn_probe below), A's panels are packed instead,
 * MHA_GEMM_AT_PANELS at a time (see pack_at below), and past a depth of
 * MHA_GEMM_NB_K the product takes gemm_nest_nb, BLIS's own order, with the
 * same sums.
 *
 * Each C element is summed in the same order whatever the tiling of the
 * caller: k = 0, 1, ... inside a KC block, blocks added to C in order, the
 * bias last.  So results do not depend on threads. */

/* a transposed A's rows are asked for PFK rows ahead when packed: the
 * hardware follows one stream, not kc rows of a few lines each.  The
 * backward's dV = Aᵀ·dctx reads P's block from memory; Zen 3, one core,
 * (1024, 64) with K 128: 1.39-1.53x faster with A cold, 0.94-0.96x with
 * A in cache */
#define PFK 8
/* and a row-major B's rows PFB rows ahead when packed on a narrow kernel,
 * rows at least 1 KiB apart (one line per row of a panel: no stream the
 * hardware follows).  Zen 3, one core, TN (512, 256) with K 1024 (a weight
 * gradient at medium): 1.08-1.10x; NN (1024, 256) with K 1024: 1.035x */
#define PFB 16

/* The micro-kernel for an mr x nr tile: the one-vector kernels for a panel
 * of few columns (one row's, or MR rows'), the one-row one for a row, the
 * half-height one for few rows, else the full one (kernels.h; every one
 * gives the same bits) */
static inline UKR_T SUF(ukr_for)(const KT *kt, int64_t mr, int64_t nr)
{
    return nr <= kt->nr_narrow ? (mr == 1 ? kt->ukr_dot : kt->ukr_narrow)
           : mr == 1           ? kt->ukr_row
           : mr <= kt->mr_tail ? kt->ukr_tail
                               : kt->ukr;
}

/* op(B) panel: Bp[k*NR + c] = op(B)(pc + k, j + c), zero for c >= nr; a
 * row-major B's row pc + k + pf asked for with row pc + k (pf 0, or rows
 * under 1 KiB apart, which the hardware follows: not) */
static void SUF(pack_b)(int trans_b, int64_t kc, int64_t nr, int64_t NR, const T *B,
                        int64_t ldb, int64_t pc, int64_t j, T *Bp, int64_t pf)
{
    int64_t k, c;
    if (trans_b) { /* B is (N, K): row j + c, column pc + k; 8 k at a time, so
                      that the nr rows read stay in cache and the stores fill lines */
        int64_t k0, k1;
        for (k0 = 0; k0 < kc; k0 = k1) {
            k1 = kc - k0 < 8 ? kc : k0 + 8;
            for (c = 0; c < nr; c++) {
                const T *b = B + (j + c) * ldb + pc;
                for (k = k0; k < k1; k++) Bp[k * NR + c] = b[k];
            }
        }
        for (c = nr; c < NR; c++)
            for (k = 0; k < kc; k++) Bp[k * NR + c] = 0;
    } else { /* B is (K, N): row pc + k, column j + c */
        for (k = 0; k < kc; k++) {
            const T *b = B + (pc + k) * ldb + j;
            if (pf && ldb * (int64_t)sizeof(T) >= 1024) /* unswitched by gcc: an offset
                                                          hoisted by hand ran 2-3% slower */
                __builtin_prefetch(
                        (const void *)((uintptr_t)b + (uintptr_t)(pf * ldb) * sizeof(T)));
            for (c = 0; c < nr; c++) Bp[k * NR + c] = b[c];
            for (; c < NR; c++) Bp[k * NR + c] = 0;
        }
    }
}

/* Row k of a transposed A's block (mc of its columns, from a_k) into its
 * np panels of MR, element r of panel q at d[q*stride + r]; columns past mc
 * repeat the last.  AVX2's MR of 6 copies whole panels at a fixed size (two
 * moves each: a 16- and an 8-byte one for float; the loop on a run-time
 * MR of 6 spent three moves and its own counting on each) */
static inline void SUF(pack_at_row)(T *d, const T *a_k, int64_t mc, int64_t np, int64_t MR,
                                    int64_t stride)
{
    int64_t q = 0, r;
    if (MR == 6)
        for (; q * 6 + 6 <= mc; q++) memcpy(d + q * stride, a_k + q * 6, 6 * sizeof(T));
    for (; q < np; q++) {
        T *dq = d + q * stride;
        const T *aq = a_k + q * MR;
        const int64_t n = mc - q * MR < MR ? mc - q * MR : MR;
        for (r = 0; r < n; r++) dq[r] = aq[r];
        for (; r < MR; r++) dq[r] = aq[n - 1];
    }
}

/* The narrow kernels' nest (NR scalars in one cache line: AVX2, portable)
 * for a transposed A (mha_gemm_tn) deeper than MHA_GEMM_NB_K: BLIS's order.
 * The nest below keeps an MR-row panel of A in L1 and streams the (KC, NR)
 * panels of B from L2, repacking Aᵀ for every block of NC columns; here Aᵀ
 * is packed once per depth block, MHA_GEMM_NB_PANELS panels at a time (an
 * (MC, kc) block that stays in L2, its rows asked for PFK rows ahead), B's
 * block is 2·NC wide, and each (kc, NR) panel of B meets the MC rows'
 * panels one after the other.  Every element is summed in the same order
 * as below, to the bit.
 * Zen 3, one core, the weight gradients' tile (1024, 256) with K 4096, the
 * two nests alternated call by call in one process: 1.19-1.63x the median
 * GFLOP/s of the nest below (best 57-64 against 34-50).  The depth block
 * was once split into sub-blocks of 256 (B's sub-panel, 16 KiB, kept in
 * L1; the kernel went on from a sub-block's partial sums): one call over
 * the whole block is 1.06-1.09x faster on every tile tried ((512, 256) K
 * 1024, (1024, 256) K 4096, (768, 256) K 6144; the same bits), a training
 * step's weight and input gradients at B 8, S 128, E 512 34.1 -> 32.5 ms
 * (builds alternated process by process). */
static void SUF(gemm_nest_nb)(const KT *kt, int64_t M, int64_t N, int64_t K, const T *A,
                              int64_t lda, const T *B, int64_t ldb, T *C, int64_t ldc,
                              int accumulate, T *scratch)
{
    const int64_t MR = kt->mr, NR = kt->nr, NC = 2 * mha_gemm_nc(sizeof(T));
    const int64_t MC = MHA_GEMM_NB_PANELS * MR;
    T *Bp = scratch, *Ap = Bp + MHA_GEMM_KC * NC;
    int64_t jc, pc, jr, ic, q, k, o;
    for (jc = 0; jc < N; jc += NC) {
        const int64_t nc = N - jc < NC ? N - jc : NC;
        for (pc = 0; pc < K; pc += MHA_GEMM_KC) {
            const int64_t kc = K - pc < MHA_GEMM_KC ? K - pc : MHA_GEMM_KC;
            const int acc = accumulate || pc > 0;
            for (jr = 0; jr < nc; jr += NR) {
                const int64_t nr = nc - jr < NR ? nc - jr : NR;
                SUF(pack_b)(0, kc, nr, NR, B, ldb, pc, jc + jr, Bp + jr * kc, PFB);
            }
            for (ic = 0; ic < M; ic += MC) {
                const int64_t mc = M - ic < MC ? M - ic : MC, np = (mc + MR - 1) / MR;
                /* Aᵀ's block as np panels (kc, MR), element (r, k) of panel q
                 * at Ap[(q*kc + k)*MR + r], columns past M repeating the last */
                for (k = 0; k < kc; k++) {
                    const T *a_k = A + ic + (pc + k) * lda;
                    for (o = 0; o < mc; o += 64 / (int64_t)sizeof(T))
                        __builtin_prefetch((const void *)((uintptr_t)(a_k + o) +
                                                          (uintptr_t)(PFK * lda) * sizeof(T)));
                    SUF(pack_at_row)(Ap + k * MR, a_k, mc, np, MR, kc * MR);
                }
                for (jr = 0; jr < nc; jr += NR) {
                    const int64_t nr = nc - jr < NR ? nc - jr : NR;
                    for (q = 0; q < np; q++) {
                        const int64_t ir = ic + q * MR, mr = M - ir < MR ? M - ir : MR;
                        SUF(ukr_for)(kt, mr, nr)(
                                kc, Ap + q * kc * MR, 1, MR, Bp + jr * kc, NR,
                                C + ir * ldc + jc + jr, ldc, mr, nr, acc, NULL, NULL);
                    }
                }
            }
        }
    }
}

/* The loop nest; element (i, k) of A at A[i*a_rs + k*a_cs]; at_pack: a
 * transposed A (a_rs 1) is packed (mha_tn_packs), else read in place */
static void SUF(gemm_nest)(const KT *kt, int trans_b, int pack_all, int64_t M, int64_t N,
                           int64_t K, const T *A, int64_t a_rs, int64_t a_cs, const T *B, int64_t ldb,
                           const T *bias, T *C, int64_t ldc, int accumulate, T *scratch,
                           int at_pack)
{
    const int64_t MR = kt->mr, NR = kt->nr;
    const int64_t NC = mha_gemm_nc(sizeof(T));
    T *Bp = scratch;
    /* a transposed A (the TN products) on a narrow kernel (one cache line
     * of B per step: AVX2) is packed panel by panel: read in place, each
     * step of k reads a line of A (4 KiB apart: one L1 set) for MR values
     * (on AVX2 the TN products ran at a third of the peak).  A wide kernel
     * packs it where mha_tn_packs says (rows a multiple of 4 KiB apart, and
     * packing measured faster: an Intel Xeon; Zen 4 read it in place under
     * the probe's former widths, not measured since) */
    const int narrow = mha_gemm_narrow(NR, sizeof(T));
    const int pack_at = a_rs == 1 && a_cs > 1 && at_pack && MR <= MHA_GEMM_MR_MAX;
    T *Ap = scratch + MHA_GEMM_KC * NC; /* MHA_GEMM_SCRATCH's room for it */
    /* and on such a kernel a row-major B whose rows lie a multiple of
     * 2 KiB apart (Kᵀ or Vᵀ of a head at Sk 512, 1024, ...: a new line
     * every step, all in one or two L1 sets) is packed rather than read in
     * place: the copy is cheap, and the packed panel takes ukr_impl.h's
     * unrolled loop.  Zen 3, (48, 1024)·(64, 1024): 40-50 -> 42-61 GFLOP/s
     * a core, (128, 1024): 39-44 -> 67; rows 1.5 KiB or 512 B apart ran
     * faster in place (76 against 64) and stay so.  On a wide kernel rows
     * a multiple of 4 KiB apart (mha_gemm_far_rows) are packed too, where
     * A has 8 panels of rows or more to share the copy: Intel Xeon (family
     * 6, model 167), two threads, builds alternated process by process,
     * new tokens over a cache of 2048 keys whose capacity is 4096 (Kᵀ's
     * rows 16 KiB apart), E 1024, H 16, B 8, ms a call: 1 token 6.2-6.6
     * (in place), 8.5-8.6 (packed); 24 tokens 22.6-23.1, 23.9-24.6; 48
     * tokens 38.7-40.2, 37.0-38.3 */
    const int pack_far = !trans_b && a_cs == 1 && mha_gemm_far_rows(NR, ldb, sizeof(T)) &&
                         (narrow || M >= 8 * MR);
    pack_all = pack_all || pack_far;
    int64_t jc, pc, jr, ir, i, j;
    if (M <= 0 || N <= 0) return;
    if (K <= 0) { /* an empty sum: C = 0 (or unchanged), plus the bias */
        for (i = 0; i < M; i++)
            for (j = 0; j < N; j++) {
                T x = accumulate ? C[i * ldc + j] : (T)0;
                C[i * ldc + j] = bias ? x + bias[j] : x;
            }
        return;
    }
    if (pack_at && !trans_b && !bias && K > MHA_GEMM_NB_K) { /* see gemm_nest_nb */
        SUF(gemm_nest_nb)(kt, M, N, K, A, a_cs, B, ldb, C, ldc, accumulate, scratch);
        return;
    }
    for (jc = 0; jc < N; jc += NC) {
        int64_t nc = N - jc < NC ? N - jc : NC;
        for (pc = 0; pc < K; pc += MHA_GEMM_KC) {
            int64_t kc = K - pc < MHA_GEMM_KC ? K - pc : MHA_GEMM_KC;
            int acc = accumulate || pc > 0;
            const T *bias_kc = pc + kc >= K ? bias : NULL;
            for (jr = 0; jr < nc; jr += NR) {
                int64_t nr = nc - jr < NR ? nc - jr : NR;
                if (trans_b && nr == NR && kt->pack_bt)
                    kt->pack_bt(kc, B + (jc + jr) * ldb + pc, ldb, Bp + jr * kc);
                else if (trans_b || nr < NR || a_cs != 1 || pack_all)
                    SUF(pack_b)(trans_b, kc, nr, NR, B, ldb, pc, jc + jr, Bp + jr * kc,
                                narrow ? PFB : 0);
            }
            for (ir = 0; ir < M; ir += MR) {
                int64_t mr = M - ir < MR ? M - ir : MR;
                const T *ap = A + ir * a_rs + pc * a_cs;
                int64_t ars = a_rs, acs = a_cs;
                if (pack_at) { /* Aᵀ's panels, (kc, MR) each, MHA_GEMM_AT_PANELS
                                  at a time: each line of A read once */
                    const int64_t p = (ir / MR) % MHA_GEMM_AT_PANELS;
                    if (p == 0) {
                        const int64_t rows = M - ir < MHA_GEMM_AT_PANELS * MR
                                                 ? M - ir : MHA_GEMM_AT_PANELS * MR;
                        const int64_t np = (rows + MR - 1) / MR;
                        int64_t k;
                        for (k = 0; k < kc; k++) {
                            const T *a_k = A + ir + (pc + k) * a_cs;
                            T *d = Ap + k * MR;
                            int64_t o;
                            for (o = 0; o < rows; o += 64 / (int64_t)sizeof(T))
                                __builtin_prefetch((const void *)((uintptr_t)(a_k + o) +
                                                                  (uintptr_t)(PFK * a_cs) * sizeof(T)));
                            SUF(pack_at_row)(d, a_k, rows, np, MR, kc * MR);
                        }
                    }
                    ap = Ap + p * kc * MR;
                    ars = 1;
                    acs = MR;
                }
                for (jr = 0; jr < nc; jr += NR) {
                    int64_t nr = nc - jr < NR ? nc - jr : NR;
                    const T *bp = Bp + jr * kc;
                    int64_t ldbk = NR;
                    if (!trans_b && nr == NR && a_cs == 1 && !pack_all) {
                        bp = B + pc * ldb + jc + jr;
                        ldbk = ldb;
                    }
                    SUF(ukr_for)(kt, mr, nr)(
                            kc, ap, ars, acs, bp, ldbk,
                            C + ir * ldc + jc + jr, ldc, mr, nr, acc,
                            bias_kc ? bias_kc + jc + jr : NULL, NULL);
                }
            }
        }
    }
}

void SUF(mha_gemm)(const KT *kt, int trans_b, int64_t M, int64_t N, int64_t K,
                   const T *A, int64_t lda, const T *B, int64_t ldb, const T *bias,
                   T *C, int64_t ldc, int accumulate, T *scratch)
{
    if (kt->amx_gemm && K > 0 &&
        kt->amx_gemm(trans_b, M, N, K, A, lda, 1, B, ldb, bias, C, ldc, accumulate, scratch,
                     (size_t)MHA_GEMM_SCRATCH * sizeof(T)) == 0)
        return;
    SUF(mha_gemm_fma)(kt, trans_b, M, N, K, A, lda, B, ldb, bias, C, ldc, accumulate, scratch);
}

void SUF(mha_gemm_fma)(const KT *kt, int trans_b, int64_t M, int64_t N, int64_t K,
                       const T *A, int64_t lda, const T *B, int64_t ldb, const T *bias,
                       T *C, int64_t ldc, int accumulate, T *scratch)
{
    SUF(gemm_nest)(kt, trans_b, 0, M, N, K, A, lda, 1, B, ldb, bias, C, ldc, accumulate,
                   scratch, 0);
}

/* C (M, n) = A (M, K)·Bp for one packed panel of B, Bp (K, ldbp) with
 * n <= NR: the forward's S = Q·Kᵀ over a panel of keys that
 * attend_online_task transposed into its scratch (K given as rows).  The
 * kernel gemm_nest would run, on the same depth blocks in the same order,
 * so the same bits as mha_gemm_fma; the panel read where it lies, not
 * copied again into a zero-padded one (a kernel reads whole vectors of a
 * row of Bp: ldbp at least NR, or nr_narrow where n <= nr_narrow; the
 * columns past n only reach sums never stored).  Zen 4, one thread, a
 * decode step's SDPA at B 4096, H 1, L 1, S 1, D 64: the copy's zero fill
 * (a memset of 63 of 64 columns per row of the panel) took 20% of the call */
void SUF(mha_gemm_panel)(const KT *kt, int64_t M, int64_t n, int64_t K, const T *A,
                         int64_t lda, const T *Bp, int64_t ldbp, T *C, int64_t ldc)
{
    int64_t pc, ir;
    if (M <= 0 || n <= 0) return;
    if (K <= 0) { /* an empty sum */
        for (ir = 0; ir < M; ir++)
            for (pc = 0; pc < n; pc++) C[ir * ldc + pc] = 0;
        return;
    }
    for (pc = 0; pc < K; pc += MHA_GEMM_KC) {
        const int64_t kc = K - pc < MHA_GEMM_KC ? K - pc : MHA_GEMM_KC;
        for (ir = 0; ir < M; ir += kt->mr) {
            const int64_t mr = M - ir < kt->mr ? M - ir : kt->mr;
            SUF(ukr_for)(kt, mr, n)(kc, A + ir * lda + pc, lda, 1, Bp + pc * ldbp, ldbp,
                                   C + ir * ldc, ldc, mr, n, pc > 0, NULL, NULL);
        }
    }
}

void SUF(mha_gemm_tn)(const KT *kt, int64_t M, int64_t N, int64_t K, const T *A, int64_t lda,
                      const T *B, int64_t ldb, T *C, int64_t ldc, int accumulate, T *scratch)
{
    if (kt->amx_gemm && K > 0 &&
        kt->amx_gemm(0, M, N, K, A, 1, lda, B, ldb, NULL, C, ldc, accumulate, scratch,
                     (size_t)MHA_GEMM_SCRATCH * sizeof(T)) == 0)
        return;
    SUF(gemm_nest)(kt, 0, 0, M, N, K, A, 1, lda, B, ldb, NULL, C, ldc, accumulate, scratch,
                   SUF(mha_tn_packs)(kt, lda));
}

void SUF(mha_gemm_small)(const KT *kt, int64_t M, int64_t N, int64_t K, const T *A,
                         int64_t lda, const T *B, int64_t ldb, const T *bias, T *C,
                         int64_t ldc, int accumulate)
{
    kt->dot(M, N, K, A, lda, B, ldb, bias, C, ldc, accumulate);
}

/* mha_tn_pack's measurement (internal.h): a weight gradient's tile in
 * small, C (TNP_M, n) = Aᵀ·B with K = TNP_K and A's rows TNP_LDA scalars
 * apart (4 KiB: E 1024 float, 512 double; a power-of-two
 * stride, which maps the rows onto few cache sets), run with Aᵀ read in
 * place (n = MHA_TN_COLS, the backward's tile then) and packed (n =
 * MHA_TN_COLS_AT, its tile then; B's rows TNP_LDA apart too, as X's are
 * at such an E), alternated, eight times each; the first
 * of each warms up.  Packing wins when its fastest run takes under 95% of
 * the other's time per column (a tie keeps the in-place read: no copy).
 * Zen 4, one core, both at 2·NR columns: in place 90% of the peak, packed
 * 81% (float; double 87% and 77%).  Intel Xeon (family 6, model 167), one
 * core, at these widths: float 95-97 GFLOP/s in place, 127-130 packed;
 * double 49-52 and 59-61 (with both at 2·NR columns, as this probe was
 * before, double always chose in place and float either way from process
 * to process; the backward's tiles at B 4, S 1024, E 1024, float, ran at
 * 102-109 GFLOP/s in place against 135-141 packed 256 wide, and at B 8,
 * S 128, E 512 double 51-56 against 71-72).  10-20 ms, once a dtype. */
#define TNP_M 96
#define TNP_K 1024
#define TNP_LDA (4096 / (int64_t)sizeof(T))
static double SUF(tn_seconds)(const KT *kt, int at_pack, int64_t n, const T *A, const T *B,
                              T *C, T *scratch)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    SUF(gemm_nest)(kt, 0, 0, TNP_M, n, TNP_K, A, 1, TNP_LDA, B, TNP_LDA, NULL, C, n, 0,
                   scratch, at_pack);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

static int SUF(tn_probe)(const KT *kt)
{
    /* the widths in place and packed (the probe runs on a wide kernel only) */
    const int64_t n[2] = {MHA_TN_COLS(sizeof(T)),
                          MHA_TN_COLS_AT(mha_gemm_narrow(kt->nr, sizeof(T)))};
    const int64_t N = TNP_LDA; /* B's rows, TNP_LDA apart as X's at such an E */
    T *A = (T *)mha_alloc((size_t)(TNP_K * TNP_LDA) * sizeof(T));
    T *B = (T *)mha_alloc((size_t)(TNP_K * N) * sizeof(T));
    T *C = (T *)mha_alloc((size_t)(TNP_M * (n[0] > n[1] ? n[0] : n[1])) * sizeof(T));
    T *scratch = (T *)mha_alloc((size_t)MHA_GEMM_SCRATCH * sizeof(T));
    double best[2] = {1e30, 1e30};
    int64_t i, k;
    int rep, mode, packed = 0;
    if (A && B && C && scratch) {
        for (k = 0; k < TNP_K; k++) {
            for (i = 0; i < TNP_M; i++) A[k * TNP_LDA + i] = (T)((k * 7 + i) % 13) * (T)0.125;
            for (i = 0; i < N; i++) B[k * N + i] = (T)((k * 5 + i) % 11) * (T)0.25;
        }
        for (rep = 0; rep < 8; rep++)
            for (mode = 0; mode < 2; mode++) {
                const double t = SUF(tn_seconds)(kt, mode, n[mode], A, B, C, scratch) /
                                 (double)n[mode];
                if (rep > 0 && t < best[mode]) best[mode] = t;
            }
        packed = best[1] < 0.95 * best[0];
    }
    mha_free(A);
    mha_free(B);
    mha_free(C);
    mha_free(scratch);
    return packed;
}
#undef TNP_M
#undef TNP_K
#undef TNP_LDA

int SUF(mha_tn_pack)(const KT *kt)
{
    static atomic_int choice = -1; /* -1: not chosen yet */
    int v = atomic_load_explicit(&choice, memory_order_relaxed), expected = -1;
    const char *env;
    if (mha_gemm_narrow(kt->nr, sizeof(T))) return 1;
    if (v >= 0) return v;
    env = getenv("MHA_EXT_TN_PACK");
    if (env && (env[0] == '0' || env[0] == '1') && env[1] == '\0')
        v = env[0] - '0';
    else
        v = SUF(tn_probe)(kt);
    atomic_compare_exchange_strong(&choice, &expected, v);
    return atomic_load(&choice);
}

int SUF(mha_tn_packs)(const KT *kt, int64_t lda)
{
    if (mha_gemm_narrow(kt->nr, sizeof(T))) return 1;
    return mha_gemm_far_rows(kt->nr, lda, sizeof(T)) && SUF(mha_tn_pack)(kt);
}

/* internal.h's mha_tile_gemm: one tile of a product of the task list */
void SUF(mha_tile_gemm)(const KT *kt, const mha_product *pr, const mha_tile *tl, T *c,
                        int64_t ldc, int small, T *scratch)
{
    const T *A = (const T *)pr->A, *B = (const T *)pr->B, *bias = (const T *)pr->bias;
    const int nt = pr->kind == MHA_NT;
    /* on the AMX tiles where the table has them (float; 1: too little
     * scratch, the float kernels below then) */
    if (kt->amx_gemm && pr->K > 0 && !(nt && small)) {
        const int tn = pr->kind == MHA_TN;
        if (kt->amx_gemm(nt, tl->m, tl->n, pr->K, tn ? A + tl->i0 : A + tl->i0 * pr->lda,
                         tn ? 1 : pr->lda, tn ? pr->lda : 1,
                         B + (nt ? tl->n0 * pr->ldb : tl->n0), pr->ldb,
                         bias ? bias + tl->n0 : NULL, c, ldc, 0, scratch,
                         (size_t)MHA_GEMM_SCRATCH * sizeof(T)) == 0)
            return;
    }
    if (pr->kind == MHA_TN)
        SUF(mha_gemm_tn)(kt, tl->m, tl->n, pr->K, A + tl->i0, pr->lda, B + tl->n0, pr->ldb, c,
                         ldc, 0, scratch);
    else if (nt && small)
        SUF(mha_gemm_small)(kt, tl->m, tl->n, pr->K, A + tl->i0 * pr->lda, pr->lda,
                            B + tl->n0 * pr->ldb, pr->ldb, bias ? bias + tl->n0 : NULL, c, ldc,
                            0);
    else
        SUF(gemm_nest)(kt, nt, pr->pack_b, tl->m, tl->n, pr->K, A + tl->i0 * pr->lda, pr->lda, 1,
                       B + (nt ? tl->n0 * pr->ldb : tl->n0), pr->ldb, bias ? bias + tl->n0 : NULL,
                       c, ldc, 0, scratch, 0);
}
