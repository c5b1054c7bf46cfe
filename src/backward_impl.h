/* backward_impl.h: the gradients of the forward pass (forward_impl.h), written
 * once for T = float and T = double (included twice by backward.c with T, SUF,
 * KT and EXP defined, after softmax_impl.h: the forward's softmax row, and
 * transpose_impl.h).  Legend as in mha.h; dX is dL/dX.
 *
 * The forward, line by line, and the lines of the backward that undo it:
 *
 *   forward                         backward
 *   Q = query·W_qᵀ + b_q            d query = dQ·W_q   dW_q = dQᵀ·query   db_q = Σ_rows dQ
 *   K = key·W_kᵀ + b_k              d key   = dK·W_k   dW_k = dKᵀ·key     db_k = Σ_rows dK
 *   V = value·W_vᵀ + b_v            d value = dV·W_v   dW_v = dVᵀ·value   db_v = Σ_rows dV
 *   K, V += extra rows (bias_k / bias_v, zeros)   db_k' = Σ_b dK[b, Sk], db_v' = Σ_b dV[b, Sk]
 *   per (b, h):
 *     S = Q_bh·K_bhᵀ · scale        dQ_bh = dS·K_bh · scale   dK_bh = dSᵀ·Q_bh · scale
 *     S = masked(S)                 (masks are constants: dS passes where S was finite)
 *     P = softmax(S)                dS_j = P_j (dP_j - Σ_k P_k dP_k)   (dS: grad_scores)
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
 *   4. the weight gradients (dW = dYᵀ·X: mha_gemm_tn reads dYᵀ in place
 *      or packs its panels, mha_tn_packs; no transposed copy) and the input
 *      gradients, all tiles of all seven products in one pass. */

/* The attention's products (mha_gemm, mha_gemm_tn) take the AMX tiles on
 * amx: no cached call has to give the backward's bits (bwd_cut_len: K and
 * V cut once per task, dKᵀ and dVᵀ summed).  Intel Xeon (family 6, model
 * 167), two threads, builds alternated process by process, a training
 * step at B 8, S 128, E 512: 19.4-20.2 ms both; at B 4, S 1024, E 1024
 * 469-477 -> 423-452 ms.  The recomputed P is then not the forward's bit
 * for bit (its S took the float kernels): the same to float rounding. */
#define QB 128  /* queries per block inside one (b, h) task */
#define RM 1024 /* rows per NT / NN product tile: B packed once serves them all, */
#define RM_S 96  /* unless that leaves under 4 tiles per thread: then 96 x 64 */
#define RN_S 64  /* tiles, B read in place (medium: A's rows stay in L2) */
#define RM_TN 1024 /* ... for TN: B's packed strip (one per tile) serves every row, */
#define RN_TN MHA_TN_COLS(sizeof(T)) /* and each MR-row panel of Aᵀ, read in
                    place, meets 512 bytes of B's rows (internal.h) */
#define RN_TN_AT(kt) MHA_TN_COLS_AT(mha_gemm_narrow((kt)->nr, sizeof(T))) /* ... where
                    Aᵀ is packed (mha_tn_packs: a narrow kernel, or a wide one's
                    measured choice for rows a multiple of 4 KiB apart): wider
                    tiles share each packed block (internal.h) */
#define TC 64   /* columns per column-sum task */

/* colsum (C) = Σ_rows x for x (R, C), rows in order */
typedef struct {
    const T *x;
    T *colsum;
    int64_t R, C, tasks;
} SUF(btr);

