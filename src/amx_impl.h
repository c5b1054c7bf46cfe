/* amx_impl.h: the float GEMM on Intel's AMX tiles (kernels.h's amx_gemm;
 * amx_cut and amx_gemm_cut, B cut once for many products, the backward's
 * K and V, are amx_cut_impl.h's, included right after this file), included
 * by kern_avx512.c after its transposes; isa.c's "amx" uses it
 * where the CPU has AMX-BF16 and Linux lets the process use the tiles.
 *
 * The tiles multiply bfloat16 (8 significant bits) and add in float.  A
 * float x is cut into three bfloat16 pieces x = h + m + l, exactly (for
 * |x| >= 2^-110; below, see the subnormals further down): h is x
 * rounded to bfloat16 (to nearest), m is x - h rounded (x - h is exact in
 * float), l what is left (7 significant bits at most, so exact), |m| <=
 * 2^-8 |x|, |l| <= 2^-16 |x|, each of either sign (amx_split).  The
 * product of two floats is then the sum of nine piece products, each
 * exact in float; the six of the largest orders (hh; hm, mh; hl, lh, mm)
 * are summed, the three of order 2^-24 and below (ml, lm, ll) dropped:
 * under 2^-23 of the product together and, the pieces' signs varying, not
 * biased one way.  Every piece product goes into the same float
 * accumulator, in a fixed order per 32 of depth (lh, mh, mm, hm, hh, hl:
 * amx_block), chains of 128 of depth added in order (amx_run_block), so an
 * element's bits depend on K and its row and column only, never on M, the
 * tiling or the threads.  The order makes a product by a power of two
 * exact, as a float FMA's: times 1 (pieces 1, 0, 0) the sum is (m + h) + l
 * or (l + m) + h, each step exact (h + m and m + l fit in 16 bits), so a
 * one-hot row through a projection gives the weights' column bit for bit
 * (the order before, hl first, rounded l + h: 2 - 2^-9 + 2^-23 came out
 * 2 - 2^-9; tests/test_amx.py).  Against
 * a float64 truth, one 16 x 16 tile, K 512, 20 draws (/tmp harness, an
 * earlier order, hh first): mean error 4.8e-8 against 1.05e-7 for a float FMA chain (inputs
 * of both signs); 3.1e-6 against 6.8e-6 with all inputs positive, mean
 * relative bias 1.4e-9 (3.9e-8 toward zero when the pieces were cut by
 * truncation, all of x's sign).  The tiles sum each instruction's 32
 * products with more care than a chain of float FMAs would.
 *
 * The tiles treat bfloat16 subnormals as zero and flush subnormal results:
 * pieces below 2^-126 (of inputs under about 2^-110) are lost, products
 * and sums under 2^-126 become 0.  Infinities and NaNs do not survive the
 * cut (inf - inf is NaN, and inf times a zero piece is NaN), nor do floats
 * that round to infinity: a row of A or a column of B holding one is
 * computed again by one float FMA chain per
 * element (amx_fix_elem, amx_fix_row: the same bits either way), so such
 * an element is torch's kind of infinity or NaN, and the others keep
 * their tile bits; a product added to C (accumulate) holding one is left
 * whole to the float kernels (recomputing needs C as it was).
 *
 * Blocking: column blocks of AMX_NB, each over the depth in blocks of
 * AMX_KC, summed on the tiles in chains of AMX_CHAIN added to C in float
 * (amx_run_block); a block's B pieces (3 x AMX_KC x AMX_NB bfloat16, 768 KiB) stay
 * in L2; rows 32 at a time, whose A pieces (96 KiB) are cut once per depth
 * and column block; each 32 x 32 block of C is four accumulator tiles
 * (tmm0-3), A's two row tiles tmm4-5, B's two column tiles tmm6-7: per 32
 * of depth 24 tile products and 14 tile loads (a block of at most 16 rows:
 * tmm0-1 and tmm4, 12 products).  Intel Xeon (family 6, model 167), one
 * core, amx_block alone: 566 GFLOP/s (float-equivalent) with its pieces in
 * L1, 490 from L2 (the FMA probe: 240); a whole (1024, 512) product with
 * K 1024 about 300. */

