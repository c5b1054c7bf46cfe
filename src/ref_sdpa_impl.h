/* ref_sdpa_impl.h: the plain reference of mha_sdpa_forward and
 * mha_sdpa_backward, for T = float and double (included twice by ref.c).
 * Obvious loops, one thread, one row (b, h, i) at a time, the forward
 * recomputed beside each backward step: the oracle the fast path is tested
 * against, sharing nothing with it but the inputs, the argument checks and
 * the dropout stream.  Legend as in mha.h's SDPA section; dX is dL/dX. */

/* One row (b, h, i) of the forward: the weights a[0..S) (after dropout),
 * the softmax p[0..S) and keep[0..S) (the replayed dropout mask); returns 1
 * for a blocked row (every key blocked: a and p all NaN, or 0 with
 * zero_masked_rows). */
static int SUF(ref_sdpa_row)(const mha_sdpa_args *a, int64_t b, int64_t h, int64_t i, T *p,
                             T *arow, uint8_t *keep)
{
    const int64_t S = a->S, D = a->D, hk = h / (a->H / a->Hkv);
    const int64_t coff = a->is_causal == MHA_CAUSAL_LOWER_RIGHT ? a->S - a->L : 0;
    const T scale = (T)mha_score_scale(a->has_scale, a->scale, D);
    const T drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    const T *q_i = (const T *)a->q + ((b * a->H + h) * a->L + i) * D;
    const T *k_b = (const T *)a->k + (b * a->Hkv + hk) * S * D;
    T m = -(T)INFINITY, sum = 0;
    int64_t j, d;
    int n, add, blocked = S > 0;
    T msum;
    /* s_j = q_i·k_j · scale, plus the additive masks, -inf where a blocking
     * mask or causality (j > i + coff) blocks */
    for (j = 0; j < S; j++) {
        T s = 0;
        for (d = 0; d < D; d++) s += q_i[d] * k_b[j * D + d];
        s *= scale;
        for (n = 0, add = 0, msum = 0; n < a->n_masks; n++) {
            const mha_mask *mk = &a->masks[n];
            int64_t off = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                          j * mk->stride[3];
            if (mk->kind != MHA_MASK_ADD) continue;
            msum = add++ ? msum + ((const T *)mk->data)[off] : ((const T *)mk->data)[off];
        }
        if (add) s += msum; /* the masks summed first, as torch sums them */
        for (n = 0; n < a->n_masks; n++) {
            const mha_mask *mk = &a->masks[n];
            int64_t off = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                          j * mk->stride[3];
            if (mk->kind == MHA_MASK_BLOCK && ((const uint8_t *)mk->data)[off]) s = -(T)INFINITY;
        }
        if (a->is_causal && j > i + coff) s = -(T)INFINITY;
        if (a->has_window && a->window_left >= 0 && j - (i + coff) < -a->window_left)
            s = -(T)INFINITY;
        if (a->has_window && a->window_right >= 0 && j - (i + coff) > a->window_right)
            s = -(T)INFINITY;
        if (a->layout.keep && /* the block layout: (i, j)'s block not kept */
            !a->layout.keep[b * a->layout.stride[0] + h * a->layout.stride[1] +
                            (i / a->layout.q_block) * a->layout.nkb + j / a->layout.k_block])
            s = -(T)INFINITY;
        p[j] = s;
    }
    /* p = softmax(s) */
    for (j = 0; j < S; j++) {
        if (p[j] != -(T)INFINITY) blocked = 0;
        if (p[j] != p[j] || m != m) m = (T)NAN;
        else if (p[j] > m) m = p[j];
    }
    for (j = 0; j < S; j++) {
        p[j] = blocked ? (a->zero_masked_rows ? (T)0 : (T)NAN) : EXP(p[j] - m);
        sum += p[j];
    }
    for (j = 0; j < S && !blocked; j++) p[j] /= sum;
    /* a_j = p_j · keep_j / (1 - p_drop) (no dropout in a blocked row) */
    for (j = 0; j < S; j++) {
        uint64_t idx = (((uint64_t)b * (uint64_t)a->H + (uint64_t)h) * (uint64_t)a->L +
                        (uint64_t)i) * (uint64_t)S + (uint64_t)j;
        keep[j] = a->dropout == 0.0 || blocked ||
                  mha_dropout_uniform(a->seed, a->counter, idx) >= a->dropout;
        arow[j] = a->dropout == 0.0 || blocked ? p[j] : keep[j] ? p[j] * drop_scale : (T)0;
    }
    return blocked;
}

