/* memory.c: aligned allocation, the per-thread workspace cache and the
 * streaming copy (internal.h).  Legend as in mha.h. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hugemap.h"
#include "internal.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void *mha_alloc(size_t bytes)
{
    void *p = NULL;
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded < bytes) return NULL;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    return p;
}

void mha_free(void *p) { free(p); }

/* ---- the per-thread workspace cache ----
 * Each forward and backward needs a workspace.  glibc serves blocks of
 * 32 MiB and more straight from mmap and returns them to the system on
 * free, so every call would page-fault its workspace afresh, one fault per
 * 4 KiB (at B 4, S 1024, E 1024 the forward's 67 MiB: about 17 000 faults,
 * some 13 ms of a 300 ms call here).  So each thread keeps its largest
 * block of MHA_WORK_CACHE_MIN bytes or more for its next call (smaller ones
 * are malloc's, which reuses them).  A block has a 64-byte header holding
 * its capacity.  Without a thread key (creation failed) nothing is cached.
 *
 * Blocks of 2 MiB or more are mapped at a 2 MiB boundary and asked for in
 * huge pages (hugemap.h).  Q, K, V and the context are scattered per head
 * through them, a TLB miss on most 4 KiB pages:
 * Zen 3, B 8, S 128, E 512 (the 8 MiB workspace), builds alternated
 * process by process, the Q, K, V projections 12.1 -> 10.2 ms, the
 * attention 3.4 -> 2.9 ms, the call 19.2 -> 16.8 ms.  The cache's lower
 * bound, 128 KiB (glibc's first mmap threshold), keeps the forward's
 * scratch of a training step in a block already faulted in; malloc's
 * reuse of it depended on the mmap threshold that freeing the backward's
 * mapped workspace raised.  A sanitizer build maps nothing (hugemap.h). */
#define MHA_WORK_CACHE_MIN ((size_t)128 << 10)

typedef struct {
    void *raw;
    size_t cap;
} mha_work_cache;

/* a block of `bytes` (a header and the capacity after it), and its release */
static void *block_alloc(size_t bytes)
{
    void *raw = NULL;
#if MHA_HUGEMAP
    if (bytes >= MHA_HUGE_BYTES) { /* whole huge pages */
        const size_t len = (bytes + MHA_HUGE_BYTES - 1) & ~(MHA_HUGE_BYTES - 1);
        return len < bytes ? NULL : mha_huge_map(len);
    }
#endif
    return posix_memalign(&raw, 64, bytes) == 0 ? raw : NULL;
}

static void block_free(void *raw, size_t bytes)
{
    if (!raw) return;
#if MHA_HUGEMAP
    if (bytes >= MHA_HUGE_BYTES) {
        munmap(raw, (bytes + MHA_HUGE_BYTES - 1) & ~(MHA_HUGE_BYTES - 1));
        return;
    }
#endif
    (void)bytes;
    free(raw);
}

static pthread_once_t g_work_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_work_key;
static int g_work_key_ok;

static void work_cache_destroy(void *v)
{
    mha_work_cache *c = (mha_work_cache *)v;
    if (c) {
        block_free(c->raw, c->cap + 64);
        free(c);
    }
}

static void work_key_init(void)
{
    g_work_key_ok = pthread_key_create(&g_work_key, work_cache_destroy) == 0;
}

static mha_work_cache *work_cache(int create)
{
    mha_work_cache *c;
    pthread_once(&g_work_once, work_key_init);
    if (!g_work_key_ok) return NULL;
    c = (mha_work_cache *)pthread_getspecific(g_work_key);
    if (!c && create) {
        c = (mha_work_cache *)calloc(1, sizeof *c);
        if (c && pthread_setspecific(g_work_key, c) != 0) {
            free(c);
            c = NULL;
        }
    }
    return c;
}

void mha_copy_stream(void *dst, const void *src, size_t bytes)
{
#if defined(__SSE2__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15, i;
    if (bytes < 4096) {
        memcpy(dst, src, bytes);
        return;
    }
    memcpy(d, s, head); /* to a 16-byte boundary of dst */
    d += head;
    s += head;
    bytes -= head;
    for (i = 0; i + 64 <= bytes; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), x0);
        _mm_stream_si128((__m128i *)(d + i + 16), x1);
        _mm_stream_si128((__m128i *)(d + i + 32), x2);
        _mm_stream_si128((__m128i *)(d + i + 48), x3);
    }
    memcpy(d + i, s + i, bytes - i);
    _mm_sfence(); /* ordered before whatever the caller does next */
#else
    memcpy(dst, src, bytes);
#endif
}

void *mha_work_alloc(size_t bytes)
{
    mha_work_cache *c;
    void *raw = NULL;
    size_t cap = (bytes + 63) / 64 * 64;
    if (cap < bytes || cap > SIZE_MAX - ((size_t)4 << 20)) return NULL;
    c = cap >= MHA_WORK_CACHE_MIN ? work_cache(1) : NULL;
    if (c && c->raw) {
        if (c->cap >= cap) { /* the cached block is big enough: take it */
            raw = c->raw;
            c->raw = NULL;
            return (char *)raw + 64;
        }
        block_free(c->raw, c->cap + 64); /* too small: never hold two */
        c->raw = NULL;
    }
    raw = block_alloc(cap + 64);
    if (!raw) return NULL;
    *(size_t *)raw = cap;
    return (char *)raw + 64;
}

void mha_work_free(void *p)
{
    mha_work_cache *c;
    void *raw;
    size_t cap;
    if (!p) return;
    raw = (char *)p - 64;
    cap = *(size_t *)raw;
    c = cap >= MHA_WORK_CACHE_MIN ? work_cache(1) : NULL;
    if (!c || (c->raw && c->cap >= cap)) {
        block_free(raw, cap + 64);
        return;
    }
    block_free(c->raw, c->cap + 64);
    c->raw = raw;
    c->cap = cap;
}

void mha_release_workspace(void)
{
    mha_work_cache *c = work_cache(0);
    if (c) {
        block_free(c->raw, c->cap + 64);
        c->raw = NULL;
        c->cap = 0;
    }
}