#define AMX_KC 512
#define AMX_NB 256
#define AATTR __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,amx-tile,amx-bf16")))

/* the scratch's layout: B's pieces, A's pieces, A's rows (a transposed A),
 * a block of C; kernels.h's MHA_AMX_SCRATCH */
#define AMX_SCRATCH_USED \
    (3 * AMX_KC / 2 * AMX_NB * 4 + 3 * 32 * AMX_KC * 2 + 32 * AMX_KC * 4 + 32 * 32 * 4 + 64)
_Static_assert(AMX_SCRATCH_USED <= MHA_AMX_SCRATCH, "amx_impl.h: MHA_AMX_SCRATCH too small");

/* the tile configuration (palette 1: tiles 0-7 of 16 rows of 64 bytes),
 * in read-only memory: built on the stack, gcc 12 dropped the stores of
 * the rows and columns as dead before ldtilecfg (which then faulted) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;
static const amx_cfg g_amx_cfg __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* the three pieces of 16 floats, each in its lanes' upper 16 bits (the
 * lower 16 zero), and the lanes the pieces cannot carry: an infinity, a
 * NaN, or a float within half a bfloat16 step of FLT_MAX (|x| >=
 * 0x7f7f8000's 3.39e38, which rounds to infinity); amx_gemm_f32 computes
 * their rows and columns by float FMAs.  h = x rounded to bfloat16 (to
 * nearest, ties away from zero: + half a step, cut), m = x - h rounded
 * (x - h is exact in float), l = x - h - m (exact: at most 7 significant
 * bits are left), so x = h + m + l exactly, |m| <= 2^-8 |x|, |l| <= 2^-16
 * |x|, each of either sign.  (A tie leaves one bit for m and none for l.) */
AATTR static inline __mmask16 amx_split(__m512 x, __m512i *h, __m512i *m, __m512i *l)
{
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i half = _mm512_set1_epi32(0x8000);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hb = _mm512_and_si512(_mm512_add_epi32(u, half), top);
    const __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(hb));
    const __m512i mb = _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(r1), half), top);
    const __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(mb));
    *h = hb;
    *m = mb;
    *l = _mm512_and_si512(_mm512_castps_si512(r2), top);
    return _mm512_cmpge_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                   _mm512_set1_epi32(0x7f7f8000));
}

/* the smallest float amx_split cannot carry (0x7f7f8000: it rounds to
 * infinity); infinities and NaNs fail `fabsf(x) < AMX_UNCUT` too */
#define AMX_UNCUT 0x1.ff0000p+127f

static inline __mmask16 amx_first(int64_t n) /* lanes 0 .. n-1 (n clamped to 0..16) */
{
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

/* 1 when the rows x cols floats at x (rows ld apart) hold one amx_split
 * cannot carry (an infinity, a NaN, |x| >= AMX_UNCUT) */
AATTR static int amx_uncut_any(const float *x, int64_t rows, int64_t cols, int64_t ld)
{
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), lim = _mm512_set1_epi32(0x7f7f8000);
    __mmask16 bad = 0;
    int64_t r, k;
    for (r = 0; r < rows; r++)
        for (k = 0; k < cols; k += 16) {
            const __m512i u = _mm512_maskz_loadu_epi32(amx_first(cols - k), x + r * ld + k);
            bad |= _mm512_cmpge_epu32_mask(_mm512_and_si512(u, absm), lim);
        }
    return bad != 0;
}

/* One row of A's pieces: a (kc floats, contiguous) into ah, am, al (kcp
 * bfloat16 each, zero past kc); 1 when a holds a float amx_split cannot
 * carry (an infinity, a NaN, |x| >= AMX_UNCUT) */
