/* forward_impl.h: the threaded forward pass, written once for T = float and
 * T = double (included twice by mha.c with T, SUF, EXP and SQRT defined).
 *
 *   Q = query·W_qᵀ + b_q        q is (B, Sq, E)
 *   K = key·W_kᵀ + b_k          k is (B, Sk, E)
 *   V = value·W_vᵀ + b_v        v is (B, Sk, E)
 *   per (b, h, block of queries), head h being columns h*Dk .. h*Dk+Dk-1:
 *     S = Q_bh·K_bhᵀ / sqrt(Dk), masked (-inf), softmax, dropout
 *     ctx_bh = S·V_bh           ctx is (B, Sq, E): the heads concatenated
 *   out = ctx·W_oᵀ + b_o        out is (B, Sq, E)
 *
 * With weights, S is computed straight into the caller's weights array and
 * finished there in place (written once).  Without, an online softmax runs
 * over blocks of keys in per-thread scratch of (QB, KB): no (Sq, Sk) buffer. */

#define QB 32   /* queries per attention task */
#define KB 128  /* keys per block of the online softmax */
#define RM 32   /* rows per projection task */
#define RN 64   /* output columns per projection task */

typedef struct {
    const T *x, *w, *b; /* x (M, K), w (N, K), b (N) or NULL */
    T *y;               /* (M, N) */
    int64_t M, N, K, tiles_n, tiles;
} SUF(linear_job);

typedef struct {
    const mha_forward_args *a;
    int64_t B, Sq, Sk, E, H, Dk;
    T *q, *k, *v, *ctx;
    T *scratch;          /* per slot: S (QB, KB), m (QB), l (QB), acc (QB, Dk) */
    int64_t scratch_len; /* scalars per slot */
    T scale;             /* 1 / sqrt(Dk) */
    T drop_scale;        /* 1 / (1 - p) */
    uint64_t drop_key;
    int dropout_on;
    int64_t n_qblk;
    SUF(linear_job) jobs[3];
    int n_jobs;
} SUF(fwd);

static void SUF(linear_task)(void *ctx, int64_t t, int slot)
{
    SUF(fwd) *f = (SUF(fwd) *)ctx;
    int j = 0;
    (void)slot;
    while (t >= f->jobs[j].tiles) t -= f->jobs[j++].tiles;
    const SUF(linear_job) *jb = &f->jobs[j];
    int64_t i0 = (t / jb->tiles_n) * RM, n0 = (t % jb->tiles_n) * RN;
    int64_t m = jb->M - i0 < RM ? jb->M - i0 : RM;
    int64_t n = jb->N - n0 < RN ? jb->N - n0 : RN;
    SUF(mha_gemm_nt)(m, n, jb->K, jb->x + i0 * jb->K, jb->K, jb->w + n0 * jb->K, jb->K,
                     jb->b ? jb->b + n0 : NULL, jb->y + i0 * jb->N + n0, jb->N, 0);
}

static void SUF(add_job)(SUF(fwd) *f, const T *x, const T *w, const T *b, T *y,
                         int64_t M, int64_t N, int64_t K)
{
    SUF(linear_job) *jb = &f->jobs[f->n_jobs++];
    jb->x = x; jb->w = w; jb->b = b; jb->y = y;
    jb->M = M; jb->N = N; jb->K = K;
    jb->tiles_n = (N + RN - 1) / RN;
    jb->tiles = M > 0 && N > 0 ? (M + RM - 1) / RM * jb->tiles_n : 0;
}

static int64_t SUF(job_tiles)(const SUF(fwd) *f)
{
    int64_t n = 0;
    int j;
    for (j = 0; j < f->n_jobs; j++) n += f->jobs[j].tiles;
    return n;
}

/* s[0..n) are the scaled scores of row (b, h, i) for keys j0 .. j0+n-1:
 * add the additive masks, then set -inf where any blocking mask or the
 * causal rule blocks. */
