/* forward_impl.h: the threaded forward pass, written once for T = float and
 * T = double (included twice by forward.c with T, SUF, KT and EXP defined, after
 * softmax_impl.h: the softmax row it shares with the backward,
 * attend_impl.h: the attention tasks it shares with mha_sdpa_forward, and
 * transpose_impl.h: the strided transpose that scatters K per head).
 *
 *   Q = query·W_qᵀ + b_q        kept per head: qh (B, H, Sq, Dk)
 *   K = key·W_kᵀ + b_k          kept per head, transposed: kt (B, H, Dk, Sk')
 *   V = value·W_vᵀ + b_v        kept per head: vh (B, H, Sk', Dk)
 *     (Sk' = Sk + extra: add_bias_kv's row bias_k / bias_v, then
 *      add_zero_attn's zero row, appended per batch after the projections)
 *   per (b, h, block of queries), head h being columns h*Dk .. h*Dk+Dk-1:
 *     S = Q_bh·K_bhᵀ · scale (1/sqrt(Dk) by default), masked (-inf),
 *     softmax, dropout
 *     ctx_bh = S·V_bh           ctx is (B, Sq, E): the heads concatenated
 *   out = ctx·W_oᵀ + b_o        out is (B, Sq, E)
 *
 * The projections are split into (RM, RN) tiles of C over the threads; each
 * tile runs the packed GEMM (or, when the whole M is small, the unpacked dot
 * kernel).  Q, K and V are computed tile by tile into per-thread scratch and
 * scattered from there (in cache) into the per-head layouts the attention
 * reads: every head's block contiguous, no (B, S, E) copy of them at all.
 * With weights, one pass per (b, h, block of QB queries) computes
 * S straight into the caller's weights array, finishes the softmax there in
 * place (written once) and multiplies by V: no second (Sq, Sk) buffer.
 * Without, an online softmax runs over blocks of KB keys in per-thread
 * scratch of (QB, KB): no (Sq, Sk) buffer at all.  Causal: keys past the
 * block's last query are never computed (unless V holds a NaN or inf, which
 * must still reach every row as 0·NaN does in the reference).
 * Per-thread scratch (GEMM packing and the online state) is allocated once
 * per call. */

#define RM 1024      /* rows per projection task: packed W reused over them (and
                        narrower column tiles, 64 wide, before more row tiles) */

/* What a projection's tiles do besides the product (the product itself,
 * y = x·wᵀ + b, is the pass's mha_product of the same index): */
typedef struct {
    T *x_copy, *w_copy, *b_copy; /* NULL, or where to copy x, w, b (mha_copies) */
    T *yh;              /* NULL, or y per head: (B, H, S, Dk) */
    T *yt;              /* NULL, or y per head, transposed: (B, H, Dk, Sl) */
    int64_t S, Sl, Dk;  /* ... their rows per batch, rows per head in the
                           layout (S plus the extra keys) and head width */
    int64_t off;        /* the layout's row of y's first row (a cache's length) */
} SUF(proj_extra);

typedef struct {
    const KT *kern;
    T *scratch;          /* per slot: GEMM packing, then a projection tile or
                            the attention's state */
    int64_t scratch_len; /* scalars per slot */
    int small;           /* the projections use the dot kernel */
    mha_products prods;  /* the pass's projections (internal.h's task list) */
    SUF(proj_extra) extra[3]; /* ... and what each does besides */
} SUF(fwd);

/* The tile y (m, n) at rows i0.., columns n0.. of a projection (N = H*Dk
 * columns, S rows per batch), leading dimension ldy, scattered per head:
 *   yh[((b*H + h)*Sl + s)*Dk + d]  (one run of the tile's row per head), and
 *   yt[((b*H + h)*Dk + d)*Sl + s]  (16 rows of one batch at a time, so that
 *                                   each store run is long)
 * for row i0+r = b*S + s and column n0+c = h*Dk + d. */
