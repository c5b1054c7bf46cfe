/* mha_ref.c: the plain reference forward pass (ref_impl.h), for float and
 * double.  Kept beside the fast path as its oracle. */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

#define T float
#define SUF(name) name##_f32
#define EXP expf
#include "ref_impl.h"
#undef T
#undef SUF
#undef EXP

#define T double
#define SUF(name) name##_f64
#define EXP exp
#include "ref_impl.h"
#undef T
#undef SUF
#undef EXP

mha_status mha_forward_ref(const mha_config *cfg, const mha_params *p, const mha_forward_args *a)
{
    if (!cfg) return MHA_ERR_ARG;
    switch (cfg->dtype) {
    case MHA_FLOAT32: return forward_ref_f32(cfg, p, a);
    case MHA_FLOAT64: return forward_ref_f64(cfg, p, a);
    }
    return MHA_ERR_ARG;
}