static void SUF(apply_masks)(const SUF(fwd) *f, T *s, int64_t b, int64_t h, int64_t i,
                             int64_t j0, int64_t n)
{
    const mha_forward_args *a = f->a;
    int m;
    int64_t j;
    for (m = 0; m < a->n_masks; m++) {
        const mha_mask *mk = &a->masks[m];
        int64_t base = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                       j0 * mk->stride[3];
        int64_t st = mk->stride[3];
        if (mk->kind != MHA_MASK_ADD) continue;
        const T *d = (const T *)mk->data + base;
        for (j = 0; j < n; j++) s[j] += d[j * st];
    }
    for (m = 0; m < a->n_masks; m++) {
        const mha_mask *mk = &a->masks[m];
        int64_t base = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                       j0 * mk->stride[3];
        int64_t st = mk->stride[3];
        if (mk->kind != MHA_MASK_BLOCK) continue;
        const uint8_t *d = (const uint8_t *)mk->data + base;
        for (j = 0; j < n; j++)
            if (d[j * st]) s[j] = -(T)INFINITY;
    }
    if (a->is_causal) {
        j = i + 1 - j0; /* the first blocked key of this row, relative to j0 */
        for (j = j < 0 ? 0 : j; j < n; j++) s[j] = -(T)INFINITY;
    }
}

/* The largest of s[0..n); NaN as soon as any entry is NaN. */
static T SUF(row_max)(const T *s, int64_t n, T m)
{
    int64_t j;
    for (j = 0; j < n; j++)
        if (s[j] > m || s[j] != s[j]) {
            m = s[j];
            if (m != m) return m;
        }
    return m;
}

static void SUF(fill_rows)(T *x, int64_t rows, int64_t cols, int64_t ld, T value)
{
    int64_t r, c;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) x[r * ld + c] = value;
}

/* Attention with the weights written: task = (b, h, block of queries). */
static void SUF(attend_weights_task)(void *ctx, int64_t t, int slot)
{
    SUF(fwd) *f = (SUF(fwd) *)ctx;
    const mha_forward_args *a = f->a;
    int64_t bh = t / f->n_qblk, b = bh / f->H, h = bh % f->H;
    int64_t i0 = (t % f->n_qblk) * QB, nq = f->Sq - i0 < QB ? f->Sq - i0 : QB;
    int64_t E = f->E, Sk = f->Sk, Dk = f->Dk, r, j;
    const T nan_or_zero = a->zero_masked_rows ? (T)0 : (T)NAN;
    const T *q_bh = f->q + (b * f->Sq + i0) * E + h * Dk; /* (nq, Dk), ld E */
    const T *k_bh = f->k + b * Sk * E + h * Dk;           /* (Sk, Dk), ld E */
    const T *v_bh = f->v + b * Sk * E + h * Dk;           /* (Sk, Dk), ld E */
    T *c_bh = f->ctx + (b * f->Sq + i0) * E + h * Dk;     /* (nq, Dk), ld E */
    T *w_bh = (T *)a->weights + (bh * f->Sq + i0) * Sk;   /* (nq, Sk) */
    (void)slot;
    if (Sk == 0) { /* no key at all: every row is fully blocked */
        SUF(fill_rows)(c_bh, nq, Dk, E, nan_or_zero);
        return;
    }
    SUF(mha_gemm_nt)(nq, Sk, Dk, q_bh, E, k_bh, E, NULL, w_bh, Sk, 0);
    for (r = 0; r < nq; r++) {
        T *w = w_bh + r * Sk, sum = 0, inv;
        for (j = 0; j < Sk; j++) w[j] *= f->scale;
        SUF(apply_masks)(f, w, b, h, i0 + r, 0, Sk);
        T m = SUF(row_max)(w, Sk, -(T)INFINITY);
        if (m == -(T)INFINITY) { /* every key blocked */
            for (j = 0; j < Sk; j++) w[j] = nan_or_zero;
            continue;
        }
        for (j = 0; j < Sk; j++) {
            w[j] = EXP(w[j] - m);
            sum += w[j];
        }
        inv = (T)1 / sum;
        for (j = 0; j < Sk; j++) w[j] *= inv;
        if (f->dropout_on) {
            uint64_t idx = ((uint64_t)bh * (uint64_t)f->Sq + (uint64_t)(i0 + r)) * (uint64_t)Sk;
            for (j = 0; j < Sk; j++)
                w[j] = mha_stream_uniform(f->drop_key, idx + (uint64_t)j) >= a->dropout
                           ? w[j] * f->drop_scale : (T)0;
        }
    }
    SUF(mha_gemm_nn)(nq, Dk, Sk, w_bh, Sk, v_bh, E, NULL, c_bh, E, 0);
}

