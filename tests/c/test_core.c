/* test_core.c: tests of the C core alone (no Python), run by
 * tests/test_c_core.py.  Prints "N passed, N failed" and exits nonzero on a
 * failure.  Legend as in src/mha.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "kernels.h"  /* internal: the per-ISA kernel tables */
#include "internal.h" /* internal: mha_copy_stream */

static int g_pass, g_fail;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) g_pass++;                                               \
        else {                                                            \
            g_fail++;                                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                   \
            printf(__VA_ARGS__);                                          \
            printf("\n");                                                 \
        }                                                                 \
    } while (0)

static double lcg_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*s >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* E = 2, H = 1, identity weights, zero biases: the answer by hand. */
static void test_hand_computed(void)
{
    double params[4 * 4 + 4 * 2];
    double q[4] = {1, 0, 0, 1};   /* (B=1, Sq=2, E=2) */
    double v[4] = {1, 2, 3, 4};   /* (1, Sk=2, 2) */
    double out[4], w[4];
    mha_config cfg = {2, 1, 2, 2, 1, MHA_FLOAT64};
    mha_params p;
    mha_forward_args a;
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total;
    int t;
    CHECK(mha_param_layout(&cfg, off, size, &total) == MHA_OK && total == 24, "layout");
    memset(params, 0, sizeof params);
    for (t = MHA_WQ; t <= MHA_WO; t += 2) {
        params[off[t] + 0] = 1;
        params[off[t] + 3] = 1;
    }
    CHECK(mha_params_from_block(&cfg, params, &p) == MHA_OK, "params");
    memset(&a, 0, sizeof a);
    a.B = 1; a.Sq = 2; a.Sk = 2;
    a.query = q; a.key = q; a.value = v;
    a.out = out; a.weights = w;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_OK, "forward");
    /* row 0 scores [1, 0]/sqrt(2): w00 = 1 / (1 + exp(-1/sqrt(2))) */
    double w00 = 1.0 / (1.0 + exp(-1.0 / sqrt(2.0)));
    double want_w[4] = {w00, 1 - w00, 1 - w00, w00};
    double want_out[4] = {w00 * 1 + (1 - w00) * 3, w00 * 2 + (1 - w00) * 4,
                          (1 - w00) * 1 + w00 * 3, (1 - w00) * 2 + w00 * 4};
    for (t = 0; t < 4; t++) {
        CHECK(fabs(w[t] - want_w[t]) < 1e-15, "weight %d: %.17g vs %.17g", t, w[t], want_w[t]);
        CHECK(fabs(out[t] - want_out[t]) < 1e-14, "out %d: %.17g vs %.17g", t, out[t], want_out[t]);
    }
    /* block key 1 for query 0 with a (Sq, Sk) mask broadcast over B and H:
     * query 0 then sees only key 0, so its output is value 0 exactly */
    uint8_t blk[4] = {0, 1, 0, 0};
    mha_mask mk = {MHA_MASK_BLOCK, blk, {0, 0, 2, 1}};
    a.masks = &mk; a.n_masks = 1;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_OK, "masked forward");
    CHECK(w[0] == 1.0 && w[1] == 0.0, "masked weights %g %g", w[0], w[1]);
    CHECK(out[0] == 1.0 && out[1] == 2.0, "masked out %g %g", out[0], out[1]);
    /* every key blocked for query 0: NaN row by default, zeros on request */
    blk[0] = 1;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_OK, "blocked forward");
    CHECK(isnan(w[0]) && isnan(w[1]) && isnan(out[0]) && isnan(out[1]), "NaN row");
    CHECK(!isnan(w[2]) && !isnan(out[2]), "other row finite");
    a.zero_masked_rows = 1;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_OK, "zero-row forward");
    CHECK(w[0] == 0 && w[1] == 0 && out[0] == 0 && out[1] == 0, "zero row");
    /* the same through the additive kind: -inf blocks, 0 passes */
    double add[4] = {-INFINITY, -INFINITY, 0, 0};
    mha_mask mk2 = {MHA_MASK_ADD, add, {0, 0, 2, 1}};
    a.masks = &mk2; a.zero_masked_rows = 0;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_OK, "additive forward");
    CHECK(isnan(w[0]) && fabs(w[2] - want_w[2]) < 1e-15, "additive mask");
    /* causal: query 0 sees key 0 only */
    a.n_masks = 0; a.is_causal = 1;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_OK, "causal");
    CHECK(w[0] == 1 && w[1] == 0 && fabs(w[2] - want_w[2]) < 1e-15, "causal weights");
}

