/* mha.c: the public entry points: status strings, the argument checks
 * every entry point shares, and the dispatch of each call to its dtype's
 * instance (mha_forward_f32, mha_backward_f64, ... in forward.c,
 * backward.c and ref.c).  Legend as in mha.h. */
#include <stdint.h>
#include <string.h>

#include "internal.h"

const char *mha_status_str(mha_status status)
{
    switch (status) {
    case MHA_OK: return "ok";
    case MHA_ERR_ARG: return "invalid argument";
    case MHA_ERR_OVERFLOW: return "size overflow";
    case MHA_ERR_NOMEM: return "out of memory";
    case MHA_ERR_INTERRUPTED: return "interrupted";
    }
    return "unknown status";
}

size_t mha_dtype_size(mha_dtype dtype)
{
    switch (dtype) {
    case MHA_FLOAT32: return sizeof(float);
    case MHA_FLOAT64: return sizeof(double);
    }
    return 0;
}

/* mask strides over dims (B, H, Sq, Sk): every offset must fit in int64_t */
static mha_status check_masks(const mha_mask *masks, int n_masks, const int64_t dim[4])
{
    int m, d;
    int64_t span;
    if (n_masks < 0 || n_masks > MHA_MAX_MASKS || (n_masks > 0 && !masks)) return MHA_ERR_ARG;
    for (m = 0; m < n_masks; m++) {
        const mha_mask *mk = &masks[m];
        if (!mk->data || (mk->kind != MHA_MASK_BLOCK && mk->kind != MHA_MASK_ADD))
            return MHA_ERR_ARG;
        span = 0;
        for (d = 0; d < 4; d++) {
            int64_t s = mk->stride[d], reach;
            if (s == INT64_MIN) return MHA_ERR_OVERFLOW;
            if (dim[d] == 0) continue;
            if (mha_mul(s < 0 ? -s : s, dim[d] - 1, &reach) || mha_add(span, reach, &span))
                return MHA_ERR_OVERFLOW;
        }
    }
    return MHA_OK;
}

/* a block layout (mha_block_layout) against a call of (B, H, Sq, Sk):
 * positive block sizes, nqb and nkb exactly the blocks covering Sq and Sk,
 * strides >= 0 whose offsets fit in int64_t */
static mha_status check_layout(const mha_block_layout *ly, int64_t B, int64_t H, int64_t Sq,
                               int64_t Sk)
{
    int64_t span, reach;
    if (!ly->keep) return MHA_OK;
    if (ly->q_block <= 0 || ly->k_block <= 0 || ly->stride[0] < 0 || ly->stride[1] < 0)
        return MHA_ERR_ARG;
    if (ly->nqb != Sq / ly->q_block + (Sq % ly->q_block != 0) ||
        ly->nkb != Sk / ly->k_block + (Sk % ly->k_block != 0))
        return MHA_ERR_ARG;
    if (mha_mul(ly->nqb, ly->nkb, &span)) return MHA_ERR_OVERFLOW;
    if (B > 0 && (mha_mul(ly->stride[0], B - 1, &reach) || mha_add(span, reach, &span)))
        return MHA_ERR_OVERFLOW;
    if (H > 0 && (mha_mul(ly->stride[1], H - 1, &reach) || mha_add(span, reach, &span)))
        return MHA_ERR_OVERFLOW;
    return MHA_OK;
}

