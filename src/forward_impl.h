/* forward_impl.h: the threaded forward pass, written once for T = float and
 * T = double (included twice by forward.c with T, SUF, KT and EXP defined, after
 * softmax_impl.h: the softmax row it shares with the backward).
 *
 *   Q = query·W_qᵀ + b_q        kept per head: qh (B, H, Sq, Dk)
 *   K = key·W_kᵀ + b_k          kept per head, transposed: kt (B, H, Dk, Sk)
 *   V = value·W_vᵀ + b_v        kept per head: vh (B, H, Sk, Dk)
 *   per (b, h, block of queries), head h being columns h*Dk .. h*Dk+Dk-1:
 *     S = Q_bh·K_bhᵀ / sqrt(Dk), masked (-inf), softmax, dropout
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

#define QB 48        /* queries per attention task: a multiple of every kernel's MR (6, 6, 4) */
#define KB 256       /* keys per block of the online softmax */
#define RM 1024      /* rows per projection task: packed W reused over them (and
                        narrower column tiles, 64 wide, before more row tiles) */
#define SMALL_M 24   /* below this many rows, projections use the dot kernel */

/* What a projection's tiles do besides the product (the product itself,
 * y = x·wᵀ + b, is the pass's mha_product of the same index): */
typedef struct {
    T *x_copy, *w_copy, *b_copy; /* NULL, or where to copy x, w, b (mha_copies) */
    T *yh;              /* NULL, or y per head: (B, H, S, Dk) */
    T *yt;              /* NULL, or y per head, transposed: (B, H, Dk, S) */
    int64_t S, Dk;      /* ... their rows per batch and head width */
} SUF(proj_extra);

typedef struct {
    const mha_forward_args *a;
    const KT *kern;
    int64_t B, Sq, Sk, E, H, Dk;
    T *qh, *vh;          /* Q (B, H, Sq, Dk) and V (B, H, Sk, Dk) per head */
    T *kt;               /* K per head, transposed: (B, H, Dk, Sk) */
    T *ctx;              /* (B, Sq, E) */
    T *p_save;           /* NULL, or mha_saved's P (B, H, Sq, Sk) */
    T *scratch;          /* per slot: GEMM packing, then a projection tile or
                            the attention's state */
    int64_t scratch_len; /* scalars per slot */
    T scale;             /* 1 / sqrt(Dk) */
    T drop_scale;        /* 1 / (1 - p) */
    uint64_t drop_key;
    int dropout_on;
    int skip_causal;     /* causal and V finite: skip keys past the diagonal */
    int small;           /* the projections use the dot kernel */
    int64_t n_qblk;
    mha_products prods;  /* the pass's projections (internal.h's task list) */
    SUF(proj_extra) extra[3]; /* ... and what each does besides */
} SUF(fwd);

/* The tile y (m, n) at rows i0.., columns n0.. of a projection (N = H*Dk
 * columns, S rows per batch), leading dimension ldy, scattered per head:
 *   yh[((b*H + h)*S + s)*Dk + d]  (one run of the tile's row per head), and
 *   yt[((b*H + h)*Dk + d)*S + s]  (16 rows of one batch at a time, so that
 *                                   each store run is long)
 * for row i0+r = b*S + s and column n0+c = h*Dk + d. */
