/* ref.c: the plain reference passes, kept beside the fast path as its
 * oracle: the forward (ref_forward_impl.h) as mha_forward_ref_f32 and
 * mha_forward_ref_f64, the backward (ref_backward_impl.h) as
 * mha_backward_ref_f32 and mha_backward_ref_f64, and the attention on
 * projected heads (ref_sdpa_impl.h) as mha_sdpa_forward_ref_f32/_f64 and
 * mha_sdpa_backward_ref_f32/_f64 (internal.h).  They share
 * nothing with the fast path (forward.c, backward.c) but the inputs, the
 * argument checks and the dropout stream.  Legend as in mha.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define T float
#define SUF(name) name##_f32
#define EXP expf
#include "ref_forward_impl.h"
#include "ref_backward_impl.h"
#include "ref_sdpa_impl.h"
#undef T
#undef SUF
#undef EXP

#define T double
#define SUF(name) name##_f64
#define EXP exp
#include "ref_forward_impl.h"
#include "ref_backward_impl.h"
#include "ref_sdpa_impl.h"
#undef T
#undef SUF
#undef EXP

mha_status mha_forward_ref_f32(const mha_config *cfg, const mha_params *p,
                               const mha_forward_args *a)
{
    return forward_ref_f32(cfg, p, a);
}

mha_status mha_forward_ref_f64(const mha_config *cfg, const mha_params *p,
                               const mha_forward_args *a)
{
    return forward_ref_f64(cfg, p, a);
}

mha_status mha_backward_ref_f32(const mha_config *cfg, const mha_params *p,
                                const mha_backward_args *a)
{
    return backward_ref_f32(cfg, p, a);
}

mha_status mha_backward_ref_f64(const mha_config *cfg, const mha_params *p,
                                const mha_backward_args *a)
{
    return backward_ref_f64(cfg, p, a);
}

mha_status mha_sdpa_forward_ref_f32(const mha_sdpa_args *a)
{
    return sdpa_forward_ref_f32(a);
}

mha_status mha_sdpa_backward_ref_f32(const mha_sdpa_backward_args *a)
{
    return sdpa_backward_ref_f32(a);
}

mha_status mha_sdpa_forward_ref_f64(const mha_sdpa_args *a)
{
    return sdpa_forward_ref_f64(a);
}

mha_status mha_sdpa_backward_ref_f64(const mha_sdpa_backward_args *a)
{
    return sdpa_backward_ref_f64(a);
}