static mha_status check_sizes(const mha_config *cfg, int64_t B, int64_t Sq, int64_t Sk,
                              mha_sizes *sz)
{
    int64_t t, Skx, E = cfg->d_model;
    size_t bytes, es = mha_dtype_size(cfg->dtype);
    mha_status st = mha_config_check(cfg);
    if (st != MHA_OK) return st;
    if (B < 0 || Sq < 0 || Sk < 0) return MHA_ERR_ARG;
    sz->extra = mha_extra_keys(cfg);
    if (mha_add(Sk, sz->extra, &Skx)) return MHA_ERR_OVERFLOW; /* with the extra keys */
    if (mha_mul(B, Sq, &t) || mha_mul(t, E, &sz->n_query)) return MHA_ERR_OVERFLOW;
    sz->n_out = sz->n_query;
    if (mha_mul(B, Sk, &t) || mha_mul(t, cfg->kdim, &sz->n_key)) return MHA_ERR_OVERFLOW;
    if (mha_mul(B, Sk, &t) || mha_mul(t, cfg->vdim, &sz->n_value)) return MHA_ERR_OVERFLOW;
    if (mha_mul(B, cfg->n_heads, &t) || mha_mul(t, Sq, &t) || mha_mul(t, Skx, &sz->n_weights))
        return MHA_ERR_OVERFLOW;
    /* workspaces: Q and the context (B, Sq, E); K, V and K per head
     * transposed (B, Sk', E) */
    if (mha_mul(B, Skx, &t) || mha_mul(t, E, &t) || mha_mul(t, 3, &t) ||
        mha_add(t, sz->n_out, &t) || mha_add(t, sz->n_out, &t))
        return MHA_ERR_OVERFLOW;
    if (mha_bytes(sz->n_query, es, &bytes) || mha_bytes(sz->n_key, es, &bytes) ||
        mha_bytes(sz->n_value, es, &bytes) || mha_bytes(sz->n_weights, es, &bytes) ||
        mha_bytes(t, es, &bytes))
        return MHA_ERR_OVERFLOW;
    return MHA_OK;
}

mha_status mha_check_sizes(const mha_config *cfg, int64_t B, int64_t Sq, int64_t Sk)
{
    mha_sizes sz;
    if (!cfg) return MHA_ERR_ARG;
    return check_sizes(cfg, B, Sq, Sk, &sz);
}

mha_status mha_check_forward(const mha_config *cfg, const mha_params *p,
                             const mha_forward_args *a, mha_sizes *sz)
{
    mha_status st;
    int64_t H;
    if (!cfg || !p || !a || !sz) return MHA_ERR_ARG;
    st = check_sizes(cfg, a->B, a->Sq, a->Sk, sz);
    if (st != MHA_OK) return st;
    H = cfg->n_heads;
    if (a->n_masks < 0 || a->n_masks > MHA_MAX_MASKS || (a->n_masks > 0 && !a->masks))
        return MHA_ERR_ARG;
    if (!(a->dropout >= 0.0 && a->dropout <= 1.0)) return MHA_ERR_ARG; /* NaN too */
    if (a->is_causal < 0 || a->is_causal > MHA_CAUSAL_LOWER_RIGHT) return MHA_ERR_ARG;
    if (!p->wq || !p->wk || !p->wv || !p->wo) return MHA_ERR_ARG;
    if (cfg->bias && (!p->bq || !p->bk || !p->bv || !p->bo)) return MHA_ERR_ARG;
    if (cfg->add_bias_kv && (!p->bias_k || !p->bias_v)) return MHA_ERR_ARG;
    if (sz->n_query > 0 && (!a->query || !a->out)) return MHA_ERR_ARG;
    if (sz->n_key > 0 && !a->key) return MHA_ERR_ARG;
    if (sz->n_value > 0 && !a->value) return MHA_ERR_ARG;

    /* the cache: both buffers, no extra keys, room for the Sk new keys,
     * and its (B, Hkv, Dk, cap) addressable */
    if (a->cache_k || a->cache_v) {
        int64_t t, end;
        size_t bytes;
        if (!a->cache_k || !a->cache_v || sz->extra != 0 || a->cache_len < 0 ||
            a->cache_cap <= 0)
            return MHA_ERR_ARG;
        if (mha_add(a->cache_len, a->Sk, &end)) return MHA_ERR_OVERFLOW;
        if (end > a->cache_cap) return MHA_ERR_ARG;
        if (mha_mul(a->B, mha_kv_heads(cfg), &t) || mha_mul(t, a->cache_cap, &t) ||
            mha_mul(t, cfg->d_model / H, &t) || mha_bytes(t, mha_dtype_size(cfg->dtype), &bytes))
            return MHA_ERR_OVERFLOW;
    }
    /* every mask offset b*s0 + h*s1 + i*s2 + j*s3 must fit in int64_t */
    {
        const int64_t Skc = a->cache_k ? a->cache_len + a->Sk : a->Sk; /* every key */
        const int64_t dim[4] = {a->B, H, a->Sq, Skc};
        st = check_layout(&a->layout, a->B, H, a->Sq, Skc);
        return st != MHA_OK ? st : check_masks(a->masks, a->n_masks, dim);
    }
}

