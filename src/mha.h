/* mha.h: the public C interface of the multi-head attention core.
 *
 * The core knows nothing of Python or NumPy: plain pointers, sizes and
 * strides, status codes.  It never exits or aborts; every failure is a
 * status returned to the caller.
 *
 * Legend (used in every file of src/):
 *   B   batch              Sq  query length      Sk  key length
 *   E   d_model            H   heads             Dk  head width = E / H
 *   Ek  kdim (key width)   Ev  vdim (value width)
 *
 * Arrays are row-major.  Inputs and outputs are contiguous; masks carry
 * element strides so that broadcasting costs nothing (stride 0).
 * Scalars are float (MHA_FLOAT32) or double (MHA_FLOAT64) throughout one call,
 * as chosen by mha_config.dtype.
 */
#ifndef MHA_H
#define MHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    MHA_OK = 0,
    MHA_ERR_ARG = 1,      /* an argument is NULL, negative or inconsistent */
    MHA_ERR_OVERFLOW = 2, /* a size or offset does not fit in int64_t/size_t */
    MHA_ERR_NOMEM = 3,    /* an allocation failed */
    MHA_ERR_INTERRUPTED = 4 /* the call's poll function asked it to stop;
                               its outputs are unspecified */
} mha_status;

/* A short English description of a status ("ok", "size overflow", ...). */
const char *mha_status_str(mha_status status);

typedef enum { MHA_FLOAT32 = 0, MHA_FLOAT64 = 1 } mha_dtype;

/* Size in bytes of one scalar of dtype (0 for an unknown dtype). */
size_t mha_dtype_size(mha_dtype dtype);

typedef struct {
    int64_t d_model; /* E  > 0 */
    int64_t n_heads; /* H  > 0, E % H == 0 */
    int64_t kdim;    /* Ek > 0: width of the key input */
    int64_t vdim;    /* Ev > 0: width of the value input */
    int bias;        /* nonzero: the four projections have biases */
    mha_dtype dtype;
    int add_bias_kv;   /* nonzero: parameters bias_k, bias_v (E each) are
                          appended to K and V as one more key/value row per
                          batch (torch.nn.MultiheadAttention's add_bias_kv) */
    int add_zero_attn; /* nonzero: then a zero key/value row is appended
                          (torch's add_zero_attn) */
    int64_t n_kv_heads; /* Hkv: 0 (= H) or a divisor of H: grouped-query
                           attention, W_k and W_v project to Hkv*Dk features
                           and query head h reads key/value head h / (H / Hkv)
                           (Hkv = 1: multi-query attention) */
} mha_config;

/* The extra keys of a configuration: add_bias_kv's row, then
 * add_zero_attn's (0, 1 or 2).  A call of Sk keys attends over
 * Sk + mha_extra_keys(cfg) keys: the extra ones come after the given keys,
 * no mask and no causality ever blocks them, and the weights are
 * (B, H, Sq, Sk + extra) (as torch returns them). */
int64_t mha_extra_keys(const mha_config *cfg);

/* MHA_OK when every field is in range and the parameter count fits. */
mha_status mha_config_check(const mha_config *cfg);

/* The parameters live in one contiguous block of scalars, in this order,
 * each in torch.nn.Linear's (out_features, in_features) layout
 * (Ekv = Hkv*Dk, which is E unless cfg->n_kv_heads says otherwise):
 *   W_q.weight (E, E)     W_q.bias (E)
 *   W_k.weight (Ekv, Ek)  W_k.bias (Ekv)
 *   W_v.weight (Ekv, Ev)  W_v.bias (Ekv)
 *   W_o.weight (E, E)     W_o.bias (E)
 *   bias_k (Ekv)          bias_v (Ekv)
 * Bias entries have size 0 when cfg->bias == 0; bias_k and bias_v have
 * size 0 unless cfg->add_bias_kv. */
enum {
    MHA_WQ = 0, MHA_BQ, MHA_WK, MHA_BK, MHA_WV, MHA_BV, MHA_WO, MHA_BO,
    MHA_BIAS_K, MHA_BIAS_V,
    MHA_NPARAM
};

/* offset[i] and size[i] (in scalars) of tensor i inside the block, and the
 * block's total length in *total.  Overflow-checked. */
mha_status mha_param_layout(const mha_config *cfg, int64_t offset[MHA_NPARAM],
                            int64_t size[MHA_NPARAM], int64_t *total);

