/* _core_mem.c: the output cache, where the large arrays the calls return
 * get their memory.
 *
 * A large array of fresh memory costs a page fault and the kernel's zeroing
 * of every page before the core writes it: the (B, H, Sq, Sk) weights of
 * BERT-base (113 MiB) or of B 4, S 1024, E 1024 (256 MiB), the 170 MiB of
 * saved tensors and gradients of a training step there (2650 faults a step,
 * most of them 2 MiB pages).  glibc returns such blocks to the system on
 * free, so a loop of calls pays that every call.  Arrays of OUT_MIN bytes
 * and more are therefore made with a NumPy memory handler (NumPy >= 1.22,
 * PyDataMem_SetHandler) whose blocks are mapped here; a freed one is kept,
 * up to the cache's limit, for the next array of about its size (at most
 * twice); one of 32 MiB or more is marked MADV_FREE, so that the kernel
 * may still take its pages back under memory pressure (a reuse then faults
 * afresh, as without the cache; on smaller blocks the madvise call itself,
 * its TLB shootdown, cost 2-3% of a call at B 8, S 128, E 512).  A block
 * of 2 MiB or more is mapped at a 2 MiB boundary and asked for in huge
 * pages (MADV_HUGEPAGE; NumPy asks from 4 MiB on, unaligned): a training
 * step's saved Q, K, V and gradients at B 8, S 128, E 512 are 2 MiB each,
 * and the backward reads them scattered per head (Zen 3, builds alternated
 * process by process, this and src/memory.c's workspace in huge pages
 * together: the backward's attention 8.0 -> 6.3 ms, dctx = d out·W_o 4.8 ->
 * 4.0 ms).
 * The arrays are ordinary: they own their data, and NumPy frees it through
 * the handler they were made with.
 *
 * The limit: MHA_EXT_CACHE_MB (a non-negative integer, read once; 0 turns
 * the cache off; past 2**44 - 1 MiB, no limit; any other value is ignored:
 * env_limit), else 1 GiB or an eighth of
 * the physical memory, the smaller.  Eviction: the oldest block first.
 * mha_ext.release_memory() unmaps every cached block.  In a sanitizer build
 * the cache is off, so that ASan checks the outputs' bounds as malloc's. */
#include "_core.h"
#include "hugemap.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define OUT_MIN ((size_t)1 << 20) /* smaller arrays: NumPy's own allocator */
#define OUT_HDR 64                /* bytes before the data: the block's header */
#define OUT_FREE_MIN ((size_t)32 << 20) /* cached blocks from here on: MADV_FREE */
#define OUT_SLOTS 32              /* blocks the cache holds at most */
#define OUT_MAGIC_MAP 0x6d68616d61700001ULL /* "mhamap": a mapped block */
#define OUT_MAGIC_HEAP 0x6d68616d61700002ULL /* a malloc'd one (realloc's small side) */

#define OUT_SANITIZED MHA_SANITIZED /* hugemap.h's: the cache is off under ASan */

typedef struct {
    size_t len;      /* the mapping's bytes (header included), or malloc's */
    uint64_t magic;  /* OUT_MAGIC_MAP or OUT_MAGIC_HEAP */
} out_hdr;

typedef struct {
    char *raw;
    size_t len;
    uint64_t stamp;  /* when it was cached: the smallest goes first */
} out_slot;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static out_slot g_slot[OUT_SLOTS];
static int g_n;
static size_t g_total;   /* bytes cached */
static uint64_t g_clock;
static size_t g_limit;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void out_lock(void) { pthread_mutex_lock(&g_mu); }
static void out_unlock(void) { pthread_mutex_unlock(&g_mu); }

/* MHA_EXT_CACHE_MB into *limit when it holds a non-negative integer (and
 * blanks around it; past the bytes a size_t counts, the largest limit, as
 * MHA_EXT_NUM_THREADS past its range counts as its cap); anything else
 * leaves *limit as it was */
static void env_limit(const char *s, size_t *limit)
{
    char *end;
    unsigned long long mb;
    while (isspace((unsigned char)*s)) s++; /* what strtoull skips */
    if (*s == '-') return; /* strtoull would take "-5" as 2**64 - 5 */
    errno = 0;
    mb = strtoull(s, &end, 10);
    if (end == s) return; /* no digits */
    while (isspace((unsigned char)*end)) end++;
    if (*end != '\0') return;
    *limit = errno == ERANGE || mb > ((size_t)-1 >> 20) ? (size_t)-1 : (size_t)mb << 20;
}

