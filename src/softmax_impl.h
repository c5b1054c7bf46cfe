/* softmax_impl.h: the one softmax row of the attention, written once for
 * T = float and T = double and included by forward.c and backward.c (with
 * T, SUF, KT and EXP defined) before their passes, which both call it: the
 * forward's and the backward's probabilities are the same bits because
 * they come from the same code (ggml's ggml_vec_soft_max_f32 is the model).
 * The reference passes (ref_*_impl.h) keep their own plain loops: an oracle
 * shares nothing with the fast path but the inputs.
 *
 * Instances: all_finite_f32/_f64, row_masks_f32/_f64, row_max_f32/_f64, softmax_row_f32/_f64,
 * softmax_online_step_f32/_f64, blocked_row_value_f32/_f64, causal_visible_f32/_f64.
 *
 * A row is (b, h, i): the scores of query i of head h in batch b against
 * the keys.  The rules, each in one place:
 *   masks       additive masks first, then -inf where a blocking mask,
 *               causality (key j > query i + coff), the sliding window
 *               (j outside [i + coff - wl, i + coff + wr]) or the block
 *               layout (block (i / q_block, j / k_block) not kept) blocks (row_masks); keys
 *               from rr->nmk on (add_bias_kv's and add_zero_attn's) are
 *               never blocked
 *   blocked     a row with no visible key is the blocked value: NaN, or 0
 *               with zero_masked_rows                      (row_max, blocked_row_value)
 *   NaN         a NaN score makes the whole row NaN       (row_max, softmax_row)
 *   causal      keys past the diagonal are exact zeros, never exponentiated
 *   dropout     mha_dropout_keep (internal.h) */

