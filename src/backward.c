/* backward.c: the gradients of mha_forward (backward_impl.h), instantiated
 * for float and double.  Same pool, same matrix kernels as the forward; the
 * forward's intermediates are recomputed (or Q, K, V, ctx and P read back
 * from mha_forward_save's buffers), the dropout mask replayed from its
 * (seed, counter) stream.  Legend as in mha.h. */
#include <math.h>
#include <string.h>

#include "internal.h"


#define T float
#define SUF(name) name##_f32
#define EXP expf
#include "backward_impl.h"
#undef T
#undef SUF
#undef EXP

#define T double
#define SUF(name) name##_f64
#define EXP exp
#include "backward_impl.h"
#undef T
#undef SUF
#undef EXP

mha_status mha_backward(const mha_config *cfg, const mha_params *p, const mha_backward_args *a)
{
    return mha_backward_saved(cfg, p, a, NULL);
}

mha_status mha_backward_saved(const mha_config *cfg, const mha_params *p,
                              const mha_backward_args *a, const mha_saved *s)
{
    if (!cfg) return MHA_ERR_ARG;
    if (s && (!s->q || !s->k || !s->v || !s->ctx)) return MHA_ERR_ARG;
    switch (cfg->dtype) {
    case MHA_FLOAT32: return backward_f32(cfg, p, a, s);
    case MHA_FLOAT64: return backward_f64(cfg, p, a, s);
    }
    return MHA_ERR_ARG;
}