/* Attention without weights: an online softmax over blocks of KB keys. */
static void SUF(attend_online_task)(void *ctx, int64_t t, int slot)
{
    SUF(fwd) *f = (SUF(fwd) *)ctx;
    const mha_forward_args *a = f->a;
    int64_t bh = t / f->n_qblk, b = bh / f->H, h = bh % f->H;
    int64_t i0 = (t % f->n_qblk) * QB, nq = f->Sq - i0 < QB ? f->Sq - i0 : QB;
    int64_t E = f->E, Sk = f->Sk, Dk = f->Dk, r, j, j0, d;
    const T nan_or_zero = a->zero_masked_rows ? (T)0 : (T)NAN;
    const T *q_bh = f->q + (b * f->Sq + i0) * E + h * Dk;
    const T *k_bh = f->k + b * Sk * E + h * Dk;
    const T *v_bh = f->v + b * Sk * E + h * Dk;
    T *c_bh = f->ctx + (b * f->Sq + i0) * E + h * Dk;
    T *s = f->scratch + (int64_t)slot * f->scratch_len; /* (QB, KB) */
    T *mx = s + QB * KB;                                 /* (QB) running max */
    T *l = mx + QB;                                      /* (QB) running sum */
    T *acc = l + QB;                                     /* (QB, Dk) */
    for (r = 0; r < nq; r++) {
        mx[r] = -(T)INFINITY;
        l[r] = 0;
    }
    SUF(fill_rows)(acc, nq, Dk, Dk, (T)0);
    for (j0 = 0; j0 < Sk; j0 += KB) {
        int64_t nk = Sk - j0 < KB ? Sk - j0 : KB;
        SUF(mha_gemm_nt)(nq, nk, Dk, q_bh, E, k_bh + j0 * E, E, NULL, s, KB, 0);
        for (r = 0; r < nq; r++) {
            T *srow = s + r * KB, sum = 0, alpha;
            for (j = 0; j < nk; j++) srow[j] *= f->scale;
            SUF(apply_masks)(f, srow, b, h, i0 + r, j0, nk);
            T mnew = SUF(row_max)(srow, nk, mx[r]);
            if (mnew == -(T)INFINITY) { /* nothing visible yet in this row */
                for (j = 0; j < nk; j++) srow[j] = 0;
                continue;
            }
            alpha = EXP(mx[r] - mnew);
            for (j = 0; j < nk; j++) {
                srow[j] = EXP(srow[j] - mnew);
                sum += srow[j];
            }
            if (f->dropout_on) {
                uint64_t idx = ((uint64_t)bh * (uint64_t)f->Sq + (uint64_t)(i0 + r)) *
                                   (uint64_t)Sk + (uint64_t)j0;
                for (j = 0; j < nk; j++)
                    srow[j] = mha_stream_uniform(f->drop_key, idx + (uint64_t)j) >= a->dropout
                                  ? srow[j] * f->drop_scale : (T)0;
            }
            l[r] = l[r] * alpha + sum;
            if (alpha != (T)1)
                for (d = 0; d < Dk; d++) acc[r * Dk + d] *= alpha;
            mx[r] = mnew;
        }
        SUF(mha_gemm_nn)(nq, Dk, nk, s, KB, v_bh + j0 * E, E, NULL, acc, Dk, 1);
    }
    for (r = 0; r < nq; r++) {
        T *c = c_bh + r * E;
        if (mx[r] == -(T)INFINITY) {
            for (d = 0; d < Dk; d++) c[d] = nan_or_zero;
        } else {
            T inv = (T)1 / l[r];
            for (d = 0; d < Dk; d++) c[d] = acc[r * Dk + d] * inv;
        }
    }
}

