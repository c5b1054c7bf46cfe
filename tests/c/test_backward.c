/* test_backward.c: the C core's backward (no Python), run by
 * tests/test_c_core.py: mha_backward against mha_backward_ref on sizes that
 * are multiples of no tile, with masks (a fully blocked row), causality,
 * dropout, kdim != vdim, the weights' gradient, S = 0, B = 0, on every
 * instruction set this CPU runs, in float32 and float64; and the reference
 * backward itself against central differences of the reference forward.
 * Prints "N passed, N failed" and exits nonzero on a failure.  Legend as in
 * src/mha.h. */
#include "check.h"

/* One problem's inputs in float64 (rounded to float, so that the float32
 * copy holds the same numbers): parameters, query/key/value, d out,
 * d weights, and masks over (B, H, Sq, Sk): a blocking mask (Sq, Sk)
 * broadcast over B and H with row 1 fully blocked, and an additive one
 * (B, 1, Sq, Sk) broadcast over H. */
typedef struct {
    mha_config c;
    int64_t B, Sq, Sk, total, nq, nk, nv, nw;
    double *P, *X, *G, *GW, *add;
    uint8_t *blk;
    mha_mask masks[2];
} bwd_problem;

static void problem_make(bwd_problem *pr, int64_t B, int64_t Sq, int64_t Sk, int64_t E,
                         int64_t H, int64_t Ek, int64_t Ev, int bias, uint64_t seed)
{
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], i;
    uint64_t s = seed;
    mha_config c = {E, H, Ek, Ev, bias, MHA_FLOAT64};
    memset(pr, 0, sizeof *pr);
    pr->c = c;
    pr->B = B; pr->Sq = Sq; pr->Sk = Sk;
    mha_param_layout(&c, off, size, &pr->total);
    pr->nq = B * Sq * E; pr->nk = B * Sk * Ek; pr->nv = B * Sk * Ev; pr->nw = B * H * Sq * Sk;
    pr->P = malloc((size_t)pr->total * 8);
    pr->X = malloc((size_t)(pr->nq + pr->nk + pr->nv + 1) * 8);
    pr->G = malloc((size_t)(pr->nq + 1) * 8);
    pr->GW = malloc((size_t)(pr->nw + 1) * 8);
    pr->add = malloc((size_t)(B * Sq * Sk + 1) * 8);
    pr->blk = malloc((size_t)(Sq * Sk + 1));
    mha_params_init(&c, pr->P, seed);
    for (i = 0; i < pr->total; i++) pr->P[i] = (double)(float)(3.0 * pr->P[i]);
    for (i = 0; i < pr->nq + pr->nk + pr->nv; i++) pr->X[i] = (double)(float)lcg_next(&s);
    for (i = 0; i < pr->nq; i++) pr->G[i] = (double)(float)lcg_next(&s);
    for (i = 0; i < pr->nw; i++) pr->GW[i] = (double)(float)lcg_next(&s);
    for (i = 0; i < B * Sq * Sk; i++) pr->add[i] = (double)(float)(2.0 * lcg_next(&s));
    for (i = 0; i < Sq * Sk; i++) pr->blk[i] = (i * 7 + 3) % 5 == 0 || (Sq > 2 && i / Sk == 1);
    pr->masks[0].kind = MHA_MASK_BLOCK; pr->masks[0].data = pr->blk;
    pr->masks[0].stride[2] = Sk; pr->masks[0].stride[3] = 1;
    pr->masks[1].kind = MHA_MASK_ADD; pr->masks[1].data = pr->add;
    pr->masks[1].stride[0] = Sq * Sk; pr->masks[1].stride[2] = Sk; pr->masks[1].stride[3] = 1;
}

static void problem_free(bwd_problem *pr)
{
    free(pr->P); free(pr->X); free(pr->G); free(pr->GW); free(pr->add); free(pr->blk);
}

