/* sdpa_backward_impl.h: mha_sdpa_backward, the gradients of mha_sdpa_forward,
 * written once for T = float and T = double (included by backward.c after
 * backward_impl.h, whose attention task it runs on the caller's heads, as
 * the module's backward runs it on what mha_forward_save kept: per
 * (b, key/value head h'), every query head of its group in turn, dk and dv
 * summed over the group in that order).  Legend as in mha.h's SDPA section.
 *
 *   forward                        backward
 *   kt = k transposed per head     dk (B, Hkv, S, D) written per (b, h') directly
 *   S = q_bh·kt_bh' · scale        dq_bh = dS·k_bh' · scale   dk_bh' += dSᵀ·q_bh · scale
 *   P = softmax(masked(S))         dS_j = P_j (dP_j - Σ_k P_k dP_k)
 *   A = dropout(P)                 dP = dA · keep / (1 - p)
 *   out_bh = A·v_bh'               dA = dout_bh·v_bh'ᵀ (+ d weights)   dv_bh' += Aᵀ·dout_bh */

static mha_status SUF(sdpa_backward)(const mha_sdpa_backward_args *a)
{
    mha_sizes sz;
    SUF(bwd) f;
    SUF(sdpa_tr) tr;
    mha_poll_state ps;
    const mha_sdpa_args *fa;
    int64_t n_work, t, keep_total;
    size_t bytes;
    int slots;
    T *work;
    mha_status st;
    if (!a) return MHA_ERR_ARG;
    fa = &a->fwd;
    st = mha_check_sdpa(fa, 0, &sz);
    if (st != MHA_OK) return st;
    if (sz.n_out > 0 && !a->grad_out) return MHA_ERR_ARG;
    if (sz.n_out == 0 || fa->S == 0) { /* nothing reaches q, k or v */
        if (a->grad_q) memset(a->grad_q, 0, (size_t)sz.n_query * sizeof(T));
        if (a->grad_k) memset(a->grad_k, 0, (size_t)sz.n_key * sizeof(T));
        if (a->grad_v) memset(a->grad_v, 0, (size_t)sz.n_value * sizeof(T));
        if (a->grad_scores) memset(a->grad_scores, 0, (size_t)sz.n_weights * sizeof(T));
        return MHA_OK;
    }

    memset(&f, 0, sizeof f);
    f.grad_weights = (const T *)a->grad_weights;
    f.dscores = (T *)a->grad_scores;
    if (f.dscores) memset(f.dscores, 0, (size_t)sz.n_weights * sizeof(T)); /* blocked keys: 0 */
    f.rr = mha_rows_make(fa->masks, fa->n_masks, fa->is_causal, fa->L, fa->S,
                         fa->zero_masked_rows);
    mha_rows_window(&f.rr, fa->has_window, fa->window_left, fa->window_right, fa->L, fa->S);
    f.rr.lay = fa->layout;
    f.B = fa->B; f.H = fa->H; f.Hkv = fa->Hkv;
    f.Sq = fa->L; f.Sk = f.Skg = fa->S;
    f.Dk = fa->D; f.Dv = fa->Dv;
    f.E = 0; /* no (B, S, E) layouts: every array is per head */
    f.scale = (T)mha_score_scale(fa->has_scale, fa->scale, fa->D);
    f.kern = SUF(mha_kern_get)();
    (void)SUF(mha_tn_pack)(f.kern); /* measured here, before the passes, if not yet */
    f.dropout = fa->dropout;
    f.dropout_on = fa->dropout > 0.0;
    f.drop_scale = fa->dropout < 1.0 ? (T)(1.0 / (1.0 - fa->dropout)) : (T)0;
    f.drop_key = mha_stream_key(fa->seed, fa->counter);
    f.saved = 1;
    f.q = (T *)fa->q;
    f.v = (T *)fa->v;
    f.dctx = (T *)a->grad_out;
    f.dc_sb = f.H * f.Sq * f.Dv; f.dc_sh = f.Sq * f.Dv; f.dc_ld = f.Dv;
    f.dq = (T *)a->grad_q;
    f.dq_sb = f.H * f.Sq * f.Dk; f.dq_sh = f.Sq * f.Dk; f.dq_ld = f.Dk;
    f.dk = (T *)a->grad_k;
    f.dk_sb = f.Hkv * f.Sk * f.Dk; f.dk_sh = f.Sk * f.Dk; f.dk_ld = f.Dk;
    f.dv = (T *)a->grad_v;
    f.dv_sb = f.Hkv * f.Sk * f.Dv; f.dv_sh = f.Sk * f.Dv; f.dv_ld = f.Dv;

    slots = mha_get_num_threads();
    if (5.0 * (double)f.B * (double)f.H * (double)f.Sq * (double)f.Sk *
            (double)(f.Dk + f.Dv) < 4e5)
        slots = 1;
    /* workspace: kt (B, Hkv, D, S); per slot P, D (QB, S), dq's block
     * (QB, D), dk (S, D), dv (S, Dv), then mha_gemm's packing */
    if (SUF(bwd_scratch_len)(&f) || mha_add(f.scratch_len, MHA_GEMM_SCRATCH, &t) || mha_mul(t, slots, &t) ||
        mha_add(t, sz.n_key, &n_work) ||
        (fa->head_mask && mha_add(n_work, sz.n_out, &n_work)) || /* dout times the head mask */
        mha_bytes(n_work, sizeof(T), &bytes))
        return MHA_ERR_OVERFLOW;
    f.keep_len = f.dropout_on ? SUF(bwd_keep_len)(&f) : 0; /* (QB, S) bytes */
    if (mha_mul(f.keep_len, slots, &keep_total)) return MHA_ERR_OVERFLOW;
    work = (T *)mha_work_alloc(bytes);
    f.keep = (uint8_t *)mha_alloc((size_t)keep_total);
    if (!work || !f.keep) {
        mha_work_free(work);
        mha_free(f.keep);
        return MHA_ERR_NOMEM;
    }
    f.k = work;
    f.scratch = work + sz.n_key;
    f.pack = f.scratch + f.scratch_len * slots;
    if (fa->head_mask) { /* the task scales dctx by the head mask in place: a copy */
        f.dctx = f.pack + MHA_GEMM_SCRATCH * slots;
        memcpy(f.dctx, a->grad_out, (size_t)sz.n_out * sizeof(T));
        f.hmask = (const T *)fa->head_mask;
        f.hm_sb = fa->head_mask_stride[0];
        f.hm_sh = fa->head_mask_stride[1];
    }

    mha_poll_start(&ps, fa->poll, fa->poll_ctx);
    f.ps = &ps;
    tr.kern = f.kern;
    tr.k = (const T *)fa->k;
    tr.kt = work;
    tr.S = fa->S;
    tr.D = fa->D;
    tr.ld = fa->S;
    if (mha_parallel_for(f.B * f.Hkv, slots, SUF(sdpa_transpose_task), &tr, &ps)) goto stopped;
    /* no skipping when a NaN or inf must reach every key (see bwd_range) */
    f.skip = (f.rr.window || f.rr.lay.keep) && SUF(all_finite)(f.k, sz.n_key) &&
             SUF(all_finite)(f.v, sz.n_value) &&
             SUF(all_finite)(f.dctx, sz.n_out) &&
             (!f.grad_weights || SUF(all_finite)(f.grad_weights, sz.n_weights));
    if (mha_parallel_for(f.B * f.Hkv, slots, SUF(attend_backward_task), &f, &ps)) goto stopped;
    mha_work_free(work);
    mha_free(f.keep);
    return MHA_OK;
stopped: /* the poll asked to stop: the gradients are unspecified */
    mha_work_free(work);
    mha_free(f.keep);
    return MHA_ERR_INTERRUPTED;
}