/* Fill a parameter block with U(-1/sqrt(fan_in), 1/sqrt(fan_in)) draws
 * (torch.nn.Linear's default distribution), deterministically from seed;
 * bias_k and bias_v with xavier_normal_'s N(0, 1/E) as torch does
 * (the same numbers for the other tensors whether they exist or not). */
mha_status mha_params_init(const mha_config *cfg, void *block, uint64_t seed);

/* Pointers to the parameters (usually into one block from mha_param_layout).
 * Biases are NULL when cfg->bias == 0. */
typedef struct {
    const void *wq, *bq; /* (E, E), (E) */
    const void *wk, *bk; /* (Ekv, Ek), (Ekv) */
    const void *wv, *bv; /* (Ekv, Ev), (Ekv) */
    const void *wo, *bo; /* (E, E), (E) */
    const void *bias_k, *bias_v; /* (Ekv), (Ekv); NULL unless cfg->add_bias_kv */
} mha_params;

/* Point p at the tensors of a block laid out by mha_param_layout. */
mha_status mha_params_from_block(const mha_config *cfg, const void *block,
                                 mha_params *p);

/* Point p at MHA_NPARAM separate tensors t[i], in the block's order
 * (MHA_WQ, MHA_BQ, ...; NULL where the layout has none). */
void mha_params_from_tensors(const void *const t[MHA_NPARAM], mha_params *p);

typedef enum {
    MHA_MASK_BLOCK = 0, /* uint8_t; nonzero = blocked (score -> -inf) */
    MHA_MASK_ADD = 1    /* scalars of cfg->dtype, added to the scaled scores */
} mha_mask_kind;

/* A mask over (B, H, Sq, Sk): element (b, h, i, j) is
 * data[b*stride[0] + h*stride[1] + i*stride[2] + j*stride[3]].
 * Strides are in elements and may be 0 (broadcast) or negative. */
typedef struct {
    mha_mask_kind kind;
    const void *data;
    int64_t stride[4];
} mha_mask;

#define MHA_MAX_MASKS 8

/* A block-sparse layout over the Sk given keys (never the extra ones):
 * queries in blocks of q_block, keys in blocks of k_block (the last block of
 * each may be partial).  keep == NULL: no layout.  Else block (qb, kb) of
 * head (b, h) is kept (computed) iff
 *   keep[b*stride[0] + h*stride[1] + qb*nkb + kb] != 0
 * (strides in elements, >= 0; 0 broadcasts), with nqb = ceil(Sq / q_block)
 * and nkb = ceil(Sk / k_block) exactly.  Polarity: nonzero = KEPT, unlike
 * MHA_MASK_BLOCK's nonzero = blocked.  Key j of query i is blocked unless
 * block (i / q_block, j / k_block) is kept (combined with masks, causality
 * and the window); the fast paths skip the key ranges whose blocks are all
 * empty for a whole task of queries. */
typedef struct {
    const uint8_t *keep;
    int64_t nqb, nkb;        /* query blocks, key blocks */
    int64_t q_block, k_block; /* > 0 */
    int64_t stride[2];
} mha_block_layout;

/* A caller's "should this call stop?" question (for example: did the user
 * press Ctrl-C).  mha_forward, mha_forward_save, mha_backward,
 * mha_backward_saved (through fwd.poll), mha_sdpa_forward and
 * mha_sdpa_backward call it on the thread that made the
 * call, between tasks, at most about every MHA_POLL_MS milliseconds and
 * never during the first MHA_POLL_MS (short calls never see it); nonzero
 * stops the call: no thread starts another task, everything the call
 * allocated is freed, and it returns MHA_ERR_INTERRUPTED (the pool serves
 * the next call as usual).  A poll that answers 0 changes no result.  The
 * reference paths (mha_forward_ref, mha_backward_ref, mha_sdpa_*_ref) do
 * not call it. */
typedef int (*mha_poll_fn)(void *ctx);
#define MHA_POLL_MS 50

/* mha_forward_args.is_causal (and mha_sdpa_args.is_causal): 0, no causal
 * mask, or one of these alignments of query i (of Sq) against key j (of Sk):
 *   MHA_CAUSAL_TOP_LEFT      key j > i is blocked
 *   MHA_CAUSAL_LOWER_RIGHT   key j > i + (Sk - Sq) is blocked: the last
 *                            query sees every key (torch's
 *                            causal_lower_right, the decoding alignment);
 *                            with Sq > Sk the first Sq - Sk rows see none */
