/* test_sdpa.c: mha_sdpa_forward and mha_sdpa_backward (attention on projected
 * heads, torch's scaled_dot_product_attention) alone, run by
 * tests/test_c_core.py: fast against the references (mha_sdpa_forward_ref,
 * mha_sdpa_backward_ref) on edge sizes, every instruction set, both dtypes,
 * GQA and MQA, Dv != D, both causal alignments, masks, dropout, blocked
 * rows, S = 0, L = 0, B = 0; the reference backward against finite
 * differences of the reference forward in float64; sliding windows (issue
 * 14) with every other option; GQA against its heads
 * repeated; arguments refused.  Legend as in src/mha.h's SDPA section. */
#include "check.h"

typedef struct {
    int causal, has_scale;
    double scale;
    int masked, zero_rows, gw;
    double p;
    int win;           /* a sliding window (wl, wr; < 0 unbounded) */
    int64_t wl, wr;
    int lay;           /* 0 none, 1 a block layout per (B, H), 2 one broadcast,
                          3 a sparse one per (B, H): runs of skipped keys */
    int64_t qbs, kbs;  /*   its block sizes */
    int hmask;         /* 0 none, 1 a head mask over (B, H), 2 over (H) broadcast */
} opts;

typedef struct {
    mha_sdpa_args a;
    int64_t nq, nk, nv, no, nw;
    void *q, *k, *v, *G, *GW, *add, *hm;
    uint8_t *blk, *keep;
    mha_mask masks[2];
} problem;

/* a block layout (issue 14) of q_block qbs, k_block kbs into *ly: per (B,
 * H) (per_bh) or one (nqb, nkb) broadcast; about two thirds of the blocks
 * kept, query block 1 empty (rows with no visible key) */
static uint8_t *layout_make(mha_block_layout *ly, int64_t B, int64_t H, int64_t Sq, int64_t Sk,
                            int64_t qbs, int64_t kbs, int per_bh)
{
    int64_t e, n, nqb = (Sq + qbs - 1) / qbs, nkb = (Sk + kbs - 1) / kbs;
    uint8_t *keep;
    n = (per_bh ? B * H : 1) * nqb * nkb;
    keep = malloc((size_t)(n + 1));
    for (e = 0; e < n; e++)
        keep[e] = per_bh == 2 /* sparse: a quarter of the blocks and key block 0 */
                      ? (uint8_t)(e % nkb == 0 || ((e % nkb) * 7 + e / nkb) % 4 == 0)
                      : (uint8_t)((e * 5 + 1) % 3 != 0 && (nqb < 3 || (e / nkb) % nqb != 1));
    ly->keep = keep;
    ly->nqb = nqb; ly->nkb = nkb;
    ly->q_block = qbs; ly->k_block = kbs;
    ly->stride[0] = per_bh ? H * nqb * nkb : 0;
    ly->stride[1] = per_bh ? nqb * nkb : 0;
    return keep;
}

