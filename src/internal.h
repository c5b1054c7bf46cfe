/* internal.h: what the files of src/ share and nobody else sees.
 * Legend as in mha.h: B, Sq, Sk, E, H, Dk, Ek, Ev. */
#ifndef MHA_INTERNAL_H
#define MHA_INTERNAL_H

#include "mha.h"
#include "kernels.h"

/* ---- checked arithmetic: nonzero on overflow (or a negative operand) ---- */
static inline int mha_mul(int64_t a, int64_t b, int64_t *r)
{
    if (a < 0 || b < 0) return 1;
    return __builtin_mul_overflow(a, b, r);
}
static inline int mha_add(int64_t a, int64_t b, int64_t *r)
{
    if (a < 0 || b < 0) return 1;
    return __builtin_add_overflow(a, b, r);
}
/* n scalars of `size` bytes as a byte count that fits size_t and int64_t. */
static inline int mha_bytes(int64_t n, size_t size, size_t *r)
{
    int64_t b;
    if (mha_mul(n, (int64_t)size, &b)) return 1;
    *r = (size_t)b;
    return 0;
}

/* 64-byte aligned allocation (NULL on failure or bytes == 0 -> a valid
 * minimal block); free with mha_free. */
void *mha_alloc(size_t bytes);
void mha_free(void *p);
/* The same for a call's workspace, through the calling thread's cache of
 * one block (memory.c): free with mha_work_free, which keeps the block for the
 * thread's next call (mha_release_workspace frees it). */
void *mha_work_alloc(size_t bytes);
void mha_work_free(void *p);

/* memcpy for a copy that is not read again soon (mha_saved's copies of the
 * inputs and parameters, read only by the backward): with SSE2, stores that
 * bypass the caches, so that the copy does not push out what the rest of
 * the call reads; memcpy otherwise, and for small copies. */
void mha_copy_stream(void *dst, const void *src, size_t bytes);

/* ---- a developer's probe: phase times of a call on stderr ----
 * Built with -DMHA_TIMING (MHA_EXT_CFLAGS=-DMHA_TIMING), the forward and
 * backward print each parallel pass's time; otherwise the ticks are empty. */
#ifdef MHA_TIMING
#include <stdio.h>
#include <time.h>
static inline double mha_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#define MHA_TICK_START double mha_t0_ = mha_now()
#define MHA_TICK(what) do { double t1_ = mha_now(); \
    fprintf(stderr, "%-30s %8.2f ms\n", what, 1e3 * (t1_ - mha_t0_)); mha_t0_ = t1_; } while (0)
#else
#define MHA_TICK_START (void)0
#define MHA_TICK(what) (void)0
#endif

