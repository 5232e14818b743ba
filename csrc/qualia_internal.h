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
#endif