/* fast path against the reference, float32 against float64 */
static void test_fast_vs_ref(int64_t B, int64_t Sq, int64_t Sk, int64_t E, int64_t H,
                             int64_t Ek, int64_t Ev, int masked, int causal, double p_drop)
{
    mha_config c64 = {E, H, Ek, Ev, 1, MHA_FLOAT64}, c32 = c64;
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, i;
    int64_t nq = B * Sq * E, nk = B * Sk * Ek, nv = B * Sk * Ev, nw = B * H * Sq * Sk;
    uint64_t s = 12345 + (uint64_t)(B * 7 + Sq * 13 + Sk * 17 + E);
    c32.dtype = MHA_FLOAT32;
    mha_param_layout(&c64, off, size, &total);
    double *P = malloc(total * 8), *X = malloc((nq + nk + nv) * 8);
    float *P32 = malloc(total * 4), *X32 = malloc((nq + nk + nv) * 4);
    double *out = malloc(nq * 8), *ref = malloc(nq * 8), *w = malloc((nw + 1) * 8),
           *wr = malloc((nw + 1) * 8), *out2 = malloc(nq * 8);
    float *out32 = malloc(nq * 4), *w32 = malloc((nw + 1) * 4);
    uint8_t *mask = malloc((size_t)(Sq * Sk + 1));
    mha_params p, p32;
    mha_forward_args a;
    mha_mask mk;
    CHECK(mha_params_init(&c64, P, 7) == MHA_OK, "init");
    for (i = 0; i < total; i++) P32[i] = (float)(P[i] = (double)(float)P[i]);
    for (i = 0; i < nq + nk + nv; i++) X32[i] = (float)(X[i] = (double)(float)lcg_next(&s));
    for (i = 0; i < Sq * Sk; i++) mask[i] = masked && ((i * 7 + 3) % 5 == 0);
    mha_params_from_block(&c64, P, &p);
    mha_params_from_block(&c32, P32, &p32);
    memset(&a, 0, sizeof a);
    a.B = B; a.Sq = Sq; a.Sk = Sk;
    a.query = X; a.key = X + nq; a.value = X + nq + nk;
    mk.kind = MHA_MASK_BLOCK; mk.data = mask;
    mk.stride[0] = 0; mk.stride[1] = 0; mk.stride[2] = Sk; mk.stride[3] = 1;
    a.masks = &mk; a.n_masks = masked;
    a.is_causal = causal;
    a.dropout = p_drop; a.seed = 99; a.counter = 3;
    a.out = out; a.weights = w;
    CHECK(mha_forward(&c64, &p, &a) == MHA_OK, "fast f64");
    a.out = ref; a.weights = wr;
    CHECK(mha_forward_ref(&c64, &p, &a) == MHA_OK, "ref f64");
    a.out = out2; a.weights = NULL;
    CHECK(mha_forward(&c64, &p, &a) == MHA_OK, "online f64");
    double e_out = 0, e_w = 0, e_on = 0, e_32 = 0;
    int nan_mismatch = 0;
    for (i = 0; i < nq; i++) {
        if (isnan(out[i]) != isnan(ref[i]) || isnan(out2[i]) != isnan(ref[i])) nan_mismatch++;
        if (!isnan(ref[i])) {
            e_out = fmax(e_out, fabs(out[i] - ref[i]));
            e_on = fmax(e_on, fabs(out2[i] - ref[i]));
        }
    }
    for (i = 0; i < nw; i++) {
        if (isnan(w[i]) != isnan(wr[i])) nan_mismatch++;
        else if (!isnan(wr[i])) e_w = fmax(e_w, fabs(w[i] - wr[i]));
    }
    a.query = X32; a.key = X32 + nq; a.value = X32 + nq + nk;
    a.out = out32; a.weights = w32;
    CHECK(mha_forward(&c32, &p32, &a) == MHA_OK, "fast f32");
    for (i = 0; i < nq; i++)
        if (!isnan(ref[i])) e_32 = fmax(e_32, fabs((double)out32[i] - ref[i]));
    CHECK(nan_mismatch == 0, "NaN positions differ (%d)", nan_mismatch);
    CHECK(e_out < 1e-12 && e_w < 1e-12 && e_on < 1e-12,
          "f64 fast vs ref B%lld Sq%lld Sk%lld E%lld H%lld: out %g weights %g online %g",
          (long long)B, (long long)Sq, (long long)Sk, (long long)E, (long long)H, e_out, e_w, e_on);
    CHECK(e_32 < 2e-5, "f32 vs f64 B%lld Sq%lld Sk%lld E%lld: %g", (long long)B,
          (long long)Sq, (long long)Sk, (long long)E, e_32);
    free(P); free(X); free(P32); free(X32); free(out); free(ref); free(w); free(wr);
    free(out2); free(out32); free(w32); free(mask);
}