static mha_status SUF(sdpa_forward_ref)(const mha_sdpa_args *a)
{
    mha_sizes sz;
    int64_t b, h, i, j, d, S, Dv;
    T *p = NULL, *arow = NULL;
    uint8_t *keep = NULL;
    mha_status st = mha_check_sdpa(a, 1, &sz);
    if (st != MHA_OK) return st;
    S = a->S;
    Dv = a->Dv;
    if (!(p = (T *)mha_alloc((size_t)S * sizeof(T))) ||
        !(arow = (T *)mha_alloc((size_t)S * sizeof(T))) || !(keep = (uint8_t *)mha_alloc((size_t)S))) {
        st = MHA_ERR_NOMEM;
        goto done;
    }
    for (b = 0; b < a->B; b++)
        for (h = 0; h < a->H; h++)
            for (i = 0; i < a->L; i++) {
                const int64_t bh = b * a->H + h, hk = h / (a->H / a->Hkv);
                const T *v_b = (const T *)a->v + (b * a->Hkv + hk) * S * Dv;
                T *o = (T *)a->out + (bh * a->L + i) * Dv;
                int blocked = SUF(ref_sdpa_row)(a, b, h, i, p, arow, keep);
                for (j = 0; j < S && a->head_mask; j++) /* A = A · head_mask[b, h] */
                    arow[j] *= ((const T *)a->head_mask)[b * a->head_mask_stride[0] +
                                                         h * a->head_mask_stride[1]];
                if (a->weights)
                    for (j = 0; j < S; j++) ((T *)a->weights)[(bh * a->L + i) * S + j] = arow[j];
                /* out_i = Σ_j a_j v_j (a blocked row: NaN, or 0·V with
                 * zero_masked_rows, its a being 0; S == 0: 0) */
                for (d = 0; d < Dv; d++) {
                    T c = 0;
                    if (blocked && !a->zero_masked_rows) c = (T)NAN;
                    else
                        for (j = 0; j < S; j++) c += arow[j] * v_b[j * Dv + d];
                    o[d] = c;
                }
            }
done:
    mha_free(p);
    mha_free(arow);
    mha_free(keep);
    return st;
}

