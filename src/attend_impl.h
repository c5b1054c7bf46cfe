/* attend_impl.h: the forward's attention tasks, written once for T = float
 * and T = double (included by forward.c after softmax_impl.h, before
 * attend_pass_impl.h, which hands them to the pool, and forward_impl.h and
 * sdpa_impl.h, which both run them: the module's
 * attention on its projected heads and mha_sdpa_forward's on the caller's).
 *
 *   per (b, h, block of QB queries), h' = h / (H / Hkv) its key/value head:
 *     S = Q_bh·K_bh'ᵀ · scale, masked (-inf), softmax, dropout
 *     ctx_bh = S·V_bh'
 *
 * With weights (or P kept), one pass per task computes S straight into the
 * weights array, finishes the softmax there in place (written once) and
 * multiplies by V: no second (Sq, Sk) buffer.  Without, an online softmax
 * runs over blocks of KB keys in per-thread scratch of (QB, KB): no (Sq, Sk)
 * buffer at all.  Causal and sliding windows: keys outside the block's
 * visible range are never computed, and P·V takes each run of rows only
 * up to its last visible key (skip, av_runs; not when V holds a NaN or
 * inf, which must still reach every row as 0·NaN does in the reference,
 * nor with extra keys).
 *
 * The products take the float kernels (mha_gemm_fma) on every ISA, amx
 * too: a decode step must give the full call's bits (docs/API.md §3.3).
 * A prototype on the tiles (Xeon, two threads; benchmarks/RESULTS.md): long
 * 330-335 -> 279-282 ms, decode (B 8, 2048 keys) 3.8 -> 10.1 ms, as it cut
 * the cache's whole K and V; nor can FMAs give the tiles' bits: a tdpbf16ps
 * differs from sequential FMAs, exact and pairwise sums in 39%/42%/45%. */