AATTR static int amx_cut_row(const float *a, int64_t kc, int64_t kcp, uint16_t *ah, uint16_t *am,
                             uint16_t *al)
{
    /* bfloat16 j of the result: the upper half of float j of (x0, x1) */
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                         35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                         5, 3, 1);
    __mmask16 bad = 0;
    int64_t k;
    for (k = 0; k < kcp; k += 32) {
        const __m512 x0 = _mm512_maskz_loadu_ps(amx_first(kc - k), a + k);
        const __m512 x1 = _mm512_maskz_loadu_ps(amx_first(kc - k - 16), a + k + 16);
        __m512i h0, m0, l0, h1, m1, l1;
        bad |= amx_split(x0, &h0, &m0, &l0);
        bad |= amx_split(x1, &h1, &m1, &l1);
        _mm512_storeu_si512(ah + k, _mm512_permutex2var_epi16(h0, odd, h1));
        _mm512_storeu_si512(am + k, _mm512_permutex2var_epi16(m0, odd, m1));
        _mm512_storeu_si512(al + k, _mm512_permutex2var_epi16(l0, odd, l1));
    }
    return bad != 0;
}

/* A's pieces for a block of mb rows (x + r*ldx, kc floats each) into ap:
 * three pieces of 32 rows of kcp bfloat16 each (ap, ap + 32*kcp, ap +
 * 64*kcp), rows past mb zero up to 16 or 32; 1 when a row holds a float
 * amx_split cannot carry */
AATTR static int amx_cut_a(const float *x, int64_t ldx, int64_t mb, int64_t kc, int64_t kcp,
                           uint16_t *ap)
{
    int bad = 0;
    int64_t r;
    for (r = 0; r < (mb > 16 ? 32 : 16); r++) {
        uint16_t *d = ap + r * kcp;
        if (r >= mb) {
            memset(d, 0, (size_t)kcp * 2);
            memset(d + 32 * kcp, 0, (size_t)kcp * 2);
            memset(d + 64 * kcp, 0, (size_t)kcp * 2);
            continue;
        }
        bad |= amx_cut_row(x + r * ldx, kc, kcp, d, d + 32 * kcp, d + 64 * kcp);
    }
    return bad;
}

/* B's pieces for 32 columns from a depth-major float block (src (k, c) at
 * src[k*lds + c], `cols` valid columns, kc rows): bp[p][k2*32 + c] holds
 * the pair (2·k2, 2·k2 + 1) of column c as the tiles read it (bfloat16
 * for k even in the low half), zero past kc and past cols.  Returns the
 * columns (bit c) holding a float amx_split cannot carry. */
AATTR static uint32_t amx_cut_cols(const float *src, int64_t lds, int64_t kc, int64_t kcp,
                                   int64_t cols, uint32_t *bh, uint32_t *bm, uint32_t *bl)
{
    uint32_t bad = 0;
    int64_t k2, half;
    for (k2 = 0; k2 < kcp / 2; k2++)
        for (half = 0; half < 2; half++) {
            const __mmask16 c = amx_first(cols - 16 * half);
            const int64_t e = 2 * k2, o = e + 1;
            const __m512 xe = e < kc ? _mm512_maskz_loadu_ps(c, src + e * lds + 16 * half)
                                     : _mm512_setzero_ps();
            const __m512 xo = o < kc ? _mm512_maskz_loadu_ps(c, src + o * lds + 16 * half)
                                     : _mm512_setzero_ps();
            __m512i he, me, le, ho, mo, lo;
            bad |= (uint32_t)(amx_split(xe, &he, &me, &le) | amx_split(xo, &ho, &mo, &lo))
                   << (16 * half);
            _mm512_storeu_si512(bh + k2 * 32 + 16 * half,
                                _mm512_or_si512(_mm512_srli_epi32(he, 16), ho));
            _mm512_storeu_si512(bm + k2 * 32 + 16 * half,
                                _mm512_or_si512(_mm512_srli_epi32(me, 16), mo));
            _mm512_storeu_si512(bl + k2 * 32 + 16 * half,
                                _mm512_or_si512(_mm512_srli_epi32(le, 16), lo));
        }
    return bad;
}

