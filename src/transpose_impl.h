/* transpose_impl.h: K per head transposed, (B, Hkv, S, D) -> (B, Hkv, D, S),
 * the layout in which the attention's Q·Kᵀ reads K in place; written once
 * for T = float and T = double (included by forward.c and backward.c for
 * mha_sdpa_forward and mha_sdpa_backward).  Legend as in mha.h's SDPA
 * section. */

typedef struct {
    const T *k;
    T *kt;
    int64_t S, D;
} SUF(sdpa_tr);

/* one (b, h') of k (S, D) into kt (D, S) */
static void SUF(sdpa_transpose_task)(void *ctx, int64_t t, int slot)
{
    const SUF(sdpa_tr) *tr = (const SUF(sdpa_tr) *)ctx;
    const int64_t S = tr->S, D = tr->D;
    const T *k = tr->k + t * S * D;
    T *kt = tr->kt + t * S * D;
    int64_t s0, s, d;
    (void)slot;
    for (s0 = 0; s0 < S; s0 += 16) /* 16 keys at a time: long store runs */
        for (d = 0; d < D; d++)
            for (s = s0; s < S && s < s0 + 16; s++) kt[d * S + s] = k[s * D + d];
}