static void SUF(tile_to_heads)(const KT *kern, const T *y, int64_t ldy, int64_t N, int64_t i0,
                               int64_t m, int64_t n0, int64_t n, int64_t S, int64_t Sl,
                               int64_t Dk, int64_t off, T *yh, T *yt)
{
    const int64_t H = N / Dk;
    int64_t r0, r1, r, c, c1;
    for (r0 = i0; r0 < i0 + m; r0 = r1) {
        const int64_t b = r0 / S, s0 = r0 % S + off;
        r1 = i0 + m;
        if (r1 > (b + 1) * S) r1 = (b + 1) * S;
        if (r1 > r0 + 16) r1 = r0 + 16;
        if (yt) /* the rows' run inside each head at once */
            for (c = n0; c < n0 + n; c = c1) {
                c1 = (c / Dk + 1) * Dk;
                if (c1 > n0 + n) c1 = n0 + n;
                SUF(transpose)(kern, y + (r0 - i0) * ldy + c - n0, r1 - r0, c1 - c, ldy,
                               yt + ((b * H + c / Dk) * Dk + c % Dk) * Sl + s0, Sl);
            }
        if (yh)
            for (r = r0; r < r1; r++)
                for (c = n0; c < n0 + n; c = c1) { /* the row's run inside one head */
                    c1 = (c / Dk + 1) * Dk;
                    if (c1 > n0 + n) c1 = n0 + n;
                    memcpy(yh + ((b * H + c / Dk) * Sl + s0 + r - r0) * Dk + c % Dk,
                           y + (r - i0) * ldy + c - n0, (size_t)(c1 - c) * sizeof(T));
                }
    }
}

/* One tile of a projection: the product, into the caller's y or the
 * slot's scratch, and around it the copies and the scatter per head. */
static void SUF(linear_task)(void *ctx, int64_t t, int slot)
{
    SUF(fwd) *f = (SUF(fwd) *)ctx;
    const mha_tile tl = mha_products_tile(&f->prods, t);
    const mha_product *jb = &f->prods.p[tl.j];
    const SUF(proj_extra) *ex = &f->extra[tl.j];
    const T *x = (const T *)jb->A, *w = (const T *)jb->B, *b = (const T *)jb->bias;
    const int64_t i0 = tl.i0, n0 = tl.n0, m = tl.m, n = tl.n;
    T *gs = f->scratch + (int64_t)slot * f->scratch_len;
    /* the tile: in place, or in the slot's scratch (after the packing) */
    T *y = jb->C ? (T *)jb->C + i0 * jb->N + n0 : gs + MHA_GEMM_SCRATCH;
    const int64_t ldy = jb->C ? jb->N : n;
    /* the caller's copies: x's rows by the first column tile, w's rows (and
     * b) by the first row tile, just before the product reads them */
    if (ex->x_copy && n0 == 0)
        mha_copy_stream(ex->x_copy + i0 * jb->K, x + i0 * jb->K,
                        (size_t)(m * jb->K) * sizeof(T));
    if (ex->w_copy && i0 == 0) {
        mha_copy_stream(ex->w_copy + n0 * jb->K, w + n0 * jb->K,
                        (size_t)(n * jb->K) * sizeof(T));
        if (ex->b_copy) memcpy(ex->b_copy + n0, b + n0, (size_t)n * sizeof(T));
    }
    SUF(mha_tile_gemm)(f->kern, jb, &tl, y, ldy, f->small, gs);
    if (ex->yh || ex->yt)
        SUF(tile_to_heads)(f->kern, y, ldy, jb->N, i0, m, n0, n, ex->S, ex->Sl, ex->Dk, ex->off,
                           ex->yh, ex->yt);
}

/* A projection y (M, N) = x (M, K)·w (N, K)ᵀ + b into the pass's list, in
 * RM-row tiles; column tiles wide for the packed GEMM, narrower when that
 * leaves too few tasks for the threads; on the AMX tiles mha_amx_tiles'.
 * Returns its extra, cleared. */
static SUF(proj_extra) *SUF(add_proj)(SUF(fwd) *f, const T *x, const T *w, const T *b, T *y,
                                      int64_t M, int64_t N, int64_t K, int slots)
{
    const int64_t rows = (M + RM - 1) / RM;
    int64_t rm = RM, rn = mha_tile_cols(rows, N, mha_gemm_nc(sizeof(T)), slots);
    SUF(proj_extra) *ex = &f->extra[f->prods.n];
    if (f->kern->amx_gemm) mha_amx_tiles(M, N, mha_gemm_nc(sizeof(T)), slots, &rm, &rn);
    mha_products_add(&f->prods, MHA_NT, x, K, w, K, b, y, N, M, N, K, rm, rn);
    memset(ex, 0, sizeof *ex);
    return ex;
}

/* Where mha_copies asks for copies of projection j's inputs: x into xc,
 * and the weight and bias of parameter pair `wi` (MHA_WQ, ...) into the
 * copied block; a projection without tiles (M == 0) copies its w and b at
 * once. */