/* amx_cut_cols for a B given as rows of columns (trans_b: op(B)(k, c) at
 * w[c*ldb + k], `cols` of them): 16 columns by 16 of depth through the
 * registers (transpose16_f32), each pair of depth rows then cut as
 * amx_cut_cols does; no depth-major copy in memory.  Returns the columns
 * (bit c) holding a float amx_split cannot carry. */
AATTR static uint32_t amx_cut_rows(const float *w, int64_t ldb, int64_t kc, int64_t kcp,
                                   int64_t cols, uint32_t *bh, uint32_t *bm, uint32_t *bl)
{
    uint32_t bad = 0;
    int64_t half, k0, i, j;
    for (half = 0; half < 2; half++)
        for (k0 = 0; k0 < kcp; k0 += 16) {
            const __mmask16 kmask = amx_first(kc - k0);
            __m512 r[16];
            for (i = 0; i < 16; i++)
                r[i] = 16 * half + i < cols
                               ? _mm512_maskz_loadu_ps(kmask, w + (16 * half + i) * ldb + k0)
                               : _mm512_setzero_ps();
            transpose16_f32(r); /* r[j]: depth k0 + j of the 16 columns */
            for (j = 0; j < 16; j += 2) {
                __m512i he, me, le, ho, mo, lo;
                const int64_t o = (k0 + j) / 2 * 32 + 16 * half;
                bad |= (uint32_t)(amx_split(r[j], &he, &me, &le) |
                                  amx_split(r[j + 1], &ho, &mo, &lo))
                       << (16 * half);
                _mm512_storeu_si512(bh + o, _mm512_or_si512(_mm512_srli_epi32(he, 16), ho));
                _mm512_storeu_si512(bm + o, _mm512_or_si512(_mm512_srli_epi32(me, 16), mo));
                _mm512_storeu_si512(bl + o, _mm512_or_si512(_mm512_srli_epi32(le, 16), lo));
            }
        }
    return bad;
}

/* C's 32 x 32 block (tiles 0-3) += the pieces' products over kcp: A's
 * pieces a[p] rows of lda_b bytes, B's b[p] (kcp/2 rows of 32 pairs).
 * Per 32 of depth the products in the order lh, mh, mm, hm, hh, hl (a
 * piece of A, then of B), 14 tile loads: from one product to the next
 * only A's two tiles (tmm4-5) or B's two (tmm6-7) change, and each tile is
 * loaded as soon as its last product has been issued, so that the load
 * runs under the products still to come */
#define AMX_DP_AFIRST /* the products, A's tmm4 read first (then tmm5) */ \
    _tile_dpbf16ps(0, 4, 6);                                          \
    _tile_dpbf16ps(1, 4, 7)
#define AMX_DP_ALAST                                                   \
    _tile_dpbf16ps(2, 5, 6);                                          \
    _tile_dpbf16ps(3, 5, 7)
#define AMX_DP_BFIRST /* B's tmm6 read first (then tmm7) */            \
    _tile_dpbf16ps(0, 4, 6);                                          \
    _tile_dpbf16ps(2, 5, 6)
#define AMX_DP_BLAST                                                   \
    _tile_dpbf16ps(1, 4, 7);                                          \
    _tile_dpbf16ps(3, 5, 7)