static void problem_make(problem *pr, mha_dtype dt, int64_t B, int64_t H, int64_t Hkv, int64_t L,
                         int64_t S, int64_t D, int64_t Dv, const opts *o)
{
    uint64_t s = 7 + (uint64_t)(B * 3 + H * 5 + Hkv * 7 + L * 11 + S * 13 + D * 17 + Dv);
    int64_t i;
    memset(pr, 0, sizeof *pr);
    pr->nq = B * H * L * D; pr->nk = B * Hkv * S * D; pr->nv = B * Hkv * S * Dv;
    pr->no = B * H * L * Dv; pr->nw = B * H * L * S;
    pr->q = rand_array(dt, pr->nq, &s);
    pr->k = rand_array(dt, pr->nk, &s);
    pr->v = rand_array(dt, pr->nv, &s);
    pr->G = rand_array(dt, pr->no, &s);
    pr->GW = rand_array(dt, pr->nw, &s);
    pr->add = rand_array(dt, H * L * S, &s); /* (1, H, L, S) */
    pr->blk = malloc((size_t)(B * S + 1));   /* (B, 1, 1, S): a key padding mask */
    for (i = 0; i < B * S; i++) pr->blk[i] = (i * 7 + 3) % 5 == 0;
    pr->masks[0].kind = MHA_MASK_BLOCK; pr->masks[0].data = pr->blk;
    pr->masks[0].stride[0] = S; pr->masks[0].stride[3] = 1;
    pr->masks[1].kind = MHA_MASK_ADD; pr->masks[1].data = pr->add;
    pr->masks[1].stride[1] = L * S; pr->masks[1].stride[2] = S; pr->masks[1].stride[3] = 1;
    pr->a.dtype = dt;
    pr->a.B = B; pr->a.H = H; pr->a.Hkv = Hkv; pr->a.L = L; pr->a.S = S; pr->a.D = D;
    pr->a.Dv = Dv;
    pr->a.q = pr->q; pr->a.k = pr->k; pr->a.v = pr->v;
    pr->a.masks = pr->masks; pr->a.n_masks = o->masked ? 2 : 0;
    pr->a.is_causal = o->causal;
    pr->a.has_scale = o->has_scale; pr->a.scale = o->scale;
    pr->a.zero_masked_rows = o->zero_rows;
    pr->a.dropout = o->p; pr->a.seed = 3; pr->a.counter = 11;
    pr->a.has_window = o->win;
    pr->a.window_left = o->wl; pr->a.window_right = o->wr;
    pr->hm = rand_array(dt, B * H + 1, &s); /* (B, H): some heads off, some halved */
    for (i = 0; i < B * H; i++) {
        double x = i % 3 == 0 ? 0.0 : i % 3 == 1 ? 1.0 : 0.5;
        if (dt == MHA_FLOAT32) ((float *)pr->hm)[i] = (float)x;
        else ((double *)pr->hm)[i] = x;
    }
    if (o->hmask) {
        pr->a.head_mask = pr->hm;
        pr->a.head_mask_stride[0] = o->hmask == 1 ? H : 0;
        pr->a.head_mask_stride[1] = 1;
    }
    if (o->lay) pr->keep = layout_make(&pr->a.layout, B, H, L, S, o->qbs, o->kbs,
                                     o->lay == 3 ? 2 : o->lay == 1);
}

static void problem_free(problem *pr)
{
    free(pr->q); free(pr->k); free(pr->v); free(pr->G); free(pr->GW); free(pr->add);
    free(pr->blk); free(pr->keep); free(pr->hm);
}