#define QB 48        /* queries per block of an attention task (attend_blocks_task runs
                        up to QGRP of them): a multiple of every kernel's MR (6, 6, 4).
                        72 and 96 (before the groups: K and V read from L3 for fewer
                        blocks of queries) measured the same: Zen 5, two threads,
                        builds alternated process by process, medians, B 1, S 4096,
                        E 1024, H 16: 252-258 -> 251-254 ms (QB 96); B 4, S 1024:
                        121-123 both; BERT 88-90 both, with its weights 86-90 ->
                        86-87; the SDPA alone at long's shape 175-179 -> 174-176
                        (QB 72 and 96).  S = Q·Kᵀ inside the call (rdtsc around
                        each product, one thread, long's SDPA): 81% of a core, P·V 91%,
                        the softmax 15% of the pass; Kᵀ laid out in contiguous 64-key
                        panels left S's rate unchanged */
#define KB 512       /* keys per block of the online softmax: Zen 5, B 1, S 4096,
                        E 1024, H 16, two threads, alternated: 256 -> 512 keys
                        263-268 -> 250-262 ms (the running max and sum
                        updated, the context rescaled, half as often); B 4,
                        S 1024: 121-124 -> 121-122; at S 128 and 384 the same */
#define ROWS 48      /* grouped-query tasks: at most this many rows (G * Sq) */
#define TASKS 32     /* attention tasks a thread (attend): blocks of queries of one
                        head grouped until there are about this many */
#define QGRP 8       /* ... at most this many blocks a group: the pool polls for
                        Ctrl-C between tasks, and a group is at most 8 / 48 of a
                        head's queries' work (long sequences: at S 4096 groups of 8
                        and of 22 blocks ran the same, within the noise) */
#define HEAD_WORK (1 << 17) /* whole heads of little work (a decode step's few keys)
                        grouped, several a task, until a task holds about this
                        many products (att_hpt) */

typedef struct {
    const KT *kern;
    mha_rows rr;          /* masks, causality, blocked rows */
    int64_t B, H, Hkv, Sq, Sk, Dk, Dv; /* Sk: every key, the extra ones too */
    int64_t kld;          /* K's and V's rows per head in memory (>= Sk: a
                             cache's capacity); 0: Sk */
    int64_t vld;          /* V's, when not kld (SDPA's Kᵀ set a line apart); 0: kld */
    const T *qh;          /* Q per head: (B, H, Sq, Dk) */
    const T *kt;          /* K per head, transposed: (B, Hkv, Dk, kld) */
    const T *k_rows;      /* or NULL: K per head as rows, (B, Hkv, Sk, Dk) (the
                             SDPA's k with few queries, no weights): the online
                             task transposes each panel of NR keys into its
                             scratch (Dk, NR), in L1, just before Q·Kᵀ reads it
                             (Kᵀ never formed in memory: a decode step read K
                             three times more) */
    const T *vh;          /* V per head: (B, Hkv, vld, Dv) */
    T *ctx;               /* row i of head (b, h): ctx + b*cs_b + h*cs_h + i*ldc, Dv wide */
    int64_t cs_b, cs_h, ldc;
    T *weights;           /* NULL, or (B, H, Sq, Sk); with avg (B, Sq, Sk) */
    T *p_save;            /* NULL, or mha_saved's P (B, H, Sq, Sk) */
    T *scratch;           /* per slot: GEMM packing, then the task's state */
    int64_t scratch_len;  /* scalars per slot */
    T scale;              /* the score scale */
    T drop_scale;         /* 1 / (1 - p) */
    double dropout;       /* p */
    uint64_t drop_key;
    int dropout_on;
    const T *hmask;       /* NULL, or the head mask: (b, h) at b*hm_sb + h*hm_sh */
    int64_t hm_sb, hm_sh;
    int stream;           /* P and the weights formed in the slot's scratch and
                             streamed out (attend_weights_task) */
    int skip;             /* V finite, no extra keys: skip the keys causality
                             and the window block (att_kbeg, att_kend) */
    int grp;              /* tasks per (b, key/value head), rows the group's */
    int avg;              /* the weights are (B, Sq, Sk), the mean over the heads
                             (attend_avg_task) */
    T *avg_heads;         /* with avg and too few tasks for it (att_avg_heads):
                             room for the per-head weights (B, H, Sq, Sk) */
    int64_t n_qblk;
    int64_t qgrp;         /* blocks of queries per task, consecutive ones of one
                             head (attend_blocks_task) */
    int64_t hpt;          /* or, when > 1, whole heads per task (att_hpt) */
} SUF(att);

/* The weights alone, or P (kept for the backward, which reads it next) past
 * 32 MiB: formed in the slot's scratch and streamed out
 * (attend_weights_task).  The weights at every size: the caller's array
 * is then written once and never read, where a store into it first reads
 * each line from memory.  Zen 4, B 8 S 128 E 512 H 8 (4 MiB of float32
 * weights, 8 of float64), the attention pass: 2.0 -> 1.9 ms, float64
 * 4.26 -> 3.96; B 1 (512 KiB) 0.23 -> 0.22; B 2 S 10 unchanged */
static int SUF(att_streams)(const SUF(att) *at)
{
    if (at->weights && !at->p_save) return 1;
    return at->p_save &&
           (double)at->B * (double)at->H * (double)at->Sq * (double)at->Sk * (double)sizeof(T) >
                   32.0 * 1048576.0;
}

/* scalars of per-slot state (after the packing) a task of `at` needs */
static int SUF(att_state)(const SUF(att) *at, int64_t *state)
{
    *state = 0;
    if (!at->weights && !at->p_save)
        return mha_mul(QB, at->Dv, state) || mha_add(*state, QB * KB + 2 * QB, state) ||
               (at->k_rows && mha_add(*state, at->Dk * at->kern->nr, state));
    if (SUF(att_streams)(at) || at->avg || (at->p_save && !at->weights && at->dropout_on))
        return mha_mul(QB, at->Sk, state);
    return 0;
}

/* K given as rows (B, Hkv, Sk, Dk) rather than transposed: taken (k_rows)
 * when the online task runs with one block of queries per head, so that
 * no block of keys is transposed twice; else the caller forms kt */
static void SUF(att_k_rows)(SUF(att) *at, const T *k)
{
    if (at->weights || at->p_save || at->Sq > QB) return;
    at->k_rows = k;
}

/* slot's panel of keys (Dk, NR) for k_rows, after its GEMM scratch and its
 * online state (att_state) */
static T *SUF(att_kb)(const SUF(att) *at, int slot)
{
    return at->scratch + (int64_t)slot * at->scratch_len + MHA_GEMM_SCRATCH + QB * KB +
           2 * QB + QB * at->Dv;
}

/* the keys [kbeg, kend) the block of queries i0 .. i0+nq-1 may see */
static int64_t SUF(att_kend)(const SUF(att) *at, int64_t i0, int64_t nq)
{
    int64_t kend = at->Sk;
    if (at->skip && at->rr.causal && i0 + nq + at->rr.coff < kend) kend = i0 + nq + at->rr.coff;
    if (at->skip && at->rr.window && at->rr.wr >= 0 &&
        i0 + nq + at->rr.coff + at->rr.wr < kend)
        kend = i0 + nq + at->rr.coff + at->rr.wr;
    return kend < 0 ? 0 : kend;
}
static int64_t SUF(att_kbeg)(const SUF(att) *at, int64_t i0)
{
    int64_t kbeg = 0;
    if (at->skip && at->rr.window && at->rr.wl >= 0) kbeg = i0 + at->rr.coff - at->rr.wl;
    return kbeg < 0 ? 0 : kbeg > at->Sk ? at->Sk : kbeg;
}

static void SUF(fill_rows)(T *x, int64_t rows, int64_t cols, int64_t ld, T value)
{
    int64_t r, c;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) x[r * ld + c] = value;
}