AATTR static void amx_block(int64_t kcp, const uint16_t *const a[3], int64_t lda_b,
                            const uint32_t *const b[3])
{
    const int64_t r16 = 16 * lda_b / 2; /* 16 rows of A, in bfloat16 */
    int64_t k;
    for (k = 0; k < kcp; k += 32) {
        const uint16_t *ah = a[0] + k, *am = a[1] + k, *al = a[2] + k;
        const uint32_t *bh = b[0] + k / 2 * 32, *bm = b[1] + k / 2 * 32, *bl = b[2] + k / 2 * 32;
        _tile_loadd(4, al, lda_b);
        _tile_loadd(6, bh, 128);
        _tile_loadd(5, al + r16, lda_b);
        _tile_loadd(7, bh + 16, 128);
        AMX_DP_AFIRST; /* lh */
        _tile_loadd(4, am, lda_b);
        AMX_DP_ALAST;
        _tile_loadd(5, am + r16, lda_b);
        AMX_DP_BFIRST; /* mh */
        _tile_loadd(6, bm, 128);
        AMX_DP_BLAST;
        _tile_loadd(7, bm + 16, 128);
        AMX_DP_AFIRST; /* mm */
        _tile_loadd(4, ah, lda_b);
        AMX_DP_ALAST;
        _tile_loadd(5, ah + r16, lda_b);
        AMX_DP_BFIRST; /* hm */
        _tile_loadd(6, bh, 128);
        AMX_DP_BLAST;
        _tile_loadd(7, bh + 16, 128);
        AMX_DP_BFIRST; /* hh */
        _tile_loadd(6, bl, 128);
        AMX_DP_BLAST;
        _tile_loadd(7, bl + 16, 128);
        AMX_DP_AFIRST; /* hl */
        AMX_DP_ALAST;
    }
}
#undef AMX_DP_AFIRST
#undef AMX_DP_ALAST
#undef AMX_DP_BFIRST
#undef AMX_DP_BLAST

/* amx_block for a block of at most 16 rows: A's one row tile (tmm4) and
 * the accumulators tmm0-1 only, the products in the same order (each
 * element the same bits as in a block of 32: a tile's row is summed alone) */
AATTR static void amx_block16(int64_t kcp, const uint16_t *const a[3], int64_t lda_b,
                              const uint32_t *const b[3])
{
    int64_t k;
    for (k = 0; k < kcp; k += 32) {
        const uint32_t *bh = b[0] + k / 2 * 32, *bm = b[1] + k / 2 * 32, *bl = b[2] + k / 2 * 32;
        _tile_loadd(4, a[2] + k, lda_b);
        _tile_loadd(6, bh, 128);
        _tile_loadd(7, bh + 16, 128);
        _tile_dpbf16ps(0, 4, 6); /* lh */
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(4, a[1] + k, lda_b);
        _tile_dpbf16ps(0, 4, 6); /* mh */
        _tile_loadd(6, bm, 128);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(7, bm + 16, 128);
        _tile_dpbf16ps(0, 4, 6); /* mm */
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(4, a[0] + k, lda_b);
        _tile_dpbf16ps(0, 4, 6); /* hm */
        _tile_loadd(6, bh, 128);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(7, bh + 16, 128);
        _tile_dpbf16ps(0, 4, 6); /* hh */
        _tile_loadd(6, bl, 128);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(7, bl + 16, 128);
        _tile_dpbf16ps(0, 4, 6); /* hl */
        _tile_dpbf16ps(1, 4, 7);
    }
}

/* The float FMA form of an element, for the rows and columns an infinity
 * or NaN keeps off the tiles: C(i, j) = Σ_k a(i, k)·b(k, j), each step one
 * rounding (fmaf), k in order from 0, then + bias(j).  Row by row
 * (amx_fix_row: 16 columns a vector) and element by element (amx_fix_elem)
 * give the same bits, so an element is the same whichever finds it. */
AATTR static float amx_fix_elem(const float *a, int64_t a_cs, const float *b, int64_t b_cs,
                                int64_t K, const float *bias)
{
    float acc = 0.0f;
    int64_t k;
    for (k = 0; k < K; k++) acc = fmaf(a[k * a_cs], b[k * b_cs], acc);
    return bias ? acc + *bias : acc;
}

