/* params.c: the parameter block: its layout (and so the configuration
 * check), its initialisation and the pointers into it.  Legend as in
 * mha.h. */
#include <math.h>
#include <stdint.h>

#include "internal.h"

mha_status mha_param_layout(const mha_config *cfg, int64_t offset[MHA_NPARAM],
                            int64_t size[MHA_NPARAM], int64_t *total)
{
    int64_t E, Ekv, in[4], out[4], pos = 0;
    int i;
    if (!cfg || !offset || !size || !total) return MHA_ERR_ARG;
    if (cfg->d_model <= 0 || cfg->n_heads <= 0 || cfg->kdim <= 0 || cfg->vdim <= 0 ||
        cfg->d_model % cfg->n_heads != 0 || mha_dtype_size(cfg->dtype) == 0 ||
        cfg->n_kv_heads < 0 || cfg->n_kv_heads > cfg->n_heads ||
        (cfg->n_kv_heads > 0 && cfg->n_heads % cfg->n_kv_heads != 0))
        return MHA_ERR_ARG;
    E = cfg->d_model;
    Ekv = mha_kv_heads(cfg) * (E / cfg->n_heads); /* <= E */
    in[0] = E; in[1] = cfg->kdim; in[2] = cfg->vdim; in[3] = E;
    out[0] = E; out[1] = Ekv; out[2] = Ekv; out[3] = E;
    for (i = 0; i < 4; i++) {
        if (mha_mul(out[i], in[i], &size[2 * i])) return MHA_ERR_OVERFLOW;
        size[2 * i + 1] = cfg->bias ? out[i] : 0;
    }
    size[MHA_BIAS_K] = size[MHA_BIAS_V] = cfg->add_bias_kv ? Ekv : 0;
    for (i = 0; i < MHA_NPARAM; i++) {
        offset[i] = pos;
        if (mha_add(pos, size[i], &pos)) return MHA_ERR_OVERFLOW;
    }
    /* the whole block must also be addressable in bytes */
    size_t bytes;
    if (mha_bytes(pos, mha_dtype_size(cfg->dtype), &bytes)) return MHA_ERR_OVERFLOW;
    *total = pos;
    return MHA_OK;
}

int64_t mha_kv_heads(const mha_config *cfg)
{
    return !cfg ? 0 : cfg->n_kv_heads > 0 ? cfg->n_kv_heads : cfg->n_heads;
}

int64_t mha_extra_keys(const mha_config *cfg)
{
    return cfg ? (int64_t)(cfg->add_bias_kv != 0) + (int64_t)(cfg->add_zero_attn != 0) : 0;
}

mha_status mha_config_check(const mha_config *cfg)
{
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM], total;
    return mha_param_layout(cfg, offset, size, &total);
}

mha_status mha_params_init(const mha_config *cfg, void *block, uint64_t seed)
{
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM], total, i, n;
    int t;
    mha_status st = mha_param_layout(cfg, offset, size, &total);
    if (st != MHA_OK) return st;
    if (!block) return MHA_ERR_ARG;
    uint64_t key = mha_stream_key(seed, MHA_INIT_COUNTER);
    for (t = 0; t < MHA_BIAS_K; t++) {
        /* fan_in: the in_features of the Linear this tensor belongs to */
        int64_t fan_in = t < MHA_WK ? cfg->d_model
                       : t < MHA_WV ? cfg->kdim
                       : t < MHA_WO ? cfg->vdim : cfg->d_model;
        double bound = 1.0 / sqrt((double)fan_in);
        n = size[t];
        for (i = 0; i < n; i++) {
            uint64_t idx = (uint64_t)(offset[t] + i);
            double v = (2.0 * mha_stream_uniform(key, idx) - 1.0) * bound;
            if (cfg->dtype == MHA_FLOAT32) ((float *)block)[offset[t] + i] = (float)v;
            else ((double *)block)[offset[t] + i] = v;
        }
    }
    /* bias_k, bias_v (torch: xavier_normal_ of a (1, 1, E) tensor, std
     * 1/sqrt(E)): Box-Muller over the stream's next draws */
    for (t = MHA_BIAS_K; t <= MHA_BIAS_V; t++)
        for (i = 0; i < size[t]; i++) {
            uint64_t idx = 2 * (uint64_t)(offset[t] + i);
            double u1 = 1.0 - mha_stream_uniform(key, idx); /* (0, 1] */
            double u2 = mha_stream_uniform(key, idx + 1);
            double v = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) /
                       sqrt((double)cfg->d_model);
            if (cfg->dtype == MHA_FLOAT32) ((float *)block)[offset[t] + i] = (float)v;
            else ((double *)block)[offset[t] + i] = v;
        }
    return MHA_OK;
}

mha_status mha_params_from_block(const mha_config *cfg, const void *block, mha_params *p)
{
    int64_t offset[MHA_NPARAM], size[MHA_NPARAM], total;
    const void *t[MHA_NPARAM];
    int i;
    mha_status st = mha_param_layout(cfg, offset, size, &total);
    if (st != MHA_OK) return st;
    if (!block || !p) return MHA_ERR_ARG;
    size_t es = mha_dtype_size(cfg->dtype);
    for (i = 0; i < MHA_NPARAM; i++)
        t[i] = size[i] ? (const char *)block + (size_t)offset[i] * es : NULL;
    mha_params_from_tensors(t, p);
    return MHA_OK;
}

void mha_params_from_tensors(const void *const t[MHA_NPARAM], mha_params *p)
{
    p->wq = t[MHA_WQ]; p->bq = t[MHA_BQ];
    p->wk = t[MHA_WK]; p->bk = t[MHA_BK];
    p->wv = t[MHA_WV]; p->bv = t[MHA_BV];
    p->wo = t[MHA_WO]; p->bo = t[MHA_BO];
    p->bias_k = t[MHA_BIAS_K]; p->bias_v = t[MHA_BIAS_V];
}
