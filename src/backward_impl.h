/* backward_impl.h: the gradients of the forward pass (forward_impl.h), written
 * once for T = float and T = double (included twice by backward.c with T, SUF,
 * KT and EXP defined, after softmax_impl.h: the forward's softmax row).  Legend as in mha.h; dX is dL/dX.
 *
 * The forward, line by line, and the lines of the backward that undo it:
 *
 *   forward                         backward
 *   Q = query·W_qᵀ + b_q            d query = dQ·W_q   dW_q = dQᵀ·query   db_q = Σ_rows dQ
 *   K = key·W_kᵀ + b_k              d key   = dK·W_k   dW_k = dKᵀ·key     db_k = Σ_rows dK
 *   V = value·W_vᵀ + b_v            d value = dV·W_v   dW_v = dVᵀ·value   db_v = Σ_rows dV
 *   per (b, h):
 *     S = Q_bh·K_bhᵀ / sqrt(Dk)     dQ_bh = dS·K_bh / sqrt(Dk)   dK_bh = dSᵀ·Q_bh / sqrt(Dk)
 *     S = masked(S)                 (masks are constants: dS passes where S was finite)
 *     P = softmax(S)                dS_j = P_j (dP_j - Σ_k P_k dP_k)
 *     A = dropout(P)                dP = dA · keep / (1 - p)   (keep replayed, not stored)
 *     ctx_bh = A·V_bh               dA = dctx_bh·V_bhᵀ (+ d weights)   dV_bh = Aᵀ·dctx_bh
 *   out = ctx·W_oᵀ + b_o            dctx = d out·W_o   dW_o = d outᵀ·ctx   db_o = Σ_rows d out
 *
 * Phases, each one parallel pass on the pool:
 *   1. recompute Q, K, V (the forward's projections) and dctx = d out·W_o
 *      (only dctx when mha_forward_save kept Q, K, V and ctx);
 *   2. per (b, h): recompute S and P (unless mha_forward_save kept P), A
 *      (and ctx_bh, unless kept) block by block of queries, and write dQ_bh,
 *      dK_bh, dV_bh and their column sums.  Q, K, V are read in the
 *      forward's per-head layouts when kept (K transposed), else as columns
 *      of (B, S, E); the products with K_bhᵀ or V_bhᵀ pack them (no
 *      transposed copies);
 *   3. (in phase 4's pass) the bias gradients: the column sums of d out, and
 *      the batches' sums of phase 2's;
 *   4. the weight gradients (dW = dYᵀ·X: mha_gemm_tn packs dYᵀ's panels, no
 *      transposed copy) and the input gradients, all tiles of all seven
 *      products in one pass. */

#define QB 128  /* queries per block inside one (b, h) task */
#define RM 96  /* rows per product tile */
#define RN 64   /* columns per product tile */
#define RN_TN 1024 /* ... for TN: each MR-row panel of Aᵀ serves the whole tile */
#define TC 64   /* columns per column-sum task */

/* colsum (C) = Σ_rows x for x (R, C), rows in order */
typedef struct {
    const T *x;
    T *colsum;
    int64_t R, C, tasks;
} SUF(btr);

typedef struct {
    const mha_backward_args *a;
    const mha_forward_args *fa;
    int64_t B, Sq, Sk, E, H, Dk;
    T *q, *k, *v;         /* recomputed: Q (B, Sq, E), K and V (B, Sk, E); kept
                             (saved): Q (B, H, Sq, Dk), K (B, H, Dk, Sk), V (B, H, Sk, Dk) */
    T *ctx, *dctx;        /* (B, Sq, E) */
    int saved;            /* q, k, v, ctx are mha_forward_save's: never written */
    const T *p_saved;     /* NULL, or mha_forward_save's P (B, H, Sq, Sk) */
    T *dq, *dk, *dv;      /* dQ (B, Sq, E), dK and dV (B, Sk, E) */
    T *bsum;              /* (3, B, E): Σ over each batch's rows of dQ, dK, dV */
    T *scratch;           /* per slot: P, D (QB, Sk), then dQ_bh's block (QB, Dk),
                             dK_bh and dV_bh (Sk, Dk) */
    T *pack;              /* per slot: MHA_GEMM_SCRATCH scalars for mha_gemm's packing */
    const KT *kern;       /* the kernels of the ISA in use */
    int64_t scratch_len;  /* scalars per slot */
    uint8_t *keep;        /* per slot: the replayed dropout mask (QB, Sk) */
    int64_t keep_len;     /* bytes per slot */
    T scale;              /* 1 / sqrt(Dk) */
    T drop_scale;         /* 1 / (1 - p) */
    uint64_t drop_key;
    int dropout_on;
    mha_products prods;   /* a pass's products (internal.h's task list) */
    SUF(btr) tr[4];
    int n_tr;
} SUF(bwd);