/* A workspace of 32 MiB or more is kept by the thread for its next call:
 * calls through the kept block give the same numbers, and
 * mha_release_workspace frees it (the next call allocates afresh). */
static void test_workspace_cache(void)
{
    const int64_t B = 50000, S = 8, E = 8, H = 2; /* workspace: 5 x 12.8 MB */
    mha_config c = {E, H, E, E, 1, MHA_FLOAT32};
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, i, n = B * S * E;
    uint64_t s = 31;
    float *P, *X = malloc((size_t)n * 4), *o1 = malloc((size_t)n * 4),
          *o2 = malloc((size_t)n * 4), *o3 = malloc((size_t)n * 4);
    mha_params p;
    mha_forward_args a;
    mha_param_layout(&c, off, size, &total);
    P = malloc((size_t)total * 4);
    CHECK(mha_params_init(&c, P, 3) == MHA_OK, "init");
    mha_params_from_block(&c, P, &p);
    for (i = 0; i < n; i++) X[i] = (float)lcg_next(&s);
    memset(&a, 0, sizeof a);
    a.B = B; a.Sq = S; a.Sk = S;
    a.query = X; a.key = X; a.value = X;
    a.out = o1;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "first call");
    a.out = o2;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "call through the kept workspace");
    mha_release_workspace();
    a.out = o3;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "call after mha_release_workspace");
    mha_release_workspace();
    mha_release_workspace(); /* nothing kept: a no-op */
    CHECK(memcmp(o1, o2, (size_t)n * 4) == 0 && memcmp(o1, o3, (size_t)n * 4) == 0,
          "the kept workspace changed the output");
    free(P); free(X); free(o1); free(o2); free(o3);
}

static void test_status(void)
{
    mha_config bad = {10, 3, 10, 10, 1, MHA_FLOAT32};
    CHECK(mha_config_check(&bad) == MHA_ERR_ARG, "E %% H != 0");
    mha_config huge = {INT64_C(1) << 40, 1, 1, 1, 1, MHA_FLOAT32};
    CHECK(mha_config_check(&huge) == MHA_ERR_OVERFLOW, "huge d_model: %d", mha_config_check(&huge));
    /* a shape whose weights would not fit in int64_t: a status, nothing allocated */
    mha_config cfg = {8, 2, 8, 8, 1, MHA_FLOAT32};
    float params[4 * 64 + 32];
    float dummy[8] = {0};
    mha_params p;
    mha_forward_args a;
    mha_params_from_block(&cfg, params, &p);
    memset(&a, 0, sizeof a);
    a.B = INT64_C(1) << 20; a.Sq = INT64_C(1) << 20; a.Sk = INT64_C(1) << 20;
    a.query = a.key = a.value = dummy;
    a.out = dummy;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_ERR_OVERFLOW, "size overflow");
    CHECK(mha_forward_ref(&cfg, &p, &a) == MHA_ERR_OVERFLOW, "size overflow (ref)");
    a.B = 1; a.Sq = 1; a.Sk = 1; a.dropout = NAN;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_ERR_ARG, "NaN dropout");
    a.dropout = 0; a.B = -1;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_ERR_ARG, "negative B");
    a.B = 1; a.query = NULL;
    CHECK(mha_forward(&cfg, &p, &a) == MHA_ERR_ARG, "NULL query");
    CHECK(strcmp(mha_status_str(MHA_ERR_OVERFLOW), "size overflow") == 0, "status string");
}

