/* gemm.c: matrix multiply for the projections and the attention tiles.
 * The kernels are in gemm_impl.h, instantiated here for float and double. */
#include "internal.h"

#define T float
#define SUF(name) name##_f32
#define LANES 8
#include "gemm_impl.h"
#undef T
#undef SUF
#undef LANES

#define T double
#define SUF(name) name##_f64
#define LANES 4
#include "gemm_impl.h"
#undef T
#undef SUF
#undef LANES
