/* test_options.c: the module path's options of issue 12, alone (no Python),
 * run by tests/test_c_core.py: lower-right causal alignment
 * (MHA_CAUSAL_LOWER_RIGHT), the score scale override (has_scale, scale),
 * add_bias_kv and add_zero_attn; and issue 14's sliding window
 * (has_window, window_left, window_right) and head mask (over (B, H) or
 * broadcast from (H)) with each of them.  The fast forward and backward (also
 * through mha_forward_save / mha_backward_saved) against the references on
 * every instruction set in both dtypes; the reference backward against
 * finite differences of the reference forward in float64; hand-checked
 * cases.  Legend as in src/mha.h. */
#include "check.h"

typedef struct {
    int bias_kv, zero_attn, causal, has_scale;
    double scale;
    int masked, zero_rows, gw;
    double p;
    int win;           /* a sliding window (wl, wr; < 0 unbounded) */
    int64_t wl, wr;
    int hmask;         /* 0 none, 1 a head mask over (B, H), 2 over (H) broadcast */
    int lay;           /* 0 none, 1 a block layout per (B, H), 2 one broadcast,
                          3 a sparse one per (B, H): runs of skipped keys */
    int64_t qbs, kbs;  /*   its block sizes */
} opts;

typedef struct {
    mha_config c;
    int64_t B, Sq, Sk, Skx, nq, nk, nv, nw, total;
    int64_t off[MHA_NPARAM], size[MHA_NPARAM];
    void *P, *query, *key, *value, *G, *GW, *add, *hm;
    uint8_t *blk, *keep;
    mha_mask masks[2];
    mha_params p;
    mha_forward_args a;
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

static void problem_make(problem *pr, mha_dtype dt, int64_t B, int64_t Sq, int64_t Sk, int64_t E,
                         int64_t H, int64_t Ek, int64_t Ev, const opts *o)
{
    uint64_t s = 99 + (uint64_t)(B * 3 + Sq * 5 + Sk * 7 + E * 11 + H);
    int64_t i;
    memset(pr, 0, sizeof *pr);
    pr->c.d_model = E; pr->c.n_heads = H; pr->c.kdim = Ek; pr->c.vdim = Ev; pr->c.bias = 1;
    pr->c.dtype = dt;
    pr->c.add_bias_kv = o->bias_kv;
    pr->c.add_zero_attn = o->zero_attn;
    pr->B = B; pr->Sq = Sq; pr->Sk = Sk; pr->Skx = Sk + mha_extra_keys(&pr->c);
    mha_param_layout(&pr->c, pr->off, pr->size, &pr->total);
    pr->nq = B * Sq * E; pr->nk = B * Sk * Ek; pr->nv = B * Sk * Ev;
    pr->nw = B * H * Sq * pr->Skx;
    pr->P = rand_array(dt, pr->total, &s);
    pr->query = rand_array(dt, pr->nq, &s);
    pr->key = rand_array(dt, pr->nk, &s);
    pr->value = rand_array(dt, pr->nv, &s);
    pr->G = rand_array(dt, pr->nq, &s);
    pr->GW = rand_array(dt, pr->nw, &s);
    pr->add = rand_array(dt, B * Sq * Sk, &s); /* (B, 1, Sq, Sk) */
    pr->blk = malloc((size_t)(Sq * Sk + 1));   /* (Sq, Sk), broadcast */
    for (i = 0; i < Sq * Sk; i++) pr->blk[i] = (i * 7 + 3) % 5 == 0;
    pr->masks[0].kind = MHA_MASK_BLOCK; pr->masks[0].data = pr->blk;
    pr->masks[0].stride[2] = Sk; pr->masks[0].stride[3] = 1;
    pr->masks[1].kind = MHA_MASK_ADD; pr->masks[1].data = pr->add;
    pr->masks[1].stride[0] = Sq * Sk; pr->masks[1].stride[2] = Sk; pr->masks[1].stride[3] = 1;
    mha_params_from_block(&pr->c, pr->P, &pr->p);
    memset(&pr->a, 0, sizeof pr->a);
    pr->a.B = B; pr->a.Sq = Sq; pr->a.Sk = Sk;
    pr->a.query = pr->query; pr->a.key = pr->key; pr->a.value = pr->value;
    pr->a.masks = pr->masks; pr->a.n_masks = o->masked ? 2 : 0;
    pr->a.is_causal = o->causal;
    pr->a.has_scale = o->has_scale; pr->a.scale = o->scale;
    pr->a.zero_masked_rows = o->zero_rows;
    pr->a.dropout = o->p; pr->a.seed = 5; pr->a.counter = 8;
    pr->hm = rand_array(dt, B * H, &s); /* (B, H): some heads off, some halved */
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
    pr->a.has_window = o->win;
    pr->a.window_left = o->wl; pr->a.window_right = o->wr;
    if (o->lay) pr->keep = layout_make(&pr->a.layout, B, H, Sq, Sk, o->qbs, o->kbs,
                                     o->lay == 3 ? 2 : o->lay == 1);
}

static void problem_free(problem *pr)
{
    free(pr->P); free(pr->query); free(pr->key); free(pr->value); free(pr->G); free(pr->GW);
    free(pr->add); free(pr->blk); free(pr->hm); free(pr->keep);
}

/* m (B, n) = the mean over the heads of w (B, H, n): head 0, + head 1, ...,
 * then / H (mha_forward_args.average_weights' order) */
static void heads_mean(mha_dtype dt, const void *w, void *m, int64_t B, int64_t H, int64_t n)
{
    int64_t b, h, i;
    for (b = 0; b < B; b++)
        for (i = 0; i < n; i++)
            if (dt == MHA_FLOAT32) {
                const float *x = (const float *)w + b * H * n + i;
                float t = x[0];
                for (h = 1; h < H; h++) t += x[h * n];
                ((float *)m)[b * n + i] = t / (float)H;
            } else {
                const double *x = (const double *)w + b * H * n + i;
                double t = x[0];
                for (h = 1; h < H; h++) t += x[h * n];
                ((double *)m)[b * n + i] = t / (double)H;
            }
}

/* fast (mha_forward with and without weights, with the heads' mean,
 * mha_forward_save, mha_backward, mha_backward_saved) against the
 * references */
static void module_case(mha_dtype dt, int64_t B, int64_t Sq, int64_t Sk, int64_t E, int64_t H,
                        int64_t Ek, int64_t Ev, opts o)
{
    problem pr;
    const size_t es = mha_dtype_size(dt);
    int64_t nan_bad = 0, n, k;
    double e_out, e_on, e_w, e_sv, e_g = 0, e_gs = 0;
    problem_make(&pr, dt, B, Sq, Sk, E, H, Ek, Ev, &o);
    n = pr.total + pr.nq + pr.nk + pr.nv;
    const int64_t nkv = B * pr.Skx * E;
    char *out = malloc((size_t)(pr.nq + 1) * es), *ref = malloc((size_t)(pr.nq + 1) * es);
    char *out2 = malloc((size_t)(pr.nq + 1) * es), *out3 = malloc((size_t)(pr.nq + 1) * es);
    char *w = malloc((size_t)(pr.nw + 1) * es), *wr = malloc((size_t)(pr.nw + 1) * es);
    char *sq = malloc((size_t)(pr.nq + 1) * es), *sk = malloc((size_t)(nkv + 1) * es);
    char *svv = malloc((size_t)(nkv + 1) * es), *sc = malloc((size_t)(pr.nq + 1) * es);
    char *sp = malloc((size_t)(pr.nw + 1) * es);
    char *g[3];
    mha_saved sv = {sq, sk, svv, sc, sp};
    mha_forward_args a = pr.a;
    mha_backward_args ba;
    a.out = out; a.weights = w;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "fast forward");
    a.out = out2; a.weights = NULL;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "online forward");
    a.out = out3; a.weights = NULL;
    CHECK(mha_forward_save(&pr.c, &pr.p, &a, &sv, NULL) == MHA_OK, "forward_save");
    a.out = ref; a.weights = wr;
    CHECK(mha_forward_ref(&pr.c, &pr.p, &a) == MHA_OK, "reference forward");
    e_out = rel_err(dt, out, ref, pr.nq, &nan_bad);
    e_on = rel_err(dt, out2, ref, pr.nq, &nan_bad);
    e_sv = rel_err(dt, out3, ref, pr.nq, &nan_bad);
    e_w = rel_err(dt, w, wr, pr.nw, &nan_bad);
    {   /* average_weights: the bits of heads_mean of the per-head weights,
         * the output's bits unchanged, fast, reference and fast with the
         * projections and P kept (into out2, out3: their errors are taken;
         * sv is overwritten with the same bits) */
        const int64_t nm = B * Sq * pr.Skx;
        char *wa = malloc((size_t)(nm + 1) * es), *wm = malloc((size_t)(nm + 1) * es);
        int pass;
        for (pass = 0; pass < 3; pass++) {
            const int r = pass == 1;
            a = pr.a;
            a.out = r ? out3 : out2;
            a.weights = wa;
            a.average_weights = 1;
            CHECK((r ? mha_forward_ref(&pr.c, &pr.p, &a)
               : pass ? mha_forward_save(&pr.c, &pr.p, &a, &sv, NULL)
                      : mha_forward(&pr.c, &pr.p, &a)) == MHA_OK,
                  "averaged forward %d", pass);
            heads_mean(dt, r ? wr : w, wm, B, H, Sq * pr.Skx);
            CHECK(memcmp(wa, wm, (size_t)nm * es) == 0 &&
                          memcmp(r ? out3 : out2, r ? ref : out, (size_t)pr.nq * es) == 0,
                  "%s %s B%lld Sq%lld Sk%lld H%lld: the heads' mean (%s) is not the per-head "
                  "weights' mean, or the output changed",
                  mha_get_isa(), dt == MHA_FLOAT32 ? "f32" : "f64", (long long)B,
                  (long long)Sq, (long long)Sk, (long long)H,
                  r ? "reference" : pass ? "P kept" : "fast");
        }
        free(wa);
        free(wm);
    }
    memset(&ba, 0, sizeof ba);
    ba.fwd = pr.a;
    ba.grad_out = pr.G;
    ba.grad_weights = o.gw ? pr.GW : NULL;
    for (k = 0; k < 3; k++) {
        g[k] = malloc((size_t)(n + 1) * es);
        memset(g[k], 0x7f, (size_t)n * es); /* every gradient must be written */
        ba.grad_params = g[k];
        ba.grad_query = g[k] + pr.total * es;
        ba.grad_key = g[k] + (pr.total + pr.nq) * es;
        ba.grad_value = g[k] + (pr.total + pr.nq + pr.nk) * es;
        CHECK((k == 0 ? mha_backward_ref(&pr.c, &pr.p, &ba)
               : k == 1 ? mha_backward(&pr.c, &pr.p, &ba)
                        : mha_backward_saved(&pr.c, &pr.p, &ba, &sv)) == MHA_OK,
              "backward %lld", (long long)k);
    }
    e_g = rel_err(dt, g[1], g[0], n, &nan_bad);
    e_gs = rel_err(dt, g[2], g[0], n, &nan_bad);
    CHECK(nan_bad == 0 && e_out < tol(dt) && e_on < tol(dt) && e_sv < tol(dt) && e_w < tol(dt) &&
              e_g < tol(dt) && e_gs < tol(dt),
          "%s %s B%lld Sq%lld Sk%lld E%lld H%lld bias_kv %d zero_attn %d causal %d scale %d:%g "
          "masked %d zero %d p %g gw %d: out %g online %g saved %g weights %g grads %g saved "
          "grads %g, %lld NaN misplaced",
          mha_get_isa(), dt == MHA_FLOAT32 ? "f32" : "f64", (long long)B, (long long)Sq,
          (long long)Sk, (long long)E, (long long)H, o.bias_kv, o.zero_attn, o.causal,
          o.has_scale, o.scale, o.masked, o.zero_rows, o.p, o.gw, e_out, e_on, e_sv, e_w, e_g,
          e_gs, (long long)nan_bad);
    for (k = 0; k < 3; k++) free(g[k]);
    free(out); free(ref); free(out2); free(out3); free(w); free(wr);
    free(sq); free(sk); free(svv); free(sc); free(sp);
    problem_free(&pr);
}