enum { MHA_CAUSAL_TOP_LEFT = 1, MHA_CAUSAL_LOWER_RIGHT = 2 };

typedef struct {
    int64_t B, Sq, Sk;    /* B >= 0, Sq >= 0, Sk >= 0 */
    const void *query;    /* (B, Sq, E)  contiguous */
    const void *key;      /* (B, Sk, Ek) contiguous */
    const void *value;    /* (B, Sk, Ev) contiguous */
    const mha_mask *masks;  /* n_masks masks, all applied together */
    int n_masks;            /* 0 .. MHA_MAX_MASKS */
    int is_causal;        /* 0, MHA_CAUSAL_TOP_LEFT or MHA_CAUSAL_LOWER_RIGHT
                             (over the Sk given keys; never the extra ones) */
    int zero_masked_rows; /* a row with every key blocked:
                             0 -> its weights and output row are NaN,
                             1 -> zero weights, context 0 (output = bias).
                             Sk == 0 is no such row: its context is an
                             empty sum, 0, either way (as in torch) */
    double dropout;       /* p in [0, 1]; 0 disables dropout */
    uint64_t seed;        /* dropout stream: element (b, h, i, j) of call */
    uint64_t counter;     /*   (seed, counter) is kept iff u >= p */
    void *out;            /* (B, Sq, E) written */
    void *weights;        /* (B, H, Sq, Sk + extra) written, after dropout; or
                             NULL: then no (Sq, Sk) buffer per head is
                             allocated (extra: mha_extra_keys) */
    int average_weights;  /* nonzero: weights is (B, Sq, Sk + extra), the mean
                             over the heads, summed head by head in order
                             (head 0, + head 1, ...) then divided by H: the
                             bits of averaging the per-head weights that way.
                             mha_forward adds each head's weights into the
                             mean as it goes (no per-head array) when the
                             call has four (batch, block of queries) tasks
                             a thread, else forms them in its workspace
                             first.  Not in a backward's fwd (the backwards
                             refuse it) */
    mha_poll_fn poll;     /* NULL, or asked between tasks whether to stop */
    void *poll_ctx;       /*   its argument */
    int has_scale;        /* nonzero: the scores are scaled by `scale` (any */
    double scale;         /*   value, 0 too); else by 1 / sqrt(Dk) */
    int has_window;       /* nonzero: a sliding window over the Sk given keys */
    int64_t window_left, window_right; /* (never the extra keys): query i sees
                             key j iff i + c - window_left <= j <= i + c +
                             window_right, c = Sk - Sq with
                             MHA_CAUSAL_LOWER_RIGHT, else 0; a negative bound
                             is unbounded on its side.  Keys outside are
                             blocked (combined with masks and causality), and
                             the fast paths skip their blocks */
    const void *head_mask; /* NULL, or scalars of cfg->dtype over (B, H):
                             element (b, h) = head_mask[b*head_mask_stride[0] +
                             h*head_mask_stride[1]] (strides may be 0) multiplies
                             head h's weights after dropout (Hugging Face's
                             head_mask: 0 switches the head off); the weights
                             returned are the multiplied ones.  Finite values
                             (the binding checks); no gradient for it */
    int64_t head_mask_stride[2];
    /* A key/value cache (mha_forward only; the other entry points refuse
     * one, as does a configuration with extra keys): cache_k (B, Hkv, Dk,
     * cache_cap), K per head transposed, and cache_v (B, Hkv, cache_cap, Dk),
     * contiguous, their first cache_len keys already projected.  The call
     * projects its Sk keys and values into keys cache_len .. cache_len+Sk-1
     * (cache_len + Sk <= cache_cap) and attends over all cache_len + Sk of
     * them: masks, causality and the window are over (B, H, Sq, cache_len +
     * Sk) then, and the weights (B, H, Sq, cache_len + Sk) (average_weights:
     * (B, Sq, cache_len + Sk)).  The caller
     * advances its length.  Sq == 0 only fills the cache.  A row's bits are
     * those of the same row in one call over the whole sequence. */
    void *cache_k, *cache_v; /* both NULL: no cache */
    int64_t cache_cap, cache_len;
    mha_block_layout layout; /* keep == NULL: none (see mha_block_layout) */
} mha_forward_args;