/* a float copy of n doubles */
static float *to_f32(const double *x, int64_t n)
{
    float *y = malloc((size_t)(n + 1) * 4);
    int64_t i;
    for (i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}

/* mha_backward against mha_backward_ref, in dtype: every gradient, NaN
 * where the reference has NaN and within tol of it (relative to the
 * largest gradient) elsewhere.  masked: the two masks; zero_rows: the
 * fully blocked row gives zeros (else NaN) */
static void test_backward_vs_ref(mha_dtype dtype, int64_t B, int64_t Sq, int64_t Sk, int64_t E,
                                 int64_t H, int64_t Ek, int64_t Ev, int bias, int masked,
                                 int causal, int zero_rows, double p_drop, int with_gw)
{
    bwd_problem pr;
    const int f32 = dtype == MHA_FLOAT32;
    const size_t es = f32 ? 4 : 8;
    int64_t n, i, nan_bad = 0;
    float *P32 = NULL, *X32 = NULL, *G32 = NULL, *GW32 = NULL, *A32 = NULL;
    void *g_fast, *g_ref;
    mha_config c;
    mha_params p;
    mha_forward_args a;
    mha_backward_args ba;
    double scale = 0, err = 0;
    problem_make(&pr, B, Sq, Sk, E, H, Ek, Ev, bias, 17 + (uint64_t)(B + 3 * Sq + 5 * Sk + 7 * E));
    c = pr.c;
    c.dtype = dtype;
    n = pr.total + pr.nq + pr.nk + pr.nv;
    g_fast = malloc((size_t)(n + 1) * es);
    g_ref = malloc((size_t)(n + 1) * es);
    if (f32) {
        P32 = to_f32(pr.P, pr.total);
        X32 = to_f32(pr.X, pr.nq + pr.nk + pr.nv);
        G32 = to_f32(pr.G, pr.nq);
        GW32 = to_f32(pr.GW, pr.nw);
        A32 = to_f32(pr.add, B * Sq * Sk);
        pr.masks[1].data = A32;
    }
    mha_params_from_block(&c, f32 ? (void *)P32 : (void *)pr.P, &p);
    memset(&a, 0, sizeof a);
    a.B = B; a.Sq = Sq; a.Sk = Sk;
    a.query = f32 ? (void *)X32 : (void *)pr.X;
    a.key = f32 ? (void *)(X32 + pr.nq) : (void *)(pr.X + pr.nq);
    a.value = f32 ? (void *)(X32 + pr.nq + pr.nk) : (void *)(pr.X + pr.nq + pr.nk);
    a.masks = pr.masks; a.n_masks = masked ? 2 : 0;
    a.is_causal = causal;
    a.zero_masked_rows = zero_rows;
    a.dropout = p_drop; a.seed = 21; a.counter = 2;
    memset(&ba, 0, sizeof ba);
    ba.fwd = a;
    ba.grad_out = f32 ? (void *)G32 : (void *)pr.G;
    ba.grad_weights = !with_gw ? NULL : f32 ? (void *)GW32 : (void *)pr.GW;
    for (i = 0; i < 2; i++) {
        char *g = (char *)(i ? g_ref : g_fast);
        memset(g, 0x7f, (size_t)n * es); /* every gradient must be written */
        ba.grad_params = g;
        ba.grad_query = g + pr.total * es;
        ba.grad_key = g + (pr.total + pr.nq) * es;
        ba.grad_value = g + (pr.total + pr.nq + pr.nk) * es;
        CHECK((i ? mha_backward_ref(&c, &p, &ba) : mha_backward(&c, &p, &ba)) == MHA_OK,
              "backward (%s)", i ? "reference" : "fast");
    }
    for (i = 0; i < n; i++) {
        double x = f32 ? ((float *)g_fast)[i] : ((double *)g_fast)[i];
        double r = f32 ? ((float *)g_ref)[i] : ((double *)g_ref)[i];
        if (isnan(x) != isnan(r)) nan_bad++;
        else if (!isnan(r)) {
            scale = fmax(scale, fabs(r));
            err = fmax(err, fabs(x - r));
        }
    }
    CHECK(nan_bad == 0 && err <= (f32 ? 2e-5 : 1e-12) * fmax(scale, 1.0),
          "backward vs reference %s %s B%lld Sq%lld Sk%lld E%lld H%lld Ek%lld Ev%lld bias %d "
          "masked %d causal %d zero %d p %g gw %d: err %g (scale %g), %lld NaN misplaced",
          mha_get_isa(), f32 ? "f32" : "f64", (long long)B, (long long)Sq, (long long)Sk,
          (long long)E, (long long)H, (long long)Ek, (long long)Ev, bias, masked, causal,
          zero_rows, p_drop, with_gw, err, scale, (long long)nan_bad);
    free(g_fast); free(g_ref); free(P32); free(X32); free(G32); free(GW32); free(A32);
    problem_free(&pr);
}

/* L = Σ out·G + Σ weights·GW through mha_forward_ref, in float64 */
static double ref_loss(const bwd_problem *pr, const mha_params *p, const mha_forward_args *a0,
                       double *out, double *w)
{
    mha_forward_args a = *a0;
    double L = 0;
    int64_t i;
    a.out = out; a.weights = w;
    if (mha_forward_ref(&pr->c, p, &a) != MHA_OK) return NAN;
    for (i = 0; i < pr->nq; i++) L += out[i] * pr->G[i];
    for (i = 0; i < pr->nw; i++) L += w[i] * pr->GW[i];
    return L;
}

/* The reference backward itself, by central differences of the reference
 * forward in float64: every parameter and every input element, with both
 * masks (a fully blocked row, zero_masked_rows), causal, dropout 0.3,
 * kdim != vdim != E, with and without biases. */
static void test_backward_ref_fd(int bias)
{
    bwd_problem pr;
    const double step = 1e-6;
    int64_t n, i;
    double *g, *out, *w, err = 0, scale = 0;
    mha_params p;
    mha_forward_args a;
    mha_backward_args ba;
    problem_make(&pr, 2, 4, 5, 4, 2, 3, 5, bias, 99);
    n = pr.total + pr.nq + pr.nk + pr.nv;
    g = malloc((size_t)n * 8);
    out = malloc((size_t)pr.nq * 8);
    w = malloc((size_t)pr.nw * 8);
    mha_params_from_block(&pr.c, pr.P, &p);
    memset(&a, 0, sizeof a);
    a.B = pr.B; a.Sq = pr.Sq; a.Sk = pr.Sk;
    a.query = pr.X; a.key = pr.X + pr.nq; a.value = pr.X + pr.nq + pr.nk;
    a.masks = pr.masks; a.n_masks = 2;
    a.is_causal = 1; a.zero_masked_rows = 1;
    a.dropout = 0.3; a.seed = 5; a.counter = 6;
    memset(&ba, 0, sizeof ba);
    ba.fwd = a;
    ba.grad_out = pr.G; ba.grad_weights = pr.GW;
    ba.grad_params = g; ba.grad_query = g + pr.total;
    ba.grad_key = g + pr.total + pr.nq; ba.grad_value = g + pr.total + pr.nq + pr.nk;
    CHECK(mha_backward_ref(&pr.c, &p, &ba) == MHA_OK, "reference backward");
    for (i = 0; i < n; i++) {
        /* the i-th number: a parameter, then query, key, value */
        double *x = i < pr.total ? pr.P + i : pr.X + (i - pr.total), x0 = *x, lp, lm, fd;
        *x = x0 + step;
        lp = ref_loss(&pr, &p, &a, out, w);
        *x = x0 - step;
        lm = ref_loss(&pr, &p, &a, out, w);
        *x = x0;
        fd = (lp - lm) / (2 * step);
        scale = fmax(scale, fabs(fd));
        err = fmax(err, fabs(fd - g[i]));
    }
    CHECK(scale > 0.1 && err < 1e-6 * fmax(scale, 1.0),
          "reference backward vs finite differences (bias %d): err %g, scale %g", bias, err,
          scale);
    free(g); free(out); free(w);
    problem_free(&pr);
}

int main(void)
{
    const char *isas[4] = {"portable", "avx2", "avx512", "amx"};
    int n, d;
    for (n = 0; n < 4; n++) {
        if (mha_set_isa(isas[n]) != MHA_OK) continue;
        for (d = 0; d < 2; d++) {
            const mha_dtype dt = d ? MHA_FLOAT64 : MHA_FLOAT32;
            /* dtype, B, Sq, Sk, E, H, Ek, Ev, bias, masked, causal, zero rows, p, d weights */
            test_backward_vs_ref(dt, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0.0, 0);
            test_backward_vs_ref(dt, 2, 7, 5, 6, 3, 5, 9, 1, 1, 0, 1, 0.0, 1);
            test_backward_vs_ref(dt, 2, 7, 5, 6, 3, 5, 9, 0, 1, 1, 0, 0.0, 0); /* NaN rows */
            test_backward_vs_ref(dt, 3, 33, 17, 16, 4, 5, 9, 1, 1, 1, 1, 0.2, 1);
            test_backward_vs_ref(dt, 2, 65, 129, 24, 2, 24, 16, 1, 0, 1, 0, 0.3, 0);
            test_backward_vs_ref(dt, 1, 130, 7, 8, 2, 8, 8, 0, 1, 0, 1, 0.5, 1);
            test_backward_vs_ref(dt, 1, 40, 300, 32, 4, 32, 32, 1, 1, 0, 1, 0.0, 0);
            test_backward_vs_ref(dt, 1, 3, 8, 8, 1, 8, 8, 1, 0, 0, 0, 1.0, 1); /* all dropped */
            test_backward_vs_ref(dt, 2, 3, 0, 6, 3, 5, 9, 1, 0, 0, 0, 0.0, 0); /* Sk = 0 */
            test_backward_vs_ref(dt, 2, 0, 4, 6, 3, 5, 9, 1, 0, 0, 0, 0.0, 0); /* Sq = 0 */
            test_backward_vs_ref(dt, 0, 3, 4, 6, 3, 5, 9, 1, 0, 0, 0, 0.0, 0); /* B = 0 */
        }
    }
    test_backward_ref_fd(1);
    test_backward_ref_fd(0);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
