/* bwd_keys_impl.h: which keys a block of queries of the backward's
 * attention task works on (bwd_range: the causal / window / layout hull;
 * bwd_run: the layout's kept runs inside it), and the extra keys' rows the
 * module's backward appends to K and V and drops from dK and dV
 * (append_extra, drop_extra), written once for T = float and T = double;
 * included by backward_impl.h after its SUF(bwd) struct. */

/* The keys [*ks, *ke) the queries i0 .. i0+nq-1 may see (with f->skip;
 * else every key).  Outside, P is exactly 0 and, V, dctx and grad_weights
 * being finite, so is every term of the gradients: skipping them changes
 * nothing unless a row is NaN (then the block is redone on every key). */
static void SUF(bwd_range)(const SUF(bwd) *f, int64_t b, int64_t h, int64_t i0, int64_t nq,
                           int64_t *ks, int64_t *ke)
{
    const mha_rows *rr = &f->rr;
    int64_t lo = 0, hi = f->Sk;
    if (f->skip) {
        if (rr->causal && i0 + nq + rr->coff < hi) hi = i0 + nq + rr->coff;
        if (rr->window && rr->wr >= 0 && i0 + nq + rr->coff + rr->wr < hi)
            hi = i0 + nq + rr->coff + rr->wr;
        if (rr->window && rr->wl >= 0 && i0 + rr->coff - rr->wl > lo) lo = i0 + rr->coff - rr->wl;
        if (lo < hi) mha_lay_hull(&rr->lay, b, h, i0, nq, &lo, &hi); /* the layout's */
    }
    if (hi <= lo) { /* every row blocked: the plain path handles the blocked rows */
        lo = 0;
        hi = f->Sk;
    }
    *ks = lo;
    *ke = hi;
}

/* The next run [*rs, *re) of keys from key j (< ke) that the layout keeps
 * for some query of rows i0 .. i0+nq-1 of (b, h); with runs 0 (no layout,
 * no skipping, or a NaN row redone on every key) the one run [j, ke).
 * *rs >= ke: none left.  Between runs, P is exactly 0 for every row of the
 * block (the layout blocks those keys), so the products skip them. */
static void SUF(bwd_run)(const SUF(bwd) *f, int runs, int64_t b, int64_t h, int64_t i0,
                         int64_t nq, int64_t j, int64_t ke, int64_t *rs, int64_t *re)
{
    if (runs) {
        mha_lay_run(&f->rr.lay, b, h, i0, nq, j, ke, rs, re);
    } else {
        *rs = j;
        *re = ke;
    }
}

/* x (rows, cols), leading dimension ld, set to 0 */
static void SUF(bwd_zero)(T *x, int64_t rows, int64_t cols, int64_t ld)
{
    int64_t r;
    for (r = 0; r < rows; r++) memset(x + r * ld, 0, (size_t)cols * sizeof(T));
}

/* Append the extra rows (add_bias_kv's bias_k, add_zero_attn's zeros) to
 * the Sk rows of each batch of x (B*Sk, E), into y (B, Sk', E). */
static void SUF(append_extra)(const mha_config *cfg, const T *x, const T *bias, T *y, int64_t B,
                              int64_t Sk, int64_t Skx, int64_t E)
{
    int64_t b, j;
    for (b = B - 1; b >= 0; b--) { /* from the end: x may be y */
        T *y_b = y + b * Skx * E;
        j = Sk;
        memmove(y_b, x + b * Sk * E, (size_t)(Sk * E) * sizeof(T));
        if (cfg->add_bias_kv) memcpy(y_b + (j++) * E, bias, (size_t)E * sizeof(T));
        if (cfg->add_zero_attn) memset(y_b + j * E, 0, (size_t)E * sizeof(T));
    }
}

/* Drop the extra rows of each batch of dy (B, Sk', E) in place, leaving
 * (B*Sk, E); the gradient of bias (E) (add_bias_kv) is Σ_b dy[b, Sk]. */
static void SUF(drop_extra)(const mha_config *cfg, T *dy, T *dbias, int64_t B, int64_t Sk,
                            int64_t Skx, int64_t E)
{
    int64_t b, c;
    if (dbias) {
        for (c = 0; c < E; c++) dbias[c] = 0;
        if (cfg->add_bias_kv)
            for (b = 0; b < B; b++)
                for (c = 0; c < E; c++) dbias[c] += dy[(b * Skx + Sk) * E + c];
    }
    for (b = 1; b < B; b++)
        memmove(dy + b * Sk * E, dy + b * Skx * E, (size_t)(Sk * E) * sizeof(T));
}