static void test_dropout_stream(void)
{
    /* a pure function of (seed, counter, idx), and about uniform */
    int64_t i, below = 0, n = 100000;
    CHECK(mha_dropout_uniform(1, 2, 3) == mha_dropout_uniform(1, 2, 3), "deterministic");
    CHECK(mha_dropout_uniform(1, 2, 3) != mha_dropout_uniform(1, 3, 3), "counter matters");
    for (i = 0; i < n; i++) below += mha_dropout_uniform(5, 0, (uint64_t)i) < 0.3;
    CHECK(fabs((double)below / n - 0.3) < 0.006, "fraction below 0.3: %g", (double)below / n);
}

/* distance in units in the last place between two finite floats of one sign */
static int64_t ulps32(float a, float b)
{
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    return ia > ib ? (int64_t)ia - ib : (int64_t)ib - ia;
}
static int64_t ulps64(double a, double b)
{
    int64_t ia, ib;
    memcpy(&ia, &a, 8);
    memcpy(&ib, &b, 8);
    return ia > ib ? ia - ib : ib - ia;
}

/* the vector exp of every ISA: <= 2 ulp where the result is normal, and
 * NaN, -inf, +inf, 0 handled like exp */
static void test_exp(void)
{
    static float xs[4099];
    static double xd[4099];
    const char *names[3] = {"portable", "avx2", "avx512"};
    int isa, i;
    for (isa = 0; isa < 3; isa++) {
        const mha_kern_f32 *k32 = mha_kern_for_f32(isa);
        const mha_kern_f64 *k64 = mha_kern_for_f64(isa);
        int64_t worst32 = 0, worst64 = 0;
        if (!k32 || !k64) continue;
        for (i = 0; i < 4096; i++) {
            xs[i] = -87.0f + 175.0f * (float)i / 4095.0f;
            xd[i] = -708.0 + 1416.0 * (double)i / 4095.0;
        }
        xs[4096] = NAN; xs[4097] = -INFINITY; xs[4098] = INFINITY;
        xd[4096] = NAN; xd[4097] = -INFINITY; xd[4098] = INFINITY;
        k32->exp(xs, 4099);
        k64->exp(xd, 4099);
        for (i = 0; i < 4096; i++) {
            float x = -87.0f + 175.0f * (float)i / 4095.0f;
            double y = -708.0 + 1416.0 * (double)i / 4095.0;
            int64_t u = ulps32(xs[i], (float)exp((double)x));
            int64_t v = ulps64(xd[i], (double)expl((long double)y));
            if (u > worst32) worst32 = u;
            if (v > worst64) worst64 = v;
        }
        CHECK(worst32 <= 2, "%s exp f32: %lld ulp", names[isa], (long long)worst32);
        CHECK(worst64 <= 2, "%s exp f64: %lld ulp", names[isa], (long long)worst64);
        CHECK(isnan(xs[4096]) && xs[4097] == 0 && isinf(xs[4098]), "%s exp f32 specials", names[isa]);
        CHECK(isnan(xd[4096]) && xd[4097] == 0 && isinf(xd[4098]), "%s exp f64 specials", names[isa]);
    }
}

/* Defect 4: the vector exp of every ISA over the whole negative range,
 * -1e38 .. 0 (float) and -1e308 .. 0 (double) and -inf, against libm: the
 * score gaps of a huge additive mask (-1e7 in float, -6e15 in double
 * overflowed the exponent's integer conversion).  Within 2 ulp of libm's
 * result (0 far below the underflow threshold); under UBSan also free of
 * signed overflow. */
