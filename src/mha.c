/* mha.c: configuration, parameters, argument checks and the forward pass.
 * The forward pass itself is forward_impl.h, instantiated for float and
 * double below.  Legend as in mha.h. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

void *mha_alloc(size_t bytes)
{
    void *p = NULL;
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded < bytes) return NULL;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    return p;
}

void mha_free(void *p) { free(p); }

/* ---- the per-thread workspace cache ----
 * Each forward and backward needs a workspace.  glibc serves blocks of
 * 32 MiB and more straight from mmap and returns them to the system on
 * free, so every call would page-fault its workspace afresh, one fault per
 * 4 KiB (at B 4, S 1024, E 1024 the forward's 67 MiB: about 17 000 faults,
 * some 13 ms of a 300 ms call here).  So each thread keeps its largest such
 * block for its next call.  Smaller blocks are left to malloc, which already
 * reuses them (and whose reuse depends on seeing them freed).  A block has a
 * 64-byte header holding its capacity.  Without a thread key (creation
 * failed) nothing is cached. */
#define MHA_WORK_CACHE_MIN ((size_t)32 << 20)
typedef struct {
    void *raw;
    size_t cap;
} mha_work_cache;

static pthread_once_t g_work_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_work_key;
static int g_work_key_ok;

static void work_cache_destroy(void *v)
{
    mha_work_cache *c = (mha_work_cache *)v;
    if (c) {
        free(c->raw);
        free(c);
    }
}

static void work_key_init(void)
{
    g_work_key_ok = pthread_key_create(&g_work_key, work_cache_destroy) == 0;
}

static mha_work_cache *work_cache(int create)
{
    mha_work_cache *c;
    pthread_once(&g_work_once, work_key_init);
    if (!g_work_key_ok) return NULL;
    c = (mha_work_cache *)pthread_getspecific(g_work_key);
    if (!c && create) {
        c = (mha_work_cache *)calloc(1, sizeof *c);
        if (c && pthread_setspecific(g_work_key, c) != 0) {
            free(c);
            c = NULL;
        }
    }
    return c;
}

void mha_copy_stream(void *dst, const void *src, size_t bytes)
{
#if defined(__SSE2__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15, i;
    if (bytes < 4096) {
        memcpy(dst, src, bytes);
        return;
    }
    memcpy(d, s, head); /* to a 16-byte boundary of dst */
    d += head;
    s += head;
    bytes -= head;
    for (i = 0; i + 64 <= bytes; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), x0);
        _mm_stream_si128((__m128i *)(d + i + 16), x1);
        _mm_stream_si128((__m128i *)(d + i + 32), x2);
        _mm_stream_si128((__m128i *)(d + i + 48), x3);
    }
    memcpy(d + i, s + i, bytes - i);
    _mm_sfence(); /* ordered before whatever the caller does next */
#else
    memcpy(dst, src, bytes);
#endif
}

void *mha_work_alloc(size_t bytes)
{
    mha_work_cache *c;
    void *raw = NULL;
    size_t cap = (bytes + 63) / 64 * 64;
    if (cap < bytes || cap > SIZE_MAX - 64) return NULL;
    c = cap >= MHA_WORK_CACHE_MIN ? work_cache(1) : NULL;
    if (c && c->raw) {
        if (c->cap >= cap) { /* the cached block is big enough: take it */
            raw = c->raw;
            c->raw = NULL;
            return (char *)raw + 64;
        }
        free(c->raw); /* too small: never hold two */
        c->raw = NULL;
    }
    if (posix_memalign(&raw, 64, cap + 64) != 0) return NULL;
    *(size_t *)raw = cap;
    return (char *)raw + 64;
}

void mha_work_free(void *p)
{
    mha_work_cache *c;
    void *raw;
    size_t cap;
    if (!p) return;
    raw = (char *)p - 64;
    cap = *(size_t *)raw;
    c = cap >= MHA_WORK_CACHE_MIN ? work_cache(1) : NULL;
    if (!c) {
        free(raw);
        return;
    }
    if (c->raw && c->cap >= cap) {
        free(raw);
        return;
    }
    free(c->raw);
    c->raw = raw;
    c->cap = cap;
}

void mha_release_workspace(void)
{
    mha_work_cache *c = work_cache(0);
    if (c) {
        free(c->raw);
        c->raw = NULL;
        c->cap = 0;
    }
}

