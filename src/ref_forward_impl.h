/* ref_forward_impl.h: the plain reference forward pass, for T = float and
 * double (included twice by ref.c).  Obvious loops, one thread, one row of
 * scores at a time: the oracle the fast path is tested against.
 * Legend as in mha.h. */

/* Append K or V's extra rows to x (B, Sk + extra, E), whose first Sk rows
 * per batch are set: add_bias_kv's bias row, then add_zero_attn's zeros. */
static void SUF(ref_extra_rows)(const mha_config *cfg, const T *bias, T *x, int64_t B,
                                int64_t Sk, int64_t Skx, int64_t E)
{
    int64_t b, c;
    for (b = 0; b < B; b++) {
        int64_t j = Sk;
        if (cfg->add_bias_kv) {
            for (c = 0; c < E; c++) x[(b * Skx + j) * E + c] = bias[c];
            j++;
        }
        if (cfg->add_zero_attn)
            for (c = 0; c < E; c++) x[(b * Skx + j) * E + c] = 0;
    }
}

/* 1 when causality or the sliding window blocks key j of row (b, h, i):
 * they cover the Sk given keys, never the extra ones */
static int SUF(ref_causal_blocks)(const mha_forward_args *a, int64_t i, int64_t j)
{
    const int64_t coff = a->is_causal == MHA_CAUSAL_LOWER_RIGHT ? a->Sk - a->Sq : 0;
    if (j >= a->Sk) return 0;
    if (a->is_causal && j > i + coff) return 1;
    if (a->has_window && a->window_left >= 0 && j - (i + coff) < -a->window_left) return 1;
    if (a->has_window && a->window_right >= 0 && j - (i + coff) > a->window_right) return 1;
    return 0;
}

/* forward: the scores of query i (batch b, head h) against every key j <
 * Skx: s_j = q_i·k_j · scale, plus the additive masks, -inf where a
 * blocking mask, causality, the window or the layout blocks (never the extra keys
 * j >= Sk).  q_i (Dk) is head h's slice of a query row; k_b (Skx, E) is
 * batch b's keys (E: Hkv*Dk), hk the key head of query head h.  The forward and the backward reference both call it. */
static void SUF(ref_scores)(const mha_forward_args *a, const T *q_i, const T *k_b, int64_t E,
                            int64_t Dk, int64_t Skx, int64_t b, int64_t h, int64_t hk, int64_t i,
                            T scale, T *row)
{
    int64_t j, d;
    int n, add;
    T sum;
    for (j = 0; j < Skx; j++) {
        T s = 0;
        for (d = 0; d < Dk; d++) s += q_i[d] * k_b[j * E + hk * Dk + d];
        s *= scale;
        for (n = 0, add = 0, sum = 0; n < a->n_masks && j < a->Sk; n++) {
            const mha_mask *mk = &a->masks[n];
            int64_t off = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                          j * mk->stride[3];
            if (mk->kind != MHA_MASK_ADD) continue;
            sum = add++ ? sum + ((const T *)mk->data)[off] : ((const T *)mk->data)[off];
        }
        if (add) s += sum; /* the masks summed first, as torch sums them */
        for (n = 0; n < a->n_masks && j < a->Sk; n++) {
            const mha_mask *mk = &a->masks[n];
            int64_t off = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                          j * mk->stride[3];
            if (mk->kind == MHA_MASK_BLOCK && ((const uint8_t *)mk->data)[off])
                s = -(T)INFINITY;
        }
        if (SUF(ref_causal_blocks)(a, i, j)) s = -(T)INFINITY;
        if (a->layout.keep && j < a->Sk && /* the block layout: (i, j)'s block not kept */
            !a->layout.keep[b * a->layout.stride[0] + h * a->layout.stride[1] +
                            (i / a->layout.q_block) * a->layout.nkb + j / a->layout.k_block])
            s = -(T)INFINITY;
        row[j] = s;
    }
}

/* y (M, N) = x (M, K) · w (N, K)ᵀ + b (N) */
static void SUF(ref_linear)(const T *x, const T *w, const T *b, T *y,
                            int64_t M, int64_t N, int64_t K)
{
    int64_t i, o, k;
    for (i = 0; i < M; i++)
        for (o = 0; o < N; o++) {
            T s = 0;
            for (k = 0; k < K; k++) s += x[i * K + k] * w[o * K + k];
            y[i * N + o] = b ? s + b[o] : s;
        }
}