static void SUF(proj_copies)(SUF(fwd) *f, int j, const mha_copies *cp, const int64_t *offset,
                             int wi, void *xc)
{
    const mha_product *jb = &f->prods.p[j];
    SUF(proj_extra) *ex = &f->extra[j];
    if (!cp) return;
    ex->x_copy = (T *)xc;
    if (cp->params) {
        ex->w_copy = (T *)cp->params + offset[wi];
        ex->b_copy = jb->bias ? (T *)cp->params + offset[wi + 1] : NULL;
    }
    if (jb->tiles == 0 && ex->w_copy) {
        memcpy(ex->w_copy, jb->B, (size_t)(jb->N * jb->K) * sizeof(T));
        if (ex->b_copy) memcpy(ex->b_copy, jb->bias, (size_t)jb->N * sizeof(T));
    }
}

/* Copy what mha_copies asks for of the inputs and parameters at once (when
 * no projection task runs to copy them on its way). */
static void SUF(save_copies)(const mha_params *p, const mha_forward_args *a,
                             const mha_copies *cp, const mha_sizes *sz, const int64_t *offset,
                             const int64_t *size)
{
    const void *src[MHA_NPARAM] = {p->wq, p->bq, p->wk, p->bk, p->wv,
                                   p->bv, p->wo, p->bo, p->bias_k, p->bias_v};
    int i;
    if (cp->query) memcpy(cp->query, a->query, (size_t)sz->n_query * sizeof(T));
    if (cp->key) memcpy(cp->key, a->key, (size_t)sz->n_key * sizeof(T));
    if (cp->value) memcpy(cp->value, a->value, (size_t)sz->n_value * sizeof(T));
    if (cp->params)
        for (i = 0; i < MHA_NPARAM; i++)
            if (size[i] > 0) memcpy((T *)cp->params + offset[i], src[i], (size_t)size[i] * sizeof(T));
}

/* K and V's extra rows (add_bias_kv's bias_k / bias_v, then add_zero_attn's
 * zeros) after the Sk projected ones of every (b, h) (h of the H = Hkv
 * key/value heads): kt (B, H, Dk, Sk'), vh (B, H, Sk', Dk) */
static void SUF(extra_rows)(const mha_config *cfg, const mha_params *p, T *kt, T *vh, int64_t B,
                            int64_t H, int64_t Sk, int64_t Skx, int64_t Dk)
{
    int64_t bh, d;
    for (bh = 0; bh < B * H; bh++) {
        const int64_t h = bh % H;
        for (d = 0; d < Dk; d++) {
            int64_t j = Sk;
            if (cfg->add_bias_kv) {
                kt[(bh * Dk + d) * Skx + j] = ((const T *)p->bias_k)[h * Dk + d];
                vh[(bh * Skx + j) * Dk + d] = ((const T *)p->bias_v)[h * Dk + d];
                j++;
            }
            if (cfg->add_zero_attn) {
                kt[(bh * Dk + d) * Skx + j] = 0;
                vh[(bh * Skx + j) * Dk + d] = 0;
            }
        }
    }
}

/* sv: NULL, or the caller's buffers of mha_forward_save (Q, K, V and ctx;
 * P); cp: NULL, or where to copy the inputs and parameters (each NULL when
 * not kept) */