mha_status mha_check_sdpa(const mha_sdpa_args *a, int need_out, mha_sizes *sz)
{
    int64_t t, ws;
    size_t bytes, es;
    if (!a || !sz) return MHA_ERR_ARG;
    es = mha_dtype_size(a->dtype);
    if (es == 0) return MHA_ERR_ARG;
    if (a->B < 0 || a->L < 0 || a->S < 0 || a->H <= 0 || a->Hkv <= 0 || a->D <= 0 ||
        a->Dv <= 0 || a->H % a->Hkv != 0)
        return MHA_ERR_ARG;
    if (!(a->dropout >= 0.0 && a->dropout <= 1.0)) return MHA_ERR_ARG; /* NaN too */
    if (a->is_causal < 0 || a->is_causal > MHA_CAUSAL_LOWER_RIGHT) return MHA_ERR_ARG;
    sz->extra = 0;
    if (mha_mul(a->B, a->H, &t) || mha_mul(t, a->L, &t) || mha_mul(t, a->D, &sz->n_query) ||
        mha_mul(t, a->Dv, &sz->n_out) || mha_mul(t, a->S, &sz->n_weights) ||
        mha_mul(a->B, a->Hkv, &t) || mha_mul(t, a->S, &t) || mha_mul(t, a->D, &sz->n_key) ||
        mha_mul(t, a->Dv, &sz->n_value))
        return MHA_ERR_OVERFLOW;
    /* the backward's per-thread scratch: (2*48*2 + D + Dv) * S + 128 * D at most */
    if (mha_add(a->D, a->Dv, &ws) || mha_add(ws, 512, &ws) || mha_mul(ws, a->S, &ws) ||
        mha_mul(a->D, 512, &t) || mha_add(ws, t, &ws))
        return MHA_ERR_OVERFLOW;
    if (mha_bytes(sz->n_query, es, &bytes) || mha_bytes(sz->n_key, es, &bytes) ||
        mha_bytes(sz->n_value, es, &bytes) || mha_bytes(sz->n_out, es, &bytes) ||
        mha_bytes(sz->n_weights, es, &bytes) || mha_bytes(ws, es, &bytes))
        return MHA_ERR_OVERFLOW;
    if ((sz->n_query > 0 && !a->q) || (sz->n_key > 0 && !a->k) ||
        (sz->n_value > 0 && !a->v) || (need_out && sz->n_out > 0 && !a->out))
        return MHA_ERR_ARG;
    {
        const int64_t dim[4] = {a->B, a->H, a->L, a->S};
        const mha_status st = check_layout(&a->layout, a->B, a->H, a->L, a->S);
        return st != MHA_OK ? st : check_masks(a->masks, a->n_masks, dim);
    }
}

/* ---- the entry points: checks common to both dtypes, then the dtype's
 * instance ---- */

mha_status mha_forward(const mha_config *cfg, const mha_params *p, const mha_forward_args *a)
{
    return mha_forward_save(cfg, p, a, NULL, NULL);
}

