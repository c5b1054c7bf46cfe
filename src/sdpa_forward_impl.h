/* sdpa_forward_impl.h: mha_sdpa_forward, attention on the caller's projected
 * heads, written once for T = float and T = double (included by forward.c
 * after attend_impl.h and transpose_impl.h, whose tasks it runs: the module's attention, the
 * same softmax row, the same pool).  Legend as in mha.h's SDPA section.
 *
 *   kt (B, Hkv, D, S) = k transposed per head (Q·Kᵀ reads it in place, as
 *                       the module's attention reads its K; rows a line
 *                       more apart where S's would lie a multiple of 2 KiB
 *                       apart on a narrow kernel, 4 KiB on a wide one:
 *                       mha_kt_ld, as forward_impl.h's)
 *   per (b, h, block of queries), h' = h / (H / Hkv):
 *     S = q_bh·kt_bh' · scale, masked, softmax, dropout;  out_bh = S·v_bh' */

/* a query row's fixed cost in the pool's threshold below, as multiply-adds:
 * Zen 4, one thread, B 4096, H 1, L 1, S 1, D 64 takes ~220 ns a row (its
 * softmax, two kernel calls and a task's share), ~4,000 flops of the
 * products at small sizes; counting the products alone, that call (1 ms)
 * ran on one thread */
#ifndef SDPA_ROW_COST
#define SDPA_ROW_COST 4096.0
#endif

static mha_status SUF(sdpa_forward)(const mha_sdpa_args *a)
{
    mha_sizes sz;
    SUF(att) at;
    SUF(sdpa_tr) tr;
    mha_poll_state ps;
    int64_t n_work, state, t, n_kt;
    size_t bytes;
    int slots;
    T *work;
    mha_status st = mha_check_sdpa(a, 1, &sz);
    if (st != MHA_OK) return st;
    if (sz.n_out == 0) return MHA_OK; /* B, H or L zero: nothing to compute */

    memset(&at, 0, sizeof at);
    at.kern = SUF(mha_kern_get)();
    at.B = a->B; at.H = a->H; at.Hkv = a->Hkv;
    at.Sq = a->L; at.Sk = a->S; at.Dk = a->D; at.Dv = a->Dv;
    at.rr = mha_rows_make(a->masks, a->n_masks, a->is_causal, a->L, a->S, a->zero_masked_rows);
    mha_rows_window(&at.rr, a->has_window, a->window_left, a->window_right, a->L, a->S);
    at.rr.lay = a->layout;
    at.hmask = (const T *)a->head_mask;
    at.hm_sb = a->head_mask_stride[0];
    at.hm_sh = a->head_mask_stride[1];
    at.scale = (T)mha_score_scale(a->has_scale, a->scale, a->D);
    at.dropout = a->dropout;
    at.dropout_on = a->dropout > 0.0;
    at.drop_scale = a->dropout < 1.0 ? (T)(1.0 / (1.0 - a->dropout)) : (T)0;
    at.drop_key = mha_stream_key(a->seed, a->counter);
    at.weights = (T *)a->weights;
    at.qh = (const T *)a->q;
    at.vh = (const T *)a->v;
    at.ctx = (T *)a->out;
    at.cs_b = a->H * a->L * a->Dv; /* fits: n_out */
    at.cs_h = a->L * a->Dv;
    at.ldc = a->Dv;

    /* kt's rows (mha_kt_ld); V's are the caller's, S apart.  Few queries
     * and no weights (a decode step): no kt, each task transposes its
     * blocks of keys as it reads them (one query block per head: none is
     * transposed twice), so K is read once, not read, written and read */
    at.kld = mha_kt_ld(at.kern->nr, at.Sk, sizeof(T));
    at.vld = at.Sk;
    SUF(att_k_rows)(&at, (const T *)a->k);
    if (mha_mul(a->B * a->Hkv, a->D, &n_kt) || mha_mul(n_kt, at.k_rows ? 0 : at.kld, &n_kt))
        return MHA_ERR_OVERFLOW;

    slots = mha_get_num_threads();
    if ((double)a->B * (double)a->H * (double)a->L *
                (2.0 * (double)a->S * (double)(a->D + a->Dv) + SDPA_ROW_COST) < 2e6)
        slots = 1;
    /* workspace: kt (B, Hkv, D, S), then per slot the GEMM's packing and the
     * task's state */
    if (SUF(att_state)(&at, &state) || mha_add(state, MHA_GEMM_SCRATCH, &at.scratch_len) ||
        mha_mul(at.scratch_len, slots, &t) || mha_add(t, n_kt, &n_work) ||
        mha_bytes(n_work, sizeof(T), &bytes))
        return MHA_ERR_OVERFLOW;
    work = (T *)mha_work_alloc(bytes);
    if (!work) return MHA_ERR_NOMEM;
    at.kt = work;
    at.scratch = work + n_kt;

    mha_poll_start(&ps, a->poll, a->poll_ctx);
    tr.kern = at.kern;
    tr.k = (const T *)a->k;
    tr.kt = work;
    tr.S = a->S;
    tr.D = a->D;
    tr.ld = at.kld;
    if (a->S > 0 && !at.k_rows &&
        mha_parallel_for(a->B * a->Hkv, slots, SUF(sdpa_transpose_task), &tr, &ps))
        goto stopped;
    /* a NaN or inf in v must reach every row (0·NaN): no skipping */
    at.skip = (a->is_causal || at.rr.window || at.rr.lay.keep) && SUF(all_finite)(at.vh, sz.n_value);
    if (SUF(attend)(&at, slots, &ps)) goto stopped;
    mha_work_free(work);
    return MHA_OK;
stopped: /* the poll asked to stop: the outputs are unspecified */
    mha_work_free(work);
    return MHA_ERR_INTERRUPTED;
}
