/* memory.c: aligned allocation, the per-thread workspace cache and the
 * streaming copy (internal.h).  Legend as in mha.h. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
 * some 13 ms of a 300 ms call here).  So each thread keeps its largest such
 * block for its next call.  Smaller blocks are left to malloc, which already
 * reuses them (and whose reuse depends on seeing them freed).  A block has a
 * 64-byte header holding its capacity.  Without a thread key (creation
 * failed) nothing is cached. */
#define MHA_WORK_CACHE_MIN ((size_t)32 << 20)
typedef struct {
    void *raw;
    size_t cap;
} mha_work_cache;

static pthread_once_t g_work_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_work_key;
static int g_work_key_ok;

static void work_cache_destroy(void *v)
{
    mha_work_cache *c = (mha_work_cache *)v;
    if (c) {
        free(c->raw);
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
    if (cap < bytes || cap > SIZE_MAX - 64) return NULL;
    c = cap >= MHA_WORK_CACHE_MIN ? work_cache(1) : NULL;
    if (c && c->raw) {
        if (c->cap >= cap) { /* the cached block is big enough: take it */
            raw = c->raw;
            c->raw = NULL;
            return (char *)raw + 64;
        }
        free(c->raw); /* too small: never hold two */
        c->raw = NULL;
    }
    if (posix_memalign(&raw, 64, cap + 64) != 0) return NULL;
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
    if (!c) {
        free(raw);
        return;
    }
    if (c->raw && c->cap >= cap) {
        free(raw);
        return;
    }
    free(c->raw);
    c->raw = raw;
    c->cap = cap;
}

void mha_release_workspace(void)
{
    mha_work_cache *c = work_cache(0);
    if (c) {
        free(c->raw);
        c->raw = NULL;
        c->cap = 0;
    }
}