static void test_exp_far_below(void)
{
    enum { N = 4000 };
    static float xs[N + 2];
    static double xd[N + 2];
    int isa, i;
    for (isa = 0; isa < 3; isa++) {
        const mha_kern_f32 *k32 = mha_kern_for_f32(isa);
        const mha_kern_f64 *k64 = mha_kern_for_f64(isa);
        int64_t worst32 = 0, worst64 = 0;
        if (!k32 || !k64) continue;
        /* -10^e for e from -3 to 38 (float) or 308 (double), log-spaced */
        for (i = 0; i < N; i++) {
            xs[i] = -(float)pow(10.0, -3.0 + 41.0 * i / (N - 1));
            xd[i] = -pow(10.0, -3.0 + 311.0 * i / (N - 1));
        }
        xs[N] = 0; xs[N + 1] = -INFINITY;
        xd[N] = 0; xd[N + 1] = -INFINITY;
        k32->exp(xs, N + 2);
        k64->exp(xd, N + 2);
        for (i = 0; i < N; i++) {
            float x = -(float)pow(10.0, -3.0 + 41.0 * i / (N - 1));
            double y = -pow(10.0, -3.0 + 311.0 * i / (N - 1));
            int64_t u = ulps32(xs[i], (float)exp((double)x));
            int64_t v = ulps64(xd[i], (double)expl((long double)y));
            if (u > worst32) worst32 = u;
            if (v > worst64) worst64 = v;
        }
        CHECK(worst32 <= 2, "%s exp f32 over -1e38 .. 0: %lld ulp", k32->name, (long long)worst32);
        CHECK(worst64 <= 2, "%s exp f64 over -1e308 .. 0: %lld ulp", k64->name, (long long)worst64);
        CHECK(xs[N] == 1 && xs[N + 1] == 0, "%s exp f32 of 0, -inf", k32->name);
        CHECK(xd[N] == 1 && xd[N + 1] == 0, "%s exp f64 of 0, -inf", k64->name);
    }
}

/* AVX-512's vector exp gives AVX2's bits (both with FMA; AVX-512 takes
 * single instructions for the selects and 2^n, kern_impl.h's V_MAX ..
 * V_SCALEF, where AVX2 has the template's defaults): float over every 4099th bit pattern (every sign, exponent and
 * NaN class, the subnormal results included), double over random bit
 * patterns and random values in -760 .. 740 (exp's subnormal and overflow
 * edges).  NaN matches NaN. */
static void test_exp_same_bits(void)
{
    enum { N = 1 << 14 };
    static float xs[N], ys[N];
    static double xd[N], yd[N];
    const mha_kern_f32 *p32 = mha_kern_for_f32(MHA_ISA_AVX2);
    const mha_kern_f64 *p64 = mha_kern_for_f64(MHA_ISA_AVX2);
    const mha_kern_f32 *k32 = mha_kern_for_f32(MHA_ISA_AVX512);
    const mha_kern_f64 *k64 = mha_kern_for_f64(MHA_ISA_AVX512);
    uint64_t s = 88172645463325252ull, u, done;
    int i;
    {
        int64_t bad32 = 0, bad64 = 0;
        if (!k32 || !k64 || !p32 || !p64) { /* no AVX-512 here: said, not counted */
            printf("skipped: avx512 exp against avx2 (this CPU lacks one)\n");
            return;
        }
        for (done = 0; done < (1ull << 32); done += (uint64_t)N * 4099u) {
            for (i = 0; i < N; i++) {
                uint32_t b = (uint32_t)(done + (uint64_t)i * 4099u);
                memcpy(&xs[i], &b, sizeof b);
            }
            memcpy(ys, xs, sizeof xs);
            k32->exp(xs, N);
            p32->exp(ys, N);
            for (i = 0; i < N; i++)
                bad32 += memcmp(&xs[i], &ys[i], sizeof xs[i]) != 0 && !(isnan(xs[i]) && isnan(ys[i]));
        }
        for (u = 0; u < 64; u++) {
            for (i = 0; i < N; i++) {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                if (i & 1) xd[i] = (double)(s >> 11) / 9007199254740992.0 * 1500.0 - 760.0;
                else memcpy(&xd[i], &s, sizeof s);
            }
            memcpy(yd, xd, sizeof xd);
            k64->exp(xd, N);
            p64->exp(yd, N);
            for (i = 0; i < N; i++)
                bad64 += memcmp(&xd[i], &yd[i], sizeof xd[i]) != 0 && !(isnan(xd[i]) && isnan(yd[i]));
        }
        CHECK(bad32 == 0, "avx512 exp f32: %lld results differ from avx2's", (long long)bad32);
        CHECK(bad64 == 0, "avx512 exp f64: %lld results differ from avx2's", (long long)bad64);
    }
}