/* ------------------------------------------------------------ products */

/* a product into the pass's list: RM x RN tiles (TN: RM x RN_TN) */
static void SUF(prod_add)(SUF(bwd) *f, int kind, const T *A, int64_t lda, const T *B,
                          int64_t ldb, const T *bias, T *C, int64_t ldc,
                          int64_t M, int64_t N, int64_t K)
{
    mha_products_add(&f->prods, kind, A, lda, B, ldb, bias, C, ldc, M, N, K, RM,
                     kind == MHA_TN ? RN_TN : RN);
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
    int64_t r, c;
    T sum[TC];
    (void)slot;
    while (t >= f->tr[j].tasks) t -= f->tr[j++].tasks;
    const SUF(btr) *tr = &f->tr[j];
    int64_t c0 = t * TC, nc = tr->C - c0 < TC ? tr->C - c0 : TC;
    for (c = 0; c < nc; c++) sum[c] = 0;
    for (r = 0; r < tr->R; r++) {
        const T *x_r = tr->x + r * tr->C + c0;
        for (c = 0; c < nc; c++) sum[c] += x_r[c];
    }
    for (c = 0; c < nc; c++) tr->colsum[c0 + c] = sum[c];
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

/* out[c] = Σ_r x[r*ld + c] for c < C, rows in order */
static void SUF(colsum)(const T *x, int64_t R, int64_t C, int64_t ld, T *out)
{
    int64_t r, c;
    for (c = 0; c < C; c++) out[c] = 0;
    for (r = 0; r < R; r++)
        for (c = 0; c < C; c++) out[c] += x[r * ld + c];
}

/* ------------------------------------------------------------ attention */

/* One (b, h): the forward of the attention recomputed block by block of
 * queries, each step followed by its backward. */
static void SUF(attend_backward_task)(void *vf, int64_t bh, int slot)
{
    const SUF(bwd) *f = (const SUF(bwd) *)vf;
    const mha_forward_args *fa = f->fa;
    const int64_t b = bh / f->H, h = bh % f->H;
    const int64_t E = f->E, Sq = f->Sq, Sk = f->Sk, Dk = f->Dk;
    int64_t i0, r, j;
    /* Q_bh and V_bh: per head (kept by the forward) or columns of (B, S, E)
     * (recomputed); K_bh: transposed per head (Dk, Sk) or columns of K */
    const int hm = f->saved;
    const int64_t ldq = hm ? Dk : E; /* of Q_bh and V_bh */
    const T *q_bh = hm ? f->q + bh * Sq * Dk : f->q + b * Sq * E + h * Dk; /* (Sq, Dk) */
    const T *k_bh = hm ? f->k + bh * Dk * Sk : f->k + b * Sk * E + h * Dk; /* see above */
    const T *v_bh = hm ? f->v + bh * Sk * Dk : f->v + b * Sk * E + h * Dk; /* (Sk, Dk) */
    const T *dc_bh = f->dctx + b * Sq * E + h * Dk; /* (Sq, Dk), ld E */
    T *c_bh = f->ctx + b * Sq * E + h * Dk;         /* (Sq, Dk), ld E */
    T *dq_bh = f->dq + b * Sq * E + h * Dk;         /* (Sq, Dk), ld E */
    T *dk_bh = f->dk + b * Sk * E + h * Dk;         /* (Sk, Dk), ld E */
    T *dv_bh = f->dv + b * Sk * E + h * Dk;         /* (Sk, Dk), ld E */
    const T *gw_bh = f->a->grad_weights ? (const T *)f->a->grad_weights + bh * Sq * Sk : NULL;
    T *p = f->scratch + (int64_t)slot * f->scratch_len; /* (QB, Sk) P, when recomputed */
    T *d = p + QB * Sk;                                 /* (QB, Sk) A, then dA, dP, dS */
    /* then (QB, Dk) dQ_bh's block, (Sk, Dk) dK_bh and dV_bh: see below */
    uint8_t *keep = f->keep + (int64_t)slot * f->keep_len; /* (QB, Sk) */
    T *gs = f->pack + (int64_t)slot * MHA_GEMM_SCRATCH;  /* mha_gemm's packing */
    /* the products write dQ_bh, dK_bh, dV_bh here, contiguous, and the task
     * copies them out into the (B, S, E) rows: a product's output tiles
     * then stay in cache instead of missing on E-strided lines */
    T *dqs = d + QB * Sk, *dks = dqs + QB * Dk, *dvs = dks + Sk * Dk;

    if (Sk == 0) { /* no key at all: the context is an empty sum, nothing to differentiate */
        for (r = 0; r < Sq; r++)
            for (j = 0; j < Dk; j++) {
                if (!f->saved) c_bh[r * E + j] = 0;
                dq_bh[r * E + j] = 0;
            }
        SUF(colsum)(dq_bh, Sq, Dk, E, f->bsum + b * E + h * Dk);
        SUF(colsum)(dk_bh, 0, Dk, E, f->bsum + (f->B + b) * E + h * Dk); /* empty sums: 0 */
        SUF(colsum)(dv_bh, 0, Dk, E, f->bsum + (2 * f->B + b) * E + h * Dk);
        return;
    }
    for (i0 = 0; i0 < Sq; i0 += QB) {
        const int64_t nq = Sq - i0 < QB ? Sq - i0 : QB;
        const int first = i0 == 0;
        /* P of this block: the forward's, or recomputed into p */
        const T *pb = f->p_saved ? f->p_saved + (bh * Sq + i0) * Sk : p;
        const T *a_blk = pb; /* A: P itself without dropout */

        /* forward: S = Q_bh·K_bhᵀ / sqrt(Dk); S = masked(S); P = softmax(S) */
        if (!f->p_saved)
            SUF(mha_gemm)(f->kern, !hm, nq, Sk, Dk, q_bh + i0 * ldq, ldq, k_bh, hm ? Sk : E, NULL,
                          p, Sk, 0, gs);
        for (r = 0; r < nq && !f->p_saved; r++) /* the forward's row: the same P */
            SUF(softmax_row)(f->kern, fa, f->scale, p + r * Sk, b, h, i0 + r, Sk, Sk);
        /* forward: A = dropout(P), keep replayed from the call's stream */
        if (f->dropout_on) {
            for (r = 0; r < nq; r++) {
                const uint64_t idx = ((uint64_t)bh * (uint64_t)Sq + (uint64_t)(i0 + r)) *
                                     (uint64_t)Sk;
                for (j = 0; j < Sk; j++) {
                    keep[r * Sk + j] =
                        (uint8_t)mha_dropout_keep(f->drop_key, idx + (uint64_t)j, fa->dropout);
                    d[r * Sk + j] = keep[r * Sk + j] ? pb[r * Sk + j] * f->drop_scale : (T)0;
                }
            }
            a_blk = d;
        }
        /* forward: ctx_bh = A·V_bh (for dW_o = d outᵀ·ctx), unless kept */
        if (!f->saved)
            SUF(mha_gemm)(f->kern, 0, nq, Dk, Sk, a_blk, Sk, v_bh, ldq, NULL, c_bh + i0 * E, E, 0,
                          gs);
        /* backward of ctx_bh = A·V_bh: dV_bh += Aᵀ·dctx_bh */
        SUF(mha_gemm_tn)(f->kern, Sk, Dk, nq, a_blk, Sk, dc_bh + i0 * E, E, dvs, Dk, !first, gs);
        /* ... and dA = dctx_bh·V_bhᵀ, plus the gradient of the returned weights */
        SUF(mha_gemm)(f->kern, 1, nq, Sk, Dk, dc_bh + i0 * E, E, v_bh, ldq, NULL, d, Sk, 0, gs);
        if (gw_bh)
            for (r = 0; r < nq; r++)
                for (j = 0; j < Sk; j++) d[r * Sk + j] += gw_bh[(i0 + r) * Sk + j];
        for (r = 0; r < nq; r++) {
            T *d_r = d + r * Sk;
            /* backward of A = dropout(P): dP = dA · keep / (1 - p) */
            if (f->dropout_on)
                for (j = 0; j < Sk; j++)
                    d_r[j] = keep[r * Sk + j] ? d_r[j] * f->drop_scale : (T)0;
            /* backward of P = softmax(S): dS_j = P_j (dP_j - Σ_k P_k dP_k),
             * and of S = .../sqrt(Dk): the scale folded in */
            f->kern->softmax_grad(pb + r * Sk, d_r, Sk, f->scale);
        }
        /* backward of S = Q_bh·K_bhᵀ: dQ_bh = dS·K_bh, dK_bh += dSᵀ·Q_bh */
        SUF(mha_gemm)(f->kern, hm, nq, Dk, Sk, d, Sk, k_bh, hm ? Sk : E, NULL, dqs, Dk, 0, gs);
        SUF(mha_gemm_tn)(f->kern, Sk, Dk, nq, d, Sk, q_bh + i0 * ldq, ldq, dks, Dk, !first, gs);
        for (r = 0; r < nq; r++) memcpy(dq_bh + (i0 + r) * E, dqs + r * Dk, (size_t)Dk * sizeof(T));
    }
    for (r = 0; r < Sk; r++) {
        memcpy(dk_bh + r * E, dks + r * Dk, (size_t)Dk * sizeof(T));
        memcpy(dv_bh + r * E, dvs + r * Dk, (size_t)Dk * sizeof(T));
    }
    /* this head's share of the bias gradients (db = Σ_rows dY), summed while
     * dQ_bh, dK_bh, dV_bh are still in cache; phase 4 adds the batches */
    SUF(colsum)(dq_bh, Sq, Dk, E, f->bsum + b * E + h * Dk);
    SUF(colsum)(dks, Sk, Dk, Dk, f->bsum + (f->B + b) * E + h * Dk);
    SUF(colsum)(dvs, Sk, Dk, Dk, f->bsum + (2 * f->B + b) * E + h * Dk);
}

/* ------------------------------------------------------------ the pass */

/* sv: NULL, or Q, K, V and ctx as mha_forward_save kept them */
static mha_status SUF(backward)(const mha_config *cfg, const mha_params *p,
                                const mha_backward_args *a, const mha_saved *sv)
{
    mha_sizes sz;
    mha_forward_args chk;
    SUF(bwd) f;
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM], total;
    int64_t n_q, n_kv, n_work, t, Rq, Rk, Ek, Ev;
    size_t bytes;
    int slots;
    T *work = NULL, *g = NULL;
    mha_status st;
    mha_poll_state ps;

    if (!a) return MHA_ERR_ARG;
    /* the forward's checks; out is not used, grad_out has its shape */
    chk = a->fwd;
    chk.out = (void *)a->grad_out;
    chk.weights = NULL;
    st = mha_check_forward(cfg, p, &chk, &sz);
    if (st != MHA_OK) return st;
    st = mha_param_layout(cfg, offset, size, &total);
    if (st != MHA_OK) return st;
    g = (T *)a->grad_params;
    Ek = cfg->kdim;
    Ev = cfg->vdim;

    if (sz.n_out == 0) { /* B == 0 or Sq == 0: nothing reaches the loss */
        if (a->grad_key && mha_bytes(sz.n_key, sizeof(T), &bytes) == 0)
            memset(a->grad_key, 0, bytes);
        if (a->grad_value && mha_bytes(sz.n_value, sizeof(T), &bytes) == 0)
            memset(a->grad_value, 0, bytes);
        if (g && mha_bytes(total, sizeof(T), &bytes) == 0) memset(g, 0, bytes);
        return MHA_OK;
    }

    memset(&f, 0, sizeof f);
    f.a = a;
    f.fa = &a->fwd;
    f.B = a->fwd.B; f.Sq = a->fwd.Sq; f.Sk = a->fwd.Sk;
    f.E = cfg->d_model; f.H = cfg->n_heads; f.Dk = f.E / f.H;
    f.scale = (T)(1.0 / sqrt((double)f.Dk));
    f.kern = SUF(mha_kern_get)();
    f.dropout_on = a->fwd.dropout > 0.0;
    f.drop_scale = a->fwd.dropout < 1.0 ? (T)(1.0 / (1.0 - a->fwd.dropout)) : (T)0;
    f.drop_key = mha_stream_key(a->fwd.seed, a->fwd.counter);
    Rq = f.B * f.Sq; /* rows of query-side matrices; n_out = Rq * E fits */
    Rk = f.B * f.Sk; /* rows of key-side matrices;   n_key = Rk * Ek fits */
    n_q = sz.n_out;
    if (mha_mul(Rk, f.E, &n_kv)) return MHA_ERR_OVERFLOW;

    slots = mha_get_num_threads();
    {
        double flops = 2.0 * (double)Rq * (double)f.E * (double)f.E * 6.0 +
                       2.0 * (double)Rk * (double)f.E * (double)(Ek + Ev) * 3.0 +
                       10.0 * (double)Rq * (double)f.Sk * (double)f.E;
        if (flops < 4e5) slots = 1;
    }

    /* workspace: dctx, dq (B, Sq, E); dk, dv (B, Sk, E); bsum (3, B, E);
     * without sv also q, ctx (B, Sq, E), k and v (B, Sk, E); then per slot
     * P, D (QB, Sk), dQ_bh's block (QB, Dk), dK_bh and dV_bh (Sk, Dk), and
     * mha_gemm's packing */
    if (mha_mul(2 * QB + 2 * f.Dk, f.Sk, &f.scratch_len) ||
        mha_add(f.scratch_len, QB * f.Dk, &f.scratch_len) ||
        mha_mul(n_q, sv ? 2 : 4, &n_work) || mha_mul(n_kv, sv ? 2 : 4, &t) ||
        mha_add(n_work, t, &n_work) || mha_mul(f.B * f.E, 3, &t) || mha_add(n_work, t, &n_work) ||
        mha_mul(f.scratch_len, slots, &t) || mha_add(n_work, t, &n_work) ||
        mha_mul(MHA_GEMM_SCRATCH, slots, &t) || mha_add(n_work, t, &n_work) ||
        mha_bytes(n_work, sizeof(T), &bytes))
        return MHA_ERR_OVERFLOW;
    f.keep_len = f.dropout_on ? QB * f.Sk : 0;
    {
        int64_t keep_total;
        if (mha_mul(f.keep_len, slots, &keep_total)) return MHA_ERR_OVERFLOW;
        work = (T *)mha_work_alloc(bytes);
        f.keep = (uint8_t *)mha_alloc((size_t)keep_total);
        if (!work || !f.keep) {
            mha_work_free(work);
            mha_free(f.keep);
            return MHA_ERR_NOMEM;
        }
    }
    f.dctx = work;
    f.dq = f.dctx + n_q;
    f.dk = f.dq + n_q;
    f.dv = f.dk + n_kv;
    f.bsum = f.dv + n_kv;
    f.scratch = f.bsum + 3 * f.B * f.E;
    if (sv) { /* read only */
        f.saved = 1;
        f.p_saved = (const T *)sv->p;
        f.q = (T *)sv->q;
        f.ctx = (T *)sv->ctx;
        f.k = (T *)sv->k;
        f.v = (T *)sv->v;
    } else {
        f.q = f.scratch;
        f.ctx = f.q + n_q;
        f.k = f.ctx + n_q;
        f.v = f.k + n_kv;
        f.scratch = f.v + n_kv;
    }
    f.pack = f.scratch + f.scratch_len * slots;
    mha_poll_start(&ps, a->fwd.poll, a->fwd.poll_ctx);
    MHA_TICK_START;

    /* 1. the forward's projections, and dctx = d out·W_o
     *    (backward of out = ctx·W_oᵀ + b_o, for ctx) */
    if (!f.saved) {
        SUF(prod_add)(&f, MHA_NT, (const T *)a->fwd.query, f.E, (const T *)p->wq, f.E,
                      (const T *)p->bq, f.q, f.E, Rq, f.E, f.E);
        SUF(prod_add)(&f, MHA_NT, (const T *)a->fwd.key, Ek, (const T *)p->wk, Ek,
                      (const T *)p->bk, f.k, f.E, Rk, f.E, Ek);
        SUF(prod_add)(&f, MHA_NT, (const T *)a->fwd.value, Ev, (const T *)p->wv, Ev,
                      (const T *)p->bv, f.v, f.E, Rk, f.E, Ev);
    }
    SUF(prod_add)(&f, MHA_NN, (const T *)a->grad_out, f.E, (const T *)p->wo, f.E,
                  NULL, f.dctx, f.E, Rq, f.E, f.E);
    if (mha_parallel_for(f.prods.tiles, slots, SUF(prod_task), &f, &ps)) goto stopped;
    MHA_TICK("backward 1 proj");

    /* 2. attention, per (b, h) */
    if (mha_parallel_for(f.B * f.H, slots, SUF(attend_backward_task), &f, &ps)) goto stopped;
    MHA_TICK("backward 2 attn");

    /* 4. the weight gradients (dW = dYᵀ·X, as (Rows, E)ᵀ·(Rows, In)) and the
     *    input gradients (dX = dY·W) */
    memset(&f.prods, 0, sizeof f.prods);
    if (g) {
        SUF(prod_add)(&f, MHA_TN, (const T *)a->grad_out, f.E, f.ctx, f.E, NULL,
                      g + offset[MHA_WO], f.E, f.E, f.E, Rq);
        SUF(prod_add)(&f, MHA_TN, f.dq, f.E, (const T *)a->fwd.query, f.E, NULL,
                      g + offset[MHA_WQ], f.E, f.E, f.E, Rq);
        SUF(prod_add)(&f, MHA_TN, f.dk, f.E, (const T *)a->fwd.key, Ek, NULL,
                      g + offset[MHA_WK], Ek, f.E, Ek, Rk);
        SUF(prod_add)(&f, MHA_TN, f.dv, f.E, (const T *)a->fwd.value, Ev, NULL,
                      g + offset[MHA_WV], Ev, f.E, Ev, Rk);
    }
    if (a->grad_query)
        SUF(prod_add)(&f, MHA_NN, f.dq, f.E, (const T *)p->wq, f.E, NULL,
                      (T *)a->grad_query, f.E, Rq, f.E, f.E);
    if (a->grad_key)
        SUF(prod_add)(&f, MHA_NN, f.dk, f.E, (const T *)p->wk, Ek, NULL,
                      (T *)a->grad_key, Ek, Rk, Ek, f.E);
    if (a->grad_value)
        SUF(prod_add)(&f, MHA_NN, f.dv, f.E, (const T *)p->wv, Ev, NULL,
                      (T *)a->grad_value, Ev, Rk, Ev, f.E);
    /* ... and, in the same pass, the bias gradients: the column sums of
     * d out, and of dQ, dK, dV as the sums of their batches' sums */
    if (g && cfg->bias) {
        SUF(btr_add)(&f, (const T *)a->grad_out, g + offset[MHA_BO], Rq, f.E);
        SUF(btr_add)(&f, f.bsum, g + offset[MHA_BQ], f.B, f.E);
        SUF(btr_add)(&f, f.bsum + f.B * f.E, g + offset[MHA_BK], f.B, f.E);
        SUF(btr_add)(&f, f.bsum + 2 * f.B * f.E, g + offset[MHA_BV], f.B, f.E);
    }
    {
        int64_t n_tasks = f.prods.tiles;
        int i;
        for (i = 0; i < f.n_tr; i++) n_tasks += f.tr[i].tasks;
        if (mha_parallel_for(n_tasks, slots, SUF(grad_task), &f, &ps)) goto stopped;
    }
    MHA_TICK("backward 3+4 grads, bias sums");

    mha_work_free(work);
    mha_free(f.keep);
    return MHA_OK;
stopped: /* the poll asked to stop: the gradients are unspecified */
    mha_work_free(work);
    mha_free(f.keep);
    return MHA_ERR_INTERRUPTED;
}

#undef QB
#undef RM
#undef RN
#undef RN_TN
#undef TC
