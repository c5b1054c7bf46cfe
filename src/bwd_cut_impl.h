/* bwd_cut_impl.h: the room a slot of the backward's attention task needs
 * (bwd_scratch_len; bwd_keep_len, its replayed dropout mask) and, on the AMX
 * tiles (float, ISA amx), the task's K and V cut once for all its blocks of
 * queries (bwd_cut_sizes, bwd_cut_len) and its products from those pieces
 * (bwd_gemm), written once for T = float and T = double; included by
 * backward_impl.h after its SUF(bwd) struct and QB, before the task
 * (attend_backward_task) that runs them; sdpa_backward_impl.h sizes its
 * slots with bwd_scratch_len and bwd_keep_len too. */

/* On the AMX tiles (float, amx) the task accumulates dK_bhᵀ and dV_bhᵀ
 * (D, Sk) rather than dK_bh and dV_bh: dVᵀ += dctxᵀ·A and dKᵀ += Qᵀ·dS
 * read A and dS, (QB, Sk), as the tiles' B, cut as they lie, where
 * dV += Aᵀ·dctx transposed all of A first (the small dctxᵀ and Qᵀ are
 * transposed instead), and one transpose each at the end.  And where a
 * head has more than one block of queries, its K and V are cut once for
 * them all (amx_cut): Kᵀ (Dk deep, Sk columns: S recomputed), V (Sk deep,
 * Dv: the context recomputed), Vᵀ (Dv deep, Sk: dA) and K (Sk deep, Dk:
 * dQ), each block's product then reading them rather than cutting its B
 * again.  Intel Xeon (family 6, model 167), two threads, builds
 * alternated process by process, a training step at B 4, S 1024, E 1024:
 * the pieces 462-489 -> 438-471 ms.  bwd_cut_sizes: the uint32 of each */
static void SUF(bwd_cut_sizes)(const SUF(bwd) *f, int64_t n[4])
{
    n[0] = (f->Sk + 31) / 32 * MHA_AMX_GROUP(f->Dk);
    n[1] = (f->Dv + 31) / 32 * MHA_AMX_GROUP(f->Sk);
    n[2] = (f->Sk + 31) / 32 * MHA_AMX_GROUP(f->Dv);
    n[3] = (f->Dk + 31) / 32 * MHA_AMX_GROUP(f->Sk);
}

/* scalars of a slot's room for dK_bhᵀ (Dk, Sk), dV_bhᵀ (Dv, Sk) and the
 * pieces (0: not on the tiles); nonzero on overflow */
static int SUF(bwd_cut_len)(const SUF(bwd) *f, int64_t *len)
{
    int64_t n[4], t = 0, i;
    *len = 0;
    if (!f->kern->amx_cut || f->Sk == 0 || f->Dk == 0 || f->Dv == 0) return 0;
    if (f->Sk > ((int64_t)1 << 40) || f->Dk > ((int64_t)1 << 20) || f->Dv > ((int64_t)1 << 20))
        return 0; /* past any memory: the float kernels' layout, which checks its own sizes */
    if (f->Sq > QB) {
        SUF(bwd_cut_sizes)(f, n);
        for (i = 0; i < 4; i++)
            if (mha_add(t, n[i], &t)) return 1;
    }
    return mha_mul(t, 4, &t) || mha_add(t, 64 + (int64_t)sizeof(T) - 1, &t) ||
           mha_add(t / (int64_t)sizeof(T), f->Sk * (f->Dk + f->Dv), len);
}

/* C (M, N) (+)= A·B: from B's pieces cut for the task (bp + off, groups
 * gsz uint32 apart; bwd_cut_len) on the AMX tiles, else mha_gemm (the
 * same bits either way).  The callers pass bp only at a column or depth
 * offset that is a multiple of 32: the product reads its depth rounded up
 * to 32, which then stays inside the cut (Sk rounded up to 32) */
static void SUF(bwd_gemm)(const SUF(bwd) *f, const uint32_t *bp, int64_t gsz, int64_t off,
                          int64_t M, int64_t N, int64_t K, const T *A, int64_t lda, const T *B,
                          int64_t ldb, T *C, int64_t ldc, int accumulate, T *gs)
{
    if (bp && f->kern->amx_gemm_cut(M, N, K, A, lda, bp + off, gsz, gsz / 3, B, ldb, C, ldc,
                                    accumulate, gs, (size_t)MHA_GEMM_SCRATCH * sizeof(T)) == 0)
        return;
    SUF(mha_gemm)(f->kern, 0, M, N, K, A, lda, B, ldb, NULL, C, ldc, accumulate, gs);
}

/* bytes of a slot's dropout mask: (QB, Sk) */
static int64_t SUF(bwd_keep_len)(const SUF(bwd) *f) { return QB * f->Sk; }

/* scalars per slot of the attention task's scratch: P, D (QB, Sk), dQ_bh's
 * block (QB, Dk), dK_bh (Sk, Dk) and dV_bh (Sk, Dv), V_bhᵀ (Dv, Sk) and K_bh
 * transposed (Sk, Dk); on the tiles then bwd_cut_len's; nonzero on
 * overflow */
static int SUF(bwd_scratch_len)(SUF(bwd) *f)
{
    int64_t cut;
    return mha_mul(2 * QB + 2 * (f->Dk + f->Dv), f->Sk, &f->scratch_len) ||
           mha_add(f->scratch_len, QB * f->Dk, &f->scratch_len) ||
           SUF(bwd_cut_len)(f, &cut) || mha_add(f->scratch_len, cut, &f->scratch_len);
}