AATTR static void amx_fix_row(int trans_b, int64_t N, int64_t K, const float *a, int64_t a_cs,
                              const float *B, int64_t ldb, const float *bias, float *c)
{
    int64_t j, k, k0, i;
    for (j = 0; j < N; j += 16) {
        const __mmask16 cm = amx_first(N - j);
        __m512 acc = _mm512_setzero_ps();
        if (trans_b) { /* op(B)(k, j) = B[j*ldb + k]: 16 columns by 16 of depth transposed */
            for (k0 = 0; k0 < K; k0 += 16) {
                const __mmask16 km = amx_first(K - k0);
                __m512 r[16];
                for (i = 0; i < 16; i++)
                    r[i] = j + i < N ? _mm512_maskz_loadu_ps(km, B + (j + i) * ldb + k0)
                                     : _mm512_setzero_ps();
                transpose16_f32(r);
                for (k = k0; k < K && k < k0 + 16; k++)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(a[k * a_cs]), r[k - k0], acc);
            }
        } else {
            for (k = 0; k < K; k++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(a[k * a_cs]),
                                      _mm512_maskz_loadu_ps(cm, B + k * ldb + j), acc);
        }
        if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(cm, bias + j));
        _mm512_mask_storeu_ps(c + j, cm, acc);
    }
}

/* C's 32 x 32 block at c (cols, mb valid) += the products of the chain
 * of AMX_CHAIN of depth from k0 (of kcp): each chain summed on the tiles
 * from zero, then added to C in float, the callers taking the chains in
 * order (the first of the product, first and k0 0, written); as the float kernels' UKR_KB chains: one
 * running sum over a depth of 1024 had 1.15x the float kernels' RMS error
 * at B 4, S 1024, E 1024 (benchmarks/accuracy.py: 7.2e-9 against 6.3e-9,
 * the largest 6.6e-8 against torch's 6.4e-8) */
#define AMX_CHAIN 128
AATTR static void amx_run_block(int first, int64_t mb, int64_t cols, float *c, int64_t ldc,
                                float *cb, int64_t kcp, const uint16_t *const pa[3],
                                const uint32_t *const pb[3], int64_t k0)
{
    const int two = mb > 16; /* the second row of tiles (2, 3) in use */
    const __mmask16 lo = amx_first(cols), hi = amx_first(cols - 16);
    int64_t i;
    {
        const int64_t ch = kcp - k0 < AMX_CHAIN ? kcp - k0 : AMX_CHAIN;
        const uint16_t *a[3] = {pa[0] + k0, pa[1] + k0, pa[2] + k0};
        const uint32_t *b[3] = {pb[0] + k0 / 2 * 32, pb[1] + k0 / 2 * 32, pb[2] + k0 / 2 * 32};
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
            amx_block(ch, a, kcp * 2, b);
        } else {
            amx_block16(ch, a, kcp * 2, b);
        }
        if (first && k0 == 0 && cols == 32 && (mb == 16 || mb == 32)) {
            /* C's block written whole by this chain: the tiles straight
             * into C (the same floats, no copy through cb) */
            _tile_stored(0, c, ldc * 4);
            _tile_stored(1, c + 16, ldc * 4);
            if (two) {
                _tile_stored(2, c + 16 * ldc, ldc * 4);
                _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
            }
            return;
        }
        _tile_stored(0, cb, 128);
        _tile_stored(1, cb + 16, 128);
        if (two) {
            _tile_stored(2, cb + 16 * 32, 128);
            _tile_stored(3, cb + 16 * 32 + 16, 128);
        }
        for (i = 0; i < mb; i++) {
            float *ci = c + i * ldc;
            __m512 x0 = _mm512_loadu_ps(cb + i * 32), x1 = _mm512_loadu_ps(cb + i * 32 + 16);
            if (!first || k0 > 0) {
                x0 = _mm512_add_ps(_mm512_maskz_loadu_ps(lo, ci), x0);
                x1 = _mm512_add_ps(_mm512_maskz_loadu_ps(hi, ci + 16), x1);
            }
            _mm512_mask_storeu_ps(ci, lo, x0);
            _mm512_mask_storeu_ps(ci + 16, hi, x1);
        }
    }
}