static void sdpa_case(mha_dtype dt, int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, int64_t Dv, opts o)
{
    problem pr;
    const size_t es = mha_dtype_size(dt);
    int64_t nan_bad = 0, n, k;
    double e_out, e_on, e_w, e_g, e_s;
    problem_make(&pr, dt, B, H, Hkv, L, S, D, Dv, &o);
    n = pr.nq + pr.nk + pr.nv;
    char *out = malloc((size_t)(pr.no + 1) * es), *out2 = malloc((size_t)(pr.no + 1) * es);
    char *ref = malloc((size_t)(pr.no + 1) * es);
    char *w = malloc((size_t)(pr.nw + 1) * es), *wr = malloc((size_t)(pr.nw + 1) * es);
    char *g[2], *ds[2];
    mha_sdpa_args a = pr.a;
    mha_sdpa_backward_args ba;
    a.out = out; a.weights = w;
    CHECK(mha_sdpa_forward(&a) == MHA_OK, "fast forward");
    a.out = out2; a.weights = NULL;
    CHECK(mha_sdpa_forward(&a) == MHA_OK, "online forward");
    a.out = ref; a.weights = wr;
    CHECK(mha_sdpa_forward_ref(&a) == MHA_OK, "reference forward");
    e_out = rel_err(dt, out, ref, pr.no, &nan_bad);
    e_on = rel_err(dt, out2, ref, pr.no, &nan_bad);
    e_w = rel_err(dt, w, wr, pr.nw, &nan_bad);
    memset(&ba, 0, sizeof ba);
    ba.fwd = pr.a;
    ba.grad_out = pr.G;
    ba.grad_weights = o.gw ? pr.GW : NULL;
    for (k = 0; k < 2; k++) {
        g[k] = malloc((size_t)(n + 1) * es);
        memset(g[k], 0x7f, (size_t)n * es); /* every gradient must be written */
        ba.grad_q = g[k];
        ba.grad_k = g[k] + pr.nq * es;
        ba.grad_v = g[k] + (pr.nq + pr.nk) * es;
        ds[k] = malloc((size_t)(pr.nw + 1) * es); /* the masked scores' gradient */
        memset(ds[k], 0x7f, (size_t)pr.nw * es);  /* every one written (0 where blocked) */
        ba.grad_scores = ds[k];
        CHECK((k ? mha_sdpa_backward(&ba) : mha_sdpa_backward_ref(&ba)) == MHA_OK,
              "backward %lld", (long long)k);
    }
    ba.grad_scores = NULL;
    e_g = rel_err(dt, g[1], g[0], n, &nan_bad);
    e_s = rel_err(dt, ds[1], ds[0], pr.nw, &nan_bad);
    /* one gradient at a time: the others NULL, the same numbers */
    {
        char *one = malloc((size_t)(n + 1) * es);
        int64_t j, bad1 = 0;
        memset(one, 0x7f, (size_t)n * es);
        for (j = 0; j < 3; j++) {
            ba.grad_q = j == 0 ? one : NULL;
            ba.grad_k = j == 1 ? one + pr.nq * es : NULL;
            ba.grad_v = j == 2 ? one + (pr.nq + pr.nk) * es : NULL;
            CHECK(mha_sdpa_backward(&ba) == MHA_OK, "backward, one gradient");
        }
        for (j = 0; j < n; j++) {
            double x = get(dt, one, j), y = get(dt, g[1], j);
            if (!(x == y || (isnan(x) && isnan(y)))) bad1++;
        }
        CHECK(bad1 == 0, "gradients alone differ from together (%lld)", (long long)bad1);
        free(one);
    }
    CHECK(nan_bad == 0 && e_out < tol(dt) && e_on < tol(dt) && e_w < tol(dt) && e_g < tol(dt) &&
              e_s < tol(dt),
          "%s %s B%lld H%lld Hkv%lld L%lld S%lld D%lld Dv%lld causal %d scale %d:%g masked %d "
          "zero %d p %g gw %d win %d:%lld,%lld: out %g online %g weights %g grads %g "
          "scores %g, %lld NaN misplaced",
          mha_get_isa(), dt == MHA_FLOAT32 ? "f32" : "f64", (long long)B, (long long)H,
          (long long)Hkv, (long long)L, (long long)S, (long long)D, (long long)Dv, o.causal,
          o.has_scale, o.scale, o.masked, o.zero_rows, o.p, o.gw, o.win, (long long)o.wl,
          (long long)o.wr, e_out, e_on, e_w, e_g, e_s, (long long)nan_bad);
    for (k = 0; k < 2; k++) {
        free(g[k]);
        free(ds[k]);
    }
    free(out); free(out2); free(ref); free(w); free(wr);
    problem_free(&pr);
}

/* L = Σ out·G + Σ weights·GW through mha_sdpa_forward_ref (float64) */
static double loss(problem *pr, double *out, double *w)
{
    mha_sdpa_args a = pr->a;
    double l = 0;
    int64_t i;
    a.out = out; a.weights = w;
    if (mha_sdpa_forward_ref(&a) != MHA_OK) return NAN;
    for (i = 0; i < pr->no; i++) l += out[i] * ((double *)pr->G)[i];
    for (i = 0; i < pr->nw; i++) l += w[i] * ((double *)pr->GW)[i];
    return l;
}