static mha_status SUF(forward)(const mha_config *cfg, const mha_params *p,
                               const mha_forward_args *a)
{
    mha_sizes sz;
    SUF(fwd) f;
    int64_t n_work = 0, n_scratch = 0, t;
    size_t bytes;
    int slots;
    T *work = NULL;
    mha_status st = mha_check_forward(cfg, p, a, &sz);
    if (st != MHA_OK) return st;
    if (sz.n_out == 0) return MHA_OK; /* B == 0 or Sq == 0: nothing to write */

    memset(&f, 0, sizeof f);
    f.a = a;
    f.B = a->B; f.Sq = a->Sq; f.Sk = a->Sk;
    f.E = cfg->d_model; f.H = cfg->n_heads; f.Dk = f.E / f.H;
    f.scale = (T)(1.0 / sqrt((double)f.Dk));
    f.dropout_on = a->dropout > 0.0;
    f.drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    f.drop_key = mha_stream_key(a->seed, a->counter);
    f.n_qblk = (f.Sq + QB - 1) / QB;

    /* small problems stay on the calling thread */
    slots = mha_get_num_threads();
    {
        double flops = 2.0 * (double)f.B * (double)f.Sq * (double)f.E * (double)f.E * 2.0 +
                       2.0 * (double)f.B * (double)f.Sk * (double)f.E *
                           (double)(cfg->kdim + cfg->vdim) +
                       4.0 * (double)f.B * (double)f.Sq * (double)f.Sk * (double)f.E;
        if (flops < 4e5) slots = 1;
    }

    /* workspace: q and ctx (B, Sq, E), k and v (B, Sk, E), per-slot scratch */
    if (mha_mul(f.B * f.Sk, f.E, &t) || mha_mul(t, 2, &t) || mha_add(t, 2 * sz.n_out, &n_work))
        return MHA_ERR_OVERFLOW;
    if (!a->weights) {
        if (mha_mul((int64_t)QB, (int64_t)KB + 2 + f.Dk, &f.scratch_len) ||
            mha_mul(f.scratch_len, slots, &n_scratch) || mha_add(n_work, n_scratch, &n_work))
            return MHA_ERR_OVERFLOW;
    }
    if (mha_bytes(n_work, sizeof(T), &bytes)) return MHA_ERR_OVERFLOW;
    work = (T *)mha_alloc(bytes);
    if (!work) return MHA_ERR_NOMEM;
    f.q = work;
    f.ctx = f.q + sz.n_out;
    f.k = f.ctx + sz.n_out;
    f.v = f.k + f.B * f.Sk * f.E;
    f.scratch = f.v + f.B * f.Sk * f.E;

    /* the three input projections, one parallel pass over all their tiles */
    SUF(add_job)(&f, (const T *)a->query, (const T *)p->wq, (const T *)p->bq, f.q,
                 f.B * f.Sq, f.E, f.E);
    SUF(add_job)(&f, (const T *)a->key, (const T *)p->wk, (const T *)p->bk, f.k,
                 f.B * f.Sk, f.E, cfg->kdim);
    SUF(add_job)(&f, (const T *)a->value, (const T *)p->wv, (const T *)p->bv, f.v,
                 f.B * f.Sk, f.E, cfg->vdim);
    mha_parallel_for(SUF(job_tiles)(&f), slots, SUF(linear_task), &f);

    /* attention, per (b, h, block of queries) */
    mha_parallel_for(f.B * f.H * f.n_qblk, slots,
                     a->weights ? SUF(attend_weights_task) : SUF(attend_online_task), &f);

    /* the output projection */
    f.n_jobs = 0;
    SUF(add_job)(&f, f.ctx, (const T *)p->wo, (const T *)p->bo, (T *)a->out,
                 f.B * f.Sq, f.E, f.E);
    mha_parallel_for(SUF(job_tiles)(&f), slots, SUF(linear_task), &f);

    mha_free(work);
    return MHA_OK;
}

#undef QB
#undef KB
#undef RM
#undef RN