/* A = dropout(P) over w[0..n), the row's elements idx, idx+1, ... of the
 * call's stream */
static void SUF(dropout_row)(const SUF(att) *at, T *w, int64_t n, uint64_t idx)
{
    int64_t j;
    for (j = 0; j < n; j++)
        w[j] = mha_dropout_keep(at->drop_key, idx + (uint64_t)j, at->dropout)
                   ? w[j] * at->drop_scale : (T)0;
}

/* Row r of the block's A from its P (rows Sk apart): a copy when they
 * differ, then the dropout (none on a row with every key blocked, ne < 0) */
static void SUF(a_row)(const SUF(att) *at, const T *p_bh, T *a_bh, int64_t r, int64_t ne,
                       int64_t bh, int64_t i0)
{
    const int64_t Sk = at->Sk;
    if (a_bh != p_bh) memcpy(a_bh + r * Sk, p_bh + r * Sk, (size_t)Sk * sizeof(T));
    if (at->dropout_on && ne >= 0)
        SUF(dropout_row)(at, a_bh + r * Sk, ne,
                         ((uint64_t)bh * (uint64_t)at->Sq + (uint64_t)(i0 + r)) * (uint64_t)Sk);
}

/* Set sums (not accumulate): C + 0, a sum of -0 to +0, as a sum added to a
 * zero fill gives (every other value unchanged).  Its sign would otherwise
 * depend on how many keys past the row's own its run of rows took (a run's
 * last entries add p·v = 0, and -0 + 0 = +0). */
static void SUF(plus_zero)(T *c, int64_t m, int64_t n, int64_t ldc, int accumulate)
{
    int64_t i, j;
    if (accumulate) return;
    for (i = 0; i < m; i++)
        for (j = 0; j < n; j++) c[i * ldc + j] += (T)0;
}

/* c (+)= A·V for a task's nq rows: A (nq, nk), rows lda apart, V (nk, Dv).
 * With V finite (at->skip), row r of A is 0 past its first ne[r] entries
 * (ne[r] < 0: ne_blocked), so each run of rows takes only the keys up to
 * its last entry that may be nonzero (causality's triangle), in chunks of
 * CH rows, a run of chunks with the same count in one call; the keys left
 * out would add exact zeros to the sums.  Otherwise (a NaN or inf in V
 * must reach every row, as 0·NaN) every row takes all nk keys. */
