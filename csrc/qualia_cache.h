/* Private to the compiled core: the page hash of automatic prefix caching and the allocator of
   its large tables (qualia/core/pagecache.pxi; docs/DESIGN.md, "Automatic prefix caching"). */
#ifndef QUALIA_CACHE_H
#define QUALIA_CACHE_H
#include <stddef.h>
#include <stdint.h>

/* Zeroed memory for the core's large tables (the cache's records and index, the engine step's
   entries and token arena), 64-byte aligned (a record that fits a cache line starts one).  On
   Linux, tables of 2 MiB and more are mapped 2 MiB-aligned and marked for transparent huge
   pages, so that lookups spread over a million-page pool do not take a TLB miss per page;
   otherwise (and under AddressSanitizer, which guards heap blocks only) calloc.  A mapped table
   of at most 1 GiB is committed at once (every page written now, MADV_POPULATE_WRITE where the kernel has it):
   memory sized at construction is faulted in at construction, so no step pays a page fault, and
   a machine that cannot back the table fails the constructor (NULL: MemoryError) rather than a
   later step.  The 16 bytes
   below the returned pointer say how to free it: the block's base, and its mapped length (0:
   calloc'd). */
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#define QUALIA_HUGE ((size_t)2 << 20)
#define QUALIA_COMMIT_MAX ((size_t)1 << 30)   /* larger tables are faulted in as touched */
#if defined(__linux__) && defined(MAP_ANONYMOUS) && !defined(__SANITIZE_ADDRESS__)
#include <errno.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
/* Fault in [p, p + n) for writing: -1 where the kernel cannot back it. */
static int qualia_commit(char *p, size_t n) {
    volatile char *q = (volatile char *)p;
    size_t off;
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0)
        return 0;
    if (errno == ENOMEM)
        return -1;   /* the machine cannot back it */
    for (off = 0; off < n; off += 4096)   /* a kernel without the advice (or interrupted) */
        q[off] = 0;
    return 0;
}
#endif
static void *qualia_big_zalloc(size_t n) {
    char *p;
#if defined(__linux__) && defined(MAP_ANONYMOUS) && !defined(__SANITIZE_ADDRESS__)
    if (n >= QUALIA_HUGE && n < ((size_t)-1) / 2) {
        size_t len = n + QUALIA_HUGE;
        char *base = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == (char *)MAP_FAILED)
            return NULL;
        p = (char *)(((uintptr_t)base + QUALIA_HUGE) & ~(uintptr_t)(QUALIA_HUGE - 1));
#ifdef MADV_HUGEPAGE
        madvise(p, n, MADV_HUGEPAGE);
#endif
        if (n <= QUALIA_COMMIT_MAX && qualia_commit(p, n) != 0) {
            munmap(base, len);
            return NULL;
        }
        ((void **)p)[-2] = base;
        ((size_t *)p)[-1] = len;
        return p;
    }