mha_status mha_param_layout(const mha_config *cfg, int64_t offset[MHA_NPARAM],
                            int64_t size[MHA_NPARAM], int64_t *total)
{
    int64_t E, in[4], pos = 0;
    int i;
    if (!cfg || !offset || !size || !total) return MHA_ERR_ARG;
    if (cfg->d_model <= 0 || cfg->n_heads <= 0 || cfg->kdim <= 0 || cfg->vdim <= 0 ||
        cfg->d_model % cfg->n_heads != 0 || mha_dtype_size(cfg->dtype) == 0)
        return MHA_ERR_ARG;
    E = cfg->d_model;
    in[0] = E; in[1] = cfg->kdim; in[2] = cfg->vdim; in[3] = E;
    for (i = 0; i < 4; i++) {
        if (mha_mul(E, in[i], &size[2 * i])) return MHA_ERR_OVERFLOW;
        size[2 * i + 1] = cfg->bias ? E : 0;
    }
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
    for (t = 0; t < MHA_NPARAM; t++) {
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
    p->wq = t[MHA_WQ]; p->bq = t[MHA_BQ];
    p->wk = t[MHA_WK]; p->bk = t[MHA_BK];
    p->wv = t[MHA_WV]; p->bv = t[MHA_BV];
    p->wo = t[MHA_WO]; p->bo = t[MHA_BO];
    return MHA_OK;
}

static mha_status check_sizes(const mha_config *cfg, int64_t B, int64_t Sq, int64_t Sk,
                              mha_sizes *sz)
{
    int64_t t, E = cfg->d_model;
    size_t bytes, es = mha_dtype_size(cfg->dtype);
    mha_status st = mha_config_check(cfg);
    if (st != MHA_OK) return st;
    if (B < 0 || Sq < 0 || Sk < 0) return MHA_ERR_ARG;
    if (mha_mul(B, Sq, &t) || mha_mul(t, E, &sz->n_query)) return MHA_ERR_OVERFLOW;
    sz->n_out = sz->n_query;
    if (mha_mul(B, Sk, &t) || mha_mul(t, cfg->kdim, &sz->n_key)) return MHA_ERR_OVERFLOW;
    if (mha_mul(B, Sk, &t) || mha_mul(t, cfg->vdim, &sz->n_value)) return MHA_ERR_OVERFLOW;
    if (mha_mul(B, cfg->n_heads, &t) || mha_mul(t, Sq, &t) || mha_mul(t, Sk, &sz->n_weights))
        return MHA_ERR_OVERFLOW;
    /* workspaces: Q and the context (B, Sq, E); K, V and K per head
     * transposed (B, Sk, E) */
    if (mha_mul(B, Sk, &t) || mha_mul(t, E, &t) || mha_mul(t, 3, &t) ||
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
    int64_t H, span;
    int m, d;
    if (!cfg || !p || !a || !sz) return MHA_ERR_ARG;
    st = check_sizes(cfg, a->B, a->Sq, a->Sk, sz);
    if (st != MHA_OK) return st;
    H = cfg->n_heads;
    if (a->n_masks < 0 || a->n_masks > MHA_MAX_MASKS || (a->n_masks > 0 && !a->masks))
        return MHA_ERR_ARG;
    if (!(a->dropout >= 0.0 && a->dropout <= 1.0)) return MHA_ERR_ARG; /* NaN too */
    if (!p->wq || !p->wk || !p->wv || !p->wo) return MHA_ERR_ARG;
    if (cfg->bias && (!p->bq || !p->bk || !p->bv || !p->bo)) return MHA_ERR_ARG;
    if (sz->n_query > 0 && (!a->query || !a->out)) return MHA_ERR_ARG;
    if (sz->n_key > 0 && !a->key) return MHA_ERR_ARG;
    if (sz->n_value > 0 && !a->value) return MHA_ERR_ARG;

    /* every mask offset b*s0 + h*s1 + i*s2 + j*s3 must fit in int64_t */
    for (m = 0; m < a->n_masks; m++) {
        const mha_mask *mk = &a->masks[m];
        const int64_t dim[4] = {a->B, H, a->Sq, a->Sk};
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

/* ---- the forward pass, for float and double ---- */

#define T float
#define SUF(name) name##_f32
#define KT mha_kern_f32
#define EXP expf
#define SQRT sqrtf
#include "forward_impl.h"
#undef T
#undef SUF
#undef KT
#undef EXP
#undef SQRT

#define T double
#define SUF(name) name##_f64
#define KT mha_kern_f64
#define EXP exp
#define SQRT sqrt
#include "forward_impl.h"
#undef T
#undef SUF
#undef KT
#undef EXP
#undef SQRT

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
    switch (cfg->dtype) {
    case MHA_FLOAT32: return forward_f32(cfg, p, a, s, c);
    case MHA_FLOAT64: return forward_f64(cfg, p, a, s, c);
    }
    return MHA_ERR_ARG;
}