static void SUF(av_runs)(const SUF(att) *at, int64_t nq, int64_t nk, const T *a, int64_t lda,
                         const int64_t *ne, int64_t ne_blocked, const T *v, T *c, int64_t ldc,
                         int accumulate, T *gs)
{
    const int64_t CH = 2 * at->kern->mr, Dv = at->Dv;
    int64_t r0, r1, r;
    if (!at->skip) {
        SUF(mha_gemm_fma)(at->kern, 0, nq, Dv, nk, a, lda, v, Dv, NULL, c, ldc, accumulate, gs);
        SUF(plus_zero)(c, nq, Dv, ldc, accumulate);
        return;
    }
    for (r0 = 0; r0 < nq; r0 = r1) {
        int64_t kc = -1;
        for (r1 = r0; r1 < nq;) {
            const int64_t e = r1 + CH < nq ? r1 + CH : nq;
            int64_t kn = 0;
            for (r = r1; r < e; r++) {
                const int64_t k = ne[r] < 0 ? ne_blocked : ne[r];
                if (k > kn) kn = k < nk ? k : nk;
            }
            if (kc >= 0 && kn != kc) break;
            kc = kn;
            r1 = e;
        }
        if (kc > 0)
            SUF(mha_gemm_fma)(at->kern, 0, r1 - r0, Dv, kc, a + r0 * lda, lda, v, Dv, NULL,
                          c + r0 * ldc, ldc, accumulate, gs);
        else if (!accumulate)
            SUF(fill_rows)(c + r0 * ldc, r1 - r0, Dv, ldc, (T)0);
    }
    SUF(plus_zero)(c, nq, Dv, ldc, accumulate);
}

/* avg (nq, Sk) = A (head 0) or avg + A (the heads after it), in order */
static void SUF(avg_add)(const SUF(att) *at, T *avg, const T *a, int64_t nq, int64_t h)
{
    const int64_t n = nq * at->Sk;
    int64_t i;
    if (h == 0)
        memcpy(avg, a, (size_t)n * sizeof(T));
    else
        for (i = 0; i < n; i++) avg[i] += a[i];
}

/* Attention with the weights written: task = (b, h, block of queries)
 * (attend_weights_task; attend_avg_task: its rows with avg, each head's in
 * turn).
 * P (the softmax) is formed in the weights array itself, or in mha_saved's
 * P when that is kept; A = dropout(P), what multiplies V, is then the
 * weights array, P itself (no dropout, no weights asked for) or a scratch
 * block of the slot (dropout, no weights).  With at->stream (att_streams:
 * the weights alone, or past 32 MiB) P and A are both formed in that
 * scratch block, which stays in L2, and copied
 * out with stores that bypass the caches: P before its dropout, the
 * weights (m·A) once the block is done.  The destinations are then
 * written once and never read, so no line of them is first read from
 * memory (as a store into the array itself reads each line). */