/* Hkv: cfg->n_kv_heads, or n_heads when that is 0. */
int64_t mha_kv_heads(const mha_config *cfg);

/* The size checks of a call of shape (B, Sq, Sk), with nothing computed or
 * allocated: MHA_OK, MHA_ERR_ARG or MHA_ERR_OVERFLOW, as mha_forward would
 * return them.  Lets a caller refuse a shape before allocating its output. */
mha_status mha_check_sizes(const mha_config *cfg, int64_t B, int64_t Sq, int64_t Sk);

/* The fast forward pass (threaded).  cfg->dtype selects float or double. */
mha_status mha_forward(const mha_config *cfg, const mha_params *p,
                       const mha_forward_args *a);

/* The plain reference: the same contract, obvious loops, one thread.
 * It is the oracle the tests hold mha_forward to. */
mha_status mha_forward_ref(const mha_config *cfg, const mha_params *p,
                           const mha_forward_args *a);

/* The dropout stream: the uniform draw in [0, 1) for element index idx of
 * the stream (seed, counter); idx = ((b*H + h)*Sq + i)*Sk + j, Sk counting
 * the extra keys. */
double mha_dropout_uniform(uint64_t seed, uint64_t counter, uint64_t idx);

/* Worker threads used by mha_forward and mha_backward.  The default, fixed
 * at first use: the environment variable MHA_EXT_NUM_THREADS when it holds
 * a positive integer (an invalid value is ignored), else the CPUs this
 * process may use (its affinity mask).  OMP_NUM_THREADS is not read: the
 * pool is mha_ext's own, not OpenMP's.  n < 1 is clamped to 1 (and n to
 * 256). */
void mha_set_num_threads(int n);
int mha_get_num_threads(void);

/* Each thread that calls mha_forward or mha_backward with a workspace of
 * 128 KiB or more (67 MiB at B 4, S 1024, E 1024 on two threads) keeps the
 * largest such block for its next call, rather than page-faulting fresh
 * memory every call (on Linux one of 2 MiB or more is mapped in huge
 * pages).  The block is freed when the thread exits, or now by
 * mha_release_workspace (for the calling thread). */
void mha_release_workspace(void);

/* The instruction set of mha_forward's kernels: "portable", "avx2" (AVX2 +
 * FMA), "avx512" (AVX-512F) or "amx" (AVX-512's kernels, the float matrix
 * products on Intel's AMX tiles: src/amx_impl.h).  The default is the
 * widest this CPU, kernel and build can run; the
 * environment variable MHA_EXT_ISA (read once, at first use) or
 * mha_set_isa choose another.  mha_set_isa returns MHA_ERR_ARG for an unknown
 * name or one this CPU (or build) cannot run, and changes nothing then.
 * Results agree across instruction sets to float rounding. */
mha_status mha_set_isa(const char *name);
const char *mha_get_isa(void);
/* 1 when this CPU and build can run the named instruction set, else 0. */
int mha_isa_available(const char *name);

/* What the CPU reports and the blocking drawn from it (src/cpu.c).  Cache
 * sizes in bytes (L1d and L2 per core, L3 shared; 0: unknown) from CPUID,
 * else sysconf, else defaults (cache_source says which); fma_bits: the
 * vector FMA width of the instruction set in use (512, 256; 0 portable);
 * fma512_per_cycle: 512-bit FMAs a core starts per cycle, measured (tens of
 * ms, on each call) from fma_ratio = time(256-bit) / time(512-bit) of the
 * same FMA count (about 0.5 on Zen 4: 1; about 1 with two 512-bit ports:
 * 2, above 0.9); 0 without AVX-512.  gemm_kc, gemm_nc_*: the packed GEMM's block of B, KC x NC
 * scalars in half the L2 (MHA_EXT_GEMM_NC, a multiple of 64 in [64, 512],
 * read once, overrides NC).  tn_pack_*: 1 when the transposed-A products
 * (the weight gradients) pack an Aᵀ whose rows lie a multiple of 4 KiB
 * apart, 0 when they read it in place: packed on AVX2 and portable kernels
 * (every Aᵀ); on AVX-512 whichever a probe of 10-20 ms at first use
 * measured faster (MHA_EXT_TN_PACK, 0 or 1, read then, overrides), any
 * other Aᵀ read in place.  The blocking and tn_pack change no result. */