/* mha_copy_stream copies exactly, whatever the alignment and size, and
 * writes nothing past the end */
static void test_copy_stream(void)
{
    static unsigned char src[200064], dst[200064];
    const size_t sizes[6] = {0, 1, 4095, 4096, 5003, 200000};
    size_t i, z, off;
    int bad = 0;
    for (i = 0; i < sizeof src; i++) src[i] = (unsigned char)(i * 7 + 3);
    for (z = 0; z < 6; z++)
        for (off = 0; off < 18; off += 5) {
            memset(dst, 0xAB, sizeof dst);
            mha_copy_stream(dst + off, src + 17 - off % 3, sizes[z]);
            bad += memcmp(dst + off, src + 17 - off % 3, sizes[z]) != 0;
            for (i = 0; i < off; i++) bad += dst[i] != 0xAB;
            for (i = off + sizes[z]; i < off + sizes[z] + 48 && i < sizeof dst; i++)
                bad += dst[i] != 0xAB;
        }
    CHECK(bad == 0, "mha_copy_stream: %d wrong", bad);
}

/* pack_bt, where an ISA has one, is exactly the transposed packing:
 * Bp[k*NR + c] = B[c*ldb + k], for depths that are and are not multiples
 * of its blocks */
static void test_pack_bt(void)
{
    static float B[64 * 300], Bp[300 * 64];
    const int64_t kcs[4] = {1, 16, 37, 300};
    int isa, t;
    int64_t i, k, c;
    for (i = 0; i < 64 * 300; i++) B[i] = (float)i;
    for (isa = 0; isa < 3; isa++) {
        const mha_kern_f32 *k32 = mha_kern_for_f32(isa);
        if (!k32 || !k32->pack_bt) continue;
        for (t = 0; t < 4; t++) {
            const int64_t kc = kcs[t], ldb = 300, NR = k32->nr;
            int bad = 0;
            memset(Bp, 0xff, sizeof Bp);
            k32->pack_bt(kc, B, ldb, Bp);
            for (k = 0; k < kc; k++)
                for (c = 0; c < NR; c++) bad += Bp[k * NR + c] != B[c * ldb + k];
            CHECK(bad == 0, "%s pack_bt kc %lld: %d wrong", k32->name, (long long)kc, bad);
        }
    }
}

/* no key at all (Sk == 0) is an empty sum, not a masked row: the output is
 * W_o.bias in both masked-row modes, on the fast and the reference path */
static void test_no_keys(void)
{
    mha_config cfg = {4, 2, 4, 4, 1, MHA_FLOAT64};
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total;
    double params[4 * 16 + 16], q[2 * 4], kv[1], out[2 * 4], w[1];
    mha_params p;
    mha_forward_args a;
    int zero, path, i;
    mha_param_layout(&cfg, off, size, &total);
    mha_params_init(&cfg, params, 3);
    mha_params_from_block(&cfg, params, &p);
    for (i = 0; i < 8; i++) q[i] = i * 0.25;
    for (zero = 0; zero < 2; zero++)
        for (path = 0; path < 3; path++) {
            memset(&a, 0, sizeof a);
            a.B = 1; a.Sq = 2; a.Sk = 0;
            a.query = q; a.key = kv; a.value = kv;
            a.out = out; a.weights = path == 1 ? NULL : w;
            a.zero_masked_rows = zero;
            CHECK((path == 2 ? mha_forward_ref(&cfg, &p, &a) : mha_forward(&cfg, &p, &a)) == MHA_OK,
                  "Sk = 0 forward");
            for (i = 0; i < 8; i++)
                CHECK(out[i] == params[off[MHA_BO] + i % 4], "Sk = 0: out[%d] = %g, bias %g (path %d)",
                      i, out[i], params[off[MHA_BO] + i % 4], path);
        }
}