#endif
    {
        char *base = (char *)calloc(1, n + 16 + 64);
        if (base == NULL)
            return NULL;
        p = (char *)(((uintptr_t)base + 16 + 63) & ~(uintptr_t)63);
        ((void **)p)[-2] = base;
        ((size_t *)p)[-1] = 0;
    }
    return p;
}
static void qualia_big_free(void *q) {
    char *p = (char *)q;
    if (p == NULL)
        return;
#if defined(__linux__) && defined(MAP_ANONYMOUS) && !defined(__SANITIZE_ADDRESS__)
    if (((size_t *)p)[-1] != 0) {
        munmap(((void **)p)[-2], ((size_t *)p)[-1]);
        return;
    }
#endif
    free(((void **)p)[-2]);
}
typedef struct { uint64_t lo, hi; } qualia_u128;
static inline qualia_u128 qualia_mul128(uint64_t a, uint64_t b) {
    qualia_u128 r;
#if defined(__SIZEOF_INT128__)
    __uint128_t p = (__uint128_t)a * b;
    r.lo = (uint64_t)p;
    r.hi = (uint64_t)(p >> 64);
#else
    uint64_t al = (uint32_t)a, ah = a >> 32, bl = (uint32_t)b, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t mid = (ll >> 32) + (uint32_t)lh + (uint32_t)hl;
    r.lo = (mid << 32) | (uint32_t)ll;
    r.hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
#endif
    return r;
}
static inline uint64_t qualia_mum(uint64_t a, uint64_t b) {
    qualia_u128 r = qualia_mul128(a, b);
    return r.lo ^ r.hi;
}
static inline uint64_t qualia_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static inline uint64_t qualia_page_hash_n(const uint64_t *k, const uint64_t *K, uint32_t n,
                                          uint64_t parent, int has_parent, uint64_t ns_hash,
                                          const uint32_t *t) {
    uint64_t lo = 0, hi = 0, w0, w1, x, u;
    qualia_u128 p;
    uint32_t i = 0, j = 0;
#if defined(__SIZEOF_INT128__)
    __uint128_t s = 0;
    for (; i + 4 <= n; i += 4, j += 2) {
        w0 = (uint64_t)t[i] | ((uint64_t)t[i + 1] << 32);
        w1 = (uint64_t)t[i + 2] | ((uint64_t)t[i + 3] << 32);
        s += (__uint128_t)(w0 + K[j]) * (w1 + K[j + 1]);
    }
    lo = (uint64_t)s;
    hi = (uint64_t)(s >> 64);
#else
    for (; i + 4 <= n; i += 4, j += 2) {
        w0 = (uint64_t)t[i] | ((uint64_t)t[i + 1] << 32);
        w1 = (uint64_t)t[i + 2] | ((uint64_t)t[i + 3] << 32);
        p = qualia_mul128(w0 + K[j], w1 + K[j + 1]);
        lo += p.lo;
        hi += p.hi + (lo < p.lo);
    }
#endif
    if (i < n) {  /* 1 to 3 tokens left: zero-padded to two words */
        w0 = t[i];
        w1 = 0;
        if (i + 1 < n) w0 |= (uint64_t)t[i + 1] << 32;
        if (i + 2 < n) w1 = t[i + 2];
        p = qualia_mul128(w0 + K[j], w1 + K[j + 1]);
        lo += p.lo;
        hi += p.hi + (lo < p.lo);
    }
    /* tokens and namespace fold into u off the chain; the chain step is one
       multiply-fold (the finaliser that makes an identity is applied off the chain) */
    u = qualia_mum(lo ^ k[2], hi ^ k[4]) ^ ns_hash;
    x = has_parent ? parent : k[0];
    return qualia_mum(x ^ k[1], u ^ k[3]);
}
static inline uint64_t qualia_page_chain(const uint64_t *k, const uint64_t *K, uint32_t n,
                                         uint64_t parent, int has_parent, uint64_t ns_hash,
                                         const uint32_t *t) {
    if (n == 16)  /* the common page size: a loop the compiler unrolls */
        return qualia_page_hash_n(k, K, 16, parent, has_parent, ns_hash, t);
    return qualia_page_hash_n(k, K, n, parent, has_parent, ns_hash, t);
}

/* The positions of the KV event ring (qualia/core/pagecache.pxi; docs/DESIGN.md, "KV events").
   The ring has one producer, the core, which may run without the GIL inside Scheduler.run(),
   and one consumer at a time, drain_events(), which runs with the GIL.  Each position is
   written by one side only: the side that writes it publishes with a release store, the other
   side reads it with an acquire load, so a consumer that sees a position sees every record
   below it complete, and the producer never reuses a record the consumer is still copying. */
#if defined(__GNUC__) || defined(__clang__)
static inline uint64_t qualia_load_acquire(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void qualia_store_release(uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
#else
#error "qualia's event ring needs the GCC/Clang __atomic builtins"
#endif
#endif
