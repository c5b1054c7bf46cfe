/* test_cache.c: grouped-query attention on the module path and the
 * key/value cache of mha_forward_args (issue 15), in C alone:
 *   - n_kv_heads: the layout's sizes, mha_forward against mha_forward_ref,
 *     mha_backward against mha_backward_ref (every ISA);
 *   - the cache: a sequence fed in chunks (1, 3, 7, all) through cache_k /
 *     cache_v gives outputs bit-identical to one causal call over the whole
 *     sequence, and the cache holds K transposed and V per head;
 *   - bad caches as statuses: one buffer only, overflow, negative length,
 *     extra keys, the reference and save paths, the backward.
 * Legend as in mha.h; Hkv key/value heads, L the cache's length. */
#include "check.h"

static mha_config cfg_make(mha_dtype dt, int64_t E, int64_t H, int64_t Hkv)
{
    mha_config c;
    memset(&c, 0, sizeof c);
    c.d_model = E; c.n_heads = H; c.kdim = E; c.vdim = E; c.bias = 1; c.dtype = dt;
    c.n_kv_heads = Hkv;
    return c;
}

static void test_layout(void)
{
    mha_config c = cfg_make(MHA_FLOAT32, 64, 8, 2);
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total;
    CHECK(mha_param_layout(&c, off, size, &total) == MHA_OK, "layout");
    CHECK(size[MHA_WK] == 16 * 64 && size[MHA_BK] == 16 && size[MHA_WV] == 16 * 64 &&
          size[MHA_WQ] == 64 * 64 && size[MHA_WO] == 64 * 64, "GQA sizes");
    CHECK(mha_kv_heads(&c) == 2, "mha_kv_heads");
    c.n_kv_heads = 3;
    CHECK(mha_config_check(&c) == MHA_ERR_ARG, "3 does not divide 8");
    c.n_kv_heads = 16;
    CHECK(mha_config_check(&c) == MHA_ERR_ARG, "more K/V heads than heads");
    c.n_kv_heads = -1;
    CHECK(mha_config_check(&c) == MHA_ERR_ARG, "negative");
    c.n_kv_heads = 0;
    CHECK(mha_config_check(&c) == MHA_OK && mha_kv_heads(&c) == 8, "0 = n_heads");
}

/* fast against reference, forward and backward, one GQA shape */
static void test_gqa_vs_ref(mha_dtype dt, int64_t E, int64_t H, int64_t Hkv, int causal)
{
    const int64_t B = 2, Sq = 5, Sk = 7;
    mha_config c = cfg_make(dt, E, H, Hkv);
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, n_err = 0;
    uint64_t s = 7;
    size_t es = mha_dtype_size(dt);
    mha_param_layout(&c, off, size, &total);
    void *block = malloc((size_t)total * es), *gp = malloc((size_t)total * es),
         *gr = malloc((size_t)total * es);
    mha_params_init(&c, block, 3);
    mha_params p;
    mha_params_from_block(&c, block, &p);
    void *q = rand_array(dt, B * Sq * E, &s), *k = rand_array(dt, B * Sk * E, &s),
         *v = rand_array(dt, B * Sk * E, &s), *go = rand_array(dt, B * Sq * E, &s);
    void *o1 = malloc((size_t)(B * Sq * E) * es), *o2 = malloc((size_t)(B * Sq * E) * es);
    void *w1 = malloc((size_t)(B * H * Sq * Sk) * es), *w2 = malloc((size_t)(B * H * Sq * Sk) * es);
    void *gk1 = malloc((size_t)(B * Sk * E) * es), *gk2 = malloc((size_t)(B * Sk * E) * es);
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.B = B; a.Sq = Sq; a.Sk = Sk; a.query = q; a.key = k; a.value = v;
    a.is_causal = causal ? MHA_CAUSAL_LOWER_RIGHT : 0;
    a.out = o1; a.weights = w1;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "GQA forward");
    a.out = o2; a.weights = w2;
    CHECK(mha_forward_ref(&c, &p, &a) == MHA_OK, "GQA reference forward");
    CHECK(rel_err(dt, o1, o2, B * Sq * E, &n_err) < tol(dt) && n_err == 0, "GQA out vs ref");
    CHECK(rel_err(dt, w1, w2, B * H * Sq * Sk, &n_err) < tol(dt) && n_err == 0, "GQA w vs ref");
    mha_backward_args ba;
    memset(&ba, 0, sizeof ba);
    ba.fwd = a;
    ba.grad_out = go;
    ba.grad_params = gp; ba.grad_key = gk1;
    CHECK(mha_backward(&c, &p, &ba) == MHA_OK, "GQA backward");
    ba.grad_params = gr; ba.grad_key = gk2;
    CHECK(mha_backward_ref(&c, &p, &ba) == MHA_OK, "GQA reference backward");
    CHECK(rel_err(dt, gp, gr, total, &n_err) < 10 * tol(dt) && n_err == 0,
          "GQA parameter gradients vs ref (E %lld H %lld Hkv %lld)", (long long)E, (long long)H,
          (long long)Hkv);
    CHECK(rel_err(dt, gk1, gk2, B * Sk * E, &n_err) < 10 * tol(dt) && n_err == 0,
          "GQA key gradient vs ref");
    free(block); free(gp); free(gr); free(q); free(k); free(v); free(go);
    free(o1); free(o2); free(w1); free(w2); free(gk1); free(gk2);
}

