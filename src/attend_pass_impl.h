/* attend_pass_impl.h: the forward's attention pass, written once for T =
 * float and T = double (included by forward.c right after attend_impl.h,
 * whose tasks and block sizes it uses and whose macros it undefines at its
 * end): how the tasks of attend_impl.h are cut and handed to the pool (a
 * head's blocks of queries grouped, small heads several a task, grouped
 * query heads together) and attend() itself, which forward_impl.h and
 * sdpa_forward_impl.h call. */

/* Task t of the attention pass (attend): the qgrp blocks of queries of one (b, h) from
 * block (t % groups)·qgrp, one after the other on this thread, which then
 * reads that head's K and V from its own cache after the first block (the
 * tasks of single blocks went to the threads in turn, so each thread read
 * every head's K and V from L3).  The same operations per block, so the
 * same bits.  Intel Xeon (family 6, model 167), two threads, builds
 * alternated process by process, medians: the SDPA at (8, 8, 128, 64) 1.57
 * and 1.61 -> 1.46 and 1.41 ms; the module at B 8, S 128, E 512, H 8
 * (three blocks a head, a head a task) 7.74-7.90 -> 7.03-7.73 ms, with its
 * weights 7.75-8.04 -> 7.66-7.80, float64 with its weights 14.9-15.2 ->
 * 14.4-15.2; BERT (B 16, S 384, E 768: a head a task), large (B 4, S 1024,
 * E 1024: 22 blocks a head, measured as a head a task) and long (B 1,
 * S 4096, E 1024: 86 blocks a head, measured as 22 a task) the same within
 * the noise. */
static void SUF(attend_blocks_task)(void *ctx, int64_t t, int slot)
{
    const SUF(att) *at = (const SUF(att) *)ctx;
    if (at->hpt > 1) { /* whole heads, one after the other */
        const int64_t nbh = at->B * at->H, end = (t + 1) * at->hpt < nbh ? (t + 1) * at->hpt : nbh;
        int64_t bh, i;
        for (bh = t * at->hpt; bh < end; bh++)
            for (i = 0; i < at->n_qblk; i++) {
                if (at->weights || at->p_save)
                    SUF(attend_weights_task)(ctx, bh * at->n_qblk + i, slot);
                else
                    SUF(attend_online_task)(ctx, bh * at->n_qblk + i, slot);
            }
        return;
    }
    const int64_t groups = (at->n_qblk + at->qgrp - 1) / at->qgrp;
    const int64_t bh = t / groups, first = (t % groups) * at->qgrp;
    const int64_t last = first + at->qgrp < at->n_qblk ? first + at->qgrp : at->n_qblk;
    int64_t i;
    for (i = first; i < last; i++) {
        if (at->weights || at->p_save)
            SUF(attend_weights_task)(ctx, bh * at->n_qblk + i, slot);
        else
            SUF(attend_online_task)(ctx, bh * at->n_qblk + i, slot);
    }
}

/* Whole heads a task (attend_blocks_task): where a head is one task and
 * does little work (few queries and keys: a decode step), heads are
 * grouped until a task does about HEAD_WORK multiply-adds, leaving at
 * least TASKS tasks a thread.  Each task took a head before: its work
 * (~100 ns at one key) then weighed less than the pool's per-task cost
 * (the shared counter's line between the cores, the caller's poll for
 * Ctrl-C).  The same operations per head, so the same bits. */
static int64_t SUF(att_hpt)(const SUF(att) *at, int slots)
{
    const int64_t nbh = at->B * at->H;
    const double work = (double)at->Sq * ((double)at->Sk + 16.0) *
                        ((double)at->Dk + (double)at->Dv + 16.0); /* a head's products, and
                                                                     its fixed cost */
    int64_t hpt;
    if (at->qgrp < at->n_qblk) return 1; /* a head is split already */
    hpt = (int64_t)((double)HEAD_WORK / work);
    if (hpt > nbh / (TASKS * (int64_t)slots)) hpt = nbh / (TASKS * (int64_t)slots);
    return hpt > 1 ? hpt : 1;
}

/* The attention pass: every (b, h, group of blocks of queries) on the pool
 * (with the heads' mean: every (b, block of queries), or see att_avg_heads;
 * grouped-query attention with few queries: every (b, key/value head)). */
static int SUF(attend)(SUF(att) *at, int slots, mha_poll_state *ps)
{
    at->n_qblk = (at->Sq + QB - 1) / QB;
    if (at->kld == 0) at->kld = at->Sk;
    if (at->vld == 0) at->vld = at->kld;
    if (at->avg && at->avg_heads) { /* the per-head weights, then their mean */
        SUF(att) heads = *at;
        const int64_t per = at->Sq * at->Sk;
        heads.avg = 0;
        heads.avg_heads = NULL;
        heads.weights = at->avg_heads;
        if (SUF(attend)(&heads, slots, ps)) return 1;
        return mha_parallel_for(at->B * ((per + MEAN_CHUNK - 1) / MEAN_CHUNK), slots,
                                SUF(attend_mean_task), at, ps);
    }
    at->stream = SUF(att_streams)(at);
    if (at->k_rows) { /* a panel's columns past its keys are read, their sums never
                         stored (mha_gemm_panel): zeros, not bytes never written */
        int s;
        for (s = 0; s < slots; s++)
            memset(SUF(att_kb)(at, s), 0, (size_t)(at->Dk * at->kern->nr) * sizeof(T));
    }
    if (at->avg)
        return mha_parallel_for(at->B * at->n_qblk, slots, SUF(attend_avg_task), at, ps);
    /* grouped-query attention with few queries: one task per key/value head
     * (when that leaves a task for every thread) */
    at->grp = !at->weights && !at->p_save && at->H > at->Hkv && !at->rr.lay.keep &&
              at->Sq * (at->H / at->Hkv) <= ROWS && at->B * at->Hkv >= slots;
    if (at->grp)
        return mha_parallel_for(at->B * at->Hkv, slots, SUF(attend_online_task), at, ps);
    {   /* about TASKS tasks a thread: a head's blocks split into as many
         * groups as that takes (one, a whole head, once there are TASKS
         * heads a thread), never more groups than blocks, at most QGRP
         * blocks a group (B·H or Sq of 0: no task; qgrp stays 1) */
        const int64_t nbh = at->B * at->H;
        int64_t ng = nbh > 0 ? (TASKS * (int64_t)slots + nbh - 1) / nbh : 1;
        if (ng > at->n_qblk) ng = at->n_qblk;
        if (ng < 1) ng = 1;
        at->qgrp = (at->n_qblk + ng - 1) / ng;
        if (at->qgrp > QGRP) at->qgrp = QGRP;
        if (at->qgrp < 1) at->qgrp = 1;
        at->hpt = SUF(att_hpt)(at, slots);
        if (at->hpt > 1)
            return mha_parallel_for((nbh + at->hpt - 1) / at->hpt, slots,
                                    SUF(attend_blocks_task), at, ps);
        return mha_parallel_for(nbh * ((at->n_qblk + at->qgrp - 1) / at->qgrp), slots,
                                SUF(attend_blocks_task), at, ps);
    }
}

#undef QB
#undef KB
#undef ROWS
#undef TASKS
#undef QGRP
#undef HEAD_WORK
#undef MEAN_CHUNK
