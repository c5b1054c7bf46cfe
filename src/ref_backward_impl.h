/* ref_backward_impl.h: the plain reference backward pass, for T = float and
 * double (included twice by ref.c after ref_forward_impl.h, whose
 * ref_linear it uses).  Obvious loops, one thread, written like llm.c's
 * attention_backward: the forward (ref_forward_impl.h) is recomputed row by
 * row, and each step of the backward quotes the forward line it undoes.
 * It shares nothing with the fast backward (backward_impl.h) but the
 * inputs: the oracle the C tests hold mha_backward to.  dX is dL/dX.
 * Legend as in mha.h. */

/* backward of y (M, N) = x (M, K) · w (N, K)ᵀ + b (N):
 *   dx (M, K) = dy·w     dw (N, K) = dyᵀ·x     db (N) = Σ_rows dy
 * each output NULL when not wanted; all overwritten */
static void SUF(ref_linear_backward)(const T *dy, const T *x, const T *w, T *dx, T *dw,
                                     T *db, int64_t M, int64_t N, int64_t K)
{
    int64_t i, o, k;
    if (dx)
        for (i = 0; i < M; i++)
            for (k = 0; k < K; k++) {
                T s = 0;
                for (o = 0; o < N; o++) s += dy[i * N + o] * w[o * K + k];
                dx[i * K + k] = s;
            }
    if (dw)
        for (o = 0; o < N; o++)
            for (k = 0; k < K; k++) {
                T s = 0;
                for (i = 0; i < M; i++) s += dy[i * N + o] * x[i * K + k];
                dw[o * K + k] = s;
            }
    if (db)
        for (o = 0; o < N; o++) {
            T s = 0;
            for (i = 0; i < M; i++) s += dy[i * N + o];
            db[o] = s;
        }
}

