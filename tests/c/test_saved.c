/* test_saved.c: the saved path of the C core (no Python), run by
 * tests/test_c_core.py: mha_forward_save's kept Q, K, V, ctx and P and its
 * copies of the inputs and parameters, mha_backward_saved reading them
 * against mha_backward, and the masked scores' gradient (grad_scores) of
 * the reference, recomputed, saved and kept-P backwards, on every
 * instruction set this CPU runs.  Prints "N passed, N failed". */
#include "check.h"

/* mha_forward_save writes Q, K, V and ctx and the same output as
 * mha_forward; mha_backward_saved reads them (and only reads them) and
 * gives mha_backward's gradients to rounding. */
static void test_saved(int64_t B, int64_t Sq, int64_t Sk, int64_t E, int64_t H, int64_t Ek,
                       int64_t Ev, int masked, int causal, double p_drop)
{
    mha_config c = {E, H, Ek, Ev, 1, MHA_FLOAT64};
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, i;
    int64_t nq = B * Sq * E, nk = B * Sk * Ek, nv = B * Sk * Ev, nkv = B * Sk * E;
    uint64_t s = 777 + (uint64_t)(B * 3 + Sq * 5 + Sk * 11 + E);
    mha_param_layout(&c, off, size, &total);
    double *P = malloc(total * 8), *X = malloc((nq + nk + nv) * 8), *G = malloc(nq * 8);
    double *out = malloc(nq * 8), *out2 = malloc(nq * 8);
    double *sq = malloc(nq * 8), *sk = malloc((nkv + 1) * 8), *sv = malloc((nkv + 1) * 8),
           *sc = malloc(nq * 8), *copy = malloc((2 * nq + 2 * nkv + 1) * 8);
    double *g1 = malloc((total + nq + nk + nv) * 8), *g2 = malloc((total + nq + nk + nv) * 8);
    uint8_t *mask = malloc((size_t)(Sq * Sk + 1));
    mha_params p;
    mha_forward_args a;
    mha_backward_args ba;
    mha_saved kept = {sq, sk, sv, sc}, bad = {sq, NULL, sv, sc};
    mha_mask mk;
    double scale = 0, err = 0;
    CHECK(mha_params_init(&c, P, 5) == MHA_OK, "init");
    for (i = 0; i < nq + nk + nv; i++) X[i] = lcg_next(&s);
    for (i = 0; i < nq; i++) G[i] = lcg_next(&s);
    for (i = 0; i < Sq * Sk; i++) mask[i] = masked && ((i * 3 + 1) % 7 == 0);
    mha_params_from_block(&c, P, &p);
    memset(&a, 0, sizeof a);
    a.B = B; a.Sq = Sq; a.Sk = Sk;
    a.query = X; a.key = X + nq; a.value = X + nq + nk;
    mk.kind = MHA_MASK_BLOCK; mk.data = mask;
    mk.stride[0] = 0; mk.stride[1] = 0; mk.stride[2] = Sk; mk.stride[3] = 1;
    a.masks = &mk; a.n_masks = masked;
    a.is_causal = causal;
    a.zero_masked_rows = 1;
    a.dropout = p_drop; a.seed = 4; a.counter = 9;
    a.out = out;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "forward");
    a.out = out2;
    CHECK(mha_forward_save(&c, &p, &a, &bad, NULL) == MHA_ERR_ARG, "a NULL buffer is refused");
    CHECK(mha_forward_save(&c, &p, &a, &kept, NULL) == MHA_OK, "forward_save");
    CHECK(memcmp(out, out2, (size_t)nq * 8) == 0, "forward_save's output differs from forward's");
    memcpy(copy, sq, (size_t)nq * 8);
    memcpy(copy + nq, sc, (size_t)nq * 8);
    memcpy(copy + 2 * nq, sk, (size_t)nkv * 8);
    memcpy(copy + 2 * nq + nkv, sv, (size_t)nkv * 8);
    memset(&ba, 0, sizeof ba);
    ba.fwd = a;
    ba.grad_out = G;
    ba.grad_params = g1; ba.grad_query = g1 + total;
    ba.grad_key = g1 + total + nq; ba.grad_value = g1 + total + nq + nk;
    CHECK(mha_backward(&c, &p, &ba) == MHA_OK, "backward");
    ba.grad_params = g2; ba.grad_query = g2 + total;
    ba.grad_key = g2 + total + nq; ba.grad_value = g2 + total + nq + nk;
    CHECK(mha_backward_saved(&c, &p, &ba, &bad) == MHA_ERR_ARG, "a NULL buffer is refused");
    CHECK(mha_backward_saved(&c, &p, &ba, &kept) == MHA_OK, "backward_saved");
    CHECK(memcmp(copy, sq, (size_t)nq * 8) == 0 && memcmp(copy + nq, sc, (size_t)nq * 8) == 0 &&
              memcmp(copy + 2 * nq, sk, (size_t)nkv * 8) == 0 &&
              memcmp(copy + 2 * nq + nkv, sv, (size_t)nkv * 8) == 0,
          "backward_saved wrote into the kept buffers");
    for (i = 0; i < total + nq + nk + nv; i++) scale = fmax(scale, fabs(g1[i]));
    for (i = 0; i < total + nq + nk + nv; i++) err = fmax(err, fabs(g1[i] - g2[i]));
    CHECK(err <= 1e-12 * fmax(scale, 1.0), "saved vs recomputed gradients B%lld Sq%lld Sk%lld: %g",
          (long long)B, (long long)Sq, (long long)Sk, err);

    /* P kept too, and copies of the inputs and parameters made on the way */
    {
        int64_t nw = B * H * Sq * Sk;
        double *sp = malloc((size_t)(nw + 1) * 8), *w0 = malloc((size_t)(nw + 1) * 8),
               *w1 = malloc((size_t)(nw + 1) * 8), *w2 = malloc((size_t)(nw + 1) * 8),
               *cx = malloc((size_t)(nq + nk + nv + 1) * 8), *cp = malloc((size_t)total * 8);
        mha_saved full = {sq, sk, sv, sc, sp};
        mha_saved p_alone = {NULL, NULL, NULL, NULL, sp};
        mha_copies copies = {cx, cx + nq, cx + nq + nk, cp};
        double e_out = 0, e_p = 0, e_w = 0, e_g = 0;
        CHECK(mha_forward_save(&c, &p, &a, &p_alone, NULL) == MHA_ERR_ARG, "P without the four refused");
        memset(cx, 0, (size_t)(nq + nk + nv) * 8);
        memset(cp, 0, (size_t)total * 8);
        CHECK(mha_forward_save(&c, &p, &a, NULL, &copies) == MHA_OK, "forward_save, copies only");
        CHECK(memcmp(out, out2, (size_t)nq * 8) == 0, "copies change the output");
        CHECK(memcmp(cx, X, (size_t)(nq + nk + nv) * 8) == 0 && memcmp(cp, P, (size_t)total * 8) == 0,
              "copies of the inputs and parameters B%lld Sq%lld Sk%lld", (long long)B,
              (long long)Sq, (long long)Sk);
        memset(cx, 0, (size_t)(nq + nk + nv) * 8);
        memset(cp, 0, (size_t)total * 8);
        CHECK(mha_forward_save(&c, &p, &a, &full, &copies) == MHA_OK, "forward_save with P");
        CHECK(memcmp(cx, X, (size_t)(nq + nk + nv) * 8) == 0 && memcmp(cp, P, (size_t)total * 8) == 0,
              "copies made with P kept");
        for (i = 0; i < nq; i++)
            if (!isnan(out[i])) e_out = fmax(e_out, fabs(out2[i] - out[i]));
        /* P is the softmax before dropout: the weights of the call without it;
         * the weights returned beside a kept P are those of a plain call */
        {
            mha_forward_args a0 = a;
            a0.dropout = 0; a0.weights = w0; a0.out = out2;
            CHECK(mha_forward(&c, &p, &a0) == MHA_OK, "weights without dropout");
            a0 = a; a0.weights = w1; a0.out = out2;
            CHECK(mha_forward(&c, &p, &a0) == MHA_OK, "weights with dropout");
            a0.weights = w2;
            CHECK(mha_forward_save(&c, &p, &a0, &full, &copies) == MHA_OK, "forward_save with weights and P");
        }
        for (i = 0; i < nw; i++) {
            e_p = fmax(e_p, isnan(w0[i]) != isnan(sp[i]) ? INFINITY
                           : isnan(w0[i]) ? 0 : fabs(w0[i] - sp[i]));
            e_w = fmax(e_w, isnan(w1[i]) != isnan(w2[i]) ? INFINITY
                           : isnan(w1[i]) ? 0 : fabs(w1[i] - w2[i]));
        }
        ba.grad_params = g2; ba.grad_query = g2 + total;
        ba.grad_key = g2 + total + nq; ba.grad_value = g2 + total + nq + nk;
        CHECK(mha_backward_saved(&c, &p, &ba, &full) == MHA_OK, "backward_saved with P");
        for (i = 0; i < total + nq + nk + nv; i++) e_g = fmax(e_g, fabs(g1[i] - g2[i]));
        CHECK(e_p < 1e-14 && e_w < 1e-14 && e_out < 1e-13 && e_g <= 1e-12 * fmax(scale, 1.0),
              "kept P B%lld Sq%lld Sk%lld: P %g weights %g out %g gradients %g", (long long)B,
              (long long)Sq, (long long)Sk, e_p, e_w, e_out, e_g);
        /* the masked scores' gradient: the reference's, recomputed, read from
         * Q, K, V and ctx kept, and from P kept (every entry written) */
        {
            double *ds[4], e_s = 0;
            int k2, nan_bad = 0;
            for (k2 = 0; k2 < 4; k2++) {
                ds[k2] = malloc((size_t)(nw + 1) * 8);
                memset(ds[k2], 0x7f, (size_t)nw * 8);
                ba.grad_scores = ds[k2];
                CHECK((k2 == 0 ? mha_backward_ref(&c, &p, &ba)
                       : k2 == 1 ? mha_backward(&c, &p, &ba)
                       : mha_backward_saved(&c, &p, &ba, k2 == 2 ? &kept : &full)) == MHA_OK,
                      "backward %d with grad_scores", k2);
            }
            ba.grad_scores = NULL;
            for (k2 = 1; k2 < 4; k2++)
                for (i = 0; i < nw; i++) {
                    if (isnan(ds[0][i]) || isnan(ds[k2][i])) {
                        nan_bad += isnan(ds[0][i]) != isnan(ds[k2][i]);
                        continue;
                    }
                    e_s = fmax(e_s, fabs(ds[0][i] - ds[k2][i]));
                }
            CHECK(nan_bad == 0 && e_s <= 1e-12,
                  "grad_scores B%lld Sq%lld Sk%lld: %g, %d NaN misplaced", (long long)B,
                  (long long)Sq, (long long)Sk, e_s, nan_bad);
            for (k2 = 0; k2 < 4; k2++) free(ds[k2]);
        }
        free(sp); free(w0); free(w1); free(w2); free(cx); free(cp);
    }
    free(P); free(X); free(G); free(out); free(out2); free(sq); free(sk); free(sv); free(sc);
    free(copy); free(g1); free(g2); free(mask);
}

int main(void)
{
    int n;
    for (n = 0; n < 4; n++) {
        if (mha_set_isa(g_isas[n]) != MHA_OK) continue;
        test_saved(2, 7, 5, 6, 3, 5, 9, 1, 0, 0.0);
        test_saved(2, 65, 129, 24, 2, 24, 16, 0, 1, 0.3);
        test_saved(1, 40, 300, 32, 4, 32, 32, 1, 0, 0.0);
        test_saved(0, 3, 4, 6, 3, 5, 9, 0, 0, 0.0);  /* no batch: the copies still made */
        test_saved(2, 3, 0, 6, 3, 5, 9, 0, 0, 0.0);  /* no key: K, V jobs without tiles */
        test_saved(2, 0, 4, 6, 3, 5, 9, 0, 0, 0.0);  /* no query */
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