/* ---- the poll hook (mha_forward_args.poll) ---- */
typedef struct {
    int calls;
    int stop_at; /* answer stop at this call (1: the first); 0: never */
} poll_count;

static int count_poll(void *ctx)
{
    poll_count *pc = (poll_count *)ctx;
    pc->calls++;
    return pc->stop_at > 0 && pc->calls >= pc->stop_at;
}

/* A poll that never says stop changes no bit of any result; one that says
 * stop at its first question makes a call long enough to be asked return
 * MHA_ERR_INTERRUPTED (forward, forward_save, backward, backward_saved),
 * having asked once; the next call, on the same pool, gives the same
 * results as before.  The batch grows until a call lasts long enough to be
 * asked three times (some 4 MHA_POLL_MS: the same call is then surely
 * asked again, however the machine's load varies). */
static void test_poll(void)
{
    const int64_t S = 256, E = 128, H = 4, BMAX = 256;
    mha_config c = {E, H, E, E, 1, MHA_FLOAT64};
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, i, B, n;
    uint64_t s = 2024;
    double *P, *X, *G, *o0, *o1, *g0, *g1, *sq, *sk, *sv, *sc;
    mha_params p;
    mha_forward_args a;
    mha_backward_args ba;
    mha_saved kept;
    poll_count never = {0, 0}, stop = {0, 1};
    mha_param_layout(&c, off, size, &total);
    n = BMAX * S * E;
    P = malloc((size_t)total * 8);
    X = malloc((size_t)n * 8); G = malloc((size_t)n * 8);
    o0 = malloc((size_t)n * 8); o1 = malloc((size_t)n * 8);
    g0 = malloc((size_t)(total + 3 * n) * 8); g1 = malloc((size_t)(total + 3 * n) * 8);
    sq = malloc((size_t)n * 8); sk = malloc((size_t)n * 8);
    sv = malloc((size_t)n * 8); sc = malloc((size_t)n * 8);
    kept.q = sq; kept.k = sk; kept.v = sv; kept.ctx = sc; kept.p = NULL;
    CHECK(mha_params_init(&c, P, 8) == MHA_OK, "init");
    mha_params_from_block(&c, P, &p);
    for (i = 0; i < n; i++) X[i] = lcg_next(&s);
    for (i = 0; i < n; i++) G[i] = lcg_next(&s);
    memset(&a, 0, sizeof a);
    a.Sq = S; a.Sk = S;
    a.query = X; a.key = X; a.value = X;
    a.is_causal = 1;
    a.dropout = 0.1; a.seed = 3; a.counter = 4;
    for (B = 2; B <= BMAX; B *= 2) { /* long enough to be asked at least once */
        a.B = B; a.out = o1;
        a.poll = count_poll; a.poll_ctx = &never;
        never.calls = 0;
        CHECK(mha_forward(&c, &p, &a) == MHA_OK, "forward with a poll");
        if (never.calls >= 3) break; /* asked 3 times: some 200 ms, a margin */
    }
    if (B > BMAX) B = BMAX;
    n = B * S * E;
    CHECK(never.calls > 0, "no call was long enough to be polled (B %lld)", (long long)B);
    a.poll = NULL; a.out = o0;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "forward");
    CHECK(memcmp(o0, o1, (size_t)n * 8) == 0, "a poll that never stops changed the output");
    a.poll = count_poll; a.poll_ctx = &stop;
    CHECK(mha_forward(&c, &p, &a) == MHA_ERR_INTERRUPTED && stop.calls == 1,
          "forward stopped by its poll (asked %d times)", stop.calls);
    stop.calls = 0;
    CHECK(mha_forward_save(&c, &p, &a, &kept, NULL) == MHA_ERR_INTERRUPTED && stop.calls == 1,
          "forward_save stopped by its poll (asked %d times)", stop.calls);
    a.poll = NULL; a.out = o1;
    memset(o1, 0, (size_t)n * 8);
    CHECK(mha_forward(&c, &p, &a) == MHA_OK && memcmp(o0, o1, (size_t)n * 8) == 0,
          "the call after an interrupted one");
    CHECK(mha_forward_save(&c, &p, &a, &kept, NULL) == MHA_OK && memcmp(o0, o1, (size_t)n * 8) == 0,
          "forward_save after an interrupted call");

    /* the backward asks a->fwd.poll */
    memset(&ba, 0, sizeof ba);
    ba.fwd = a;
    ba.grad_out = G;
    ba.grad_params = g0; ba.grad_query = g0 + total;
    ba.grad_key = g0 + total + n; ba.grad_value = g0 + total + 2 * n;
    CHECK(mha_backward(&c, &p, &ba) == MHA_OK, "backward");
    ba.grad_params = g1; ba.grad_query = g1 + total;
    ba.grad_key = g1 + total + n; ba.grad_value = g1 + total + 2 * n;
    ba.fwd.poll = count_poll; ba.fwd.poll_ctx = &never;
    never.calls = 0;
    CHECK(mha_backward(&c, &p, &ba) == MHA_OK && never.calls > 0, "backward with a poll");
    CHECK(memcmp(g0, g1, (size_t)(total + 3 * n) * 8) == 0,
          "a poll that never stops changed the gradients");
    ba.fwd.poll_ctx = &stop;
    stop.calls = 0;
    CHECK(mha_backward(&c, &p, &ba) == MHA_ERR_INTERRUPTED && stop.calls == 1,
          "backward stopped by its poll (asked %d times)", stop.calls);
    stop.calls = 0;
    CHECK(mha_backward_saved(&c, &p, &ba, &kept) == MHA_ERR_INTERRUPTED && stop.calls == 1,
          "backward_saved stopped by its poll (asked %d times)", stop.calls);
    ba.fwd.poll = NULL;
    memset(g1, 0, (size_t)(total + 3 * n) * 8);
    CHECK(mha_backward(&c, &p, &ba) == MHA_OK && memcmp(g0, g1, (size_t)(total + 3 * n) * 8) == 0,
          "the backward after an interrupted one");
    free(P); free(X); free(G); free(o0); free(o1); free(g0); free(g1);
    free(sq); free(sk); free(sv); free(sc);
}