static mha_status SUF(backward_ref)(const mha_config *cfg, const mha_params *p,
                                    const mha_backward_args *ba)
{
    mha_sizes sz;
    mha_forward_args chk;
    const mha_forward_args *a;
    int64_t B, Sq, Sk, Skx, E, H, Dk, Ek, Ev, b, h, i, j, d, n_kv, Ekv, hk;
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM], total;
    size_t bytes;
    T *q = NULL, *k = NULL, *v = NULL, *ctx = NULL, *dctx = NULL, *dq = NULL, *dk = NULL,
      *dv = NULL, *row = NULL, *arow = NULL, *drow = NULL, *g;
    uint8_t *keep = NULL; /* the replayed dropout mask of one row */
    mha_status st;
    if (!ba) return MHA_ERR_ARG;
    a = &ba->fwd;
    chk = *a; /* the forward's checks; grad_out has out's shape */
    chk.out = (void *)ba->grad_out;
    chk.weights = NULL;
    st = mha_check_forward(cfg, p, &chk, &sz);
    if (st != MHA_OK) return st;
    st = mha_param_layout(cfg, offset, size, &total);
    if (st != MHA_OK) return st;
    B = a->B; Sq = a->Sq; Sk = a->Sk;
    E = cfg->d_model; H = cfg->n_heads; Dk = E / H; Ek = cfg->kdim; Ev = cfg->vdim;
    Skx = Sk + sz.extra; /* the given keys, then the extra ones */
    Ekv = mha_kv_heads(cfg) * Dk; /* K and V's width: Hkv heads */
    n_kv = B * Skx * Ekv; /* checked by mha_check_forward */
    g = (T *)ba->grad_params;

    st = MHA_ERR_NOMEM;
    if (mha_bytes(sz.n_out, sizeof(T), &bytes)) return MHA_ERR_OVERFLOW;
    if (!(q = (T *)mha_alloc(bytes)) || !(ctx = (T *)mha_alloc(bytes)) ||
        !(dctx = (T *)mha_alloc(bytes)) || !(dq = (T *)mha_alloc(bytes)))
        goto done;
    if (mha_bytes(n_kv, sizeof(T), &bytes)) { st = MHA_ERR_OVERFLOW; goto done; }
    if (!(k = (T *)mha_alloc(bytes)) || !(v = (T *)mha_alloc(bytes)) ||
        !(dk = (T *)mha_alloc(bytes)) || !(dv = (T *)mha_alloc(bytes)))
        goto done;
    if (!(row = (T *)mha_alloc((size_t)Skx * sizeof(T))) ||
        !(arow = (T *)mha_alloc((size_t)Skx * sizeof(T))) ||
        !(drow = (T *)mha_alloc((size_t)Skx * sizeof(T))) ||
        !(keep = (uint8_t *)mha_alloc((size_t)Skx)))
        goto done;
    memset(dq, 0, (size_t)sz.n_out * sizeof(T));
    memset(dk, 0, (size_t)n_kv * sizeof(T));
    memset(dv, 0, (size_t)n_kv * sizeof(T));

    /* forward: Q = query·W_qᵀ + b_q, K = key·W_kᵀ + b_k, V = value·W_vᵀ + b_v */
    SUF(ref_linear)((const T *)a->query, (const T *)p->wq, (const T *)p->bq, q, B * Sq, E, E);
    for (b = 0; b < B && Sk > 0; b++) { /* ... each batch's Sk rows, then K, V += extra rows */
        SUF(ref_linear)((const T *)a->key + b * Sk * Ek, (const T *)p->wk, (const T *)p->bk,
                        k + b * Skx * Ekv, Sk, Ekv, Ek);
        SUF(ref_linear)((const T *)a->value + b * Sk * Ev, (const T *)p->wv, (const T *)p->bv,
                        v + b * Skx * Ekv, Sk, Ekv, Ev);
    }
    SUF(ref_extra_rows)(cfg, (const T *)p->bias_k, k, B, Sk, Skx, Ekv);
    SUF(ref_extra_rows)(cfg, (const T *)p->bias_v, v, B, Sk, Skx, Ekv);
    /* backward of out = ctx·W_oᵀ + b_o, for ctx: dctx = d out·W_o */
    SUF(ref_linear_backward)((const T *)ba->grad_out, NULL, (const T *)p->wo, dctx, NULL, NULL,
                             B * Sq, E, E);

    const T scale = (T)mha_score_scale(a->has_scale, a->scale, Dk);
    const T drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    const T nan_or_zero = a->zero_masked_rows ? (T)0 : (T)NAN;
    for (b = 0; b < B; b++)
        for (h = 0; h < H; h++)
            for (i = 0; i < Sq; i++) {
                const T *q_i = q + (b * Sq + i) * E + h * Dk;     /* (Dk) */
                const T *dc_i = dctx + (b * Sq + i) * E + h * Dk; /* (Dk) */
                T *c_i = ctx + (b * Sq + i) * E + h * Dk;
                T *dq_i = dq + (b * Sq + i) * E + h * Dk;
                T m = -(T)INFINITY, sum = 0, dot = 0;
                int blocked_row;
                /* forward: s_j = q_i·k_j · scale + masks (ref_scores) */
                hk = h / (H / (Ekv / Dk)); /* the key/value head of query head h */
                SUF(ref_scores)(a, q_i, k + b * Skx * Ekv, Ekv, Dk, Skx, b, h, hk, i, scale, row);
                /* forward: p = softmax(s); a row with every key blocked is
                 * NaN, or 0 with zero_masked_rows (Sk == 0 is no such row) */
                blocked_row = Skx > 0;
                for (j = 0; j < Skx; j++) {
                    if (row[j] != -(T)INFINITY) blocked_row = 0;
                    if (row[j] != row[j] || m != m) m = (T)NAN;
                    else if (row[j] > m) m = row[j];
                }
                for (j = 0; j < Skx; j++) {
                    row[j] = blocked_row ? nan_or_zero : EXP(row[j] - m);
                    sum += row[j];
                }
                for (j = 0; j < Skx && !blocked_row; j++) row[j] /= sum;
                /* forward: a_j = p_j · keep_j / (1 - p_drop) (not in a blocked row) */
                for (j = 0; j < Skx; j++) {
                    uint64_t idx = (((uint64_t)b * (uint64_t)H + (uint64_t)h) * (uint64_t)Sq +
                                    (uint64_t)i) * (uint64_t)Skx + (uint64_t)j;
                    keep[j] = a->dropout == 0.0 || blocked_row ||
                              mha_dropout_uniform(a->seed, a->counter, idx) >= a->dropout;
                    arow[j] = a->dropout == 0.0 || blocked_row ? row[j]
                              : keep[j] ? row[j] * drop_scale : (T)0;
                }
                /* forward: a_j = a_j · m, the head mask of (b, h) */
                const T hm = a->head_mask ? ((const T *)a->head_mask)[
                    b * a->head_mask_stride[0] + h * a->head_mask_stride[1]] : (T)1;
                for (j = 0; j < Skx && a->head_mask; j++) arow[j] *= hm;
                /* forward: ctx_i = Σ_j a_j v_j (a blocked row: NaN or 0) */
                for (d = 0; d < Dk; d++) {
                    T c = 0;
                    if (blocked_row && !a->zero_masked_rows) c = nan_or_zero;
                    else /* zero_masked_rows: a blocked row's a is 0, its context 0·V */
                        for (j = 0; j < Skx; j++) c += arow[j] * v[(b * Skx + j) * Ekv + hk * Dk + d];
                    c_i[d] = c;
                }
                /* backward of ctx_i = Σ_j a_j v_j: dv_j += a_j dctx_i,
                 * da_j = dctx_i·v_j (plus d weights: the weights are a) */
                for (j = 0; j < Skx; j++) {
                    T da = 0;
                    for (d = 0; d < Dk; d++) {
                        dv[(b * Skx + j) * Ekv + hk * Dk + d] += arow[j] * dc_i[d];
                        da += dc_i[d] * v[(b * Skx + j) * Ekv + hk * Dk + d];
                    }
                    if (ba->grad_weights)
                        da += ((const T *)ba->grad_weights)[((b * H + h) * Sq + i) * Skx + j];
                    drow[j] = da;
                }
                /* (a blocked row of zero_masked_rows: p = 0, ds = 0·dp, NaN only
                 * where V held NaN or inf, as torch's) */
                /* backward of a_j = a_j · m: da_j = da_j · m */
                for (j = 0; j < Skx && a->head_mask; j++) drow[j] *= hm;
                /* backward of a_j = p_j · keep_j / (1 - p_drop): dp_j = da_j · keep_j / (1 - p_drop) */
                if (a->dropout > 0.0 && !blocked_row)
                    for (j = 0; j < Skx; j++) drow[j] = keep[j] ? drow[j] * drop_scale : (T)0;
                /* backward of p = softmax(s): ds_j = p_j (dp_j - Σ_k p_k dp_k) */
                for (j = 0; j < Skx; j++) dot += row[j] * drow[j];
                for (j = 0; j < Skx; j++) drow[j] = row[j] * (drow[j] - dot);
                if (ba->grad_scores) /* dL/d masked scores: an additive mask's gradient */
                    memcpy((T *)ba->grad_scores + ((b * H + h) * Sq + i) * Skx, drow,
                           (size_t)Skx * sizeof(T));
                /* the masks are constants: ds passes where s was finite (p_j = 0
                 * elsewhere, so ds_j = 0 there) */
                /* backward of s_j = q_i·k_j · scale: dq_i += ds_j k_j · scale,
                 * dk_j += ds_j q_i · scale */
                for (j = 0; j < Skx; j++) {
                    const T ds = drow[j] * scale;
                    for (d = 0; d < Dk; d++) {
                        dq_i[d] += ds * k[(b * Skx + j) * Ekv + hk * Dk + d];
                        dk[(b * Skx + j) * Ekv + hk * Dk + d] += ds * q_i[d];
                    }
                }
            }

    /* backward of out = ctx·W_oᵀ + b_o: dW_o = d outᵀ·ctx, db_o = Σ_rows d out */
    if (g)
        SUF(ref_linear_backward)((const T *)ba->grad_out, ctx, NULL, NULL, g + offset[MHA_WO],
                                 cfg->bias ? g + offset[MHA_BO] : NULL, B * Sq, E, E);
    /* backward of K, V += extra rows: d bias_k = Σ_b dk[b, Sk] (likewise v);
     * then the given rows alone, (B*Sk, E) */
    if (g && cfg->add_bias_kv)
        for (d = 0; d < Ekv; d++) {
            T sk = 0, sv = 0;
            for (b = 0; b < B; b++) {
                sk += dk[(b * Skx + Sk) * Ekv + d];
                sv += dv[(b * Skx + Sk) * Ekv + d];
            }
            g[offset[MHA_BIAS_K] + d] = sk;
            g[offset[MHA_BIAS_V] + d] = sv;
        }
    for (b = 1; b < B && Skx != Sk; b++) {
        memmove(dk + b * Sk * Ekv, dk + b * Skx * Ekv, (size_t)(Sk * Ekv) * sizeof(T));
        memmove(dv + b * Sk * Ekv, dv + b * Skx * Ekv, (size_t)(Sk * Ekv) * sizeof(T));
    }
    /* backward of Q = query·W_qᵀ + b_q, K = key·W_kᵀ + b_k, V = value·W_vᵀ + b_v */
    SUF(ref_linear_backward)(dq, (const T *)a->query, (const T *)p->wq, (T *)ba->grad_query,
                             g ? g + offset[MHA_WQ] : NULL,
                             g && cfg->bias ? g + offset[MHA_BQ] : NULL, B * Sq, E, E);
    SUF(ref_linear_backward)(dk, (const T *)a->key, (const T *)p->wk, (T *)ba->grad_key,
                             g ? g + offset[MHA_WK] : NULL,
                             g && cfg->bias ? g + offset[MHA_BK] : NULL, B * Sk, Ekv, Ek);
    SUF(ref_linear_backward)(dv, (const T *)a->value, (const T *)p->wv, (T *)ba->grad_value,
                             g ? g + offset[MHA_WV] : NULL,
                             g && cfg->bias ? g + offset[MHA_BV] : NULL, B * Sk, Ekv, Ev);
    st = MHA_OK;
done:
    mha_free(q); mha_free(k); mha_free(v); mha_free(ctx); mha_free(dctx);
    mha_free(dq); mha_free(dk); mha_free(dv);
    mha_free(row); mha_free(arow); mha_free(drow); mha_free(keep);
    return st;
}