/* L = Σ out·G + Σ weights·GW through mha_forward_ref (float64) */
static double loss(problem *pr, double *out, double *w)
{
    mha_forward_args a = pr->a;
    double l = 0;
    int64_t i;
    a.out = out; a.weights = w;
    if (mha_forward_ref(&pr->c, &pr->p, &a) != MHA_OK) return NAN;
    for (i = 0; i < pr->nq; i++) l += out[i] * ((double *)pr->G)[i];
    for (i = 0; i < pr->nw; i++) l += w[i] * ((double *)pr->GW)[i];
    return l;
}

/* the reference backward against central differences of the reference
 * forward, every parameter (bias_k, bias_v among them) and input */
static void test_fd(opts o)
{
    problem pr;
    int64_t i, n, bad = 0;
    double worst = 0;
    problem_make(&pr, MHA_FLOAT64, 2, 3, 4, 4, 2, 3, 5, &o);
    n = pr.total + pr.nq + pr.nk + pr.nv;
    double *g = malloc((size_t)n * 8), *out = malloc((size_t)pr.nq * 8);
    double *w = malloc((size_t)(pr.nw + 1) * 8);
    double *x[4] = {pr.P, pr.query, pr.key, pr.value};
    int64_t len[4] = {pr.total, pr.nq, pr.nk, pr.nv};
    mha_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.fwd = pr.a;
    ba.grad_out = pr.G;
    ba.grad_weights = pr.GW;
    ba.grad_params = g;
    ba.grad_query = g + pr.total;
    ba.grad_key = g + pr.total + pr.nq;
    ba.grad_value = g + pr.total + pr.nq + pr.nk;
    CHECK(mha_backward_ref(&pr.c, &pr.p, &ba) == MHA_OK, "reference backward");
    {
        int t;
        int64_t base = 0;
        for (t = 0; t < 4; t++) {
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
    }
    CHECK(bad == 0, "finite differences bias_kv %d zero_attn %d causal %d scale %d:%g masked %d: "
          "%lld off, worst %g", o.bias_kv, o.zero_attn, o.causal, o.has_scale, o.scale, o.masked,
          (long long)bad, worst);
    free(g); free(out); free(w);
    problem_free(&pr);
}

/* hand-checked: the alignments, the scale, the extra keys never blocked */
static void test_hand(void)
{
    const opts none = {0};
    problem pr;
    int64_t i, same = 1;
    double out[2 * 5 * 8], out2[2 * 5 * 8], w[2 * 2 * 5 * 7], w2[2 * 2 * 5 * 7];
    mha_forward_args a;
    /* Sq == Sk: lower-right is top-left, bit for bit */
    problem_make(&pr, MHA_FLOAT64, 2, 5, 5, 8, 2, 8, 8, &none);
    a = pr.a;
    a.out = out; a.weights = w; a.is_causal = MHA_CAUSAL_TOP_LEFT;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "top-left");
    a.out = out2; a.weights = w2; a.is_causal = MHA_CAUSAL_LOWER_RIGHT;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "lower-right");
    CHECK(memcmp(out, out2, sizeof(double) * 80) == 0 && memcmp(w, w2, sizeof(double) * 100) == 0,
          "Sq == Sk: lower-right differs from top-left");
    /* the default scale given explicitly: bit for bit */
    a.has_scale = 1; a.scale = 1.0 / sqrt(4.0);
    a.out = out; a.weights = w;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "explicit scale");
    CHECK(memcmp(out, out2, sizeof(double) * 80) == 0, "explicit 1/sqrt(Dk) differs");
    /* scale 0: uniform weights over the visible keys (no mask, no causal) */
    a.scale = 0.0; a.is_causal = 0;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "scale 0");
    for (i = 0; i < 2 * 2 * 5 * 5; i++) same &= fabs(w[i] - 0.2) < 1e-15;
    CHECK(same, "scale 0: weights not uniform");
    problem_free(&pr);
    /* lower-right, Sq 2 < Sk 7: query 1 sees every key, query 0 all but the
     * last; top-left: query 0 sees key 0 only */
    problem_make(&pr, MHA_FLOAT64, 2, 2, 7, 8, 2, 8, 8, &none);
    a = pr.a;
    a.out = out; a.weights = w; a.is_causal = MHA_CAUSAL_LOWER_RIGHT;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "lower-right Sq < Sk");
    CHECK(w[6] == 0.0 && w[5] > 0 && w[7 + 6] > 0, "lower-right Sq < Sk: %g %g %g", w[6], w[5],
          w[13]);
    a.is_causal = MHA_CAUSAL_TOP_LEFT;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "top-left Sq < Sk");
    CHECK(w[0] == 1.0 && w[1] == 0.0 && w[7 + 2] == 0.0 && w[7 + 1] > 0, "top-left Sq < Sk");
    problem_free(&pr);
    /* lower-right, Sq 5 > Sk 2: rows 0..2 see no key (NaN, or zero rows),
     * row 3 sees key 0 */
    problem_make(&pr, MHA_FLOAT64, 1, 5, 2, 8, 2, 8, 8, &none);
    a = pr.a;
    a.out = out; a.weights = w; a.is_causal = MHA_CAUSAL_LOWER_RIGHT;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "lower-right Sq > Sk");
    CHECK(isnan(w[0]) && isnan(w[5]) && isnan(out[2 * 8]) && w[6] == 1.0 && w[7] == 0.0 &&
              !isnan(out[3 * 8]),
          "lower-right Sq > Sk: blocked rows");
    a.zero_masked_rows = 1;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "lower-right Sq > Sk, zero rows");
    CHECK(w[0] == 0.0 && w[5] == 0.0 && out[0] == ((double *)pr.P)[pr.off[MHA_BO]],
          "lower-right Sq > Sk: zero rows");
    problem_free(&pr);
    /* add_zero_attn: every given key blocked, the zero key still seen (weight
     * 1, context 0: out = b_o); causal never blocks it either */
    {
        opts z = {0};
        uint8_t all[5 * 4];
        mha_mask mk = {MHA_MASK_BLOCK, all, {0, 0, 4, 1}};
        z.zero_attn = 1;
        memset(all, 1, sizeof all);
        problem_make(&pr, MHA_FLOAT64, 2, 5, 4, 8, 2, 8, 8, &z);
        a = pr.a;
        a.masks = &mk; a.n_masks = 1;
        a.out = out; a.weights = w;
        CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "zero attn");
        same = 1;
        for (i = 0; i < 2 * 2 * 5; i++) same &= w[i * 5 + 4] == 1.0 && w[i * 5] == 0.0;
        for (i = 0; i < 2 * 5 * 8; i++) same &= out[i] == ((double *)pr.P)[pr.off[MHA_BO] + i % 8];
        CHECK(same, "add_zero_attn: the zero key blocked, or the output not b_o");
        problem_free(&pr);
    }
    /* add_bias_kv: the layout grows by bias_k, bias_v at the end, the other
     * offsets unchanged */
    {
        mha_config c = {6, 2, 5, 7, 1, MHA_FLOAT32, 0, 0}, cb = c;
        int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, offb[MHA_NPARAM], sizeb[MHA_NPARAM], totalb;
        int t, ok = 1;
        cb.add_bias_kv = 1;
        mha_param_layout(&c, off, size, &total);
        mha_param_layout(&cb, offb, sizeb, &totalb);
        for (t = 0; t < MHA_BIAS_K; t++) ok &= off[t] == offb[t] && size[t] == sizeb[t];
        CHECK(ok && size[MHA_BIAS_K] == 0 && sizeb[MHA_BIAS_K] == 6 && sizeb[MHA_BIAS_V] == 6 &&
                  offb[MHA_BIAS_K] == total && totalb == total + 12,
              "layout with add_bias_kv");
        CHECK(mha_extra_keys(&c) == 0 && mha_extra_keys(&cb) == 1, "extra keys");
        cb.add_zero_attn = 1;
        CHECK(mha_extra_keys(&cb) == 2, "extra keys, both");
    }
}