int main(void)
{
    const char *isas[4] = {"portable", "avx2", "avx512", "amx"};
    int n;
    test_exp();
    test_exp_far_below();
    test_exp_same_bits();
    test_pack_bt();
    test_copy_stream();
    test_hand_computed();
    test_no_keys();
    test_status();
    test_dropout_stream();
    test_workspace_cache();
    test_poll();
    /* sizes that are multiples of no tile, masks, causal, dropout, cross;
     * on every instruction set this CPU runs */
    for (n = 0; n < 4; n++) {
        if (mha_set_isa(isas[n]) != MHA_OK) continue;
        test_fast_vs_ref(1, 1, 1, 1, 1, 1, 1, 0, 0, 0.0);
        test_fast_vs_ref(2, 7, 5, 6, 3, 6, 6, 1, 0, 0.0);
        test_fast_vs_ref(3, 33, 17, 16, 4, 5, 9, 1, 0, 0.0);
        test_fast_vs_ref(2, 65, 129, 24, 2, 24, 24, 0, 1, 0.0);
        test_fast_vs_ref(1, 40, 300, 32, 4, 32, 32, 1, 0, 0.25);
        test_fast_vs_ref(2, 10, 10, 64, 8, 64, 64, 1, 1, 0.5);
        test_fast_vs_ref(1, 3, 8, 8, 1, 8, 8, 0, 0, 1.0);
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