static void SUF(attend_weights_rows)(const SUF(att) *at, int64_t bh, int64_t i0, int64_t nq,
                                     int slot, T *avg)
{
    int64_t b = bh / at->H, h = bh % at->H;
    int64_t bkv = b * at->Hkv + h / (at->H / at->Hkv);
    int64_t Sk = at->Sk, Dk = at->Dk, Dv = at->Dv, r, kend, kbeg;
    const T *q_bh = at->qh + (bh * at->Sq + i0) * Dk;          /* (nq, Dk) */
    const T *kt_bh = at->kt + bkv * Dk * at->kld;              /* (Dk, Sk), ld kld */
    const T *v_bh = at->vh + bkv * at->vld * Dv;               /* (Sk, Dv) */
    T *c_bh = at->ctx + b * at->cs_b + h * at->cs_h + i0 * at->ldc; /* (nq, Dv), ld ldc */
    T *gs = at->scratch + (int64_t)slot * at->scratch_len;
    /* P and A (nq, Sk); with avg, A (and P when not kept) in the slot's
     * scratch, A then added into avg */
    T *p_bh = at->p_save ? at->p_save + (bh * at->Sq + i0) * Sk
              : avg      ? gs + MHA_GEMM_SCRATCH
                         : at->weights + (bh * at->Sq + i0) * Sk;
    T *a_bh = p_bh;
    T *p_out = NULL, *w_out = NULL; /* with at->stream: where P and the weights go */
    int64_t ne[QB];
    if (avg)
        a_bh = gs + MHA_GEMM_SCRATCH;
    else if (at->p_save && at->weights)
        a_bh = at->weights + (bh * at->Sq + i0) * Sk;
    else if (at->p_save && at->dropout_on)
        a_bh = gs + MHA_GEMM_SCRATCH;
    if (Sk == 0) { /* no key at all: the context is an empty sum */
        SUF(fill_rows)(c_bh, nq, Dv, at->ldc, (T)0);
        return;
    }
    kend = SUF(att_kend)(at, i0, nq); /* later keys: blocked for all */
    kbeg = SUF(att_kbeg)(at, i0);     /* earlier keys: blocked for all */
    if (at->skip) mha_lay_hull(&at->rr.lay, b, h, i0, nq, &kbeg, &kend); /* the layout's */
    if (kend <= kbeg) { /* every row of the block is blocked (lower-right with
                           Sq > Sk, an empty window or layout) */
        const T value = SUF(blocked_row_value)(&at->rr);
        SUF(fill_rows)(p_bh, nq, Sk, Sk, value);
        if (a_bh != p_bh) SUF(fill_rows)(a_bh, nq, Sk, Sk, value);
        SUF(fill_rows)(c_bh, nq, Dv, at->ldc, value);
        if (avg) SUF(avg_add)(at, avg, a_bh, nq, h);
        return;
    }
    if (at->stream) {
        p_out = at->p_save ? p_bh : NULL;
        w_out = at->weights && !avg ? at->weights + (bh * at->Sq + i0) * Sk : NULL;
        p_bh = a_bh = gs + MHA_GEMM_SCRATCH;
    }
    /* the keys before kbeg: 0 scores, which the window or the layout masks */
    if (kbeg > 0) SUF(fill_rows)(p_bh, nq, kbeg, Sk, (T)0);
    SUF(mha_gemm_fma)(at->kern, 0, nq, kend - kbeg, Dk, q_bh, Dk, kt_bh + kbeg, at->kld, NULL,
                  p_bh + kbeg, Sk, 0, gs);
    for (r = 0; r < nq; r++) { /* P = softmax(masked S · scale); ne < 0: every key blocked */
        ne[r] = SUF(softmax_row)(at->kern, &at->rr, at->scale, p_bh + r * Sk, b, h, i0 + r, 0,
                                 kend, Sk);
        if (!p_out) SUF(a_row)(at, p_bh, a_bh, r, ne[r], bh, i0);
    }
    if (p_out) { /* P leaves before its dropout, the block in one streamed copy */
        mha_copy_stream(p_out, p_bh, (size_t)(nq * Sk) * sizeof(T));
        for (r = 0; r < nq; r++) SUF(a_row)(at, p_bh, a_bh, r, ne[r], bh, i0);
    }
    /* A·V from a multiple of the GEMM's depth block (A is 0 before kbeg):
     * a row's sums then never depend on the block of queries it is in.  A
     * blocked row (its value, NaN or 0, everywhere) takes every key */
    kbeg -= kbeg % MHA_GEMM_KC;
    for (r = 0; r < nq; r++)
        if (ne[r] >= 0) ne[r] -= kbeg;
    SUF(av_runs)(at, nq, kend - kbeg, a_bh + kbeg, Sk, ne, kend - kbeg, v_bh + kbeg * Dv, c_bh,
                 at->ldc, 0, gs);
    if (at->hmask) { /* the head mask m: weights m·A, context (m·A)·V = m·(A·V) */
        const T m = at->hmask[b * at->hm_sb + h * at->hm_sh];
        for (r = 0; r < nq; r++) {
            at->kern->scale(c_bh + r * at->ldc, Dv, m);
            if (at->weights) at->kern->scale(a_bh + r * Sk, Sk, m); /* A is the weights */
        }
    }
    if (w_out) mha_copy_stream(w_out, a_bh, (size_t)(nq * Sk) * sizeof(T));
    if (avg) SUF(avg_add)(at, avg, a_bh, nq, h);
}