static void test_fd(opts o)
{
    problem pr;
    int64_t i, n, bad = 0, base = 0;
    double worst = 0;
    int t;
    problem_make(&pr, MHA_FLOAT64, 2, 4, 2, 3, 5, 3, 2, &o);
    n = pr.nq + pr.nk + pr.nv;
    double *g = malloc((size_t)n * 8), *out = malloc((size_t)pr.no * 8);
    double *w = malloc((size_t)pr.nw * 8);
    double *x[3] = {pr.q, pr.k, pr.v};
    int64_t len[3] = {pr.nq, pr.nk, pr.nv};
    mha_sdpa_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.fwd = pr.a;
    ba.grad_out = pr.G;
    ba.grad_weights = pr.GW;
    ba.grad_q = g;
    ba.grad_k = g + pr.nq;
    ba.grad_v = g + pr.nq + pr.nk;
    CHECK(mha_sdpa_backward_ref(&ba) == MHA_OK, "reference backward");
    for (t = 0; t < 3; t++) {
        for (i = 0; i < len[t]; i++) {
            const double h = 1e-6, x0 = x[t][i];
            double lp, lm, fd;
            x[t][i] = x0 + h;
            lp = loss(&pr, out, w);
            x[t][i] = x0 - h;
            lm = loss(&pr, out, w);
            x[t][i] = x0;
            fd = (lp - lm) / (2 * h);
            worst = fmax(worst, fabs(fd - g[base + i]));
            if (!(fabs(fd - g[base + i]) < 1e-6 * fmax(1.0, fabs(fd)))) bad++;
        }
        base += len[t];
    }
    CHECK(bad == 0, "finite differences causal %d scale %d:%g masked %d: %lld off, worst %g",
          o.causal, o.has_scale, o.scale, o.masked, (long long)bad, worst);
    free(g); free(out); free(w);
    problem_free(&pr);
}

/* GQA is the same as the key/value heads repeated (forward: bit for bit;
 * backward: dk, dv the sums of the repeated heads' gradients) */
static void test_gqa_repeat(mha_dtype dt)
{
    const opts o = {MHA_CAUSAL_LOWER_RIGHT, 0, 0, 1, 0, 0, 0};
    const int64_t B = 2, H = 6, Hkv = 2, G = 3, L = 7, S = 9, D = 5, Dv = 3;
    const size_t es = mha_dtype_size(dt);
    problem pr;
    int64_t b, h, i, bad = 0;
    double err;
    problem_make(&pr, dt, B, H, Hkv, L, S, D, Dv, &o);
    char *kr = malloc((size_t)(B * H * S * D) * es), *vr = malloc((size_t)(B * H * S * Dv) * es);
    char *o1 = malloc((size_t)pr.no * es), *o2 = malloc((size_t)pr.no * es);
    char *dk = malloc((size_t)pr.nk * es), *dkr = malloc((size_t)(B * H * S * D) * es);
    char *dsum = malloc((size_t)pr.nk * es);
    for (b = 0; b < B; b++)
        for (h = 0; h < H; h++) {
            memcpy(kr + ((b * H + h) * S * D) * es, (char *)pr.k + ((b * Hkv + h / G) * S * D) * es,
                   (size_t)(S * D) * es);
            memcpy(vr + ((b * H + h) * S * Dv) * es,
                   (char *)pr.v + ((b * Hkv + h / G) * S * Dv) * es, (size_t)(S * Dv) * es);
        }
    mha_sdpa_args a = pr.a, ar = pr.a;
    a.out = o1;
    ar.Hkv = H; ar.k = kr; ar.v = vr; ar.out = o2;
    CHECK(mha_sdpa_forward(&a) == MHA_OK && mha_sdpa_forward(&ar) == MHA_OK, "forward");
    CHECK(memcmp(o1, o2, (size_t)pr.no * es) == 0, "GQA differs from repeated heads");
    mha_sdpa_backward_args ba, bar;
    memset(&ba, 0, sizeof ba);
    ba.fwd = a; ba.grad_out = pr.G; ba.grad_k = dk;
    bar = ba; bar.fwd = ar; bar.grad_k = dkr;
    CHECK(mha_sdpa_backward(&ba) == MHA_OK && mha_sdpa_backward(&bar) == MHA_OK, "backward");
    for (b = 0; b < B; b++)
        for (h = 0; h < Hkv; h++)
            for (i = 0; i < S * D; i++) {
                double s = 0;
                int64_t g;
                for (g = 0; g < G; g++) s += get(dt, dkr, (b * H + h * G + g) * S * D + i);
                if (dt == MHA_FLOAT32) ((float *)dsum)[(b * Hkv + h) * S * D + i] = (float)s;
                else ((double *)dsum)[(b * Hkv + h) * S * D + i] = s;
            }
    err = rel_err(dt, dk, dsum, pr.nk, &bad);
    CHECK(bad == 0 && err < tol(dt), "GQA dk vs repeated heads' sum: %g", err);
    free(kr); free(vr); free(o1); free(o2); free(dk); free(dkr); free(dsum);
    problem_free(&pr);
}