/* chunks of `chunk` tokens through a cache: the bits of one causal call */
static void test_cache_exact(mha_dtype dt, int64_t E, int64_t H, int64_t Hkv, int64_t chunk)
{
    const int64_t B = 2, S = 19, Dk = E / H, cap = 23;
    mha_config c = cfg_make(dt, E, H, Hkv);
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total, L, b, h, d, j, bad = 0;
    uint64_t s = 11;
    size_t es = mha_dtype_size(dt);
    mha_param_layout(&c, off, size, &total);
    void *block = malloc((size_t)total * es);
    mha_params_init(&c, block, 5);
    mha_params p;
    mha_params_from_block(&c, block, &p);
    void *x = rand_array(dt, B * S * E, &s);
    void *full = malloc((size_t)(B * S * E) * es), *part = malloc((size_t)(B * S * E) * es);
    void *kc = calloc((size_t)(B * Hkv * Dk * cap), es), *vc = calloc((size_t)(B * Hkv * cap * Dk), es);
    void *xs = malloc((size_t)(B * S * E) * es), *os = malloc((size_t)(B * S * E) * es);
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.B = B; a.Sq = S; a.Sk = S; a.query = x; a.key = x; a.value = x;
    a.is_causal = MHA_CAUSAL_TOP_LEFT; a.out = full;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "full call");
    for (L = 0; L < S; L += chunk) {
        const int64_t n = S - L < chunk ? S - L : chunk;
        for (b = 0; b < B; b++) /* the chunk's rows, contiguous */
            memcpy((char *)xs + (size_t)(b * n * E) * es, (char *)x + (size_t)((b * S + L) * E) * es,
                   (size_t)(n * E) * es);
        memset(&a, 0, sizeof a);
        a.B = B; a.Sq = n; a.Sk = n; a.query = xs; a.key = xs; a.value = xs;
        a.is_causal = MHA_CAUSAL_LOWER_RIGHT; a.out = os;
        a.cache_k = kc; a.cache_v = vc; a.cache_cap = cap; a.cache_len = L;
        CHECK(mha_forward(&c, &p, &a) == MHA_OK, "cached call at %lld", (long long)L);
        for (b = 0; b < B; b++)
            memcpy((char *)part + (size_t)((b * S + L) * E) * es, (char *)os + (size_t)(b * n * E) * es,
                   (size_t)(n * E) * es);
    }
    CHECK(memcmp(full, part, (size_t)(B * S * E) * es) == 0,
          "chunks of %lld: bit-identical to the full call (E %lld H %lld Hkv %lld)",
          (long long)chunk, (long long)E, (long long)H, (long long)Hkv);
    /* the cache: K transposed and V per head, the projections of x (bias
     * included), checked against W_k·x + b_k for one element per (b, h, j) */
    for (b = 0; b < B; b++)
        for (h = 0; h < Hkv; h++)
            for (j = 0; j < S; j++) {
                double kk = get(dt, p.bk, h * Dk), vv = get(dt, p.bv, h * Dk);
                for (d = 0; d < E; d++) {
                    kk += get(dt, p.wk, (h * Dk) * E + d) * get(dt, x, (b * S + j) * E + d);
                    vv += get(dt, p.wv, (h * Dk) * E + d) * get(dt, x, (b * S + j) * E + d);
                }
                if (fabs(kk - get(dt, kc, ((b * Hkv + h) * Dk) * cap + j)) > 1e-4 ||
                    fabs(vv - get(dt, vc, ((b * Hkv + h) * cap + j) * Dk)) > 1e-4)
                    bad++;
            }
    CHECK(bad == 0, "the cache holds K, V per head (%lld wrong)", (long long)bad);
    free(block); free(x); free(full); free(part); free(kc); free(vc); free(xs); free(os);
}

