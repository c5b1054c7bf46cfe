/* bwd_tasks_impl.h: the backward's product tiles (prod_add, prod_task) and
 * column sums (btr_add, btr_task, colsum), and phase 4's task over both
 * (grad_task), written once for T = float and T = double; included by
 * backward_impl.h after its SUF(bwd) struct and its tile sizes (RM, RM_S,
 * RN_S, RM_TN, RN_TN, RN_TN_AT(kt), TC). */

/* ------------------------------------------------------------ products */

/* a product into the pass's list: TN in RM_TN x RN_TN tiles (RN_TN_AT(kt)
 * where Aᵀ is packed, halved while the four weight gradients would give
 * fewer tiles than threads); NT and NN in
 * tiles of RM rows by the packed block's columns, op(B) packed (NN too: at
 * B 4, S 1024, E 1024 a training step 3% faster than 96 x 64 tiles reading
 * W in place), when that gives every thread 4 tiles; else (medium and
 * smaller) RM_S x RN_S tiles reading B in place, whose rows of A stay in
 * L2 across the column tiles.  But where the kernel would pack an NN
 * product's B anyway (mha_gemm_far_rows: rows a multiple of 2 KiB apart on
 * a narrow kernel, W at E 512, 1024, ...; of 4 KiB on a wide one, W at
 * E 1024 float or 512 double), each small tile would pack its own
 * (K, 64) block of W again: there two tiles per thread are enough (Zen 3,
 * training step at B 8, S 128, E 512: the input gradients 5% faster).  On
 * the AMX tiles (float, ISA amx) mha_amx_tiles' tiles instead */
static void SUF(prod_add)(SUF(bwd) *f, int kind, const T *A, int64_t lda, const T *B,
                          int64_t ldb, const T *bias, T *C, int64_t ldc,
                          int64_t M, int64_t N, int64_t K)
{
    const int64_t nc = mha_gemm_nc(sizeof(T)), rows = (M + RM - 1) / RM;
    const int slots = mha_get_num_threads();
    if (f->kern->amx_gemm) { /* on the AMX tiles: mha_amx_tiles' */
        int64_t rm, rn;
        mha_amx_tiles(M, N, nc, slots, &rm, &rn);
        mha_products_add(&f->prods, kind, A, lda, B, ldb, bias, C, ldc, M, N, K, rm, rn);
    }
    else if (kind == MHA_TN) { /* where Aᵀ is packed (mha_tn_packs): wider tiles share it */
        const int64_t rows_tn = (M + RM_TN - 1) / RM_TN;
        int64_t rn = SUF(mha_tn_packs)(f->kern, lda) ? RN_TN_AT(f->kern) : RN_TN;
        while (rn > RN_TN && 4 * rows_tn * ((N + rn - 1) / rn) < (int64_t)slots) rn /= 2;
        mha_products_add(&f->prods, kind, A, lda, B, ldb, bias, C, ldc, M, N, K, RM_TN, rn);
    }
    else if (mha_tiles_enough(rows, N, nc, slots) ||
             (kind == MHA_NN && mha_gemm_far_rows(f->kern->nr, ldb, sizeof(T)) &&
              rows * ((N + nc - 1) / nc) >= 2 * (int64_t)slots))
        mha_products_add(&f->prods, kind, A, lda, B, ldb, bias, C, ldc, M, N, K, RM, nc)
            ->pack_b = 1;
    else
        mha_products_add(&f->prods, kind, A, lda, B, ldb, bias, C, ldc, M, N, K, RM_S, RN_S);
}

/* One tile of a product, through the forward's packed GEMM (gemm.c), which
 * packs B's panels (transposed for NT) into the slot's scratch. */
static void SUF(prod_task)(void *vf, int64_t t, int slot)
{
    const SUF(bwd) *f = (const SUF(bwd) *)vf;
    const mha_tile tl = mha_products_tile(&f->prods, t);
    const mha_product *pr = &f->prods.p[tl.j];
    SUF(mha_tile_gemm)(f->kern, pr, &tl, (T *)pr->C + tl.i0 * pr->ldc + tl.n0, pr->ldc, 0,
                       f->pack + (int64_t)slot * MHA_GEMM_SCRATCH);
}

/* ------------------------------------------------------------ column sums */

/* out[c] = Σ_r x[r*ld + c] for c < C, rows in order, summed in double
 * (float32's too: a float sum over B·S rows had 12-100x torch's error at
 * 1k-131k rows) */
static void SUF(colsum)(const T *x, int64_t R, int64_t C, int64_t ld, T *out)
{
    double sum[TC];
    int64_t r, c, c0, nc;
    for (c0 = 0; c0 < C; c0 += TC) {
        nc = C - c0 < TC ? C - c0 : TC;
        for (c = 0; c < nc; c++) sum[c] = 0;
        for (r = 0; r < R; r++)
            for (c = 0; c < nc; c++) sum[c] += x[r * ld + c0 + c];
        for (c = 0; c < nc; c++) out[c0 + c] = (T)sum[c];
    }
}

static void SUF(btr_add)(SUF(bwd) *f, const T *x, T *colsum, int64_t R, int64_t C)
{
    SUF(btr) *tr = &f->tr[f->n_tr++];
    tr->x = x; tr->colsum = colsum;
    tr->R = R; tr->C = C;
    tr->tasks = (C + TC - 1) / TC;
}

static void SUF(btr_task)(void *vf, int64_t t, int slot)
{
    const SUF(bwd) *f = (const SUF(bwd) *)vf;
    int j = 0;
    (void)slot;
    while (t >= f->tr[j].tasks) t -= f->tr[j++].tasks;
    const SUF(btr) *tr = &f->tr[j];
    const int64_t c0 = t * TC, nc = tr->C - c0 < TC ? tr->C - c0 : TC;
    SUF(colsum)(tr->x + c0, tr->R, nc, tr->C, tr->colsum + c0);
}

/* phase 4's tasks: the tiles of the products, then the column sums */
static void SUF(grad_task)(void *vf, int64_t t, int slot)
{
    const SUF(bwd) *f = (const SUF(bwd) *)vf;
    if (t < f->prods.tiles)
        SUF(prod_task)(vf, t, slot);
    else
        SUF(btr_task)(vf, t - f->prods.tiles, slot);
}