static void SUF(attend_weights_task)(void *ctx, int64_t t, int slot)
{
    const SUF(att) *at = (const SUF(att) *)ctx;
    const int64_t i0 = (t % at->n_qblk) * QB;
    SUF(attend_weights_rows)(at, t / at->n_qblk, i0, at->Sq - i0 < QB ? at->Sq - i0 : QB, slot,
                             NULL);
}

/* The weights averaged over the heads (at->avg): task = (b, block of QB
 * queries), its heads in order, each one's A formed in the slot's scratch
 * and added into the block of the (B, Sq, Sk) weights (which stays in cache
 * across the heads: no (B, H, Sq, Sk) array is written), then divided by
 * H: head 0's A, + head 1's, ..., / H, mha_ext._calls.head_mean's order, so
 * the same bits as averaging the per-head weights that way. */
static void SUF(attend_avg_task)(void *ctx, int64_t t, int slot)
{
    const SUF(att) *at = (const SUF(att) *)ctx;
    const int64_t b = t / at->n_qblk, i0 = (t % at->n_qblk) * QB, Sk = at->Sk;
    const int64_t nq = at->Sq - i0 < QB ? at->Sq - i0 : QB;
    T *avg = at->weights + (b * at->Sq + i0) * Sk;
    const T H = (T)at->H;
    int64_t h, n;
    for (h = 0; h < at->H; h++) SUF(attend_weights_rows)(at, b * at->H + h, i0, nq, slot, avg);
    for (n = 0; n < nq * Sk; n++) avg[n] /= H;
}

/* Whether a call with the heads' mean has too few (b, block of queries)
 * tasks for attend_avg_task to keep the threads busy (fewer than four a
 * thread: a decode step, a short chunk of queries over a long cache, where
 * the (b, h, block) tasks run the heads in parallel): it then forms the
 * per-head weights in at->avg_heads and their mean after (attend_mean_task).
 * Zen 5, two threads, E 512, H 8, one query over 16384 cached keys: the
 * heads one after the other in one task took 2.6-3.3 ms, in parallel
 * 1.7-2.3 (the per-head weights and NumPy's mean of them). */
static int SUF(att_avg_heads)(const SUF(att) *at, int slots)
{
    return at->avg && at->B * ((at->Sq + QB - 1) / QB) < 4 * (int64_t)slots;
}

#define MEAN_CHUNK 16384 /* scalars of one batch's (Sq, Sk) per mean task */

/* A chunk of the mean of at->avg_heads into the weights: head 0, + head 1,
 * ..., then / H (attend_avg_task's order, element by element) */
static void SUF(attend_mean_task)(void *ctx, int64_t t, int slot)
{
    const SUF(att) *at = (const SUF(att) *)ctx;
    const int64_t per = at->Sq * at->Sk, nch = (per + MEAN_CHUNK - 1) / MEAN_CHUNK;
    const int64_t b = t / nch, e0 = (t % nch) * MEAN_CHUNK;
    const int64_t n = per - e0 < MEAN_CHUNK ? per - e0 : MEAN_CHUNK;
    const T *w = at->avg_heads + b * at->H * per + e0;
    T *avg = at->weights + b * per + e0;
    const T H = (T)at->H;
    int64_t h, i;
    (void)slot;
    memcpy(avg, w, (size_t)n * sizeof(T));
    for (h = 1; h < at->H; h++)
        for (i = 0; i < n; i++) avg[i] += w[h * per + i];
    for (i = 0; i < n; i++) avg[i] /= H;
}