mha_status mha_forward_save(const mha_config *cfg, const mha_params *p,
                            const mha_forward_args *a, const mha_saved *s,
                            const mha_copies *c)
{
    if (!cfg) return MHA_ERR_ARG;
    if (s) { /* the four projections together or not at all; P only with them */
        const int n = !!s->q + !!s->k + !!s->v + !!s->ctx;
        if ((n != 0 && n != 4) || (s->p && n == 0)) return MHA_ERR_ARG;
    }
    /* a cache is mha_forward's alone: nothing saved or copied beside it */
    if (a && (a->cache_k || a->cache_v) && (s || c)) return MHA_ERR_ARG;
    switch (cfg->dtype) {
    case MHA_FLOAT32: return mha_forward_f32(cfg, p, a, s, c);
    case MHA_FLOAT64: return mha_forward_f64(cfg, p, a, s, c);
    }
    return MHA_ERR_ARG;
}

mha_status mha_backward(const mha_config *cfg, const mha_params *p, const mha_backward_args *a)
{
    return mha_backward_saved(cfg, p, a, NULL);
}

mha_status mha_backward_saved(const mha_config *cfg, const mha_params *p,
                              const mha_backward_args *a, const mha_saved *s)
{
    if (!cfg || (a && (a->fwd.cache_k || a->fwd.cache_v || a->fwd.average_weights)))
        return MHA_ERR_ARG;
    if (s && (!s->q || !s->k || !s->v || !s->ctx)) return MHA_ERR_ARG;
    switch (cfg->dtype) {
    case MHA_FLOAT32: return mha_backward_f32(cfg, p, a, s);
    case MHA_FLOAT64: return mha_backward_f64(cfg, p, a, s);
    }
    return MHA_ERR_ARG;
}

mha_status mha_forward_ref(const mha_config *cfg, const mha_params *p, const mha_forward_args *a)
{
    if (!cfg || (a && (a->cache_k || a->cache_v))) return MHA_ERR_ARG;
    switch (cfg->dtype) {
    case MHA_FLOAT32: return mha_forward_ref_f32(cfg, p, a);
    case MHA_FLOAT64: return mha_forward_ref_f64(cfg, p, a);
    }
    return MHA_ERR_ARG;
}

mha_status mha_backward_ref(const mha_config *cfg, const mha_params *p,
                            const mha_backward_args *a)
{
    if (!cfg || (a && (a->fwd.cache_k || a->fwd.cache_v || a->fwd.average_weights)))
        return MHA_ERR_ARG;
    switch (cfg->dtype) {
    case MHA_FLOAT32: return mha_backward_ref_f32(cfg, p, a);
    case MHA_FLOAT64: return mha_backward_ref_f64(cfg, p, a);
    }
    return MHA_ERR_ARG;
}

mha_status mha_sdpa_forward(const mha_sdpa_args *a)
{
    if (!a) return MHA_ERR_ARG;
    switch (a->dtype) {
    case MHA_FLOAT32: return mha_sdpa_forward_f32(a);
    case MHA_FLOAT64: return mha_sdpa_forward_f64(a);
    }
    return MHA_ERR_ARG;
}

mha_status mha_sdpa_forward_ref(const mha_sdpa_args *a)
{
    if (!a) return MHA_ERR_ARG;
    switch (a->dtype) {
    case MHA_FLOAT32: return mha_sdpa_forward_ref_f32(a);
    case MHA_FLOAT64: return mha_sdpa_forward_ref_f64(a);
    }
    return MHA_ERR_ARG;
}

mha_status mha_sdpa_backward(const mha_sdpa_backward_args *a)
{
    if (!a) return MHA_ERR_ARG;
    switch (a->fwd.dtype) {
    case MHA_FLOAT32: return mha_sdpa_backward_f32(a);
    case MHA_FLOAT64: return mha_sdpa_backward_f64(a);
    }
    return MHA_ERR_ARG;
}

mha_status mha_sdpa_backward_ref(const mha_sdpa_backward_args *a)
{
    if (!a) return MHA_ERR_ARG;
    switch (a->fwd.dtype) {
    case MHA_FLOAT32: return mha_sdpa_backward_ref_f32(a);
    case MHA_FLOAT64: return mha_sdpa_backward_ref_f64(a);
    }
    return MHA_ERR_ARG;
}