typedef struct {
    const mha_backward_args *a;
    const T *grad_weights; /* NULL, or dL/d weights (B, H, Sq, Sk) */
    T *dscores;           /* NULL, or dL/d masked scores (B, H, Sq, Sk) written,
                             zeroed before the tasks (grad_scores) */
    mha_rows rr;          /* the forward's masks, causality, blocked rows */
    int64_t B, Sq, Sk, E, H, Hkv, Dk, Dv, Ekv; /* Sk: every key, the extra ones too;
                                                Ekv = Hkv*Dk, K and V's width */
    int64_t Skg;          /* the given keys (Sk without the extra ones) */
    T *q, *k, *v;         /* recomputed: Q (B, Sq, E), K and V (B, Sk, E); kept
                             (saved): Q (B, H, Sq, Dk), K (B, Hkv, Dk, Sk),
                             V (B, Hkv, Sk, Dv) */
    T *ctx, *dctx;        /* (B, Sq, E) (ctx: only when not saved) */
    int64_t dc_sb, dc_sh, dc_ld; /* dctx's row i of head (b, h): b*dc_sb + h*dc_sh + i*dc_ld */
    int saved;            /* q, k, v, ctx are mha_forward_save's: never written */
    int skip;             /* a window or layout; K, V, dctx, grad_weights finite; no extra
                             keys: each block of queries works on its keys
                             [ks, ke) only (bwd_range; causality alone keeps
                             the full rows, bit for bit as before windows) */
    const T *p_saved;     /* NULL, or mha_forward_save's P (B, H, Sq, Sk) */
    const T *hmask;       /* NULL, or the head mask (b, h) at b*hm_sb + h*hm_sh */
    int64_t hm_sb, hm_sh; /*   (then dctx is scaled by it in place, per head) */
    T *dq, *dk, *dv;      /* dQ (B, Sq, E), dK and dV (B, Sk, Ekv), or as the strides say: */
    int64_t dq_sb, dq_sh, dq_ld, dk_sb, dk_sh, dk_ld, dv_sb, dv_sh, dv_ld; /* (b, h or h') */
    T *bsum;              /* NULL, or (3, B, E): Σ over each batch's rows of dQ, dK, dV
                             (the given keys' rows; dK's, dV's (B, Ekv) at B*E, 2*B*E) */
    T *scratch;           /* per slot: P, D (QB, Sk), then dQ_bh's block (QB, Dk),
                             dK_bh (Sk, Dk), dV_bh (Sk, Dv), V_bhᵀ, K_bh in the other
                             layout, and on the tiles bwd_cut_len's */
    T *pack;              /* per slot: MHA_GEMM_SCRATCH scalars for mha_gemm's packing */
    const KT *kern;       /* the kernels of the ISA in use */
    int64_t scratch_len;  /* scalars per slot */
    uint8_t *keep;        /* per slot: the replayed dropout mask (QB, Sk) */
    int64_t keep_len;     /* bytes per slot */
    T scale;              /* the score scale */
    T drop_scale;         /* 1 / (1 - p) */
    double dropout;       /* p */
    uint64_t drop_key;
    int dropout_on;
    mha_products prods;   /* a pass's products (internal.h's task list) */
    SUF(btr) tr[4];
    int n_tr;
    mha_poll_state *ps;   /* the call's poll: a task asks it between query blocks */
} SUF(bwd);

#include "bwd_tasks_impl.h" /* prod_add, prod_task, btr_add, btr_task, grad_task, colsum */

/* ------------------------------------------------------------ attention */

/* With P kept by the forward: 1 when row (b, h, i), whose P is p_r, has
 * every key blocked (then the forward applied no dropout to it).  Only a
 * NaN row can be one (with zero_masked_rows a blocked row is 0, where
 * dropout changes nothing): its scores are recomputed into s (Sk) from q_i
 * (Dk) and K transposed (Dk, Sk), and masked as the forward masked them. */
static int SUF(saved_row_blocked)(const SUF(bwd) *f, const T *p_r, const T *q_i, const T *kt,
                                  T *s, int64_t b, int64_t h, int64_t i)
{
    int64_t j, d;
    if (p_r[0] == p_r[0]) return 0;
    for (j = 0; j < f->Sk; j++) s[j] = 0;
    for (d = 0; d < f->Dk; d++)
        for (j = 0; j < f->Sk; j++) s[j] += q_i[d] * kt[d * f->Sk + j];
    return SUF(row_max)(f->kern, &f->rr, f->scale, s, b, h, i, 0, f->Sk) == -(T)INFINITY;
}

#include "bwd_keys_impl.h" /* bwd_range, bwd_run, bwd_zero, append_extra, drop_extra */

#include "bwd_cut_impl.h" /* bwd_cut_sizes, bwd_cut_len, bwd_gemm, bwd_keep_len,
                             bwd_scratch_len */

/* One (b, key/value head h'): for each query head h of its group, the
 * forward of the attention recomputed block by block of queries, each step
 * followed by its backward (the module without n_kv_heads: groups of one). */