static void test_status(void)
{
    const opts o = {0};
    problem pr;
    double out[2 * 4 * 3 * 2];
    mha_sdpa_args a;
    problem_make(&pr, MHA_FLOAT64, 2, 4, 2, 3, 5, 3, 2, &o);
    a = pr.a;
    a.out = out;
    CHECK(mha_sdpa_forward(&a) == MHA_OK, "valid call");
    a.Hkv = 3;
    CHECK(mha_sdpa_forward(&a) == MHA_ERR_ARG, "H %% Hkv != 0 accepted");
    a.Hkv = 2; a.is_causal = 3;
    CHECK(mha_sdpa_forward(&a) == MHA_ERR_ARG, "is_causal 3 accepted");
    a.is_causal = 0; a.D = 0;
    CHECK(mha_sdpa_forward_ref(&a) == MHA_ERR_ARG, "D 0 accepted");
    a.D = 3; a.dropout = NAN;
    CHECK(mha_sdpa_forward(&a) == MHA_ERR_ARG, "dropout NaN accepted");
    a.dropout = 0; a.out = NULL;
    CHECK(mha_sdpa_forward(&a) == MHA_ERR_ARG, "out NULL accepted");
    a.out = out; a.B = INT64_MAX / 2;
    CHECK(mha_sdpa_forward(&a) == MHA_ERR_OVERFLOW, "overflow not reported");
    a.B = 2; a.dtype = (mha_dtype)7;
    CHECK(mha_sdpa_forward(&a) == MHA_ERR_ARG, "dtype 7 accepted");
    {
        mha_sdpa_backward_args ba;
        memset(&ba, 0, sizeof ba);
        ba.fwd = pr.a;
        CHECK(mha_sdpa_backward(&ba) == MHA_ERR_ARG, "grad_out NULL accepted");
    }
    problem_free(&pr);
}

