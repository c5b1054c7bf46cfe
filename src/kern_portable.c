/* kern_portable.c: the kernels in plain C with GCC vector types of 16 bytes
 * (SSE2 on x86-64, NEON elsewhere, scalar code where there is neither).
 * No FMA: a*b + c rounds twice.  Runs on every CPU; MHA_EXT_ISA=portable
 * forces it.  The template is kern_impl.h. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define KATTR
#define V_FMA(a, b, c) ((a) * (b) + (c))
#define MR 4
#define NRV 2
#define DOT_C 2

#define T float
#define KDOUBLE 0
#define VL 4
typedef float vf32x4 __attribute__((vector_size(16)));
typedef int32_t vi32x4 __attribute__((vector_size(16)));
#define VT vf32x4
#define V_SET1(x) ((vf32x4){x, x, x, x})

#define VI vi32x4
#define SUF(name) name##_f32_portable
#include "kern_impl.h"

#define T double
#define KDOUBLE 1
#define VL 2
typedef double vf64x2 __attribute__((vector_size(16)));
typedef int64_t vi64x2 __attribute__((vector_size(16)));
#define VT vf64x2
#define V_SET1(x) ((vf64x2){x, x})

#define VI vi64x2
#define SUF(name) name##_f64_portable
#include "kern_impl.h"

const mha_kern_f32 mha_kern_portable_f32 = MHA_KERN_FILL("portable", MR, NRV * 4, f32_portable, 0);
const mha_kern_f64 mha_kern_portable_f64 = MHA_KERN_FILL("portable", MR, NRV * 2, f64_portable, 0);