static void out_init(void)
{
    const char *env = getenv("MHA_EXT_CACHE_MB");
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    size_t limit = (size_t)1 << 30;
    if (pages > 0 && psz > 0 && (size_t)pages / 8 < limit / (size_t)psz)
        limit = (size_t)pages / 8 * (size_t)psz;
    if (env) env_limit(env, &limit);
    g_limit = OUT_SANITIZED ? 0 : limit;
    /* a child of fork() inherits the mutex as the forking thread saw it */
    pthread_atfork(out_lock, out_unlock, out_unlock);
}

static size_t out_limit(void)
{
    pthread_once(&g_once, out_init);
    return g_limit;
}

static size_t page_round(size_t bytes)
{
    size_t psz = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes > (size_t)-1 - psz) return 0;
    return (bytes + psz - 1) / psz * psz;
}

/* a cached block of len bytes or a little more (at most twice), or NULL;
 * *got: its length, as the slot holds it (its header may read zeros: a
 * MADV_FREE page the kernel took back) */
static char *cache_take(size_t len, size_t *got)
{
    int i, best = -1;
    char *raw = NULL;
    out_lock();
    for (i = 0; i < g_n; i++)
        if (g_slot[i].len >= len && g_slot[i].len / 2 <= len &&
            (best < 0 || g_slot[i].len < g_slot[best].len))
            best = i;
    if (best >= 0) {
        raw = g_slot[best].raw;
        *got = g_slot[best].len;
        g_total -= g_slot[best].len;
        g_slot[best] = g_slot[--g_n];
    }
    out_unlock();
    return raw;
}

/* keep a block for reuse, evicting the oldest; unmap what does not fit */
static void cache_put(char *raw, size_t len)
{
    out_slot victims[OUT_SLOTS + 1];
    int nv = 0, i;
    const size_t limit = out_limit();
    if (len > limit) {
        munmap(raw, len);
        return;
    }
#ifdef MADV_FREE
    /* a big block: reclaimable until it is written again (smaller ones are
     * kept as they are: the call's TLB shootdown cost medium's calls 2-3%) */
    if (len >= OUT_FREE_MIN) madvise(raw, len, MADV_FREE);
#endif
    out_lock();
    while (g_n > 0 && (g_n == OUT_SLOTS || g_total + len > limit)) {
        int old = 0;
        for (i = 1; i < g_n; i++)
            if (g_slot[i].stamp < g_slot[old].stamp) old = i;
        victims[nv++] = g_slot[old];
        g_total -= g_slot[old].len;
        g_slot[old] = g_slot[--g_n];
    }
    g_slot[g_n].raw = raw;
    g_slot[g_n].len = len;
    g_slot[g_n].stamp = ++g_clock;
    g_n++;
    g_total += len;
    out_unlock();
    for (i = 0; i < nv; i++) munmap(victims[i].raw, victims[i].len);
}

/* a fresh mapping of len bytes (a multiple of the page): from 2 MiB on, at
 * a 2 MiB boundary and asked for in huge pages (src/hugemap.h) */
static char *out_map(size_t len)
{
    char *p;
#if MHA_HUGEMAP
    if (len >= MHA_HUGE_BYTES) return (char *)mha_huge_map(len);
#endif
    p = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == (char *)MAP_FAILED ? NULL : p;
}

/* a block of `bytes` usable bytes after its header; *fresh: its pages are
 * new (zero) */
static void *out_alloc(size_t bytes, int *fresh)
{
    size_t len = page_round(bytes + OUT_HDR);
    char *raw;
    *fresh = 0;
    if (bytes > (size_t)-1 - OUT_HDR || len == 0) return NULL;
    if (bytes < OUT_MIN) { /* realloc's small side */
        raw = (char *)malloc(bytes + OUT_HDR);
        if (!raw) return NULL;
        ((out_hdr *)raw)->len = bytes + OUT_HDR;
        ((out_hdr *)raw)->magic = OUT_MAGIC_HEAP;
        return raw + OUT_HDR;
    }
    raw = cache_take(len, &len);
    if (!raw) {
        raw = out_map(len);
        if (!raw) return NULL;
        *fresh = 1;
    }
    ((out_hdr *)raw)->len = len;
    ((out_hdr *)raw)->magic = OUT_MAGIC_MAP;
    return raw + OUT_HDR;
}