static mha_status SUF(forward)(const mha_config *cfg, const mha_params *p,
                               const mha_forward_args *a, const mha_saved *sv,
                               const mha_copies *cp)
{
    mha_sizes sz;
    SUF(fwd) f;
    SUF(att) at;
    int64_t n_work = 0, n_scratch = 0, n_avg = 0, t, offset[MHA_NPARAM], size[MHA_NPARAM],
            total, Skx;
    size_t bytes;
    int slots;
    const int keep = sv && sv->q; /* Q, K, V and ctx go to the caller's buffers */
    SUF(proj_extra) *jq, *jk, *jv;
    T *work = NULL;
    mha_poll_state ps;
    mha_status st = mha_check_forward(cfg, p, a, &sz);
    if (st != MHA_OK) return st;
    st = mha_param_layout(cfg, offset, size, &total);
    if (st != MHA_OK) return st;
    /* the cache: K, V live there, Sk new keys after its cache_len */
    const int cached = a->cache_k != NULL;
    const int64_t Hkv = mha_kv_heads(cfg), klen = cached ? a->cache_len : 0;
    if (sz.n_out == 0 && !(cached && a->B > 0 && a->Sk > 0)) {
        /* B == 0 or Sq == 0: nothing to compute (a cache still takes its keys) */
        if (cp) SUF(save_copies)(p, a, cp, &sz, offset, size);
        return MHA_OK;
    }

    memset(&f, 0, sizeof f);
    memset(&at, 0, sizeof at);
    f.kern = at.kern = SUF(mha_kern_get)();
    at.B = a->B; at.Sq = a->Sq;
    Skx = a->Sk + sz.extra; /* every key: the given ones, then the extra ones */
    at.Sk = klen + Skx;     /* ... after the cached ones */
    at.kld = cached ? a->cache_cap : at.Sk; /* K's, V's rows per head in memory */
    /* in the workspace, Kᵀ's rows as mha_kt_ld spaces them (Zen 3, B 4,
     * S 1024, E 1024, builds alternated process by process: the attention
     * 149.9 -> 141.8 ms) */
    if (!cached && !keep && sz.extra == 0) at.kld = mha_kt_ld(f.kern->nr, at.Sk, sizeof(T));
    at.H = cfg->n_heads;
    at.Hkv = Hkv;
    at.Dk = at.Dv = cfg->d_model / cfg->n_heads;
    at.rr = mha_rows_make(a->masks, a->n_masks, a->is_causal, a->Sq, klen + a->Sk,
                          a->zero_masked_rows);
    mha_rows_window(&at.rr, a->has_window, a->window_left, a->window_right, a->Sq,
                    klen + a->Sk);
    at.rr.lay = a->layout;
    at.scale = (T)mha_score_scale(a->has_scale, a->scale, at.Dk);
    at.dropout = a->dropout;
    at.dropout_on = a->dropout > 0.0;
    at.drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    at.drop_key = mha_stream_key(a->seed, a->counter);
    at.weights = (T *)a->weights;
    at.hmask = (const T *)a->head_mask;
    at.hm_sb = a->head_mask_stride[0];
    at.hm_sh = a->head_mask_stride[1];
    const int64_t B = a->B, Sq = a->Sq, Sk = a->Sk, E = cfg->d_model, Dk = at.Dk,
                  Ekv = Hkv * Dk;
    /* few rows (a decode step): the unpacked dot kernel, whose sums are the
     * packed GEMM's bit for bit, so a row's bits never depend on the rows
     * beside it either way (batch invariance; the cache's bit-exactness) */
    f.small = B * Sq <= f.kern->dot_rows && B * Sk <= f.kern->dot_rows;

    /* small problems stay on the calling thread */
    slots = mha_get_num_threads();
    {
        double flops = 2.0 * (double)B * (double)Sq * (double)E * (double)E * 2.0 +
                       2.0 * (double)B * (double)Sk * (double)Ekv *
                           (double)(cfg->kdim + cfg->vdim) +
                       4.0 * (double)B * (double)Sq * (double)at.Sk * (double)E;
        if (flops < 2e6) slots = 1;
    }

    /* P kept: the attention forms it whole (the weights task) */
    at.p_save = keep && sv->p ? (T *)sv->p : NULL;
    at.avg = a->average_weights && at.weights;

    /* per slot: the GEMM's packing, then what one pass needs after it: a
     * projection tile (at most RM rows and mha_gemm_nc columns), or the
     * attention's state (attend_impl.h) */
    {
        const int64_t nc = mha_gemm_nc(sizeof(T));
        int64_t rows = B * (Sq > Sk ? Sq : Sk), tile, state;
        if (rows > RM) rows = RM;
        tile = rows * (E < nc ? E : nc);
        if (SUF(att_state)(&at, &state)) return MHA_ERR_OVERFLOW;
        f.scratch_len = MHA_GEMM_SCRATCH + (tile > state ? tile : state);
    }
    /* workspace: qh and ctx (B, Sq, E) scalars, kt and vh (B, Sk', Ekv),
     * unless the caller keeps them (or the cache holds K and V); then the
     * slots' scratch */
    if (mha_mul(B, at.kld, &t) || mha_mul(t, Ekv, &t) ||
        mha_mul(t, keep || cached ? 0 : 2, &t) ||
        mha_add(t, keep ? 0 : 2 * sz.n_out, &n_work) ||
        mha_mul(f.scratch_len, slots, &n_scratch) || mha_add(n_work, n_scratch, &n_work))
        return MHA_ERR_OVERFLOW;
    /* the heads' mean over too few tasks: the per-head weights first */
    if (SUF(att_avg_heads)(&at, slots) &&
        (mha_mul(B * at.H * Sq, at.Sk, &n_avg) || mha_add(n_work, n_avg, &n_work)))
        return MHA_ERR_OVERFLOW;
    if (mha_bytes(n_work, sizeof(T), &bytes)) return MHA_ERR_OVERFLOW;
    work = (T *)mha_work_alloc(bytes);
    if (!work) return MHA_ERR_NOMEM;
    T *qh, *kt, *vh, *ctx;
    if (keep) {
        qh = (T *)sv->q;
        kt = (T *)sv->k;
        vh = (T *)sv->v;
        ctx = (T *)sv->ctx;
        f.scratch = work;
    } else {
        qh = work;
        ctx = qh + sz.n_out;
        kt = ctx + sz.n_out;
        vh = kt + (cached ? 0 : B * at.kld * Ekv);
        f.scratch = vh + (cached ? 0 : B * at.kld * Ekv);
        if (cached) {
            kt = (T *)a->cache_k;
            vh = (T *)a->cache_v;
        }
    }
    at.qh = qh; at.kt = kt; at.vh = vh;
    if (n_avg > 0) at.avg_heads = f.scratch + slots * f.scratch_len;
    at.ctx = ctx;
    at.cs_b = Sq * E; at.cs_h = Dk; at.ldc = E;
    at.scratch = f.scratch;
    at.scratch_len = f.scratch_len;

    mha_poll_start(&ps, a->poll, a->poll_ctx);
    MHA_TICK_START;
    /* the three input projections, one parallel pass over all their tiles:
     * each tile scattered per head (K transposed, so that Q·Kᵀ reads it in
     * place), and the copies mha_saved asks for made on the way */
    jq = SUF(add_proj)(&f, (const T *)a->query, (const T *)p->wq, (const T *)p->bq, NULL,
                       B * Sq, E, E, slots);
    jk = SUF(add_proj)(&f, (const T *)a->key, (const T *)p->wk, (const T *)p->bk, NULL,
                       B * Sk, Ekv, cfg->kdim, slots);
    jv = SUF(add_proj)(&f, (const T *)a->value, (const T *)p->wv, (const T *)p->bv, NULL,
                       B * Sk, Ekv, cfg->vdim, slots);
    SUF(proj_copies)(&f, 0, cp, offset, MHA_WQ, cp ? cp->query : NULL);
    SUF(proj_copies)(&f, 1, cp, offset, MHA_WK, cp ? cp->key : NULL);
    SUF(proj_copies)(&f, 2, cp, offset, MHA_WV, cp ? cp->value : NULL);
    if (cp && cp->params && cfg->add_bias_kv) {
        memcpy((T *)cp->params + offset[MHA_BIAS_K], p->bias_k, (size_t)Ekv * sizeof(T));
        memcpy((T *)cp->params + offset[MHA_BIAS_V], p->bias_v, (size_t)Ekv * sizeof(T));
    }
    jq->yh = qh;
    jk->yt = kt;
    jv->yh = vh;
    jq->S = jq->Sl = Sq;
    jk->S = jv->S = Sk;
    jk->Sl = jv->Sl = at.kld;
    jk->off = jv->off = klen;
    jq->Dk = jk->Dk = jv->Dk = Dk;
    if (mha_parallel_for(f.prods.tiles, slots, SUF(linear_task), &f, &ps)) goto stopped;
    if (sz.extra) SUF(extra_rows)(cfg, p, kt, vh, B, Hkv, Sk, Skx, Dk);
    MHA_TICK("forward qkv proj");

    /* a NaN or inf in V must reach every row (0·NaN), so no causal or
     * window skipping; nor past the extra keys, which nothing blocks */
    at.skip = (a->is_causal || at.rr.window || at.rr.lay.keep) && sz.extra == 0;
    {   /* causal alone: the keys up to the first query's last one are seen
         * by every row (never skipped), so only V's later rows matter (none
         * for one query, a decode step) */
        int64_t lo = a->is_causal && !at.rr.window && !at.rr.lay.keep ? at.rr.coff + 1 : 0;
        lo = lo < 0 ? 0 : lo > at.Sk ? at.Sk : lo;
        for (t = 0; t < B * Hkv && at.skip; t++) /* each head's keys (the cache's valid ones) */
            at.skip = SUF(all_finite)(vh + (t * at.kld + lo) * Dk, (at.Sk - lo) * Dk);
    }

    /* attention, per (b, h, block of queries) */
    if (SUF(attend)(&at, slots, &ps)) goto stopped;
    MHA_TICK("forward attention");

    /* the output projection */
    memset(&f.prods, 0, sizeof f.prods);
    SUF(add_proj)(&f, ctx, (const T *)p->wo, (const T *)p->bo, (T *)a->out, B * Sq, E, E, slots);
    SUF(proj_copies)(&f, 0, cp, offset, MHA_WO, NULL);
    if (mha_parallel_for(f.prods.tiles, slots, SUF(linear_task), &f, &ps)) goto stopped;
    MHA_TICK("forward out proj");

    mha_work_free(work);
    return MHA_OK;
stopped: /* the poll asked to stop: the outputs are unspecified */
    mha_work_free(work);
    return MHA_ERR_INTERRUPTED;
}

#undef RM