static void SUF(tile_to_heads)(const T *y, int64_t ldy, int64_t N, int64_t i0, int64_t m,
                               int64_t n0, int64_t n, int64_t S, int64_t Dk, T *yh, T *yt)
{
    const int64_t H = N / Dk;
    int64_t r0, r1, r, c, c1;
    for (r0 = i0; r0 < i0 + m; r0 = r1) {
        const int64_t b = r0 / S, s0 = r0 % S;
        r1 = i0 + m;
        if (r1 > (b + 1) * S) r1 = (b + 1) * S;
        if (r1 > r0 + 16) r1 = r0 + 16;
        if (yt)
            for (c = n0; c < n0 + n; c++) {
                T *dst = yt + ((b * H + c / Dk) * Dk + c % Dk) * S + s0;
                for (r = r0; r < r1; r++) dst[r - r0] = y[(r - i0) * ldy + c - n0];
            }
        if (yh)
            for (r = r0; r < r1; r++)
                for (c = n0; c < n0 + n; c = c1) { /* the row's run inside one head */
                    c1 = (c / Dk + 1) * Dk;
                    if (c1 > n0 + n) c1 = n0 + n;
                    memcpy(yh + ((b * H + c / Dk) * S + s0 + r - r0) * Dk + c % Dk,
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
        SUF(tile_to_heads)(y, ldy, jb->N, i0, m, n0, n, ex->S, ex->Dk, ex->yh, ex->yt);
}

/* A projection y (M, N) = x (M, K)·w (N, K)ᵀ + b into the pass's list, in
 * RM-row tiles; column tiles wide for the packed GEMM, narrower when that
 * leaves too few tasks for the threads.  Returns its extra, cleared. */
static SUF(proj_extra) *SUF(add_proj)(SUF(fwd) *f, const T *x, const T *w, const T *b, T *y,
                                      int64_t M, int64_t N, int64_t K, int slots)
{
    const int64_t rows = (M + RM - 1) / RM;
    int64_t rn = MHA_GEMM_NC;
    SUF(proj_extra) *ex = &f->extra[f->prods.n];
    while (rn > 64 && rows * ((N + rn - 1) / rn) < 4 * (int64_t)slots) rn /= 2;
    mha_products_add(&f->prods, MHA_NT, x, K, w, K, b, y, N, M, N, K, RM, rn);
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

static void SUF(fill_rows)(T *x, int64_t rows, int64_t cols, int64_t ld, T value)
{
    int64_t r, c;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) x[r * ld + c] = value;
}

/* A = dropout(P) over w[0..n), the row's elements idx, idx+1, ... of the
 * call's stream */
static void SUF(dropout_row)(const SUF(fwd) *f, T *w, int64_t n, uint64_t idx)
{
    int64_t j;
    for (j = 0; j < n; j++)
        w[j] = mha_dropout_keep(f->drop_key, idx + (uint64_t)j, f->a->dropout)
                   ? w[j] * f->drop_scale : (T)0;
}

/* Attention with the weights written: task = (b, h, block of queries).
 * P (the softmax) is formed in the weights array itself, or in mha_saved's
 * P when that is kept; A = dropout(P), what multiplies V, is then the
 * weights array, P itself (no dropout, no weights asked for) or a scratch
 * block of the slot (dropout, no weights). */
static void SUF(attend_weights_task)(void *ctx, int64_t t, int slot)
{
    SUF(fwd) *f = (SUF(fwd) *)ctx;
    const mha_forward_args *a = f->a;
    int64_t bh = t / f->n_qblk, b = bh / f->H, h = bh % f->H;
    int64_t i0 = (t % f->n_qblk) * QB, nq = f->Sq - i0 < QB ? f->Sq - i0 : QB;
    int64_t E = f->E, Sk = f->Sk, Dk = f->Dk, r, kend = Sk;
    const T *q_bh = f->qh + (bh * f->Sq + i0) * Dk;       /* (nq, Dk) */
    const T *kt_bh = f->kt + bh * Dk * Sk;                /* (Dk, Sk) */
    const T *v_bh = f->vh + bh * Sk * Dk;                 /* (Sk, Dk) */
    T *c_bh = f->ctx + (b * f->Sq + i0) * E + h * Dk;     /* (nq, Dk), ld E */
    T *gs = f->scratch + (int64_t)slot * f->scratch_len;
    T *p_bh = (f->p_save ? f->p_save : (T *)a->weights) + (bh * f->Sq + i0) * Sk; /* (nq, Sk) */
    T *a_bh = p_bh;                                                               /* (nq, Sk) */
    if (f->p_save && a->weights)
        a_bh = (T *)a->weights + (bh * f->Sq + i0) * Sk;
    else if (f->p_save && f->dropout_on)
        a_bh = gs + MHA_GEMM_SCRATCH;
    if (Sk == 0) { /* no key at all: the context is an empty sum */
        SUF(fill_rows)(c_bh, nq, Dk, E, (T)0);
        return;
    }
    if (f->skip_causal && i0 + nq < Sk) kend = i0 + nq; /* later keys: blocked for all */
    SUF(mha_gemm)(f->kern, 0, nq, kend, Dk, q_bh, Dk, kt_bh, Sk, NULL, p_bh, Sk, 0, gs);
    for (r = 0; r < nq; r++) {
        T *w = p_bh + r * Sk;
        const int64_t i = i0 + r;
        /* P = softmax(masked S / sqrt(Dk)); ne < 0: every key blocked */
        const int64_t ne = SUF(softmax_row)(f->kern, a, f->scale, w, b, h, i, kend, Sk);
        if (a_bh != p_bh) memcpy(a_bh + r * Sk, w, (size_t)Sk * sizeof(T));
        if (f->dropout_on && ne >= 0) /* a blocked row: no dropout either */
            SUF(dropout_row)(f, a_bh + r * Sk, ne,
                             ((uint64_t)bh * (uint64_t)f->Sq + (uint64_t)i) * (uint64_t)Sk);
    }
    SUF(mha_gemm)(f->kern, 0, nq, Dk, kend, a_bh, Sk, v_bh, Dk, NULL, c_bh, E, 0, gs);
}

/* Attention without weights: an online softmax over blocks of KB keys. */
static void SUF(attend_online_task)(void *ctx, int64_t t, int slot)
{
    SUF(fwd) *f = (SUF(fwd) *)ctx;
    const mha_forward_args *a = f->a;
    int64_t bh = t / f->n_qblk, b = bh / f->H, h = bh % f->H;
    int64_t i0 = (t % f->n_qblk) * QB, nq = f->Sq - i0 < QB ? f->Sq - i0 : QB;
    int64_t E = f->E, Sk = f->Sk, Dk = f->Dk, r, j0, d, kend = Sk;
    const T *q_bh = f->qh + (bh * f->Sq + i0) * Dk; /* (nq, Dk) */
    const T *kt_bh = f->kt + bh * Dk * Sk;          /* (Dk, Sk) */
    const T *v_bh = f->vh + bh * Sk * Dk;           /* (Sk, Dk) */
    T *c_bh = f->ctx + (b * f->Sq + i0) * E + h * Dk;
    T *gs = f->scratch + (int64_t)slot * f->scratch_len; /* GEMM packing */
    T *s = gs + MHA_GEMM_SCRATCH;                        /* (QB, KB) */
    T *mx = s + QB * KB;                                 /* (QB) running max */
    T *l = mx + QB;                                      /* (QB) running sum */
    T *acc = l + QB;                                     /* (QB, Dk) */
    for (r = 0; r < nq; r++) {
        mx[r] = -(T)INFINITY;
        l[r] = 0;
    }
    SUF(fill_rows)(acc, nq, Dk, Dk, (T)0);
    if (f->skip_causal && i0 + nq < Sk) kend = i0 + nq;
    for (j0 = 0; j0 < kend; j0 += KB) {
        int64_t nk = kend - j0 < KB ? kend - j0 : KB;
        SUF(mha_gemm)(f->kern, 0, nq, nk, Dk, q_bh, Dk, kt_bh + j0, Sk, NULL, s, KB, 0, gs);
        for (r = 0; r < nq; r++) {
            T *srow = s + r * KB, alpha;
            const int64_t i = i0 + r;
            const int64_t ne = SUF(softmax_online_step)(f->kern, a, f->scale, srow, b, h, i, j0,
                                                        nk, &mx[r], &l[r], &alpha);
            if (ne < 0) continue; /* nothing visible in this block */
            if (f->dropout_on)
                SUF(dropout_row)(f, srow, ne, ((uint64_t)bh * (uint64_t)f->Sq + (uint64_t)i) *
                                                  (uint64_t)Sk + (uint64_t)j0);
            if (alpha != (T)1) f->kern->scale(acc + r * Dk, Dk, alpha);
        }
        SUF(mha_gemm)(f->kern, 0, nq, Dk, nk, s, KB, v_bh + j0 * Dk, Dk, NULL, acc, Dk, 1, gs);
    }
    for (r = 0; r < nq; r++) {
        T *c = c_bh + r * E;
        if (mx[r] == -(T)INFINITY) { /* every key blocked; Sk == 0: an empty sum */
            for (d = 0; d < Dk; d++) c[d] = Sk == 0 ? (T)0 : SUF(blocked_row_value)(a);
        } else {
            T inv = (T)1 / l[r];
            for (d = 0; d < Dk; d++) c[d] = acc[r * Dk + d] * inv;
        }
    }
}

/* 1 when every element of x[0..n) is finite */
static int SUF(all_finite)(const T *x, int64_t n)
{
    int64_t i;
    T z = 0;
    for (i = 0; i < n; i++) z += x[i] * 0; /* NaN as soon as one is NaN or inf */
    return z == 0;
}

/* Copy what mha_copies asks for of the inputs and parameters at once (when
 * no projection task runs to copy them on its way). */
static void SUF(save_copies)(const mha_params *p, const mha_forward_args *a,
                             const mha_copies *cp, const mha_sizes *sz, const int64_t *offset,
                             const int64_t *size)
{
    const void *src[MHA_NPARAM] = {p->wq, p->bq, p->wk, p->bk, p->wv, p->bv, p->wo, p->bo};
    int i;
    if (cp->query) memcpy(cp->query, a->query, (size_t)sz->n_query * sizeof(T));
    if (cp->key) memcpy(cp->key, a->key, (size_t)sz->n_key * sizeof(T));
    if (cp->value) memcpy(cp->value, a->value, (size_t)sz->n_value * sizeof(T));
    if (cp->params)
        for (i = 0; i < MHA_NPARAM; i++)
            if (size[i] > 0) memcpy((T *)cp->params + offset[i], src[i], (size_t)size[i] * sizeof(T));
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
    int64_t n_work = 0, n_scratch = 0, t, offset[MHA_NPARAM], size[MHA_NPARAM], total;
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
    if (sz.n_out == 0) { /* B == 0 or Sq == 0: nothing to compute */
        if (cp) SUF(save_copies)(p, a, cp, &sz, offset, size);
        return MHA_OK;
    }

    memset(&f, 0, sizeof f);
    f.a = a;
    f.kern = SUF(mha_kern_get)();
    f.B = a->B; f.Sq = a->Sq; f.Sk = a->Sk;
    f.E = cfg->d_model; f.H = cfg->n_heads; f.Dk = f.E / f.H;
    f.scale = (T)(1.0 / sqrt((double)f.Dk));
    f.dropout_on = a->dropout > 0.0;
    f.drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    f.drop_key = mha_stream_key(a->seed, a->counter);
    f.n_qblk = (f.Sq + QB - 1) / QB;
    /* the kernel choice depends on the problem alone, never on threads */
    f.small = f.B * f.Sq < SMALL_M && f.B * f.Sk < SMALL_M;

    /* small problems stay on the calling thread */
    slots = mha_get_num_threads();
    {
        double flops = 2.0 * (double)f.B * (double)f.Sq * (double)f.E * (double)f.E * 2.0 +
                       2.0 * (double)f.B * (double)f.Sk * (double)f.E *
                           (double)(cfg->kdim + cfg->vdim) +
                       4.0 * (double)f.B * (double)f.Sq * (double)f.Sk * (double)f.E;
        if (flops < 2e6) slots = 1;
    }

    /* P kept: the attention forms it whole (the weights task) */
    f.p_save = keep && sv->p ? (T *)sv->p : NULL;

    /* per slot: the GEMM's packing, then what one pass needs after it: a
     * projection tile (at most RM rows and MHA_GEMM_NC columns), or the
     * online softmax's state (Dk <= E: checked), or A = dropout(P) (QB, Sk)
     * when P is kept without weights */
    {
        int64_t rows = f.B * (f.Sq > f.Sk ? f.Sq : f.Sk), tile, state = 0;
        if (rows > RM) rows = RM;
        tile = rows * (f.E < MHA_GEMM_NC ? f.E : MHA_GEMM_NC);
        if (!a->weights && !f.p_save) state = QB * KB + 2 * QB + QB * f.Dk;
        if (f.p_save && !a->weights && f.dropout_on && mha_mul(QB, f.Sk, &state))
            return MHA_ERR_OVERFLOW;
        f.scratch_len = MHA_GEMM_SCRATCH + (tile > state ? tile : state);
    }
    /* workspace: qh and ctx (B, Sq, E) scalars, kt and vh (B, Sk, E), unless
     * the caller keeps them; then the slots' scratch */
    if (mha_mul(f.B * f.Sk, f.E, &t) || mha_mul(t, keep ? 0 : 2, &t) ||
        mha_add(t, keep ? 0 : 2 * sz.n_out, &n_work) ||
        mha_mul(f.scratch_len, slots, &n_scratch) || mha_add(n_work, n_scratch, &n_work))
        return MHA_ERR_OVERFLOW;
    if (mha_bytes(n_work, sizeof(T), &bytes)) return MHA_ERR_OVERFLOW;
    work = (T *)mha_work_alloc(bytes);
    if (!work) return MHA_ERR_NOMEM;
    if (keep) {
        f.qh = (T *)sv->q;
        f.kt = (T *)sv->k;
        f.vh = (T *)sv->v;
        f.ctx = (T *)sv->ctx;
        f.scratch = work;
    } else {
        f.qh = work;
        f.ctx = f.qh + sz.n_out;
        f.kt = f.ctx + sz.n_out;
        f.vh = f.kt + f.B * f.Sk * f.E;
        f.scratch = f.vh + f.B * f.Sk * f.E;
    }

    mha_poll_start(&ps, a->poll, a->poll_ctx);
    MHA_TICK_START;
    /* the three input projections, one parallel pass over all their tiles:
     * each tile scattered per head (K transposed, so that Q·Kᵀ reads it in
     * place), and the copies mha_saved asks for made on the way */
    jq = SUF(add_proj)(&f, (const T *)a->query, (const T *)p->wq, (const T *)p->bq, NULL,
                       f.B * f.Sq, f.E, f.E, slots);
    jk = SUF(add_proj)(&f, (const T *)a->key, (const T *)p->wk, (const T *)p->bk, NULL,
                       f.B * f.Sk, f.E, cfg->kdim, slots);
    jv = SUF(add_proj)(&f, (const T *)a->value, (const T *)p->wv, (const T *)p->bv, NULL,
                       f.B * f.Sk, f.E, cfg->vdim, slots);
    SUF(proj_copies)(&f, 0, cp, offset, MHA_WQ, cp ? cp->query : NULL);
    SUF(proj_copies)(&f, 1, cp, offset, MHA_WK, cp ? cp->key : NULL);
    SUF(proj_copies)(&f, 2, cp, offset, MHA_WV, cp ? cp->value : NULL);
    jq->yh = f.qh;
    jk->yt = f.kt;
    jv->yh = f.vh;
    jq->S = f.Sq;
    jk->S = jv->S = f.Sk;
    jq->Dk = jk->Dk = jv->Dk = f.Dk;
    if (mha_parallel_for(f.prods.tiles, slots, SUF(linear_task), &f, &ps)) goto stopped;
    MHA_TICK("forward qkv proj");

    /* a NaN or inf in V must reach every row (0·NaN), so no causal skipping */
    f.skip_causal = a->is_causal && SUF(all_finite)(f.vh, f.B * f.Sk * f.E);

    /* attention, per (b, h, block of queries) */
    if (mha_parallel_for(f.B * f.H * f.n_qblk, slots,
                         a->weights || f.p_save ? SUF(attend_weights_task)
                                                : SUF(attend_online_task),
                         &f, &ps))
        goto stopped;
    MHA_TICK("forward attention");

    /* the output projection */
    memset(&f.prods, 0, sizeof f.prods);
    SUF(add_proj)(&f, f.ctx, (const T *)p->wo, (const T *)p->bo, (T *)a->out, f.B * f.Sq, f.E,
                  f.E, slots);
    SUF(proj_copies)(&f, 0, cp, offset, MHA_WO, NULL);
    if (mha_parallel_for(f.prods.tiles, slots, SUF(linear_task), &f, &ps)) goto stopped;
    MHA_TICK("forward out proj");

    mha_work_free(work);
    return MHA_OK;
stopped: /* the poll asked to stop: the outputs are unspecified */
    mha_work_free(work);
    return MHA_ERR_INTERRUPTED;
}

#undef QB
#undef KB
#undef RM
#undef SMALL_M
