/* kern_portable.c: the kernels in plain C with GCC vector types of 16 bytes
 * (SSE2 on x86-64, NEON elsewhere, scalar code where there is neither).
 * No FMA: a*b + c rounds twice.  Runs on every CPU; MHA_EXT_ISA=portable
 * forces it.  The template is kern_impl.h. */
#include <math.h>
#include <stddef.h>
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

const mha_kern_f32 mha_kern_portable_f32 = {
    .name = "portable", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 4, .nr_narrow = 4,
    .ukr = ukr_f32_portable,
    .ukr_tail = ukr_tail_f32_portable,
    .ukr_narrow = ukr_narrow_f32_portable,
    .ukr_row = ukr_row_f32_portable,
    .ukr_dot = ukr_dot_f32_portable,
    .dot_rows = 16,
    .dot = dot_f32_portable,
    .scale_max = scale_max_f32_portable,
    .max = max_f32_portable,
    .exp_sum = exp_sum_f32_portable,
    .scale = scale_f32_portable,
    .exp = exp_row_f32_portable,
    .softmax_grad = softmax_grad_f32_portable,
    .pack_bt = NULL,
    .transpose = NULL,
};
const mha_kern_f64 mha_kern_portable_f64 = {
    .name = "portable", .mr = MR, .mr_tail = MR / 2, .nr = NRV * 2, .nr_narrow = 2,
    .ukr = ukr_f64_portable,
    .ukr_tail = ukr_tail_f64_portable,
    .ukr_narrow = ukr_narrow_f64_portable,
    .ukr_row = ukr_row_f64_portable,
    .ukr_dot = ukr_dot_f64_portable,
    .dot_rows = 16,
    .dot = dot_f64_portable,
    .scale_max = scale_max_f64_portable,
    .max = max_f64_portable,
    .exp_sum = exp_sum_f64_portable,
    .scale = scale_f64_portable,
    .exp = exp_row_f64_portable,
    .softmax_grad = softmax_grad_f64_portable,
    .pack_bt = NULL,
    .transpose = NULL,
};