typedef struct {
    int64_t l1d_bytes, l2_bytes, l3_bytes;
    const char *cache_source; /* "cpuid", "sysconf" or "default" */
    int fma_bits;
    int fma512_per_cycle;
    double fma_ratio;
    int64_t gemm_kc, gemm_nc_f32, gemm_nc_f64;
    int tn_pack_f32, tn_pack_f64;
} mha_cpu_info;
mha_status mha_get_cpu_info(mha_cpu_info *out);

/* ---- backward ---------------------------------------------------------
 * The gradients of one forward call (src/backward.c, backward_impl.h).
 * Nothing of the forward is stored: the backward recomputes Q, K, V, the
 * softmax and the context from the same inputs (or, with
 * mha_backward_saved below, reads Q, K, V and the context that
 * mha_forward_save kept in the caller's buffers), and replays the dropout
 * mask from the same (seed, counter) stream, so `fwd` must describe the call
 * exactly as it was made (same inputs, masks, is_causal, zero_masked_rows,
 * dropout, seed, counter) with the same parameters.
 *
 * A row with every key blocked: with zero_masked_rows its weights are 0 and
 * it contributes nothing to any gradient but W_o.bias's; without, its NaN
 * output makes the gradients NaN (as torch autograd gives on the seed
 * module).  Masks are constants to the other gradients; grad_scores, when
 * asked for, is dL/dS' for the masked scores S' = S·scale + masks (before
 * the softmax): the gradient of any additive mask, summed over the
 * dimensions it broadcasts along (0 where a key is blocked). */
typedef struct {
    mha_forward_args fwd;     /* the forward call; fwd.out, fwd.weights unused */
    const void *grad_out;     /* (B, Sq, E): dL/d out */
    const void *grad_weights; /* (B, H, Sq, Sk + extra): dL/d weights (after dropout),
                                 or NULL when the weights did not reach L */
    void *grad_query;         /* (B, Sq, E)  written, or NULL: not computed */
    void *grad_key;           /* (B, Sk, Ek) written, or NULL */
    void *grad_value;         /* (B, Sk, Ev) written, or NULL */
    void *grad_params;        /* the parameter block of mha_param_layout
                                 (every weight and bias) written, or NULL */
    void *grad_scores;        /* (B, H, Sq, Sk + extra): dL/d masked scores
                                 written, or NULL */
} mha_backward_args;

/* Every gradient asked for, overwritten (not accumulated).  Threaded on the
 * same pool and kernels as mha_forward.  cfg->dtype selects float or double.
 * Statuses as mha_forward's. */
mha_status mha_backward(const mha_config *cfg, const mha_params *p,
                        const mha_backward_args *a);

/* The plain reference backward: the same contract as mha_backward, obvious
 * loops, one thread, the forward recomputed row by row as mha_forward_ref
 * computes it (src/ref_backward_impl.h quotes each forward line beside its
 * backward).  It is the oracle the C tests hold mha_backward to. */
mha_status mha_backward_ref(const mha_config *cfg, const mha_params *p,
                            const mha_backward_args *a);

/* ---- training: the forward keeps what the backward needs ---------------
 * mha_forward_save is mha_forward that also writes, into the caller's
 * buffers (contiguous, of cfg->dtype; NULL: not kept), what the backward
 * can read instead of recomputing (mha_saved) and snapshots of its inputs
 * and parameters (mha_copies).
 *
 * mha_saved, in the layouts the attention reads (each head's block
 * contiguous):
 *   q    (B, H, Sq, Dk)  Q = query·W_qᵀ + b_q per head      \
 *   k    (B, Hkv, Dk, Sk') K = key·W_kᵀ + b_k per head,      | the four
 *                        transposed                          | together,
 *   v    (B, Hkv, Sk', Dk) V = value·W_vᵀ + b_v per head     | or none
 *   ctx  (B, Sq, E)      the heads' A·V_bh concatenated, before W_o
 *   p    (B, H, Sq, Sk') the softmax P, before dropout (only with the four)
 *   (Sk' = Sk + mha_extra_keys(cfg): K and V with their extra rows)
 * mha_copies, for a caller that must keep the forward's inputs and
 * parameters against later writes (made by the projection tasks while
 * they read those inputs anyway: no second pass):
 *   query, key, value  copies of a->query, a->key, a->value (each NULL: not
 *                      copied; the binding copies an input that is the
 *                      query once)
 *   params             a copy of the parameters, a block of mha_param_layout
 * mha_backward_saved is mha_backward that reads q, k, v, ctx (and p when
 * set) back instead of recomputing the three input projections, the context
 * (and the softmax); the dropout mask is still replayed.  `s` must come from
 * mha_forward_save of the call that a->fwd describes, with the same
 * parameters, and hold the four; s == NULL is mha_backward.  The buffers are
 * only read.  Nothing is kept inside the library between the two calls. */
