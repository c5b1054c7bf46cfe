/* amx_cut_impl.h: B cut once into the AMX tiles' pieces for many products
 * (kernels.h's amx_cut: amx_cut_f32) and a product from such pieces
 * (amx_gemm_cut: amx_gemm_cut_f32), the backward's K and V of a head cut
 * once and read by each block of its queries (bwd_cut_impl.h); included by
 * kern_avx512.c right after amx_impl.h, under the same compiler guard, for
 * its pieces (amx_cut_cols, amx_cut_a), chains (amx_run_block, AMX_CHAIN),
 * float FMA rows (amx_fix_row), AMX_KC, AMX_UNCUT, AATTR and g_amx_cfg. */

/* kernels.h's amx_cut for float: B (K, N) depth-major, cut into the
 * tiles' pieces for every product that reads it (the backward's K and V
 * of a head, read by each block of its queries): column group g of 32 at
 * dst + g*MHA_AMX_GROUP(K), its three pieces MHA_AMX_GROUP(K)/3 apart,
 * each as amx_gemm_f32 cuts a group (amx_cut_cols), zero past K and past
 * N.  1 when B holds a float amx_split cannot carry. */
AATTR static int amx_cut_f32(int64_t K, int64_t N, const void *Bv, int64_t ldb, void *dst)
{
    const float *B = (const float *)Bv;
    const int64_t kp = (K + 31) / 32 * 32, gsz = MHA_AMX_GROUP(K), psz = gsz / 3;
    uint32_t bad = 0;
    int64_t g;
    for (g = 0; g < (N + 31) / 32; g++) {
        uint32_t *d = (uint32_t *)dst + g * gsz;
        bad |= amx_cut_cols(B + 32 * g, ldb, K, kp, N - 32 * g < 32 ? N - 32 * g : 32, d,
                            d + psz, d + 2 * psz);
    }
    return bad != 0;
}

/* kernels.h's amx_gemm_cut for float: C (M, N) (+)= A·B with B's pieces
 * cut before (amx_cut_f32), the same chains in the same order as
 * amx_gemm_f32 (depth blocks of AMX_KC, each added to C chain by chain),
 * so the same bits.  A's rows 32 at a time, each depth block of them cut
 * once for all the columns; its rows holding a float amx_split cannot
 * carry are computed again by float FMAs (amx_fix_row), or with
 * accumulate (C as it was is gone by then) the product is left to the
 * caller, 1, as amx_gemm_f32 leaves it. */
AATTR static int amx_gemm_cut_f32(int64_t M, int64_t N, int64_t K, const void *Av, int64_t lda,
                                  const void *bpv, int64_t gs, int64_t ps, const void *Bv,
                                  int64_t ldb, void *Cv, int64_t ldc, int accumulate,
                                  void *scratch, size_t scratch_bytes)
{
    const float *A = (const float *)Av, *B = (const float *)Bv;
    const uint32_t *bp = (const uint32_t *)bpv;
    float *C = (float *)Cv;
    uint8_t *s = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t *ap = (uint16_t *)s;                /* 3 x 32 x AMX_KC */
    float *cb = (float *)(ap + 3 * 32 * AMX_KC); /* 32 x 32 */
    int64_t ib, pc, g, q, k0;
    int bad = 0;
    if (M <= 0 || N <= 0 || K <= 0 || scratch_bytes < (size_t)MHA_AMX_SCRATCH) return 1;
    if (accumulate && amx_uncut_any(A, M, K, lda)) return 1;
    _tile_loadconfig(&g_amx_cfg);
    for (ib = 0; ib < M; ib += 32) {
        const int64_t mb = M - ib < 32 ? M - ib : 32;
        for (pc = 0; pc < K; pc += AMX_KC) {
            const int64_t kc = K - pc < AMX_KC ? K - pc : AMX_KC, kcp = (kc + 31) / 32 * 32;
            const uint16_t *pa[3] = {ap, ap + 32 * kcp, ap + 64 * kcp};
            bad |= amx_cut_a(A + ib * lda + pc, lda, mb, kc, kcp, ap);
            for (k0 = 0; k0 < kcp; k0 += AMX_CHAIN) /* as amx_gemm_f32: A's chain in L1 */
                for (g = 0; g < (N + 31) / 32; g++) {
                    const uint32_t *b0 = bp + g * gs + pc / 2 * 32;
                    const uint32_t *pb[3] = {b0, b0 + ps, b0 + 2 * ps};
                    amx_run_block(pc == 0 && !accumulate, mb, N - 32 * g < 32 ? N - 32 * g : 32,
                                  C + ib * ldc + 32 * g, ldc, cb, kcp, pa, pb, k0);
                }
        }
    }
    _tile_release();
    if (bad)
        for (q = 0; q < M; q++) {
            int64_t k;
            for (k = 0; k < K && fabsf(A[q * lda + k]) < AMX_UNCUT; k++) {}
            if (k < K) amx_fix_row(0, N, K, A + q * lda, 1, B, ldb, NULL, C + q * ldc);
        }
    return 0;
}
