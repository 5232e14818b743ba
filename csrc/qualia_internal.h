/* Declarations private to the compiled core (not part of the backend ABI). */
#ifndef QUALIA_INTERNAL_H
#define QUALIA_INTERNAL_H
#include <stddef.h>
#include <stdint.h>

typedef struct qualia_blake2b {
    uint64_t h[8];
    uint64_t t[2];
    size_t c;
    size_t outlen;
    uint8_t buf[128];
} qualia_blake2b;

void qualia_blake2b_init(qualia_blake2b *s, size_t outlen);
void qualia_blake2b_update(qualia_blake2b *s, const void *data, size_t n);
void qualia_blake2b_final(qualia_blake2b *s, uint8_t *out);
/* BLAKE2b-128 over: u32-LE len(ns), ns, each token as u32-LE (docs/DESIGN.md,
   "Prefix identity").  `tokens` holds n native-endian u32 ids at any alignment. */
void qualia_prefix_digest(const uint8_t *ns, uint32_t ns_len, const void *tokens, size_t n,
                          uint8_t out[16]);

/* The positions and KV slots of one whole page of 16 tokens, from position `pos` and slot
   `slot`: the lowering's common case, as vector stores where the compiler has vectors (a fixed
   16-iteration loop is unrolled into 32 scalar stores instead). */
static inline void qualia_lower_page16(int32_t *positions, int64_t *slots, uint32_t pos,
                                       int64_t slot) {
    /* positions are computed unsigned (wrapping, as the plan's int32 positions take them) */
    int i;
#if defined(__GNUC__) || defined(__clang__)
    typedef uint32_t qualia_v4u32 __attribute__((vector_size(16)));
    typedef int64_t qualia_v2i64 __attribute__((vector_size(16)));
    qualia_v4u32 p = {pos, pos + 1u, pos + 2u, pos + 3u};
    const qualia_v4u32 p4 = {4u, 4u, 4u, 4u};
    qualia_v2i64 s = {slot, slot + 1};
    const qualia_v2i64 s2 = {2, 2};
    for (i = 0; i < 4; i++) {
        __builtin_memcpy(positions + 4 * i, &p, sizeof(p));
        p += p4;
    }
    for (i = 0; i < 8; i++) {
        __builtin_memcpy(slots + 2 * i, &s, sizeof(s));
        s += s2;
    }
#else
    for (i = 0; i < 16; i++) {
        positions[i] = (int32_t)(pos + (uint32_t)i);
        slots[i] = slot + i;
    }
#endif
}
#endif