typedef struct {
    void *q, *k, *v, *ctx;
    void *p;
} mha_saved;

typedef struct {
    void *query, *key, *value;
    void *params;
} mha_copies;

mha_status mha_forward_save(const mha_config *cfg, const mha_params *p,
                            const mha_forward_args *a, const mha_saved *s,
                            const mha_copies *c);
mha_status mha_backward_saved(const mha_config *cfg, const mha_params *p,
                              const mha_backward_args *a, const mha_saved *s);

/* ---- attention on projected heads (torch's scaled_dot_product_attention)
 * Legend: H query heads, Hkv key/value heads (H % Hkv == 0: query head h
 * reads key/value head h / (H / Hkv), torch's enable_gqa), L queries,
 * S keys, D the query/key head width, Dv the value head width.
 *   out_bh = dropout(softmax(masked(scale · q_bh·k_bh'ᵀ)))·v_bh'  (h' = h / (H / Hkv))
 * Masks, causal alignments, zero_masked_rows, the dropout stream (idx =
 * ((b*H + h)*L + i)*S + j) and the poll are those of mha_forward_args,
 * with Sq = L and Sk = S (no extra keys).  mha_sdpa_forward runs on the
 * threads and kernels of mha_forward (the same softmax row);
 * mha_sdpa_forward_ref is its plain oracle. */
typedef struct {
    mha_dtype dtype;
    int64_t B, H, Hkv, L, S, D, Dv; /* >= 0; H, Hkv, D, Dv > 0 */
    const void *q;          /* (B, H, L, D)    contiguous */
    const void *k;          /* (B, Hkv, S, D)  contiguous */
    const void *v;          /* (B, Hkv, S, Dv) contiguous */
    const mha_mask *masks;  /* over (B, H, L, S) */
    int n_masks;
    int is_causal;          /* 0, MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_LOWER_RIGHT */
    int has_scale;          /* nonzero: `scale`; else 1 / sqrt(D) */
    double scale;
    int zero_masked_rows;
    double dropout;
    uint64_t seed, counter;
    void *out;              /* (B, H, L, Dv) written */
    void *weights;          /* (B, H, L, S) written (after dropout), or NULL */
    mha_poll_fn poll;
    void *poll_ctx;
    int has_window;         /* a sliding window, as in mha_forward_args */
    int64_t window_left, window_right;
    mha_block_layout layout; /* keep == NULL: none; over (B, H, L, S) */
    const void *head_mask;  /* NULL, or scalars of dtype over (B, H) at
                               b*head_mask_stride[0] + h*head_mask_stride[1],
                               as in mha_forward_args: multiplies head h's
                               weights after dropout (and so its out) */
    int64_t head_mask_stride[2];
} mha_sdpa_args;

/* The gradients of one mha_sdpa_forward call `fwd` (its out, weights
 * unused), recomputed from its inputs; each output NULL when not wanted,
 * overwritten (dk, dv summed over the query heads of each group);
 * grad_scores as mha_backward_args's, dL/d (q·kᵀ·scale + masks). */
typedef struct {
    mha_sdpa_args fwd;
    const void *grad_out;     /* (B, H, L, Dv) */
    const void *grad_weights; /* (B, H, L, S), or NULL */
    void *grad_q;             /* (B, H, L, D)    written, or NULL */
    void *grad_k;             /* (B, Hkv, S, D)  written, or NULL */
    void *grad_v;             /* (B, Hkv, S, Dv) written, or NULL */
    void *grad_scores;        /* (B, H, L, S)    written, or NULL */
} mha_sdpa_backward_args;

mha_status mha_sdpa_forward(const mha_sdpa_args *a);
mha_status mha_sdpa_forward_ref(const mha_sdpa_args *a);
mha_status mha_sdpa_backward(const mha_sdpa_backward_args *a);
mha_status mha_sdpa_backward_ref(const mha_sdpa_backward_args *a);

#ifdef __cplusplus
}
#endif
#endif /* MHA_H */
