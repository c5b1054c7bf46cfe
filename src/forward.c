/* forward.c: the threaded forward pass (forward_impl.h) and the attention
 * on projected heads (sdpa_forward_impl.h), both on the attention tasks of
 * attend_impl.h and their pass (attend_pass_impl.h), instantiated for
 * float and double as mha_forward_f32, mha_forward_f64,
 * mha_sdpa_forward_f32 and mha_sdpa_forward_f64 (internal.h), which
 * mha_forward, mha_forward_save and mha_sdpa_forward call.
 * Legend as in mha.h. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

#define T float
#define SUF(name) name##_f32
#define KT mha_kern_f32
#define EXP expf
#include "softmax_impl.h"
#include "transpose_impl.h"
#include "attend_impl.h"
#include "attend_pass_impl.h"
#include "forward_impl.h"
#include "sdpa_forward_impl.h"
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
#include "attend_impl.h"
#include "attend_pass_impl.h"
#include "forward_impl.h"
#include "sdpa_forward_impl.h"
#undef T
#undef SUF
#undef KT
#undef EXP

mha_status mha_forward_f32(const mha_config *cfg, const mha_params *p,
                           const mha_forward_args *a, const mha_saved *s, const mha_copies *c)
{
    return forward_f32(cfg, p, a, s, c);
}

mha_status mha_forward_f64(const mha_config *cfg, const mha_params *p,
                           const mha_forward_args *a, const mha_saved *s, const mha_copies *c)
{
    return forward_f64(cfg, p, a, s, c);
}

mha_status mha_sdpa_forward_f32(const mha_sdpa_args *a)
{
    return sdpa_forward_f32(a);
}

mha_status mha_sdpa_forward_f64(const mha_sdpa_args *a)
{
    return sdpa_forward_f64(a);
}