int main(void)
{
    int n, d, k;
    test_status();
    for (n = 0; n < 4; n++) {
        if (mha_set_isa(g_isas[n]) != MHA_OK) continue;
        for (d = 0; d < 2; d++) {
            const mha_dtype dt = d ? MHA_FLOAT64 : MHA_FLOAT32;
            test_gqa_repeat(dt);
            {   /* rows with no visible key (NaN) and heavy dropout: the
                 * backward replays no dropout on them, as the forward */
                opts o = {MHA_CAUSAL_LOWER_RIGHT, 0, 0, 0, 0, 1, 0.9};
                sdpa_case(dt, 1, 1, 1, 4, 2, 3, 3, o);
                sdpa_case(dt, 2, 2, 1, 6, 3, 4, 5, o);
            }
            for (k = 0; k < 16; k++) {
                /* sliding windows (issue 14) with every other option */
                static const int64_t w[8][2] = {{2, 1}, {0, 0}, {-1, 3}, {4, -1},
                                                {100, 100}, {1, 0}, {0, -1}, {-1, -1}};
                opts o = {0};
                o.win = 1;
                o.wl = w[k % 8][0]; o.wr = w[k % 8][1];
                o.causal = k % 3;
                o.has_scale = k % 4 == 3;
                o.scale = 0.41;
                o.masked = k % 2;
                o.zero_rows = (k / 3) % 2;
                o.gw = k % 5 < 2;
                o.p = k % 6 == 4 ? 0.3 : 0.0;
                sdpa_case(dt, 2, 4, 2, 7, 5, 6, 3, o);   /* L > S: empty windows */
                sdpa_case(dt, 2, 3, 1, 3, 9, 4, 7, o);
                if (k % 3 == 0) { /* several blocks: skipped key blocks */
                    o.wl = o.wl >= 0 ? 40 + o.wl : -1;
                    o.wr = o.wr >= 0 ? 7 + o.wr : -1;
                    sdpa_case(dt, 1, 4, 2, 130, 300, 16, 24, o);
                    sdpa_case(dt, 1, 2, 2, 300, 130, 24, 8, o);
                }
            }
            for (k = 0; k < 18; k++) {
                /* block layouts (issue 14) with windows and every other option */
                static const int64_t bs[6][2] = {{2, 3}, {1, 1}, {4, 2}, {3, 100}, {32, 64}, {48, 37}};
                opts o = {0};
                o.lay = 1 + k % 2;
                o.qbs = bs[k % 6][0]; o.kbs = bs[k % 6][1];
                o.win = k % 4 == 3;
                o.wl = 60; o.wr = k % 8 == 3 ? 0 : -1;
                o.causal = k % 3;
                o.has_scale = k % 4 == 3;
                o.scale = 0.41;
                o.masked = k % 2 == 0;
                o.zero_rows = (k / 3) % 2;
                o.gw = k % 5 < 2;
                o.p = k % 6 == 4 ? 0.3 : 0.0;
                o.hmask = (k + k / 3) % 3;
                sdpa_case(dt, 2, 4, 2, 7, 5, 6, 3, o);
                sdpa_case(dt, 2, 3, 1, 3, 9, 4, 7, o);
                sdpa_case(dt, 2, 2, 2, 4, 0, 5, 3, o);
                if (k % 6 >= 4 || k % 3 == 0) { /* several blocks: skipped key ranges */
                    if (k % 6 < 4) { o.qbs = 40; o.kbs = 50; }
                    if (k % 4 == 1) { o.lay = 3; o.qbs = 100; o.kbs = 20; } /* runs */
                    sdpa_case(dt, 1, 4, 2, 130, 300, 16, 24, o);
                    sdpa_case(dt, 1, 2, 2, 300, 130, 24, 8, o);
                }
            }
            for (k = 0; k < 18; k++) {
                opts o = {0};
                o.causal = k % 3;
                o.has_scale = k >= 9;
                o.scale = k >= 15 ? 0.0 : 0.41;
                o.masked = (k % 4) < 2;
                o.zero_rows = k % 5 == 0;
                o.gw = k % 2 == 1;
                o.p = k % 7 == 2 ? 0.3 : 0.0;
                /* B, H, Hkv, L, S, D, Dv */
                sdpa_case(dt, 1, 1, 1, 1, 1, 1, 1, o);
                sdpa_case(dt, 2, 4, 2, 7, 5, 6, 3, o);   /* GQA, Dv < D, L > S */
                sdpa_case(dt, 2, 3, 1, 3, 9, 4, 7, o);   /* MQA, Dv > D, L < S */
                sdpa_case(dt, 2, 2, 2, 4, 0, 5, 3, o);   /* S = 0 */
                sdpa_case(dt, 2, 2, 1, 0, 6, 5, 3, o);   /* L = 0 */
                sdpa_case(dt, 0, 2, 1, 3, 6, 5, 3, o);   /* B = 0 */
                if (k % 3 == 0 || k % 5 == 1) { /* several blocks of queries and keys */
                    sdpa_case(dt, 1, 4, 2, 130, 300, 16, 24, o);
                    sdpa_case(dt, 1, 2, 2, 300, 130, 24, 8, o);
                }
            }
        }
    }
    for (k = 0; k < 6; k++) {
        opts o = {0};
        o.causal = k % 3;
        o.has_scale = k >= 3;
        o.scale = -0.6;
        o.masked = k % 2;
        test_fd(o);
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