static void test_cache_status(void)
{
    const int64_t E = 16, H = 4, Hkv = 2, Dk = 4, cap = 4;
    mha_config c = cfg_make(MHA_FLOAT32, E, H, Hkv);
    int64_t off[MHA_NPARAM], size[MHA_NPARAM], total;
    uint64_t s = 1;
    mha_param_layout(&c, off, size, &total);
    void *block = malloc((size_t)total * 4);
    mha_params_init(&c, block, 1);
    mha_params p;
    mha_params_from_block(&c, block, &p);
    void *x = rand_array(MHA_FLOAT32, 3 * E, &s), *o = malloc((size_t)(3 * E) * 4);
    float kc[Hkv * Dk * cap], vc[Hkv * cap * Dk];
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.B = 1; a.Sq = 3; a.Sk = 3; a.query = x; a.key = x; a.value = x; a.out = o;
    a.cache_k = kc; a.cache_v = vc; a.cache_cap = cap; a.cache_len = 1;
    CHECK(mha_forward(&c, &p, &a) == MHA_OK, "3 keys after 1 fit in 4");
    a.cache_len = 2;
    CHECK(mha_forward(&c, &p, &a) == MHA_ERR_ARG, "3 keys after 2 do not fit in 4");
    a.cache_len = -1;
    CHECK(mha_forward(&c, &p, &a) == MHA_ERR_ARG, "negative length");
    a.cache_len = INT64_MAX;
    CHECK(mha_forward(&c, &p, &a) != MHA_OK, "length overflow");
    a.cache_len = 0;
    a.cache_v = NULL;
    CHECK(mha_forward(&c, &p, &a) == MHA_ERR_ARG, "one buffer only");
    a.cache_v = vc;
    a.cache_cap = 0;
    CHECK(mha_forward(&c, &p, &a) == MHA_ERR_ARG, "capacity 0");
    a.cache_cap = cap;
    CHECK(mha_forward_ref(&c, &p, &a) == MHA_ERR_ARG, "the reference refuses a cache");
    {
        mha_saved sv = {o, o, o, o, NULL};
        CHECK(mha_forward_save(&c, &p, &a, &sv, NULL) == MHA_ERR_ARG, "save refuses a cache");
        mha_backward_args ba;
        memset(&ba, 0, sizeof ba);
        ba.fwd = a;
        ba.grad_out = x;
        CHECK(mha_backward(&c, &p, &ba) == MHA_ERR_ARG, "the backward refuses a cache");
    }
    c.add_zero_attn = 1;
    mha_param_layout(&c, off, size, &total);
    CHECK(mha_forward(&c, &p, &a) == MHA_ERR_ARG, "extra keys refuse a cache");
    /* Sq = 0 only fills the cache */
    c.add_zero_attn = 0;
    a.Sq = 0;
    a.cache_len = 0;
    memset(vc, 0, sizeof vc);
    CHECK(mha_forward(&c, &p, &a) == MHA_OK && vc[0] != 0.0f, "Sq = 0 fills the cache");
    free(block); free(x); free(o);
}

int main(void)
{
    const char *isas[4] = {"portable", "avx2", "avx512", "amx"};
    int i;
    test_layout();
    test_cache_status();
    for (i = 0; i < 4; i++) {
        if (!mha_isa_available(isas[i])) continue;
        mha_set_isa(isas[i]);
        test_gqa_vs_ref(MHA_FLOAT32, 32, 8, 2, 1);
        test_gqa_vs_ref(MHA_FLOAT64, 32, 8, 1, 0);
        test_gqa_vs_ref(MHA_FLOAT64, 24, 6, 3, 1);
        test_cache_exact(MHA_FLOAT32, 32, 4, 2, 1);
        test_cache_exact(MHA_FLOAT32, 32, 4, 4, 3);
        test_cache_exact(MHA_FLOAT64, 48, 6, 2, 7);
        test_cache_exact(MHA_FLOAT64, 48, 6, 6, 19);
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