static mha_status SUF(sdpa_backward_ref)(const mha_sdpa_backward_args *ba)
{
    mha_sizes sz;
    const mha_sdpa_args *a;
    int64_t b, h, i, j, d, S, D, Dv;
    T *p = NULL, *arow = NULL, *drow = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    uint8_t *keep = NULL;
    mha_status st;
    if (!ba) return MHA_ERR_ARG;
    a = &ba->fwd;
    st = mha_check_sdpa(a, 0, &sz);
    if (st != MHA_OK) return st;
    if (sz.n_out > 0 && !ba->grad_out) return MHA_ERR_ARG;
    S = a->S; D = a->D; Dv = a->Dv;
    st = MHA_ERR_NOMEM;
    if (!(p = (T *)mha_alloc((size_t)S * sizeof(T))) ||
        !(arow = (T *)mha_alloc((size_t)S * sizeof(T))) ||
        !(drow = (T *)mha_alloc((size_t)S * sizeof(T))) || !(keep = (uint8_t *)mha_alloc((size_t)S)) ||
        !(dq = (T *)mha_alloc((size_t)sz.n_query * sizeof(T))) ||
        !(dk = (T *)mha_alloc((size_t)sz.n_key * sizeof(T))) ||
        !(dv = (T *)mha_alloc((size_t)sz.n_value * sizeof(T))))
        goto done;
    memset(dq, 0, (size_t)sz.n_query * sizeof(T));
    memset(dk, 0, (size_t)sz.n_key * sizeof(T));
    memset(dv, 0, (size_t)sz.n_value * sizeof(T));
    const T scale = (T)mha_score_scale(a->has_scale, a->scale, D);
    const T drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    for (b = 0; b < a->B; b++)
        for (h = 0; h < a->H; h++)
            for (i = 0; i < a->L; i++) {
                const int64_t bh = b * a->H + h, bk = b * a->Hkv + h / (a->H / a->Hkv);
                const T *q_i = (const T *)a->q + (bh * a->L + i) * D;
                const T *k_b = (const T *)a->k + bk * S * D;
                const T *v_b = (const T *)a->v + bk * S * Dv;
                const T *do_i = (const T *)ba->grad_out + (bh * a->L + i) * Dv;
                T *dq_i = dq + (bh * a->L + i) * D, *dk_b = dk + bk * S * D, *dv_b = dv + bk * S * Dv;
                T dot = 0;
                /* forward: the row's p and a = dropout(p) */
                int blocked = SUF(ref_sdpa_row)(a, b, h, i, p, arow, keep);
                const T hm = a->head_mask ? ((const T *)a->head_mask)[
                    b * a->head_mask_stride[0] + h * a->head_mask_stride[1]] : (T)1;
                for (j = 0; j < S && a->head_mask; j++) arow[j] *= hm; /* a·m */
                /* backward of out_i = Σ_j a_j v_j: dv_j += a_j dout_i,
                 * da_j = dout_i·v_j (plus d weights: the weights are a) */
                for (j = 0; j < S; j++) {
                    T da = 0;
                    for (d = 0; d < Dv; d++) {
                        dv_b[j * Dv + d] += arow[j] * do_i[d];
                        da += do_i[d] * v_b[j * Dv + d];
                    }
                    if (ba->grad_weights)
                        da += ((const T *)ba->grad_weights)[(bh * a->L + i) * S + j];
                    drow[j] = a->head_mask ? da * hm : da; /* back through a·m */
                }
                /* (a blocked row of zero_masked_rows: p = 0, ds = 0·dp, NaN only
                 * where V held NaN or inf, as torch's) */
                /* backward of a_j = p_j · keep_j / (1 - p_drop) */
                if (a->dropout > 0.0 && !blocked)
                    for (j = 0; j < S; j++) drow[j] = keep[j] ? drow[j] * drop_scale : (T)0;
                /* backward of p = softmax(s): ds_j = p_j (dp_j - Σ_k p_k dp_k) */
                for (j = 0; j < S; j++) dot += p[j] * drow[j];
                for (j = 0; j < S; j++) drow[j] = p[j] * (drow[j] - dot);
                if (ba->grad_scores) /* dL/d masked scores: an additive mask's gradient */
                    memcpy((T *)ba->grad_scores + (bh * a->L + i) * S, drow, (size_t)S * sizeof(T));
                /* backward of s_j = q_i·k_j · scale (masks are constants) */
                for (j = 0; j < S; j++) {
                    const T ds = drow[j] * scale;
                    for (d = 0; d < D; d++) {
                        dq_i[d] += ds * k_b[j * D + d];
                        dk_b[j * D + d] += ds * q_i[d];
                    }
                }
            }
    if (ba->grad_q) memcpy(ba->grad_q, dq, (size_t)sz.n_query * sizeof(T));
    if (ba->grad_k) memcpy(ba->grad_k, dk, (size_t)sz.n_key * sizeof(T));
    if (ba->grad_v) memcpy(ba->grad_v, dv, (size_t)sz.n_value * sizeof(T));
    st = MHA_OK;
done:
    mha_free(p); mha_free(arow); mha_free(drow); mha_free(keep);
    mha_free(dq); mha_free(dk); mha_free(dv);
    return st;
}