static size_t out_usable(void *p)
{
    const out_hdr *h = (const out_hdr *)((char *)p - OUT_HDR);
    return h->len - OUT_HDR;
}

static void out_free_block(void *p)
{
    char *raw;
    if (!p) return;
    raw = (char *)p - OUT_HDR;
    if (((out_hdr *)raw)->magic == OUT_MAGIC_MAP)
        cache_put(raw, ((out_hdr *)raw)->len);
    else
        free(raw);
}

/* ---- NumPy's PyDataMem_Handler over those blocks ---- */
static void *h_malloc(void *ctx, size_t size)
{
    int fresh;
    (void)ctx;
    return out_alloc(size ? size : 1, &fresh);
}

static void *h_calloc(void *ctx, size_t nelem, size_t elsize)
{
    int fresh;
    void *p;
    size_t bytes;
    (void)ctx;
    if (elsize && nelem > (size_t)-1 / elsize) return NULL;
    bytes = nelem * elsize;
    p = out_alloc(bytes > 0 ? bytes : 1, &fresh);
    if (p && !fresh) memset(p, 0, bytes);
    return p;
}

static void *h_realloc(void *ctx, void *ptr, size_t size)
{
    int fresh;
    void *q;
    size_t old;
    (void)ctx;
    if (!ptr) return out_alloc(size ? size : 1, &fresh);
    old = out_usable(ptr);
    if (size <= old && size >= old / 2) return ptr;
    q = out_alloc(size ? size : 1, &fresh);
    if (!q) return NULL;
    memcpy(q, ptr, size < old ? size : old);
    out_free_block(ptr);
    return q;
}

static void h_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    (void)size; /* the header knows the block's size */
    out_free_block(ptr);
}

static PyDataMem_Handler g_handler = {
    "mha_ext_output_cache",
    1,
    {NULL, h_malloc, h_calloc, h_realloc, h_free},
};

PyArrayObject *out_new_array(int nd, const npy_intp *dims, int typenum, int zero)
{
    PyArrayObject *arr;
    PyObject *cap, *old;
    size_t bytes = typenum == NPY_FLOAT64 ? 8 : typenum == NPY_FLOAT32 ? 4 : 0;
    int i;
    for (i = 0; i < nd; i++) bytes *= (size_t)dims[i]; /* the caller's shapes fit in memory */
    if (bytes < OUT_MIN || out_limit() == 0)
        return (PyArrayObject *)(zero ? PyArray_ZEROS(nd, (npy_intp *)dims, typenum, 0)
                                      : PyArray_SimpleNew(nd, (npy_intp *)dims, typenum));
    /* the handler is a context variable: set for this one array only */
    if (!(cap = PyCapsule_New(&g_handler, "mem_handler", NULL))) return NULL;
    old = PyDataMem_SetHandler(cap);
    Py_DECREF(cap);
    if (!old) return NULL;
    arr = (PyArrayObject *)(zero ? PyArray_ZEROS(nd, (npy_intp *)dims, typenum, 0)
                                 : PyArray_SimpleNew(nd, (npy_intp *)dims, typenum));
    cap = PyDataMem_SetHandler(old);
    Py_DECREF(old);
    if (!cap) {
        Py_XDECREF(arr);
        return NULL;
    }
    Py_DECREF(cap);
    return arr;
}

size_t out_cache_release(void)
{
    out_slot all[OUT_SLOTS];
    size_t total;
    int n, i;
    out_limit();
    out_lock();
    n = g_n;
    memcpy(all, g_slot, (size_t)n * sizeof *all);
    total = g_total;
    g_n = 0;
    g_total = 0;
    out_unlock();
    for (i = 0; i < n; i++) munmap(all[i].raw, all[i].len);
    return total;
}

void out_cache_info(size_t *cached, int *blocks, size_t *limit)
{
    *limit = out_limit();
    out_lock();
    *cached = g_total;
    *blocks = g_n;
    out_unlock();
}