/* arguments refused */
static void test_status(void)
{
    const opts o = {1, 1, 0, 0, 0, 0, 0, 0, 0};
    problem pr;
    double out[2 * 3 * 4];
    mha_forward_args a;
    mha_params p;
    problem_make(&pr, MHA_FLOAT64, 2, 3, 4, 4, 2, 3, 5, &o);
    a = pr.a;
    a.out = out;
    a.is_causal = 3;
    CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_ERR_ARG, "is_causal 3 accepted");
    a.is_causal = -1;
    CHECK(mha_forward_ref(&pr.c, &pr.p, &a) == MHA_ERR_ARG, "is_causal -1 accepted");
    a.is_causal = 0;
    p = pr.p;
    p.bias_k = NULL;
    CHECK(mha_forward(&pr.c, &p, &a) == MHA_ERR_ARG, "add_bias_kv without bias_k accepted");
    {   /* the heads' mean: with a kept P too, not in a backward's call */
        const int64_t nkv = 2 * (4 + mha_extra_keys(&pr.c)) * 4;
        double w[2 * 3 * 6], q[2 * 3 * 4], k[64], v[64], c[2 * 3 * 4], pp[2 * 2 * 3 * 6];
        double g[512];
        mha_saved sv = {q, k, v, c, pp};
        mha_backward_args ba;
        CHECK(nkv <= 64, "the test's buffers");
        a.weights = w;
        a.average_weights = 1;
        CHECK(mha_forward_save(&pr.c, &pr.p, &a, &sv, NULL) == MHA_OK,
              "the heads' mean with P kept refused");
        sv.p = NULL;
        CHECK(mha_forward_save(&pr.c, &pr.p, &a, &sv, NULL) == MHA_OK,
              "the heads' mean with Q, K, V, ctx kept refused");
        memset(&ba, 0, sizeof ba);
        ba.fwd = a;
        ba.grad_out = out;
        ba.grad_params = g;
        ba.grad_query = g + 300;
        ba.grad_key = g + 330;
        ba.grad_value = g + 370;
        CHECK(pr.total <= 300, "the test's gradient buffer");
        CHECK(mha_backward(&pr.c, &pr.p, &ba) == MHA_ERR_ARG,
              "a backward of an averaged call accepted");
        CHECK(mha_backward_ref(&pr.c, &pr.p, &ba) == MHA_ERR_ARG,
              "a reference backward of an averaged call accepted");
        a.average_weights = 0;
        a.weights = NULL;
    }
    {   /* block layouts (issue 14) that do not fit the call: Sq 3, Sk 4 */
        uint8_t keep[64] = {0};
        const int64_t bad[5][4] = {{2, 3, 2, 2}, {2, 2, 1, 2}, {1, 1, 0, 4}, {1, 1, 3, -4},
                                   {4, 1, 1, 4}};
        int k;
        for (k = 0; k < 5; k++) {
            a = pr.a;
            a.out = out;
            a.layout.keep = keep;
            a.layout.nqb = bad[k][0]; a.layout.nkb = bad[k][1];
            a.layout.q_block = bad[k][2]; a.layout.k_block = bad[k][3];
            CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_ERR_ARG, "bad layout %d accepted", k);
            CHECK(mha_forward_ref(&pr.c, &pr.p, &a) == MHA_ERR_ARG, "bad layout %d accepted", k);
        }
        a.layout.nqb = 2; a.layout.nkb = 1; a.layout.q_block = 2; a.layout.k_block = 4;
        a.layout.stride[1] = -1;
        CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_ERR_ARG, "negative layout stride accepted");
        a.layout.stride[0] = a.layout.stride[1] = INT64_MAX / 2 + 1; /* offsets past int64 */
        CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_ERR_OVERFLOW, "layout stride overflow");
        a.layout.stride[0] = 0; a.layout.stride[1] = 2;
        CHECK(mha_forward(&pr.c, &pr.p, &a) == MHA_OK, "a fitting layout refused");
    }
    problem_free(&pr);
}

