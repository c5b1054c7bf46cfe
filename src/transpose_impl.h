/* transpose_impl.h: a strided transpose, and K per head transposed with it,
 * (B, Hkv, S, D) -> (B, Hkv, D, S), the layout in which the attention's
 * Q·Kᵀ reads K in place; written once for T = float and T = double
 * (included by forward.c before attend_impl.h, whose online task transposes
 * the SDPA's blocks of keys with it when few queries read them, and
 * forward_impl.h, whose projections scatter K per head with it; and by
 * backward.c: mha_sdpa_forward and
 * mha_sdpa_backward, and the backward's attention task, which transposes
 * K and V once per task).  Legend as in mha.h's SDPA section. */

/* y (C, R) = xᵀ for x (R, C), row strides ldx and ldy: the ISA's vector
 * transpose (kernels.h), else 16 rows at a time, so that each store run
 * is 16 long */
static void SUF(transpose)(const KT *kern, const T *x, int64_t R, int64_t C, int64_t ldx, T *y,
                           int64_t ldy)
{
    int64_t r0, r, c;
    if (kern->transpose) {
        kern->transpose(R, C, x, ldx, y, ldy);
        return;
    }
    for (r0 = 0; r0 < R; r0 += 16)
        for (c = 0; c < C; c++)
            for (r = r0; r < R && r < r0 + 16; r++) y[c * ldy + r] = x[r * ldx + c];
}

typedef struct {
    const KT *kern;
    const T *k;
    T *kt;
    int64_t S, D;
    int64_t ld; /* kt's rows lie ld apart (>= S) */
} SUF(sdpa_tr);

/* one (b, h') of k (S, D) into kt (D, S), rows ld apart */
static void SUF(sdpa_transpose_task)(void *ctx, int64_t t, int slot)
{
    const SUF(sdpa_tr) *tr = (const SUF(sdpa_tr) *)ctx;
    (void)slot;
    SUF(transpose)(tr->kern, tr->k + t * tr->S * tr->D, tr->S, tr->D, tr->D,
                   tr->kt + t * tr->ld * tr->D, tr->ld);
}