/* 1 when every element of x[0..n) is finite */
static int SUF(all_finite)(const T *x, int64_t n)
{
    int64_t i;
    T z[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* independent sums: no chain of adds */
    for (i = 0; i + 8 <= n; i += 8) {
        int u;
        for (u = 0; u < 8; u++) z[u] += x[i + u] * 0; /* NaN once one is NaN or inf */
    }
    for (; i < n; i++) z[0] += x[i] * 0;
    return z[0] + z[1] + z[2] + z[3] + z[4] + z[5] + z[6] + z[7] == 0;
}

/* The value of every weight, and of the context, of a row with every key
 * blocked (Sk == 0 is no such row: its context is an empty sum, 0). */
static inline T SUF(blocked_row_value)(const mha_rows *rr)
{
    return rr->zero_masked_rows ? (T)0 : (T)NAN;
}

/* Of keys j0 .. j0+n-1, how many lead before causality's first blocked
 * key for query i (0 .. n; the caller checks rr->causal, and that no extra
 * key, never blocked, lies in the range) */
static inline int64_t SUF(causal_visible)(const mha_rows *rr, int64_t i, int64_t j0, int64_t n)
{
    const int64_t j = i + rr->coff + 1 - j0;
    return j < 0 ? 0 : j < n ? j : n;
}

/* s[0..n) are the scaled scores of row (b, h, i) for keys j0 .. j0+n-1:
 * add the additive masks, then set -inf where any blocking mask or the
 * causal rule blocks.  Two or more additive masks are summed first, in
 * their order, and the sum added to the score, as torch adds its attn_mask
 * and key_padding_mask: s + (m1 + m2), not (s + m1) + m2, which loses s
 * when m1 and m2 are large and cancel. */
static inline void SUF(row_masks)(const mha_rows *rr, T *s, int64_t b, int64_t h,
                                  int64_t i, int64_t j0, int64_t n)
{
    const T *add[MHA_MAX_MASKS];
    int64_t add_st[MHA_MAX_MASKS];
    int m, n_add = 0;
    int64_t j;
    if (j0 + n > rr->nmk) n = rr->nmk > j0 ? rr->nmk - j0 : 0; /* the extra keys: never blocked */
    for (m = 0; m < rr->n_masks; m++) {
        const mha_mask *mk = &rr->masks[m];
        if (mk->kind != MHA_MASK_ADD) continue;
        add[n_add] = (const T *)mk->data + b * mk->stride[0] + h * mk->stride[1] +
                     i * mk->stride[2] + j0 * mk->stride[3];
        add_st[n_add++] = mk->stride[3];
    }
    if (n_add == 1) {
        const T *d = add[0];
        if (add_st[0] == 1)
            for (j = 0; j < n; j++) s[j] += d[j];
        else
            for (j = 0; j < n; j++) s[j] += d[j * add_st[0]];
    } else if (n_add > 1) {
        for (j = 0; j < n; j++) {
            T sum = add[0][j * add_st[0]];
            for (m = 1; m < n_add; m++) sum += add[m][j * add_st[m]];
            s[j] += sum;
        }
    }
    for (m = 0; m < rr->n_masks; m++) {
        const mha_mask *mk = &rr->masks[m];
        int64_t base = b * mk->stride[0] + h * mk->stride[1] + i * mk->stride[2] +
                       j0 * mk->stride[3];
        int64_t st = mk->stride[3];
        if (mk->kind != MHA_MASK_BLOCK) continue;
        const uint8_t *d = (const uint8_t *)mk->data + base;
        if (st == 1) /* a select, not a branch: vectorised, and a random mask
                        mispredicts no branch (a bool mask took 1.4-1.7x the
                        time of the same float mask) */
            for (j = 0; j < n; j++) s[j] = d[j] ? -(T)INFINITY : s[j];
        else
            for (j = 0; j < n; j++)
                if (d[j * st]) s[j] = -(T)INFINITY;
    }
    if (rr->causal) {
        for (j = SUF(causal_visible)(rr, i, j0, n); j < n; j++) s[j] = -(T)INFINITY;
    }
    if (rr->window) {
        /* the window's first visible key, and the first blocked one after it,
         * relative to j0 */
        const int64_t lo = rr->wl < 0 ? 0 : i + rr->coff - rr->wl - j0;
        const int64_t hi = rr->wr < 0 ? n : i + rr->coff + rr->wr + 1 - j0;
        for (j = 0; j < lo && j < n; j++) s[j] = -(T)INFINITY;
        for (j = hi < 0 ? 0 : hi; j < n; j++) s[j] = -(T)INFINITY;
    }
    if (rr->lay.keep) { /* the block layout: keys of blocks not kept */
        const uint8_t *kp = mha_lay_row(&rr->lay, b, h, i);
        const int64_t kbs = rr->lay.k_block;
        for (j = 0; j < n;) {
            const int64_t kb = (j0 + j) / kbs, e = (kb + 1) * kbs - j0 < n ? (kb + 1) * kbs - j0 : n;
            if (kp[kb]) j = e;
            else
                for (; j < e; j++) s[j] = -(T)INFINITY;
        }
    }
}

/* Scale the raw scores s[0..n) of row (b, h, i), keys j0.., by `scale`,
 * mask them, and return their maximum (with causality the only mask, the
 * keys past the diagonal are neither scaled nor set to -inf: the callers
 * zero them by the same rule): -inf when every key is blocked, NaN
 * when a score is NaN and no other key is visible (then the reference's
 * row is all NaN too; otherwise a NaN score turns the sum, hence the whole
 * row, into NaN). */
static inline T SUF(row_max)(const KT *kern, const mha_rows *rr, T scale, T *s,
                             int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n)
{
    T m;
    int64_t j;
    if (rr->n_masks == 0 && !rr->window && !rr->lay.keep &&
        (!rr->causal || rr->nmk >= j0 + n)) {
        /* no mask but causality (and no extra key in range): the keys past
         * the diagonal are left unscaled and unread (every caller zeroes
         * them, softmax_row and softmax_online_step from the same rule) */
        if (rr->causal) n = SUF(causal_visible)(rr, i, j0, n);
        m = n > 0 ? kern->scale_max(s, n, scale) : -(T)INFINITY;
    } else {
        kern->scale(s, n, scale);
        SUF(row_masks)(rr, s, b, h, i, j0, n);
        m = kern->max(s, n);
    }
    if (m == -(T)INFINITY)
        for (j = 0; j < n; j++)
            if (s[j] != s[j]) return s[j];
    return m;
}

/* The softmax P of row (b, h, i) in place over s[0..n), s[0] being key j0
 * (j0 = 0 and n = Sk: the whole row; j0 > 0: the keys before j0 are
 * blocked for this row and left alone), from the raw scores of keys
 * j0 .. j0+kend-1 (kend <= n: the keys from there on are blocked by
 * causality or the window for this row, their s never read).  Returns the
 * number ne of leading entries that may be nonzero (those past it are
 * exact zeros), or -1 for a blocked row (every entry the blocked value). */
static inline int64_t SUF(softmax_row)(const KT *kern, const mha_rows *rr, T scale,
                                       T *s, int64_t b, int64_t h, int64_t i, int64_t j0,
                                       int64_t kend, int64_t n)
{
    int64_t ne = kend, j;
    T sum, m = SUF(row_max)(kern, rr, scale, s, b, h, i, j0, kend);
    if (m == -(T)INFINITY) { /* every key blocked */
        const T value = SUF(blocked_row_value)(rr);
        for (j = 0; j < n; j++) s[j] = value;
        return -1;
    }
    if (rr->causal && rr->nmk >= j0 + kend) /* the rest are exact zeros (> 0: a visible key) */
        ne = SUF(causal_visible)(rr, i, j0, ne);
    sum = kern->exp_sum(s, ne, m);
    if (sum != sum) { /* a NaN score: the reference's whole row is NaN */
        for (j = 0; j < n; j++) s[j] = (T)NAN;
        return n;
    }
    for (j = ne; j < n; j++) s[j] = 0;
    kern->scale(s, ne, (T)1 / sum);
    return ne;
}

/* One block of the online softmax of row (b, h, i): s[0..nk) holds the raw
 * scores of keys j0 .. j0+nk-1; *mx and *l are the row's running maximum
 * and sum (-inf and 0 before its first block).  On return s holds
 * exp(s - max) (exact zeros where blocked), *mx and *l include the block,
 * and *alpha is the factor by which the caller rescales what it has summed
 * so far.  Returns the number of leading entries that may be nonzero, or -1
 * when the block has no visible key (s all 0; *mx, *l unchanged, *alpha 1). */
static inline int64_t SUF(softmax_online_step)(const KT *kern, const mha_rows *rr,
                                               T scale, T *s, int64_t b, int64_t h, int64_t i,
                                               int64_t j0, int64_t nk, T *mx, T *l, T *alpha)
{
    int64_t ne = nk, j;
    T sum, mnew, bm = SUF(row_max)(kern, rr, scale, s, b, h, i, j0, nk);
    *alpha = 1;
    if (bm == -(T)INFINITY) { /* nothing visible in this block */
        for (j = 0; j < nk; j++) s[j] = 0;
        return -1;
    }
    mnew = (bm != bm || *mx != *mx) ? (T)NAN : bm > *mx ? bm : *mx;
    *alpha = *mx - mnew == 0 ? (T)1 : EXP(*mx - mnew); /* exp(0): 1 exactly, no call */
    if (rr->causal && rr->nmk >= j0 + nk) /* > 0: the block has a visible key */
        ne = SUF(causal_visible)(rr, i, j0, ne);
    sum = kern->exp_sum(s, ne, mnew);
    for (j = ne; j < nk; j++) s[j] = 0;
    *l = *l * *alpha + sum;
    *mx = mnew;
    return ne;
}