int main(void)
{
    int n, d, k;
    test_hand();
    test_status();
    for (n = 0; n < 4; n++) {
        if (mha_set_isa(g_isas[n]) != MHA_OK) continue;
        for (d = 0; d < 2; d++) {
            const mha_dtype dt = d ? MHA_FLOAT64 : MHA_FLOAT32;
            for (k = 0; k < 24; k++) {
                /* every option alone and together, each causal alignment */
                opts o = {0};
                o.bias_kv = k & 1;
                o.zero_attn = (k >> 1) & 1;
                o.causal = (k >> 2) % 3;
                o.has_scale = k >= 12;
                o.scale = k >= 18 ? 0.0 : 0.37;
                o.masked = (k % 5) < 2;
                o.zero_rows = k % 3 == 0;
                o.gw = k % 2 == 0;
                o.p = k % 7 == 3 ? 0.25 : 0.0;
                module_case(dt, 2, 7, 5, 6, 3, 5, 9, o);   /* Sq > Sk */
                module_case(dt, 2, 3, 9, 8, 2, 8, 8, o);   /* Sq < Sk */
                module_case(dt, 1, 1, 1, 1, 1, 1, 1, o);
                module_case(dt, 2, 3, 0, 6, 3, 5, 9, o);   /* Sk = 0: only the extra keys */
                if (k % 4 == 0 || k % 4 == 3) { /* several blocks of queries and keys */
                    module_case(dt, 2, 130, 300, 16, 2, 16, 16, o);
                    module_case(dt, 1, 300, 130, 16, 2, 16, 16, o);
                }
            }
            {   /* rows with no visible key (NaN) and heavy dropout, recomputed
                 * and with P kept: no dropout replayed on them */
                opts o = {0, 0, MHA_CAUSAL_LOWER_RIGHT, 0, 0, 0, 0, 1, 0.9};
                module_case(dt, 1, 4, 2, 3, 1, 3, 3, o);
                module_case(dt, 2, 6, 3, 4, 2, 4, 4, o);
            }
            for (k = 0; k < 24; k++) {
                /* sliding windows (issue 14): narrow, one-sided, empty for
                 * some rows, wider than S; with every other option */
                static const int64_t w[8][2] = {{2, 1}, {0, 0}, {-1, 3}, {4, -1},
                                                {100, 100}, {1, 0}, {0, -1}, {-1, -1}};
                opts o = {0};
                o.win = 1;
                o.wl = w[k % 8][0]; o.wr = w[k % 8][1];
                o.bias_kv = k % 5 == 1;
                o.zero_attn = k % 7 == 2;
                o.causal = k % 3;
                o.has_scale = k % 4 == 3;
                o.scale = 0.37;
                o.masked = k % 2;
                o.zero_rows = (k / 3) % 2;
                o.gw = k % 5 < 2;
                o.p = k % 6 == 4 ? 0.25 : 0.0;
                o.hmask = (k + k / 3) % 3;
                module_case(dt, 2, 7, 5, 6, 3, 5, 9, o);   /* Sq > Sk: empty windows */
                module_case(dt, 2, 3, 9, 8, 2, 8, 8, o);
                module_case(dt, 2, 3, 0, 6, 3, 5, 9, o);
                if (k % 3 == 0) { /* several blocks: skipped key blocks */
                    o.wl = o.wl >= 0 ? 40 + o.wl : -1;
                    o.wr = o.wr >= 0 ? 7 + o.wr : -1;
                    module_case(dt, 2, 130, 300, 16, 2, 16, 16, o);
                    module_case(dt, 1, 300, 130, 16, 2, 16, 16, o);
                }
            }
            for (k = 0; k < 18; k++) {
                /* block layouts (issue 14): block sizes dividing S or not,
                 * per head or broadcast, empty query blocks; with windows
                 * and every other option */
                static const int64_t bs[6][2] = {{2, 3}, {1, 1}, {4, 2}, {3, 100}, {32, 64}, {48, 37}};
                opts o = {0};
                o.lay = 1 + k % 2;
                o.qbs = bs[k % 6][0]; o.kbs = bs[k % 6][1];
                o.win = k % 4 == 3;
                o.wl = 60; o.wr = k % 8 == 3 ? 0 : -1;
                o.bias_kv = k % 5 == 1;
                o.zero_attn = k % 7 == 2;
                o.causal = k % 3;
                o.has_scale = k % 4 == 3;
                o.scale = 0.37;
                o.masked = k % 2 == 0;
                o.zero_rows = (k / 3) % 2;
                o.gw = k % 5 < 2;
                o.p = k % 6 == 4 ? 0.25 : 0.0;
                o.hmask = (k + k / 3) % 3;
                module_case(dt, 2, 7, 5, 6, 3, 5, 9, o);
                module_case(dt, 2, 3, 9, 8, 2, 8, 8, o);
                module_case(dt, 2, 3, 0, 6, 3, 5, 9, o);
                module_case(dt, 2, 0, 4, 6, 3, 5, 9, o);
                if (k % 6 >= 4 || k % 3 == 0) { /* several blocks: skipped key ranges */
                    if (k % 6 < 4) { o.qbs = 40; o.kbs = 50; }
                    if (k % 4 == 1) { o.lay = 3; o.qbs = 100; o.kbs = 20; } /* runs */
                    module_case(dt, 2, 130, 300, 16, 2, 16, 16, o);
                    module_case(dt, 1, 300, 130, 16, 2, 16, 16, o);
                }
            }
            {
                opts o = {1, 1, MHA_CAUSAL_LOWER_RIGHT, 0, 0, 0, 0, 0, 0};
                module_case(dt, 2, 0, 4, 6, 3, 5, 9, o); /* Sq = 0 */
                module_case(dt, 0, 3, 4, 6, 3, 5, 9, o); /* B = 0 */
            }
        }
    }
    for (k = 0; k < 6; k++) {
        opts o = {0};
        o.bias_kv = k != 1;
        o.zero_attn = k != 0;
        o.causal = k % 3;
        o.has_scale = k >= 3;
        o.scale = -0.7;
        o.masked = k % 2;
        test_fd(o);
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