/* kernels.h's amx_gemm for float: C (M, N) = A·op(B) (+ bias), element
 * (i, k) of A at A[i*a_rs + k*a_cs] (a_cs 1, or a_rs 1: a transposed A),
 * op(B)(k, j) at B[j*ldb + k] (trans_b) or B[k*ldb + j]; C written, or
 * with accumulate added to (the first chain added to C as the later
 * ones are).  0 when done; 1 (C untouched) when the scratch is too
 * small, or with accumulate when A or B holds a float amx_split cannot
 * carry (the float kernels then take the whole product: recomputing its
 * rows and columns by FMAs needs C as it was).
 * Blocks of AMX_NB columns, each over the depth in blocks of AMX_KC: B's
 * pieces cut for the block, then for each 32 rows A's, then the 32 x 32
 * blocks of C, the chains (AMX_CHAIN of depth) one at a time, each over
 * every column group of the 32 rows: A's pieces of a chain (24 KiB) stay
 * in L1.  The columns of B and the rows of A holding a float amx_split
 * cannot carry are then computed again by float FMAs (amx_fix_elem,
 * amx_fix_row). */
AATTR static int amx_gemm_f32(int trans_b, int64_t M, int64_t N, int64_t K, const void *Av,
                              int64_t a_rs, int64_t a_cs, const void *Bv, int64_t ldb,
                              const void *biasv, void *Cv, int64_t ldc, int accumulate,
                              void *scratch, size_t scratch_bytes)
{
    const float *A = (const float *)Av, *B = (const float *)Bv, *bias = (const float *)biasv;
    float *C = (float *)Cv;
    uint8_t *s = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint32_t *bp = (uint32_t *)s;                              /* 3 x AMX_KC/2 x AMX_NB */
    uint16_t *ap = (uint16_t *)(bp + 3 * AMX_KC / 2 * AMX_NB); /* 3 x 32 x AMX_KC */
    float *at = (float *)(ap + 3 * 32 * AMX_KC);               /* 32 x AMX_KC */
    float *cb = at + 32 * AMX_KC;                              /* 32 x 32 */
    const int64_t piece = (int64_t)AMX_KC / 2 * AMX_NB;
    int64_t pc, jb, ib, g, i, q, k, j, k0;
    int bad = 0; /* a row of A holds an infinity or NaN */
    if (M <= 0 || N <= 0 || K <= 0 || scratch_bytes < (size_t)MHA_AMX_SCRATCH) return 1;
    /* C += ...: a row or column the FMAs would compute again needs C as
     * it was, so a product holding an infinity or NaN goes to the float
     * kernels whole */
    if (accumulate && (amx_uncut_any(A, a_cs == 1 ? M : K, a_cs == 1 ? K : M,
                                     a_cs == 1 ? a_rs : a_cs) ||
                       amx_uncut_any(B, trans_b ? N : K, trans_b ? K : N, ldb)))
        return 1;
    _tile_loadconfig(&g_amx_cfg);
    for (jb = 0; jb < N; jb += AMX_NB) {
        const int64_t nb = N - jb < AMX_NB ? N - jb : AMX_NB, ng = (nb + 31) / 32;
        uint32_t badc[AMX_NB / 32] = {0}; /* the block's columns of B holding one */
        for (pc = 0; pc < K; pc += AMX_KC) {
            const int64_t kc = K - pc < AMX_KC ? K - pc : AMX_KC, kcp = (kc + 31) / 32 * 32;
            const int first = pc == 0, last = pc + kc >= K;
            /* B's pieces for these nb columns: group g at bp[p] + g*kcp*16 */
            for (g = 0; g < ng; g++) {
                const int64_t c0 = jb + 32 * g, cols = N - c0 < 32 ? N - c0 : 32;
                uint32_t *dst = bp + g * kcp * 16;
                badc[g] |= trans_b ? amx_cut_rows(B + c0 * ldb + pc, ldb, kc, kcp, cols, dst,
                                                  dst + piece, dst + 2 * piece)
                                   : amx_cut_cols(B + pc * ldb + c0, ldb, kc, kcp, cols, dst,
                                                  dst + piece, dst + 2 * piece);
            }
            for (ib = 0; ib < M; ib += 32) {
                const int64_t mb = M - ib < 32 ? M - ib : 32;
                const uint16_t *pa[3] = {ap, ap + 32 * kcp, ap + 64 * kcp};
                /* A's pieces for these rows (zero past M, to 16 or 32) */
                if (a_cs != 1) /* a transposed A: its rows through at */
                    transpose_f32_avx512(kc, mb, A + ib * a_rs + pc * a_cs, a_cs, at, AMX_KC);
                bad |= a_cs == 1 ? amx_cut_a(A + ib * a_rs + pc, a_rs, mb, kc, kcp, ap)
                                 : amx_cut_a(at, AMX_KC, mb, kc, kcp, ap);
                /* chain by chain, each over every column group: A's pieces
                 * of a chain (24 KiB) stay in L1 for all of them (each
                 * element still takes its chains in order) */
                for (k0 = 0; k0 < kcp; k0 += AMX_CHAIN)
                    for (g = 0; g < ng; g++) {
                        const int64_t c0 = jb + 32 * g, cols = N - c0 < 32 ? N - c0 : 32;
                        const uint32_t *pb[3] = {bp + g * kcp * 16, bp + g * kcp * 16 + piece,
                                                 bp + g * kcp * 16 + 2 * piece};
                        amx_run_block(first && !accumulate, mb, cols, C + ib * ldc + c0, ldc,
                                      cb, kcp, pa, pb, k0);
                    }
                for (g = 0; g < ng; g++) {
                    const int64_t c0 = jb + 32 * g, cols = N - c0 < 32 ? N - c0 : 32;
                    float *c = C + ib * ldc + c0;
                    if (last && bias) /* the bias last, as the float kernels add it */
                        for (i = 0; i < mb; i++) {
                            const __mmask16 lo = amx_first(cols), hi = amx_first(cols - 16);
                            float *ci = c + i * ldc;
                            _mm512_mask_storeu_ps(
                                    ci, lo, _mm512_add_ps(_mm512_maskz_loadu_ps(lo, ci),
                                                          _mm512_maskz_loadu_ps(lo, bias + c0)));
                            _mm512_mask_storeu_ps(
                                    ci + 16, hi,
                                    _mm512_add_ps(_mm512_maskz_loadu_ps(hi, ci + 16),
                                                  _mm512_maskz_loadu_ps(hi, bias + c0 + 16)));
                        }
                }
            }
        }
        for (g = 0; g < ng; g++) /* the columns of B holding one, by float FMAs */
            for (j = jb + 32 * g; badc[g] && j < jb + 32 * g + 32 && j < N; j++)
                if (badc[g] >> (j - jb - 32 * g) & 1)
                    for (q = 0; q < M; q++)
                        C[q * ldc + j] = amx_fix_elem(A + q * a_rs, a_cs,
                                                      trans_b ? B + j * ldb : B + j,
                                                      trans_b ? 1 : ldb, K, bias ? bias + j : NULL);
    }
    _tile_release();
    if (bad) /* the rows of A holding one (amx_split's test), by float FMAs */
        for (q = 0; q < M; q++) {
            for (k = 0; k < K && fabsf(A[q * a_rs + k * a_cs]) < AMX_UNCUT; k++) {}
            if (k < K) amx_fix_row(trans_b, N, K, A + q * a_rs, a_cs, B, ldb, bias, C + q * ldc);
        }
    return 0;
}
