/* BLAKE2b (RFC 7693), unkeyed, written for the prefix identity: hashing a prompt prefix happens on
 * every admission, so it runs in C without building a bytes object (with the GIL held: see
 * docs/DESIGN.md, "Ownership").  The tests check it against hashlib.blake2b. */
#include <string.h>
#include "qualia_internal.h"

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
    0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64_le(const uint8_t *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24)
           | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48)
           | ((uint64_t)p[7] << 56);
}

#define B2B_G(a, b, c, d, x, y)          \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr64(v[d] ^ v[a], 32);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 24);  \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr64(v[d] ^ v[a], 16);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 63);  \
    } while (0)

static void blake2b_compress(qualia_blake2b *s, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
    for (int i = 0; i < 16; i++) m[i] = load64_le(s->buf + 8 * i);
    /* the twelve rounds written out, so every message index is a compile-time constant */
#define B2B_ROUND(r)                                                              \
    do {                                                                          \
        B2B_G(0, 4, 8, 12, m[blake2b_sigma[r][0]], m[blake2b_sigma[r][1]]);       \
        B2B_G(1, 5, 9, 13, m[blake2b_sigma[r][2]], m[blake2b_sigma[r][3]]);       \
        B2B_G(2, 6, 10, 14, m[blake2b_sigma[r][4]], m[blake2b_sigma[r][5]]);      \
        B2B_G(3, 7, 11, 15, m[blake2b_sigma[r][6]], m[blake2b_sigma[r][7]]);      \
        B2B_G(0, 5, 10, 15, m[blake2b_sigma[r][8]], m[blake2b_sigma[r][9]]);      \
        B2B_G(1, 6, 11, 12, m[blake2b_sigma[r][10]], m[blake2b_sigma[r][11]]);    \
        B2B_G(2, 7, 8, 13, m[blake2b_sigma[r][12]], m[blake2b_sigma[r][13]]);     \
        B2B_G(3, 4, 9, 14, m[blake2b_sigma[r][14]], m[blake2b_sigma[r][15]]);     \
    } while (0)
    B2B_ROUND(0);
    B2B_ROUND(1);
    B2B_ROUND(2);
    B2B_ROUND(3);
    B2B_ROUND(4);
    B2B_ROUND(5);
    B2B_ROUND(6);
    B2B_ROUND(7);
    B2B_ROUND(8);
    B2B_ROUND(9);
    B2B_ROUND(10);
    B2B_ROUND(11);
#undef B2B_ROUND
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

void qualia_blake2b_init(qualia_blake2b *s, size_t outlen)
{
    for (int i = 0; i < 8; i++) s->h[i] = blake2b_iv[i];
    s->h[0] ^= 0x01010000ull ^ (uint64_t)outlen;
    s->t[0] = s->t[1] = 0;
    s->c = 0;
    s->outlen = outlen;
    memset(s->buf, 0, sizeof s->buf);
}

void qualia_blake2b_update(qualia_blake2b *s, const void *data, size_t n)
{
    const uint8_t *in = (const uint8_t *)data;
    while (n > 0) {
        if (s->c == 128) { /* compress a full buffer only once more input is known to follow */
            s->t[0] += 128;
            if (s->t[0] < 128) s->t[1]++;
            blake2b_compress(s, 0);
            s->c = 0;
        }
        size_t take = 128 - s->c;
        if (take > n) take = n;
        memcpy(s->buf + s->c, in, take);
        s->c += take;
        in += take;
        n -= take;
    }
}

void qualia_blake2b_final(qualia_blake2b *s, uint8_t *out)
{
    s->t[0] += s->c;
    if (s->t[0] < s->c) s->t[1]++;
    memset(s->buf + s->c, 0, 128 - s->c);
    blake2b_compress(s, 1);
    for (size_t i = 0; i < s->outlen; i++) out[i] = (uint8_t)(s->h[i >> 3] >> (8 * (i & 7)));
}

void qualia_prefix_digest(const uint8_t *ns, uint32_t ns_len, const void *tokens, size_t n,
                          uint8_t out[16])
{
    /* `tokens` need not be 4-byte aligned: each id is read with memcpy, never through a
       uint32_t pointer (a misaligned u32 load is undefined behaviour). */
    const unsigned char *src = (const unsigned char *)tokens;
    qualia_blake2b s;
    uint8_t le[4];
    uint8_t chunk[128];
    qualia_blake2b_init(&s, 16);
    le[0] = (uint8_t)ns_len;
    le[1] = (uint8_t)(ns_len >> 8);
    le[2] = (uint8_t)(ns_len >> 16);
    le[3] = (uint8_t)(ns_len >> 24);
    qualia_blake2b_update(&s, le, 4);
    if (ns_len) qualia_blake2b_update(&s, ns, ns_len);
    /* token ids go in as little-endian u32, 32 at a time */
    while (n > 0) {
        size_t k = n < 32 ? n : 32;
        for (size_t i = 0; i < k; i++) {
            uint32_t t;
            memcpy(&t, src + 4 * i, sizeof t);
            chunk[4 * i] = (uint8_t)t;
            chunk[4 * i + 1] = (uint8_t)(t >> 8);
            chunk[4 * i + 2] = (uint8_t)(t >> 16);
            chunk[4 * i + 3] = (uint8_t)(t >> 24);
        }
        qualia_blake2b_update(&s, chunk, 4 * k);
        src += 4 * k;
        n -= k;
    }
    qualia_blake2b_final(&s, out);
}
