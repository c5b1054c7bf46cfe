/* hugemap.h: a fresh mapping at a 2 MiB boundary, asked for in huge pages:
 * the core's workspaces (memory.c) and the binding's result arrays
 * (mha_ext/_core_mem.c) from 2 MiB on.  Linux's default for transparent huge
 * pages is "madvise": malloc's blocks get 4 KiB pages, and Q, K, V and the
 * context scattered per head through them miss the TLB on most pages.
 * MHA_HUGEMAP is 0 where there is no MADV_HUGEPAGE, and in a sanitizer build
 * (MHA_SANITIZED: ASan then checks the workspaces' bounds as malloc's);
 * callers then allocate as before. */
#ifndef MHA_HUGEMAP_H
#define MHA_HUGEMAP_H

#include <stddef.h>
#include <stdint.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define MHA_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MHA_SANITIZED 1
#endif
#endif
#ifndef MHA_SANITIZED
#define MHA_SANITIZED 0
#endif

#if defined(__linux__) && defined(MADV_HUGEPAGE) && !MHA_SANITIZED
#define MHA_HUGEMAP 1
#define MHA_HUGE_BYTES ((size_t)2 << 20)

/* len bytes (a multiple of the page), zero, at a 2 MiB boundary; NULL when
 * the mapping fails.  munmap(p, len) gives them back. */
static inline void *mha_huge_map(size_t len)
{
    char *p, *a;
    if (len == 0 || len > (size_t)-1 - MHA_HUGE_BYTES) return NULL;
    p = (char *)mmap(NULL, len + MHA_HUGE_BYTES, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == (char *)MAP_FAILED) return NULL;
    /* the aligned len bytes inside; the rest back */
    a = (char *)(((uintptr_t)p + MHA_HUGE_BYTES - 1) & ~(uintptr_t)(MHA_HUGE_BYTES - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    munmap(a + len, (size_t)(p + MHA_HUGE_BYTES - a));
    madvise(a, len, MADV_HUGEPAGE); /* a hint: its failure changes nothing */
    return a;
}
#else
#define MHA_HUGEMAP 0
#endif

#endif