static mha_status SUF(forward_ref)(const mha_config *cfg, const mha_params *p,
                                   const mha_forward_args *a)
{
    mha_sizes sz;
    int64_t B = a ? a->B : 0, Sq = a ? a->Sq : 0, Sk = a ? a->Sk : 0;
    int64_t E, H, Dk, b, h, i, j, d, n_kv, Skx, Ekv, hk;
    size_t bytes;
    T *q = NULL, *k = NULL, *v = NULL, *ctx = NULL, *row = NULL;
    mha_status st = mha_check_forward(cfg, p, a, &sz);
    if (st != MHA_OK) return st;
    if (sz.n_out == 0) return MHA_OK;
    E = cfg->d_model;
    H = cfg->n_heads;
    Dk = E / H;
    Ekv = mha_kv_heads(cfg) * Dk; /* K and V's width: Hkv heads */
    Skx = Sk + sz.extra; /* the given keys, then the extra ones */
    n_kv = B * Skx * Ekv; /* checked by mha_check_forward */
    st = MHA_ERR_NOMEM;
    if (mha_bytes(sz.n_out, sizeof(T), &bytes)) return MHA_ERR_OVERFLOW;
    if (!(q = (T *)mha_alloc(bytes)) || !(ctx = (T *)mha_alloc(bytes))) goto done;
    if (mha_bytes(n_kv, sizeof(T), &bytes)) { st = MHA_ERR_OVERFLOW; goto done; }
    if (!(k = (T *)mha_alloc(bytes)) || !(v = (T *)mha_alloc(bytes))) goto done;
    if (!(row = (T *)mha_alloc((size_t)Skx * sizeof(T)))) goto done;

    SUF(ref_linear)((const T *)a->query, (const T *)p->wq, (const T *)p->bq, q, B * Sq, E, E);
    for (b = 0; b < B && Sk > 0; b++) { /* each batch's Sk rows, then its extra ones */
        SUF(ref_linear)((const T *)a->key + b * Sk * cfg->kdim, (const T *)p->wk,
                        (const T *)p->bk, k + b * Skx * Ekv, Sk, Ekv, cfg->kdim);
        SUF(ref_linear)((const T *)a->value + b * Sk * cfg->vdim, (const T *)p->wv,
                        (const T *)p->bv, v + b * Skx * Ekv, Sk, Ekv, cfg->vdim);
    }
    SUF(ref_extra_rows)(cfg, (const T *)p->bias_k, k, B, Sk, Skx, Ekv);
    SUF(ref_extra_rows)(cfg, (const T *)p->bias_v, v, B, Sk, Skx, Ekv);

    const T scale = (T)mha_score_scale(a->has_scale, a->scale, Dk);
    const T drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    for (b = 0; b < B; b++)
        for (h = 0; h < H; h++)
            for (i = 0; i < Sq; i++) {
                /* scores of query i against every key (of key head hk) */
                T m = -(T)INFINITY, sum = 0;
                int blocked_row;
                hk = h / (H / (Ekv / Dk));
                SUF(ref_scores)(a, q + (b * Sq + i) * E + h * Dk, k + b * Skx * Ekv, Ekv, Dk,
                                Skx, b, h, hk, i, scale, row);
                /* softmax, with NaN rows where every key is blocked (Skx == 0
                 * is no such row: its context is an empty sum, 0) */
                blocked_row = Skx > 0;
                for (j = 0; j < Skx; j++) {
                    if (row[j] != -(T)INFINITY) blocked_row = 0;
                    if (row[j] > m || row[j] != row[j]) m = (m != m) ? m : row[j];
                }
                for (j = 0; j < Skx; j++) {
                    if (blocked_row) {
                        row[j] = a->zero_masked_rows ? (T)0 : (T)NAN;
                        continue;
                    }
                    row[j] = EXP(row[j] - m);
                    sum += row[j];
                }
                for (j = 0; j < Skx && !blocked_row; j++) {
                    row[j] /= sum;
                    if (a->dropout > 0.0) {
                        uint64_t idx = (((uint64_t)b * (uint64_t)H + (uint64_t)h) * (uint64_t)Sq +
                                        (uint64_t)i) * (uint64_t)Skx + (uint64_t)j;
                        if (mha_dropout_uniform(a->seed, a->counter, idx) >= a->dropout)
                            row[j] *= drop_scale;
                        else
                            row[j] = 0;
                    }
                }
                /* the head mask: a_j · m (b, h) */
                for (j = 0; j < Skx && a->head_mask; j++)
                    row[j] *= ((const T *)a->head_mask)[b * a->head_mask_stride[0] +
                                                        h * a->head_mask_stride[1]];
                if (a->weights && a->average_weights) { /* the heads' mean, in head order */
                    T *o = (T *)a->weights + (b * Sq + i) * Skx;
                    for (j = 0; j < Skx; j++) {
                        o[j] = h == 0 ? row[j] : o[j] + row[j];
                        if (h == H - 1) o[j] /= (T)H;
                    }
                } else if (a->weights) {
                    for (j = 0; j < Skx; j++)
                        ((T *)a->weights)[((b * H + h) * Sq + i) * Skx + j] = row[j];
                }
                for (d = 0; d < Dk; d++) {
                    T c = 0;
                    if (blocked_row && !a->zero_masked_rows) c = (T)NAN;
                    else /* zero_masked_rows: a blocked row's weights are 0, its context 0·V */
                        for (j = 0; j < Skx; j++) c += row[j] * v[(b * Skx + j) * Ekv + hk * Dk + d];
                    ctx[(b * Sq + i) * E + h * Dk + d] = c;
                }
            }
    SUF(ref_linear)(ctx, (const T *)p->wo, (const T *)p->bo, (T *)a->out, B * Sq, E, E);
    st = MHA_OK;
done:
    mha_free(q);
    mha_free(k);
    mha_free(v);
    mha_free(ctx);
    mha_free(row);
    return st;
}