static void SUF(attend_backward_task)(void *vf, int64_t task, int slot)
{
    const SUF(bwd) *f = (const SUF(bwd) *)vf;
    const int64_t G = f->H / f->Hkv, b = task / f->Hkv, hkv = task % f->Hkv;
    const int64_t E = f->E, Sq = f->Sq, Sk = f->Sk, Dk = f->Dk, Dv = f->Dv;
    int64_t i0, r, j, g, ks, ke, n, rj, rs, re, nr;
    int runs;
    /* Q_bh and V_bh: per head (kept by the forward) or columns of (B, S, E)
     * (recomputed); K_bh: transposed per head (Dk, Sk) or columns of K */
    const int hm = f->saved;
    const int64_t Ekv = f->Ekv;
    const int64_t ldq = hm ? Dk : E, ldv = hm ? Dv : Ekv; /* of Q_bh and V_bh */
    const int64_t bkv = b * f->Hkv + hkv;
    const T *k_bh = hm ? f->k + bkv * Dk * Sk : f->k + b * Sk * Ekv + hkv * Dk; /* see above */
    const T *v_bh = hm ? f->v + bkv * Sk * Dv : f->v + b * Sk * Ekv + hkv * Dk; /* (Sk, Dv) */
    T *dk_bh = f->dk ? f->dk + b * f->dk_sb + hkv * f->dk_sh : NULL; /* (Sk, Dk), ld dk_ld */
    T *dv_bh = f->dv ? f->dv + b * f->dv_sb + hkv * f->dv_sh : NULL; /* (Sk, Dv), ld dv_ld */
    T *p = f->scratch + (int64_t)slot * f->scratch_len; /* (QB, Sk) P, when recomputed */
    T *d = p + QB * Sk;                                 /* (QB, Sk) A, then dA, dP, dS */
    /* then (QB, Dk) dQ_bh's block, (Sk, Dk) dK_bh, (Sk, Dv) dV_bh: see below */
    uint8_t *keep = f->keep + (int64_t)slot * f->keep_len; /* (QB, Sk) */
    T *gs = f->pack + (int64_t)slot * MHA_GEMM_SCRATCH;  /* mha_gemm's packing */
    /* the products write dQ_bh, dK_bh, dV_bh here, contiguous, and the task
     * copies them out into the (B, S, E) rows: a product's output tiles
     * then stay in cache instead of missing on E-strided lines */
    T *dqs = d + QB * Sk, *dks = dqs + QB * Dk, *dvs = dks + Sk * Dk;
    /* ... and V_bh transposed (Dv, Sk) and K_bh in the layout the saved one
     * is not in (saved, Kᵀ: rows (Sk, Dk); else Kᵀ (Dk, Sk)), made once for
     * the task: every product below then reads its B in place (a product
     * with B transposed packed it again for each block of queries) */
    T *vt = dvs + Sk * Dv, *kx = vt + Dv * Sk;
    uint8_t blocked[QB] = {0}; /* the block's rows with every key blocked */

    SUF(transpose)(f->kern, v_bh, Sk, Dv, ldv, vt, Sk);
    if (hm)
        SUF(transpose)(f->kern, k_bh, Dk, Sk, Sk, kx, Dk);
    else
        SUF(transpose)(f->kern, k_bh, Sk, Dk, Ekv, kx, Sk);
    /* ... and on the AMX tiles their pieces (bwd_cut_len), after them:
     * cs for S (Kᵀ), cc for the context (V), cd for dA (Vᵀ), cq for dQ (K);
     * NULL where not cut, or where an infinity or NaN keeps them off */
    const uint32_t *cs = NULL, *cc = NULL, *cd = NULL, *cq = NULL;
    T *dkt = NULL, *dvt = NULL; /* on the tiles: dK_bhᵀ (Dk, Sk), dV_bhᵀ (Dv, Sk) */
    {
        int64_t len, nc[4];
        if (!SUF(bwd_cut_len)(f, &len) && len > 0) {
            dkt = kx + Sk * Dk;
            dvt = dkt + Dk * Sk;
        }
        if (dvt && Sq > QB) {
            uint32_t *c0 = (uint32_t *)(((uintptr_t)(dvt + Dv * Sk) + 63) & ~(uintptr_t)63);
            const mha_amx_cut cut = f->kern->amx_cut;
            SUF(bwd_cut_sizes)(f, nc);
            if (!f->p_saved && !cut(Dk, Sk, hm ? k_bh : kx, Sk, c0)) cs = c0;
            if (!f->saved && !cut(Sk, Dv, v_bh, ldv, c0 + nc[0])) cc = c0 + nc[0];
            if (!cut(Dv, Sk, vt, Sk, c0 + nc[0] + nc[1])) cd = c0 + nc[0] + nc[1];
            if (f->dq && !cut(Sk, Dk, hm ? kx : k_bh, hm ? Dk : Ekv, c0 + nc[0] + nc[1] + nc[2]))
                cq = c0 + nc[0] + nc[1] + nc[2];
        }
    }

    if (f->skip) { /* blocks of queries touch only their keys' rows */
        memset(dkt ? dkt : dks, 0, (size_t)(Sk * Dk) * sizeof(T));
        memset(dvt ? dvt : dvs, 0, (size_t)(Sk * Dv) * sizeof(T));
    }

    for (g = 0; g < G; g++) {
        const int64_t h = hkv * G + g, bh = b * f->H + h;
        const T *q_bh = hm ? f->q + bh * Sq * Dk : f->q + b * Sq * E + h * Dk; /* (Sq, Dk) */
        const T *dc_bh = f->dctx + b * f->dc_sb + h * f->dc_sh; /* (Sq, Dv), ld dc_ld */
        T *c_bh = f->saved ? NULL : f->ctx + b * Sq * E + h * Dk; /* (Sq, Dk), ld E */
        T *dq_bh = f->dq ? f->dq + b * f->dq_sb + h * f->dq_sh : NULL; /* (Sq, Dk), ld dq_ld */
        const T *gw_bh = f->grad_weights ? f->grad_weights + bh * Sq * Sk : NULL;
        /* head mask m: ctx_bh = (m·A)·V_bh, weights m·A: dctx_bh, d weights times m */
        const T hmv = f->hmask ? f->hmask[b * f->hm_sb + h * f->hm_sh] : (T)1;
        if (f->hmask)
            for (r = 0; r < Sq; r++) f->kern->scale(f->dctx + b * f->dc_sb + h * f->dc_sh +
                                                    r * f->dc_ld, Dv, hmv);
        if (Sk == 0) { /* no key: the context is an empty sum, nothing to differentiate */
            for (r = 0; r < Sq; r++) {
                for (j = 0; j < Dk && !f->saved; j++) c_bh[r * E + j] = 0;
                for (j = 0; j < Dk && dq_bh; j++) dq_bh[r * f->dq_ld + j] = 0;
            }
        }
        for (i0 = 0; Sk > 0 && i0 < Sq; i0 += QB) {
            const int64_t nq = Sq - i0 < QB ? Sq - i0 : QB;
            const int first = i0 == 0 && g == 0 && !f->skip;
            /* a task is a whole (batch, key head): seconds at long lengths;
             * Ctrl-C is heard between its blocks (the call then fails) */
            if (mha_task_stopped(f->ps, slot)) return;
            /* P of this block: the forward's, or recomputed into p */
            const T *pb = f->p_saved ? f->p_saved + (bh * Sq + i0) * Sk : p;
            const T *a_blk = pb; /* A: P itself without dropout */

            /* the block's keys [ks, ks + n); every buffer below is read and
             * written from column ks */
            SUF(bwd_range)(f, b, h, i0, nq, &ks, &ke);
            runs = f->skip && f->rr.lay.keep != NULL; /* the layout's runs of keys */
            if (runs) { /* none: every row blocked, the plain path on every key */
                SUF(bwd_run)(f, runs, b, h, i0, nq, ks, ke, &rs, &re);
                runs = rs < ke;
            }
        redo:
            n = ke - ks;
            /* forward: S = Q_bh·K_bhᵀ · scale; S = masked(S); P = softmax(S)
             * (between the runs: 0 scores, which the layout masks) */
            if (!f->p_saved) {
                if (runs) SUF(bwd_zero)(p + ks, nq, n, Sk);
                for (rj = ks; rj < ke; rj = re) {
                    SUF(bwd_run)(f, runs, b, h, i0, nq, rj, ke, &rs, &re);
                    if (rs >= ke) break;
                    SUF(bwd_gemm)(f, rs % 32 ? NULL : cs, MHA_AMX_GROUP(Dk),
                                  rs / 32 * MHA_AMX_GROUP(Dk), nq, re - rs, Dk, q_bh + i0 * ldq,
                                  ldq, (hm ? k_bh : kx) + rs, Sk, p + rs, Sk, 0, gs);
                }
            }
            for (r = 0; r < nq && !f->p_saved; r++) /* the forward's row: its P (on amx
                                                        to float rounding: S on the tiles) */
                blocked[r] = SUF(softmax_row)(f->kern, &f->rr, f->scale, p + r * Sk + ks, b, h,
                                              i0 + r, ks, n, n) < 0;
            if (n < Sk || runs) /* a NaN row must reach every key, as in the reference */
                for (r = 0; r < nq; r++)
                    if (pb[r * Sk + ks] != pb[r * Sk + ks]) {
                        ks = 0;
                        ke = Sk;
                        runs = 0;
                        goto redo;
                    }
            for (r = 0; r < nq && f->p_saved && f->dropout_on; r++)
                blocked[r] = SUF(saved_row_blocked)(f, pb + r * Sk, q_bh + (i0 + r) * ldq, k_bh,
                                                    d + r * Sk, b, h, i0 + r);
            /* forward: A = dropout(P), keep replayed from the call's stream; a
             * row with every key blocked has no dropout (as in the forward) */
            if (f->dropout_on) {
                for (r = 0; r < nq; r++) {
                    const uint64_t idx = ((uint64_t)bh * (uint64_t)Sq + (uint64_t)(i0 + r)) *
                                         (uint64_t)Sk;
                    if (blocked[r]) {
                        memset(keep + r * Sk + ks, 1, (size_t)n);
                        memcpy(d + r * Sk + ks, pb + r * Sk + ks, (size_t)n * sizeof(T));
                        continue;
                    }
                    for (j = ks; j < ke; j++) {
                        keep[r * Sk + j] =
                            (uint8_t)mha_dropout_keep(f->drop_key, idx + (uint64_t)j, f->dropout);
                        d[r * Sk + j] = keep[r * Sk + j] ? pb[r * Sk + j] * f->drop_scale : (T)0;
                    }
                }
                a_blk = d;
            }
            /* over each run of keys [rs, re) (one run [ks, ke) without a layout):
             * forward: ctx_bh = A·V_bh (for dW_o = d outᵀ·ctx), unless kept;
             * backward of ctx_bh = A·V_bh: dV_bh += Aᵀ·dctx_bh;
             * ... and dA = dctx_bh·V_bhᵀ (0 between the runs) */
            for (rj = ks, nr = 0; rj < ke; rj = re, nr++) {
                SUF(bwd_run)(f, runs, b, h, i0, nq, rj, ke, &rs, &re);
                if (rs >= ke) break;
                if (!f->saved)
                    SUF(bwd_gemm)(f, rs % 32 ? NULL : cc, MHA_AMX_GROUP(Sk), rs / 2 * 32, nq, Dv,
                                  re - rs, a_blk + rs, Sk, v_bh + rs * ldv, ldv, c_bh + i0 * E, E,
                                  nr > 0, gs);
                if (dvt)
                    SUF(mha_gemm_tn)(f->kern, Dv, re - rs, nq, dc_bh + i0 * f->dc_ld, f->dc_ld,
                                     a_blk + rs, Sk, dvt + rs, Sk, !first, gs);
                else
                    SUF(mha_gemm_tn)(f->kern, re - rs, Dv, nq, a_blk + rs, Sk,
                                     dc_bh + i0 * f->dc_ld, f->dc_ld, dvs + rs * Dv, Dv, !first,
                                     gs);
            }
            if (runs) SUF(bwd_zero)(d + ks, nq, n, Sk); /* A (maybe d) read: now dA */
            for (rj = ks; rj < ke; rj = re) {
                SUF(bwd_run)(f, runs, b, h, i0, nq, rj, ke, &rs, &re);
                if (rs >= ke) break;
                SUF(bwd_gemm)(f, rs % 32 ? NULL : cd, MHA_AMX_GROUP(Dv),
                              rs / 32 * MHA_AMX_GROUP(Dv), nq, re - rs, Dv, dc_bh + i0 * f->dc_ld,
                              f->dc_ld, vt + rs, Sk, d + rs, Sk, 0, gs);
            }
            for (r = 0; r < nq && f->hmask && !f->saved; r++)
                f->kern->scale(c_bh + (i0 + r) * E, Dv, hmv);
            /* plus the gradient of the returned weights */
            if (gw_bh)
                for (r = 0; r < nq; r++)
                    for (j = ks; j < ke; j++) d[r * Sk + j] += hmv * gw_bh[(i0 + r) * Sk + j];
            for (r = 0; r < nq; r++) {
                T *d_r = d + r * Sk;
                /* backward of A = dropout(P): dP = dA · keep / (1 - p) */
                if (f->dropout_on && !blocked[r])
                    for (j = ks; j < ke; j++)
                        d_r[j] = keep[r * Sk + j] ? d_r[j] * f->drop_scale : (T)0;
                /* backward of P = softmax(S): dS_j = P_j (dP_j - Σ_k P_k dP_k),
                 * and of S = ... · scale: the scale folded in (after dS is
                 * written out, when asked for: an additive mask's gradient) */
                if (f->dscores) {
                    f->kern->softmax_grad(pb + r * Sk + ks, d_r + ks, n, (T)1);
                    memcpy(f->dscores + (bh * Sq + i0 + r) * Sk + ks, d_r + ks,
                           (size_t)n * sizeof(T));
                    f->kern->scale(d_r + ks, n, f->scale);
                } else {
                    f->kern->softmax_grad(pb + r * Sk + ks, d_r + ks, n, f->scale);
                }
            }
            /* backward of S = Q_bh·K_bhᵀ: dQ_bh = dS·K_bh, dK_bh += dSᵀ·Q_bh
             * (dS is 0 between the runs) */
            for (rj = ks, nr = 0; rj < ke; rj = re, nr++) {
                SUF(bwd_run)(f, runs, b, h, i0, nq, rj, ke, &rs, &re);
                if (rs >= ke) break;
                if (dq_bh)
                    SUF(bwd_gemm)(f, rs % 32 ? NULL : cq, MHA_AMX_GROUP(Sk), rs / 2 * 32, nq, Dk,
                                  re - rs, d + rs, Sk, hm ? kx + rs * Dk : k_bh + rs * Ekv,
                                  hm ? Dk : Ekv, dqs, Dk, nr > 0, gs);
                if (dkt)
                    SUF(mha_gemm_tn)(f->kern, Dk, re - rs, nq, q_bh + i0 * ldq, ldq, d + rs, Sk,
                                     dkt + rs, Sk, !first, gs);
                else
                    SUF(mha_gemm_tn)(f->kern, re - rs, Dk, nq, d + rs, Sk, q_bh + i0 * ldq, ldq,
                                     dks + rs * Dk, Dk, !first, gs);
            }
            for (r = 0; r < nq && dq_bh; r++)
                memcpy(dq_bh + (i0 + r) * f->dq_ld, dqs + r * Dk, (size_t)Dk * sizeof(T));
        }
        /* this head's share of the bias gradient of Q (db = Σ_rows dY),
         * summed while dQ_bh is still in cache; phase 4 adds the batches */
        if (f->bsum) SUF(colsum)(dq_bh, Sq, Dk, f->dq_ld, f->bsum + b * E + h * Dk);
    }
    if (dkt && Sk > 0 && Sq > 0) { /* dK_bh and dV_bh from their transposes */
        SUF(transpose)(f->kern, dkt, Dk, Sk, Sk, dks, Dk);
        SUF(transpose)(f->kern, dvt, Dv, Sk, Sk, dvs, Dv);
    }
    if (Sk == 0 || Sq == 0) { /* nothing reached K and V */
        for (r = 0; r < Sk * Dk; r++) dks[r] = 0;
        for (r = 0; r < Sk * Dv; r++) dvs[r] = 0;
    }
    for (r = 0; r < Sk; r++) {
        if (dk_bh) memcpy(dk_bh + r * f->dk_ld, dks + r * Dk, (size_t)Dk * sizeof(T));
        if (dv_bh) memcpy(dv_bh + r * f->dv_ld, dvs + r * Dv, (size_t)Dv * sizeof(T));
    }
    /* ... and of K and V, over the given keys' rows */
    if (f->bsum) {
        SUF(colsum)(dks, f->Skg, Dk, Dk, f->bsum + f->B * E + b * Ekv + hkv * Dk);
        SUF(colsum)(dvs, f->Skg, Dv, Dv, f->bsum + 2 * f->B * E + b * Ekv + hkv * Dk);
    }
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
    int64_t n_q, n_kv, n_work, t, Rq, Rk, Ek, Ev, Skx;
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
    f.grad_weights = (const T *)a->grad_weights;
    f.dscores = (T *)a->grad_scores;
    if (f.dscores) memset(f.dscores, 0, (size_t)sz.n_weights * sizeof(T)); /* blocked keys: 0 */
    f.hmask = (const T *)a->fwd.head_mask;
    f.hm_sb = a->fwd.head_mask_stride[0];
    f.hm_sh = a->fwd.head_mask_stride[1];
    f.rr = mha_rows_make(a->fwd.masks, a->fwd.n_masks, a->fwd.is_causal, a->fwd.Sq, a->fwd.Sk,
                         a->fwd.zero_masked_rows);
    mha_rows_window(&f.rr, a->fwd.has_window, a->fwd.window_left, a->fwd.window_right,
                    a->fwd.Sq, a->fwd.Sk);
    f.rr.lay = a->fwd.layout;
    f.B = a->fwd.B; f.Sq = a->fwd.Sq; f.Skg = a->fwd.Sk;
    Skx = f.Sk = a->fwd.Sk + sz.extra; /* every key: the given ones, then the extra ones */
    f.E = cfg->d_model; f.H = cfg->n_heads; f.Dk = f.Dv = f.E / f.H;
    f.Hkv = mha_kv_heads(cfg); f.Ekv = f.Hkv * f.Dk;
    f.scale = (T)mha_score_scale(a->fwd.has_scale, a->fwd.scale, f.Dk);
    f.kern = SUF(mha_kern_get)();
    (void)SUF(mha_tn_pack)(f.kern); /* measured here, before the passes, if not yet */
    f.dropout = a->fwd.dropout;
    f.dropout_on = a->fwd.dropout > 0.0;
    f.drop_scale = a->fwd.dropout < 1.0 ? (T)(1.0 / (1.0 - a->fwd.dropout)) : (T)0;
    f.drop_key = mha_stream_key(a->fwd.seed, a->fwd.counter);
    Rq = f.B * f.Sq; /* rows of query-side matrices; n_out = Rq * E fits */
    Rk = f.B * f.Skg; /* rows of key-side matrices;  n_key = Rk * Ek fits */
    n_q = sz.n_out;
    if (mha_mul(f.B * Skx, f.Ekv, &n_kv)) return MHA_ERR_OVERFLOW; /* K, V with the extra rows */

    slots = mha_get_num_threads();
    {
        double flops = 2.0 * (double)Rq * (double)f.E * (double)f.E * 6.0 +
                       2.0 * (double)Rk * (double)f.E * (double)(Ek + Ev) * 3.0 +
                       10.0 * (double)Rq * (double)Skx * (double)f.E;
        if (flops < 4e5) slots = 1;
    }

    /* workspace: dctx, dq (B, Sq, E); dk, dv (B, Sk, E); bsum (3, B, E);
     * without sv also q, ctx (B, Sq, E), k and v (B, Sk, E); then per slot
     * P, D (QB, Sk), dQ_bh's block (QB, Dk), dK_bh and dV_bh (Sk, Dk), and
     * mha_gemm's packing */
    if (SUF(bwd_scratch_len)(&f) ||
        mha_mul(n_q, sv ? 2 : 4, &n_work) || mha_mul(n_kv, sv ? 2 : 4, &t) ||
        mha_add(n_work, t, &n_work) || mha_mul(f.B * f.E, 3, &t) || mha_add(n_work, t, &n_work) ||
        mha_mul(f.scratch_len, slots, &t) || mha_add(n_work, t, &n_work) ||
        mha_mul(MHA_GEMM_SCRATCH, slots, &t) || mha_add(n_work, t, &n_work) ||
        mha_bytes(n_work, sizeof(T), &bytes))
        return MHA_ERR_OVERFLOW;
    f.keep_len = f.dropout_on ? SUF(bwd_keep_len)(&f) : 0;
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
    /* the module's layouts: dctx, dq (B, Sq, E), dk, dv (B, Sk', E), heads as columns */
    f.dc_sb = f.dq_sb = f.Sq * f.E;
    f.dk_sb = f.dv_sb = Skx * f.Ekv;
    f.dc_sh = f.dq_sh = f.dk_sh = f.dv_sh = f.Dk;
    f.dc_ld = f.dq_ld = f.E; f.dk_ld = f.dv_ld = f.Ekv;
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
    f.ps = &ps;
    MHA_TICK_START;

    /* 1. the forward's projections, and dctx = d out·W_o
     *    (backward of out = ctx·W_oᵀ + b_o, for ctx) */
    if (!f.saved) { /* with extra keys, K and V first into dK and dV's space */
        SUF(prod_add)(&f, MHA_NT, (const T *)a->fwd.query, f.E, (const T *)p->wq, f.E,
                      (const T *)p->bq, f.q, f.E, Rq, f.E, f.E);
        SUF(prod_add)(&f, MHA_NT, (const T *)a->fwd.key, Ek, (const T *)p->wk, Ek,
                      (const T *)p->bk, sz.extra ? f.dk : f.k, f.Ekv, Rk, f.Ekv, Ek);
        SUF(prod_add)(&f, MHA_NT, (const T *)a->fwd.value, Ev, (const T *)p->wv, Ev,
                      (const T *)p->bv, sz.extra ? f.dv : f.v, f.Ekv, Rk, f.Ekv, Ev);
    }
    SUF(prod_add)(&f, MHA_NN, (const T *)a->grad_out, f.E, (const T *)p->wo, f.E,
                  NULL, f.dctx, f.E, Rq, f.E, f.E);
    if (mha_parallel_for(f.prods.tiles, slots, SUF(prod_task), &f, &ps)) goto stopped;
    if (!f.saved && sz.extra) { /* K, V += their extra rows */
        SUF(append_extra)(cfg, f.dk, (const T *)p->bias_k, f.k, f.B, f.Skg, Skx, f.Ekv);
        SUF(append_extra)(cfg, f.dv, (const T *)p->bias_v, f.v, f.B, f.Skg, Skx, f.Ekv);
    }
    MHA_TICK("backward 1 proj");
    /* a NaN or inf in K, V, dctx or the weights' gradient must reach every
     * key (0·NaN), as in the reference: no skipping then; nor with extra keys */
    f.skip = (f.rr.window || f.rr.lay.keep) && sz.extra == 0 && SUF(all_finite)(f.k, n_kv) &&
             SUF(all_finite)(f.v, n_kv) && SUF(all_finite)(f.dctx, n_q) &&
             (!f.grad_weights || SUF(all_finite)(f.grad_weights, sz.n_weights));

    /* 2. attention, per (b, h) */
    if (mha_parallel_for(f.B * f.Hkv, slots, SUF(attend_backward_task), &f, &ps)) goto stopped;
    if (sz.extra) { /* backward of K, V += extra rows: bias_k's, bias_v's gradients */
        SUF(drop_extra)(cfg, f.dk, g && cfg->add_bias_kv ? g + offset[MHA_BIAS_K] : NULL, f.B,
                        f.Skg, Skx, f.Ekv);
        SUF(drop_extra)(cfg, f.dv, g && cfg->add_bias_kv ? g + offset[MHA_BIAS_V] : NULL, f.B,
                        f.Skg, Skx, f.Ekv);
    }
    MHA_TICK("backward 2 attn");

    /* 4. the weight gradients (dW = dYᵀ·X, as (Rows, E)ᵀ·(Rows, In)) and the
     *    input gradients (dX = dY·W) */
    memset(&f.prods, 0, sizeof f.prods);
    if (g) {
        SUF(prod_add)(&f, MHA_TN, (const T *)a->grad_out, f.E, f.ctx, f.E, NULL,
                      g + offset[MHA_WO], f.E, f.E, f.E, Rq);
        SUF(prod_add)(&f, MHA_TN, f.dq, f.E, (const T *)a->fwd.query, f.E, NULL,
                      g + offset[MHA_WQ], f.E, f.E, f.E, Rq);
        SUF(prod_add)(&f, MHA_TN, f.dk, f.Ekv, (const T *)a->fwd.key, Ek, NULL,
                      g + offset[MHA_WK], Ek, f.Ekv, Ek, Rk);
        SUF(prod_add)(&f, MHA_TN, f.dv, f.Ekv, (const T *)a->fwd.value, Ev, NULL,
                      g + offset[MHA_WV], Ev, f.Ekv, Ev, Rk);
    }
    if (a->grad_query)
        SUF(prod_add)(&f, MHA_NN, f.dq, f.E, (const T *)p->wq, f.E, NULL,
                      (T *)a->grad_query, f.E, Rq, f.E, f.E);
    if (a->grad_key)
        SUF(prod_add)(&f, MHA_NN, f.dk, f.Ekv, (const T *)p->wk, Ek, NULL,
                      (T *)a->grad_key, Ek, Rk, Ek, f.Ekv);
    if (a->grad_value)
        SUF(prod_add)(&f, MHA_NN, f.dv, f.Ekv, (const T *)p->wv, Ev, NULL,
                      (T *)a->grad_value, Ev, Rk, Ev, f.Ekv);
    /* ... and, in the same pass, the bias gradients: the column sums of
     * d out, and of dQ, dK, dV as the sums of their batches' sums */
    if (g && cfg->bias) {
        SUF(btr_add)(&f, (const T *)a->grad_out, g + offset[MHA_BO], Rq, f.E);
        SUF(btr_add)(&f, f.bsum, g + offset[MHA_BQ], f.B, f.E);
        SUF(btr_add)(&f, f.bsum + f.B * f.E, g + offset[MHA_BK], f.B, f.Ekv);
        SUF(btr_add)(&f, f.bsum + 2 * f.B * f.E, g + offset[MHA_BV], f.B, f.Ekv);
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
#undef RM_S
#undef RN_S
#undef RM_TN
#undef RN_TN
#undef RN_TN_AT
#undef TC
