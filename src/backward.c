/* backward.c: the gradients of mha_forward (backward_impl.h) and of
 * mha_sdpa_forward (sdpa_backward_impl.h, on backward_impl.h's attention
 * task), instantiated for float and double as mha_backward_f32/_f64 and
 * mha_sdpa_backward_f32/_f64 (internal.h), which mha_backward,
 * mha_backward_saved and mha_sdpa_backward call after their checks.  Same pool, same matrix kernels, same softmax row (softmax_impl.h)
 * as the forward; the forward's intermediates are recomputed (or Q, K, V,
 * ctx and P read back from mha_forward_save's buffers), the dropout mask
 * replayed from its (seed, counter) stream.  Legend as in mha.h. */
#include <math.h>
#include <string.h>

#include "internal.h"

#define T float
#define SUF(name) name##_f32
#define KT mha_kern_f32
#define EXP expf
#include "softmax_impl.h"
#include "transpose_impl.h"
#include "backward_impl.h"
#include "sdpa_backward_impl.h"
#undef T
#undef SUF
#undef KT
#undef EXP

#define T double
#define SUF(name) name##_f64
#define KT mha_kern_f64
#define EXP exp
#include "softmax_impl.h"
#include "transpose_impl.h"
#include "backward_impl.h"
#include "sdpa_backward_impl.h"
#undef T
#undef SUF
#undef KT
#undef EXP

mha_status mha_backward_f32(const mha_config *cfg, const mha_params *p,
                            const mha_backward_args *a, const mha_saved *s)
{
    return backward_f32(cfg, p, a, s);
}

mha_status mha_backward_f64(const mha_config *cfg, const mha_params *p,
                            const mha_backward_args *a, const mha_saved *s)
{
    return backward_f64(cfg, p, a, s);
}

mha_status mha_sdpa_backward_f32(const mha_sdpa_backward_args *a)
{
    return sdpa_backward_f32(a);
}

mha_status mha_sdpa_backward_f64(const mha_sdpa_backward_args *a)
{
    return sdpa_backward_f64(a);
}