/* Attention without weights: an online softmax over blocks of KB keys.
 * Task = (b, h, block of queries) (one block of an attend_blocks_task), or
 * with `grp` (grouped-query attention, few queries: a decode step) task =
 * (b, key/value head h'), its rows the G query heads' Sq queries each
 * (contiguous in qh), so that K and V of h' are read once for the whole
 * group (a row's bits are the same either way: mha_gemm_fma's sums do not
 * depend on the rows beside it). */
static void SUF(attend_online_task)(void *ctx, int64_t t, int slot)
{
    const SUF(att) *at = (const SUF(att) *)ctx;
    const int64_t G = at->H / at->Hkv;
    int64_t b, h0, bkv, i0, nq, nqh; /* nqh: rows per query head in the task */
    const int64_t NR = at->kern->nr;
    int64_t Sk = at->Sk, Dk = at->Dk, Dv = at->Dv, r, j0, d, kend;
    int64_t ne[QB > ROWS ? QB : ROWS]; /* per row: the block's entries that may be nonzero */
    if (at->grp) {
        bkv = t;
        b = t / at->Hkv;
        h0 = (t % at->Hkv) * G;
        i0 = 0;
        nqh = at->Sq;
        nq = G * nqh;
    } else {
        const int64_t bh = t / at->n_qblk;
        b = bh / at->H;
        h0 = bh % at->H;
        bkv = b * at->Hkv + h0 / G;
        i0 = (t % at->n_qblk) * QB;
        nq = nqh = at->Sq - i0 < QB ? at->Sq - i0 : QB;
    }
    const T *q_bh = at->qh + ((b * at->H + h0) * at->Sq + i0) * Dk; /* (nq, Dk) */
    const T *v_bh = at->vh + bkv * at->vld * Dv;     /* (Sk, Dv) */
    T *gs = at->scratch + (int64_t)slot * at->scratch_len; /* GEMM packing */
    T *s = gs + MHA_GEMM_SCRATCH;                          /* (QB, KB) */
    T *mx = s + QB * KB;                                   /* (QB) running max */
    T *l = mx + QB;                                        /* (QB) running sum */
    T *acc = l + QB;                                       /* (QB, Dv), ld ald */
    T *kb = SUF(att_kb)(at, slot);                         /* k_rows: (Dk, NR) */
    const T *kt_bh = at->kt + bkv * Dk * at->kld;          /* (Dk, Sk), ld kld */
    int64_t ald = Dv, first = 1; /* first: no block summed into acc yet */
    for (r = 0; r < nq; r++) {
        mx[r] = -(T)INFINITY;
        l[r] = 0;
    }
    kend = SUF(att_kend)(at, i0, nqh);
    /* one block of keys (S up to KB) and the rows one head's: the context
     * rows themselves hold the sums, normalized in place at the end (no
     * copy; the same operations, so the same bits) */
    if (!at->grp && SUF(att_kbeg)(at, i0) / KB * KB + KB >= kend) {
        acc = at->ctx + b * at->cs_b + h0 * at->cs_h + i0 * at->ldc;
        ald = at->ldc;
    }
    /* blocks of keys anchored at key 0 (from the multiple of KB before the
     * first visible key): a row's running sums never depend on the block of
     * queries it is in, nor on keys past its last visible one.  With a
     * layout, a block no row of the task keeps is skipped: every row would
     * see it blocked, which changes no sum (softmax_online_step) */
    for (j0 = SUF(att_kbeg)(at, i0) / KB * KB; j0 < kend; j0 += KB) {
        int64_t nk = kend - j0 < KB ? kend - j0 : KB, rs, re;
        if (at->skip && at->rr.lay.keep) { /* grp is off with a layout: h0 is the head */
            mha_lay_run(&at->rr.lay, b, h0, i0, nqh, j0, kend, &rs, &re);
            if (rs >= kend) break;
            if (rs >= j0 + nk) { /* on to the block of the next kept key */
                j0 = rs / KB * KB - KB;
                continue;
            }
        }
        /* S in whole panels of the kernel's width where there are keys
         * for them (a part panel is packed first; the extra scores are
         * never read) */
        int64_t ns = (nk + NR - 1) / NR * NR;
        if (ns > Sk - j0) ns = Sk - j0;
        if (ns > KB) ns = KB;
        if (at->k_rows) { /* a panel of keys at a time, transposed into L1, then read
                             there (rows a vector apart where the panel fits in one) */
            int64_t p, pn, w;
            for (p = 0; p < ns; p += NR) {
                pn = ns - p < NR ? ns - p : NR;
                w = pn <= at->kern->nr_narrow ? at->kern->nr_narrow : NR;
                SUF(transpose)(at->kern, at->k_rows + (bkv * Sk + j0 + p) * Dk, pn, Dk, Dk, kb,
                               w);
                SUF(mha_gemm_panel)(at->kern, nq, pn, Dk, q_bh, Dk, kb, w, s + p, KB);
            }
        } else {
            SUF(mha_gemm_fma)(at->kern, 0, nq, ns, Dk, q_bh, Dk, kt_bh + j0, at->kld, NULL, s, KB,
                          0, gs);
        }
        for (r = 0; r < nq; r++) {
            T *srow = s + r * KB, alpha;
            const int64_t h = h0 + r / nqh, i = i0 + r % nqh, bh = b * at->H + h;
            ne[r] = SUF(softmax_online_step)(at->kern, &at->rr, at->scale, srow, b, h, i, j0, nk,
                                             &mx[r], &l[r], &alpha);
            if (ne[r] < 0) continue; /* nothing visible in this block */
            if (at->dropout_on)
                SUF(dropout_row)(at, srow, ne[r], ((uint64_t)bh * (uint64_t)at->Sq +
                                                   (uint64_t)i) * (uint64_t)Sk + (uint64_t)j0);
            if (alpha != (T)1 && !first) at->kern->scale(acc + r * ald, Dv, alpha);
        }
        /* a row with nothing visible here adds nothing (its s is 0); the
         * first block sets acc (as adding to a zero fill would) */
        SUF(av_runs)(at, nq, nk, s, KB, ne, 0, v_bh + j0 * Dv, acc, ald, !first, gs);
        first = 0;
    }
    if (first) SUF(fill_rows)(acc, nq, Dv, ald, (T)0); /* no block: every row blocked */
    const T *zero_v = NULL; /* Σ_j 0·V_j: a blocked row's context with zero_masked_rows */
    for (r = 0; r < nq; r++) {
        const int64_t h = h0 + r / nqh, i = i0 + r % nqh;
        T *c = at->ctx + b * at->cs_b + h * at->cs_h + i * at->ldc;
        if (mx[r] == -(T)INFINITY) { /* every key blocked; Sk == 0: an empty sum */
            if (Sk > 0 && at->rr.zero_masked_rows) {
                /* zero weights times V, as the weights path's A·V and torch's
                 * SDPA give: 0, or NaN in a column where V holds NaN or inf
                 * (computed once, in this row's unused accumulator) */
                if (!zero_v) {
                    T *z = acc + r * ald;
                    for (j0 = 0; j0 < Sk; j0++)
                        for (d = 0; d < Dv; d++) z[d] += (T)0 * v_bh[j0 * Dv + d];
                    zero_v = z;
                }
                for (d = 0; d < Dv; d++) c[d] = zero_v[d];
                continue;
            }
            for (d = 0; d < Dv; d++) c[d] = Sk == 0 ? (T)0 : SUF(blocked_row_value)(&at->rr);
        } else {
            if (c != acc + r * ald) memcpy(c, acc + r * ald, (size_t)Dv * sizeof(T));
            at->kern->scale(c, Dv, (T)1 / l[r]); /* the sums times 1/l */
            if (at->hmask) at->kern->scale(c, Dv, at->hmask[b * at->hm_sb + h * at->hm_sh]);
        }
    }
}

/* QB, KB, ROWS, TASKS, QGRP, HEAD_WORK and MEAN_CHUNK stay defined for
 * attend_pass_impl.h (the pass that runs these tasks), which undefines them */