/* ---- the dropout / initialisation stream (rng.c) ---- */
uint64_t mha_stream_key(uint64_t seed, uint64_t counter);
static inline uint64_t mha_stream_bits(uint64_t key, uint64_t idx)
{
    /* SplitMix64's finaliser applied to the idx-th state of the stream. */
    uint64_t z = key + (idx + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
/* uniform in [0, 1) with 53 random bits */
static inline double mha_stream_uniform(uint64_t key, uint64_t idx)
{
    return (double)(mha_stream_bits(key, idx) >> 11) * 0x1.0p-53;
}
/* The dropout rule, one home for the forward and the backward: element idx
 * of the stream `key` is kept (and scaled by 1/(1 - p)) iff its uniform
 * draw is >= p. */
static inline int mha_dropout_keep(uint64_t key, uint64_t idx, double p)
{
    return mha_stream_uniform(key, idx) >= p;
}
/* the counter reserved for parameter initialisation */
#define MHA_INIT_COUNTER UINT64_MAX

/* ---- worker threads (pool.c) ---- */
/* A call's poll (mha_forward_args.poll): started by the entry point, asked
 * by mha_parallel_for on the calling thread between tasks, no sooner than
 * MHA_POLL_MS after mha_poll_start and then at most every MHA_POLL_MS.
 * Once it answers nonzero, `stopped` stays set: every later pass of the
 * call returns at once, and the call returns MHA_ERR_INTERRUPTED. */
typedef struct {
    mha_poll_fn fn;   /* NULL: never asked */
    void *ctx;
    int64_t next_ms;  /* the monotonic clock's time of the next question */
    int stopped;
} mha_poll_state;
void mha_poll_start(mha_poll_state *ps, mha_poll_fn fn, void *ctx);

/* fn(ctx, task, slot) for every task in [0, n_tasks); slot in [0, max_slots)
 * names the thread running it, for per-thread scratch.  Runs on the calling
 * thread alone when n_tasks or max_slots is 1, or when another call holds
 * the pool.  ps: NULL, or the call's poll; when it says stop, no thread
 * starts another task of the pass (those running finish) and
 * mha_parallel_for returns nonzero (as it does at once for a call already
 * stopped, or when this is a fork child and the job its own thread was
 * running lost the workers' tasks); else 0. */
typedef void (*mha_task_fn)(void *ctx, int64_t task, int slot);
int mha_parallel_for(int64_t n_tasks, int max_slots, mha_task_fn fn, void *ctx,
                     mha_poll_state *ps);
/* Inside a long task of a pass given ps, between its steps: nonzero when
 * the call is to stop (the task may return at once: the call's results
 * are unspecified then).  Slot 0, the calling thread, asks the poll as
 * between tasks; a worker reads what the calling thread's poll answered.
 * ps may be NULL (never stops). */
int mha_task_stopped(mha_poll_state *ps, int slot);

/* ---- matrix multiply (gemm.c) ----
 * C (M, N) (+)= A (M, K) · op(B) + bias, row-major with leading dimensions:
 * op(B) = Bᵀ for B (N, K) when trans_b (the torch x·Wᵀ layout), else
 * B (K, N).  bias (N) or NULL; accumulate: C += (else C is never read).
 * mha_gemm: the packed loop nest around kt->ukr, one thread; scratch holds
 *   MHA_GEMM_SCRATCH scalars.
 * mha_gemm_tn: C (M, N) (+)= Aᵀ·B for A (K, M) and B (K, N), no bias: the
 *   same loop nest, Aᵀ read in place (column by column) or packed panel by
 *   panel, as mha_tn_packs says; scratch as mha_gemm's.
 * mha_tn_pack: 1 when mha_gemm_tn packs an Aᵀ whose rows lie a multiple
 *   of 4 KiB apart (E 1024 float, 512 double: each step of k reads a line
 *   in the same few L1 sets), 0 when it reads such an Aᵀ in place.  A
 *   narrow kernel (AVX2, portable) always packs; for a wide one the choice
 *   is measured at first use (gemm_impl.h's tn_probe: a weight gradient's
 *   tile in small, both ways, each at the width the backward gives it)
 *   and kept; the environment variable MHA_EXT_TN_PACK (0 or 1, read then)
 *   sets it instead.  Every element is summed in the same order either
 *   way: no result changes.
 * mha_tn_packs: whether mha_gemm_tn packs an Aᵀ whose rows lie lda scalars
 *   apart: always on a narrow kernel; on a wide one as mha_tn_pack says
 *   where the rows are a multiple of 4 KiB apart, else never (in place ran
 *   as fast or faster there: Intel Xeon (family 6, model 167), one core,
 *   the tiles at the backward's widths, float (512, 128) with K 1024 and
 *   rows 2 KiB apart 148-151 GFLOP/s in place against 139-141 packed 256
 *   wide and 142-148 packed 512 wide; rows 3 KiB apart, (768, 128) with
 *   K 6144, 137-157 against 142-143 and 142-146).  The weight gradients'
 *   rows are E apart (multiples of 1024 float, 512 double, go packed), the
 *   attention backward's dV and dK Sk apart.
 * MHA_TN_COLS, MHA_TN_COLS_AT: the weight gradients' tiles' columns with
 *   Aᵀ read in place (512 bytes of B's rows: float 128, double 64; Zen 4,
 *   one core each with both busy, tiles (1024, 128) with K 4096 ran at
 *   95-98 GFLOP/s, 90-92 at (1024, 64), 92-95 at (1024, 256)) and packed
 *   (wider: each packed block of Aᵀ serves them all; 512 on a wide kernel,
 *   256 on a narrow one, AVX2's width since its TN products were packed,
 *   not measured again.  Intel Xeon (family 6, model 167), one core,
 *   float (1024, N) with K 4096, rows 4 KiB apart: N 256 126-131 GFLOP/s,
 *   512 143, 1024 147; a training step at B 4, S 1024, E 1024, two
 *   threads, alternated: 587-604 -> 558-589 ms), halved (down to
 *   MHA_TN_COLS) while the four weight gradients' tiles would number fewer
 *   than the threads (bwd_tasks_impl.h); tn_probe measures each way at its
 *   width.
 * mha_gemm_small: the unpacked form for small M (trans_b only): dot
 *   products along K, nothing packed, no scratch. */
#define MHA_GEMM_KC 512 /* depth of a packed block (fixed: it orders the sums) */
#define MHA_GEMM_NC_MAX 512
/* the packed block's columns for scalars of that size (cpu.c: from the L2,
 * a multiple of 64, so of every micro-kernel's NR; fixed at first use) */
int64_t mha_gemm_nc(size_t scalar);
/* scratch for one mha_gemm (inside the T templates): B's packed block (KC,
 * up to 2·NC), then Aᵀ's packed panels; for float, where the AMX products
 * can run, at least their own (kernels.h), whatever the NC, so that NC
 * never decides between them */
#define MHA_GEMM_SCRATCH_NC \
    (MHA_GEMM_KC * (2 * mha_gemm_nc(sizeof(T)) + MHA_GEMM_NB_PANELS * MHA_GEMM_MR_MAX))
#define MHA_GEMM_SCRATCH                                                                   \
    (sizeof(T) == sizeof(float) && mha_amx_available() &&                                 \
                     MHA_GEMM_SCRATCH_NC * (int64_t)sizeof(T) < MHA_AMX_SCRATCH            \
             ? MHA_AMX_SCRATCH / (int64_t)sizeof(T)                                        \
             : MHA_GEMM_SCRATCH_NC)
/* 1 when this CPU, kernel and build have the AMX products (isa.c's "amx";
 * CPUID and XCR0 only, no arch_prctl), whichever ISA is in use: the float
 * scratch is then sized for them (fixed at first use) */
int mha_amx_available(void);
#define MHA_GEMM_MR_MAX 8    /* rows of a packed panel of Aᵀ at most (kernels.h's mr) */
#define MHA_GEMM_AT_PANELS 8 /* panels of Aᵀ packed at once (gemm_impl.h) */
/* gemm_impl.h's gemm_nest_nb: panels of Aᵀ packed at once, and the depth
 * past which a transposed A takes it */
#define MHA_GEMM_NB_PANELS 16
#define MHA_GEMM_NB_K 256
void mha_gemm_f32(const mha_kern_f32 *kt, int trans_b, int64_t M, int64_t N, int64_t K,
                  const float *A, int64_t lda, const float *B, int64_t ldb, const float *bias,
                  float *C, int64_t ldc, int accumulate, float *scratch);
void mha_gemm_f64(const mha_kern_f64 *kt, int trans_b, int64_t M, int64_t N, int64_t K,
                  const double *A, int64_t lda, const double *B, int64_t ldb,
                  const double *bias, double *C, int64_t ldc, int accumulate, double *scratch);
/* mha_gemm on the float kernels, never the AMX tiles (the forward's
 * attention, attend_impl.h: its bits are a cached decode step's); mha_gemm
 * and mha_gemm_tn take the tiles where the table has them (amx_gemm, C
 * written or added to), else these kernels */
void mha_gemm_fma_f32(const mha_kern_f32 *kt, int trans_b, int64_t M, int64_t N, int64_t K,
                      const float *A, int64_t lda, const float *B, int64_t ldb,
                      const float *bias, float *C, int64_t ldc, int accumulate, float *scratch);
void mha_gemm_fma_f64(const mha_kern_f64 *kt, int trans_b, int64_t M, int64_t N, int64_t K,
                      const double *A, int64_t lda, const double *B, int64_t ldb,
                      const double *bias, double *C, int64_t ldc, int accumulate,
                      double *scratch);
/* C (M, n) = A·Bp for one packed panel Bp (K, ldbp) of n <= NR columns
 * (gemm_impl.h): mha_gemm_fma's bits, the panel read in place */
void mha_gemm_panel_f32(const mha_kern_f32 *kt, int64_t M, int64_t n, int64_t K,
                        const float *A, int64_t lda, const float *Bp, int64_t ldbp, float *C,
                        int64_t ldc);
void mha_gemm_panel_f64(const mha_kern_f64 *kt, int64_t M, int64_t n, int64_t K,
                        const double *A, int64_t lda, const double *Bp, int64_t ldbp,
                        double *C, int64_t ldc);
void mha_gemm_tn_f32(const mha_kern_f32 *kt, int64_t M, int64_t N, int64_t K, const float *A,
                     int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                     int accumulate, float *scratch);
void mha_gemm_tn_f64(const mha_kern_f64 *kt, int64_t M, int64_t N, int64_t K, const double *A,
                     int64_t lda, const double *B, int64_t ldb, double *C, int64_t ldc,
                     int accumulate, double *scratch);
int mha_tn_pack_f32(const mha_kern_f32 *kt);
int mha_tn_pack_f64(const mha_kern_f64 *kt);
int mha_tn_packs_f32(const mha_kern_f32 *kt, int64_t lda);
int mha_tn_packs_f64(const mha_kern_f64 *kt, int64_t lda);
#define MHA_TN_COLS(scalar) (512 / (int64_t)(scalar))
#define MHA_TN_COLS_AT(narrow) ((narrow) ? 256 : 512)
void mha_gemm_small_f32(const mha_kern_f32 *kt, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb,
                        const float *bias, float *C, int64_t ldc, int accumulate);
void mha_gemm_small_f64(const mha_kern_f64 *kt, int64_t M, int64_t N, int64_t K,
                        const double *A, int64_t lda, const double *B, int64_t ldb,
                        const double *bias, double *C, int64_t ldc, int accumulate);

/* ---- one task list for tiled products (the forward's and the backward's
 * passes) ----
 * A pass's products, each cut into tiles of rm x rn of C, row tiles outer;
 * the pass's tasks number the tiles product after product.  Kinds:
 *   MHA_NT: C (M, N) = A (M, K) · B (N, K)ᵀ + bias   (a projection)
 *   MHA_NN: C (M, N) = A (M, K) · B (K, N)           (an input gradient)
 *   MHA_TN: C (M, N) = A (K, M)ᵀ · B (K, N)          (a weight gradient)
 * Pointers are of the call's dtype; C may be NULL when the task writes
 * each tile elsewhere (the forward's projections, scattered per head).
 * mha_tile_gemm_f32/_f64 (gemm.c) run one tile. */
enum { MHA_NT = 0, MHA_NN = 1, MHA_TN = 2 };
typedef struct {
    int kind;
    const void *A, *B, *bias; /* bias (N) or NULL */
    void *C;
    int64_t lda, ldb, ldc, M, N, K;
    int64_t rm, rn, tiles_n, tiles;
    int pack_b; /* pack op(B) where the loop nest would read it in place (NN):
                   a block packed once serves the tile's rm rows, read
                   contiguously instead of rows 4 KiB apart (B = W, whose
                   rows cross a page each: 3% of a training step at large) */
} mha_product;
#define MHA_MAX_PRODUCTS 8
typedef struct {
    mha_product p[MHA_MAX_PRODUCTS];
    int n;
    int64_t tiles; /* the pass's tasks: the products' tiles together */
} mha_products;
/* one task's tile: rows i0 .. i0+m-1, columns n0 .. n0+n-1 of product j */
typedef struct {
    int j;
    int64_t i0, n0, m, n;
} mha_tile;

/* Append a product (at most MHA_MAX_PRODUCTS per list) cut into rm x rn
 * tiles; the tiling never changes a result. */
static inline mha_product *mha_products_add(mha_products *l, int kind, const void *A,
                                            int64_t lda, const void *B, int64_t ldb,
                                            const void *bias, void *C, int64_t ldc, int64_t M,
                                            int64_t N, int64_t K, int64_t rm, int64_t rn)
{
    mha_product *pr = &l->p[l->n++];
    pr->kind = kind;
    pr->pack_b = 0;
    pr->A = A; pr->lda = lda;
    pr->B = B; pr->ldb = ldb;
    pr->bias = bias;
    pr->C = C; pr->ldc = ldc;
    pr->M = M; pr->N = N; pr->K = K;
    pr->rm = rm; pr->rn = rn;
    pr->tiles_n = (N + rn - 1) / rn;
    pr->tiles = M > 0 && N > 0 ? (M + rm - 1) / rm * pr->tiles_n : 0;
    l->tiles += pr->tiles;
    return pr;
}

/* A narrow GEMM kernel: NR scalars in one cache line (AVX2, portable);
 * gemm_impl.h packs differently for it */
static inline int mha_gemm_narrow(int64_t nr, size_t scalar)
{
    return nr * (int64_t)scalar <= 64;
}
/* 1 when gemm_impl.h packs a row-major B rather than read it in place
 * (pack_far): its rows a multiple of 2 KiB apart on a narrow kernel, of
 * 4 KiB on a wide one (each step of k then reads its lines from the same
 * few L1 sets, and the lines asked for ahead evict each other before use:
 * see mha_kt_ld).  Intel Xeon (family 6, model 167), one core, (4096, 1024)
 * with K 1024, B's rows 1024 floats apart (a training step's input
 * gradient at E 1024): 80-84 -> 143-157 GFLOP/s; double, rows 512 or 1024
 * doubles apart, 40-43 -> 65-73.  gemm_impl.h packs them only for a
 * product of 48 rows or more (8 panels) on a wide kernel.  The same test
 * on a transposed A's rows decides whether a wide kernel may pack Aᵀ
 * (gemm_impl.h's mha_tn_packs) */
static inline int mha_gemm_far_rows(int64_t nr, int64_t ldb, size_t scalar)
{
    return ldb * (int64_t)scalar % (mha_gemm_narrow(nr, scalar) ? 2048 : 4096) == 0;
}
/* The rows of a Kᵀ the attention reads as a GEMM's B (Sk keys a row): Sk,
 * or a line more (forward_impl.h's workspace, sdpa_forward_impl.h's kt)
 * where mha_gemm_far_rows says rows Sk apart would be packed (a multiple of
 * 2 KiB on a narrow kernel, of 4 KiB on a wide one: Sk 1024, 2048, 4096
 * floats), so that S = Q·Kᵀ reads them in place instead of packing them
 * for every block of queries.  Read in place 4 KiB apart, each step of k
 * took its lines from the same few L1 sets (4 KiB of L1 a way), and the
 * lines asked for ahead evicted each other before use.  Zen 5, one core,
 * S (48, 256) = Q·Kᵀ with K 64 (Dk), B's rows 1024 floats apart, read in
 * place: 198-202 GFLOP/s, 1040 apart 220-222
 *   (512, 768: 219-223); double 512 apart 101-103, 520 apart 114; B 1,
 *   S 4096, E 1024, H 16, two threads, alternated: 284-290 -> 271-274 ms */
static inline int64_t mha_kt_ld(int64_t nr, int64_t Sk, size_t scalar)
{
    return mha_gemm_far_rows(nr, Sk, scalar) ? Sk + 64 / (int64_t)scalar : Sk;
}
/* 1 when `rows` row tiles by N columns in tiles nc wide give every one of
 * `slots` threads four tiles */
static inline int mha_tiles_enough(int64_t rows, int64_t N, int64_t nc, int slots)
{
    return rows * ((N + nc - 1) / nc) >= 4 * (int64_t)slots;
}
/* Columns per tile of such a product: the packed GEMM's nc, halved (down to
 * 64) while there are not enough tiles */
static inline int64_t mha_tile_cols(int64_t rows, int64_t N, int64_t nc, int slots)
{
    while (nc > 64 && !mha_tiles_enough(rows, N, nc, slots)) nc /= 2;
    return nc;
}

/* Tiles rm x rn of a product on the AMX tiles (kernels.h's amx_gemm):
 * each tile cuts its rows of A into bfloat16 pieces once for all its
 * columns, and its columns of B once for all its rows, so the tiles are as
 * large and as square as still give every one of `slots` threads two:
 * from 1024 x min(256, nc) (no larger than M and N need), the larger side
 * halved (down to 32) until so.  Intel Xeon (family 6, model 167), two
 * threads, medium (B 8, S 128, E 512): the forward's 1024 x 64 tiles of
 * the float kernels spent 72% of the call in amx_gemm, most of it cutting
 * the same rows of A for every 64 columns */
static inline void mha_amx_tiles(int64_t M, int64_t N, int64_t nc, int slots, int64_t *rm,
                                 int64_t *rn)
{
    int64_t m = 1024, n = nc < 256 ? nc : 256;
    while (m > 32 && m / 2 >= M) m /= 2;
    while (n > 32 && n / 2 >= N) n /= 2;
    while ((M + m - 1) / m * ((N + n - 1) / n) < 2 * (int64_t)slots) {
        if (m >= n && m > 32)
            m /= 2;
        else if (n > 32)
            n /= 2;
        else
            break;
    }
    *rm = m;
    *rn = n;
}

/* the tile of task t (0 <= t < l->tiles) */
static inline mha_tile mha_products_tile(const mha_products *l, int64_t t)
{
    mha_tile tl;
    const mha_product *pr;
    int j = 0;
    while (t >= l->p[j].tiles) t -= l->p[j++].tiles;
    pr = &l->p[j];
    tl.j = j;
    tl.i0 = (t / pr->tiles_n) * pr->rm;
    tl.n0 = (t % pr->tiles_n) * pr->rn;
    tl.m = pr->M - tl.i0 < pr->rm ? pr->M - tl.i0 : pr->rm;
    tl.n = pr->N - tl.n0 < pr->rn ? pr->N - tl.n0 : pr->rn;
    return tl;
}

/* One tile of a product into c (leading dimension ldc: the product's C at
 * the tile, or the caller's scratch), through the packed loop nest
 * (scratch: MHA_GEMM_SCRATCH scalars), or for an NT product with `small`
 * the unpacked dot kernel. */
void mha_tile_gemm_f32(const mha_kern_f32 *kt, const mha_product *pr, const mha_tile *tl,
                       float *c, int64_t ldc, int small, float *scratch);
void mha_tile_gemm_f64(const mha_kern_f64 *kt, const mha_product *pr, const mha_tile *tl,
                       double *c, int64_t ldc, int small, double *scratch);

/* ---- the rules of a row of scores (softmax_impl.h), one home for every
 * pass: row (b, h, i) of Sq rows against keys j in [0, Sk + extra) ---- */
typedef struct {
    const mha_mask *masks; /* n_masks masks over (B, H, Sq, nmk) */
    int n_masks;
    int causal;            /* nonzero: key j is blocked when i + coff < j < nmk */
    int64_t coff;          /* 0 top-left; Sk - Sq lower-right */
    int64_t nmk;           /* keys the masks and causality cover (Sk); keys
                              from nmk on (the extra keys) are never blocked */
    int zero_masked_rows;
    int window;            /* nonzero: key j < nmk is blocked unless
                              i + coff - wl <= j <= i + coff + wr */
    int64_t wl, wr;        /* < 0: unbounded on that side */
    mha_block_layout lay;  /* lay.keep != NULL: key j < nmk of row (b, h, i) is
                              blocked unless its block is kept (mha.h) */
} mha_rows;
static inline mha_rows mha_rows_make(const mha_mask *masks, int n_masks, int is_causal,
                                     int64_t Sq, int64_t Sk, int zero_masked_rows)
{
    mha_rows rr;
    rr.masks = masks;
    rr.n_masks = n_masks;
    rr.causal = is_causal != 0;
    rr.coff = is_causal == MHA_CAUSAL_LOWER_RIGHT ? Sk - Sq : 0;
    rr.nmk = Sk;
    rr.zero_masked_rows = zero_masked_rows;
    rr.window = 0;
    rr.wl = rr.wr = -1;
    rr.lay.keep = NULL;
    rr.lay.nqb = rr.lay.nkb = 0;
    rr.lay.q_block = rr.lay.k_block = 1;
    rr.lay.stride[0] = rr.lay.stride[1] = 0;
    return rr;
}
/* the kept flags (nkb) of the query block of row (b, h, i) of a layout */
static inline const uint8_t *mha_lay_row(const mha_block_layout *ly, int64_t b, int64_t h,
                                         int64_t i)
{
    return ly->keep + b * ly->stride[0] + h * ly->stride[1] + (i / ly->q_block) * ly->nkb;
}
/* 1 when key block kb is kept for some query of rows i0 .. i0+nq-1 of (b, h) */
static inline int mha_lay_any(const mha_block_layout *ly, int64_t b, int64_t h, int64_t i0,
                              int64_t nq, int64_t kb)
{
    int64_t qb;
    const uint8_t *k0 = ly->keep + b * ly->stride[0] + h * ly->stride[1];
    for (qb = i0 / ly->q_block; qb <= (i0 + nq - 1) / ly->q_block; qb++)
        if (k0[qb * ly->nkb + kb]) return 1;
    return 0;
}
/* The first run of keys [*rs, *re) at or after key j (< nk keys) whose
 * blocks are kept for some query of rows i0 .. i0+nq-1 (nq > 0) of (b, h);
 * *rs = *re = nk when there is none.  Without a layout: [j, nk). */
static inline void mha_lay_run(const mha_block_layout *ly, int64_t b, int64_t h, int64_t i0,
                               int64_t nq, int64_t j, int64_t nk, int64_t *rs, int64_t *re)
{
    int64_t kb, kbs = ly->k_block;
    if (!ly->keep || j >= nk) {
        *rs = j < nk ? j : nk;
        *re = nk;
        return;
    }
    for (kb = j / kbs; kb < ly->nkb && !mha_lay_any(ly, b, h, i0, nq, kb); kb++) {}
    if (kb >= ly->nkb) {
        *rs = *re = nk;
        return;
    }
    *rs = kb * kbs > j ? kb * kbs : j;
    for (kb++; kb < ly->nkb && mha_lay_any(ly, b, h, i0, nq, kb); kb++) {}
    *re = kb * kbs < nk ? kb * kbs : nk;
}
/* The hull [*lo, *hi) of the keys kept for some query of rows i0 .. i0+nq-1
 * (nq > 0) of (b, h), within [*lo, *hi) on entry (lo == hi: none) */
static inline void mha_lay_hull(const mha_block_layout *ly, int64_t b, int64_t h, int64_t i0,
                                int64_t nq, int64_t *lo, int64_t *hi)
{
    int64_t kb, kbs = ly->k_block, first = -1, last = -1;
    if (!ly->keep || *lo >= *hi) return;
    for (kb = *lo / kbs; kb < ly->nkb && kb * kbs < *hi; kb++)
        if (mha_lay_any(ly, b, h, i0, nq, kb)) {
            if (first < 0) first = kb;
            last = kb;
        }
    if (first < 0) {
        *hi = *lo;
        return;
    }
    if (first * kbs > *lo) *lo = first * kbs;
    if ((last + 1) * kbs < *hi) *hi = (last + 1) * kbs;
}
/* A call's sliding window into rr (mha_forward_args.has_window ...): the
 * bounds clamped to Sq + Sk (wider is the same window), so that i + coff +-
 * a bound never overflows. */
static inline void mha_rows_window(mha_rows *rr, int has_window, int64_t left, int64_t right,
                                   int64_t Sq, int64_t Sk)
{
    const int64_t wide = Sq + Sk + 1;
    if (!has_window || (left < 0 && right < 0)) return; /* unbounded: no window */
    rr->window = 1;
    rr->wl = left < 0 ? -1 : left > wide ? wide : left;
    rr->wr = right < 0 ? -1 : right > wide ? wide : right;
}
/* the score scale of a call: the caller's, or 1 / sqrt(Dk) */
static inline double mha_score_scale(int has_scale, double scale, int64_t Dk)
{
    return has_scale ? scale : 1.0 / __builtin_sqrt((double)Dk);
}

/* ---- argument checks shared by every entry point (mha.c) ----
 * On MHA_OK, sizes hold the element counts of query, key, value, out and
 * weights (the last even when a->weights is NULL). */
typedef struct {
    int64_t n_query, n_key, n_value, n_out, n_weights;
    int64_t extra; /* mha_extra_keys(cfg) */
} mha_sizes;
mha_status mha_check_forward(const mha_config *cfg, const mha_params *p,
                             const mha_forward_args *a, mha_sizes *sz);

/* The checks of mha_sdpa_forward's arguments (mha.c); with out NULL
 * allowed (the backward's), and on MHA_OK the element counts of q, k, v,
 * out and weights in sz (n_query, n_key, n_value, n_out, n_weights). */
mha_status mha_check_sdpa(const mha_sdpa_args *a, int need_out, mha_sizes *sz);

/* ---- the instances per dtype: what the entry points of mha.c call ----
 * Each is the template named beside it, instantiated in its .c file. */
/* forward.c (forward_impl.h) */
mha_status mha_forward_f32(const mha_config *cfg, const mha_params *p,
                           const mha_forward_args *a, const mha_saved *s, const mha_copies *c);
mha_status mha_forward_f64(const mha_config *cfg, const mha_params *p,
                           const mha_forward_args *a, const mha_saved *s, const mha_copies *c);
/* backward.c (backward_impl.h) */
mha_status mha_backward_f32(const mha_config *cfg, const mha_params *p,
                            const mha_backward_args *a, const mha_saved *s);
mha_status mha_backward_f64(const mha_config *cfg, const mha_params *p,
                            const mha_backward_args *a, const mha_saved *s);
/* ref.c (ref_forward_impl.h, ref_backward_impl.h) */
mha_status mha_forward_ref_f32(const mha_config *cfg, const mha_params *p,
                               const mha_forward_args *a);
mha_status mha_forward_ref_f64(const mha_config *cfg, const mha_params *p,
                               const mha_forward_args *a);
mha_status mha_backward_ref_f32(const mha_config *cfg, const mha_params *p,
                                const mha_backward_args *a);
mha_status mha_backward_ref_f64(const mha_config *cfg, const mha_params *p,
                                const mha_backward_args *a);
/* forward.c (sdpa_forward_impl.h), backward.c (sdpa_backward_impl.h),
 * ref.c (ref_sdpa_impl.h) */
mha_status mha_sdpa_forward_f32(const mha_sdpa_args *a);
mha_status mha_sdpa_forward_f64(const mha_sdpa_args *a);
mha_status mha_sdpa_backward_f32(const mha_sdpa_backward_args *a);
mha_status mha_sdpa_backward_f64(const mha_sdpa_backward_args *a);
mha_status mha_sdpa_forward_ref_f32(const mha_sdpa_args *a);
mha_status mha_sdpa_forward_ref_f64(const mha_sdpa_args *a);
mha_status mha_sdpa_backward_ref_f32(const mha_sdpa_backward_args *a);
mha_status mha_sdpa_backward_ref_f64(const mha_sdpa_backward_args *a);

#endif /* MHA_INTERNAL_H */
