/* gemm.c: matrix multiply for the projections and the attention tiles: the
 * loop nest and packing (gemm_impl.h) around the micro-kernels of the ISA
 * in use (kern_*.c, picked in isa.c), for float and double. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define T float
#define SUF(name) name##_f32
#define KT mha_kern_f32
#define UKR_T mha_ukr_f32
#include "gemm_impl.h"
#undef T
#undef SUF
#undef KT
#undef UKR_T

#define T double
#define SUF(name) name##_f64
#define KT mha_kern_f64
#define UKR_T mha_ukr_f64
#include "gemm_impl.h"
#undef T
#undef SUF
#undef KT
#undef UKR_T
