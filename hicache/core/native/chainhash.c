/* hicache's page-key chain, the one hot loop of `match` that Python cannot run fast enough.
 *
 *   key[-1] = seed                                  (16 bytes)
 *   d[i]    = SHA-256(page i as int32 little-endian) (32 bytes; each page on its own)
 *   key[i]  = SHA-256(key[i-1] || d[i])[0:16]        (a 48-byte message: one block)
 *
 * Contract: hicache_chain() writes n_pages keys of 16 bytes to `out` and returns 0. page_bytes
 * may be any size (hicache passes 4 * page_tokens). Every path gives exactly the bytes of the
 * pure-Python fallback in hicache/keys.py.
 *
 * Why two hashes per page: the page digests do not depend on each other, so on x86-64 CPUs with
 * the SHA extensions two pages are hashed in lockstep, each stream's instructions filling the
 * other's wait on the latency of sha256rnds2, and only the one-block chain step stays sequential.
 * (Hashing key[i-1] || page i directly chains every block of every page, and runs at that
 * latency.) The SHA-NI code is compiled with per-function target attributes, not -msha, so the
 * library loads on any CPU and takes that path only once CPUID says it may.
 *
 * Elsewhere (other CPUs, or after hicache_chain_force_portable(1)) SHA-256 is OpenSSL's: the
 * Python loader passes in the addresses of SHA256_Init, _Update and _Final from the libcrypto that
 * hashlib already loaded, so this file needs no headers or libraries beyond libc.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

typedef int (*init_fn)(void *ctx);
typedef int (*update_fn)(void *ctx, const void *data, size_t len);
typedef int (*final_fn)(unsigned char *md, void *ctx);

enum { KEY_BYTES = 16, DIGEST_BYTES = 32, BLOCK = 64, CTX_BYTES = 256 }; /* SHA256_CTX: 112 */

static int force_portable; /* tests only */

/* Portable path: the same two hashes per page through OpenSSL. */
static void chain_portable(init_fn init, update_fn update, final_fn final,
                           const unsigned char *seed, const unsigned char *pages,
                           size_t page_bytes, size_t n_pages, unsigned char *out)
{
    _Alignas(16) unsigned char ctx[CTX_BYTES];
    unsigned char d[DIGEST_BYTES], md[DIGEST_BYTES];
    const unsigned char *prev = seed;
    for (size_t i = 0; i < n_pages; i++) {
        init(ctx);
        update(ctx, pages + i * page_bytes, page_bytes);
        final(d, ctx);
        init(ctx);
        update(ctx, prev, KEY_BYTES);
        update(ctx, d, DIGEST_BYTES);
        final(md, ctx);
        memcpy(out + i * KEY_BYTES, md, KEY_BYTES);
        prev = out + i * KEY_BYTES;
    }
}

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

#define SHA_NI __attribute__((target("sha,sse4.1,ssse3")))
#define SHA_NI_INLINE SHA_NI __attribute__((always_inline)) static inline

static int sha_ni_usable(void)
{
    static int known = -1; /* a benign race: every thread writes the same answer */
    if (known < 0) {
        unsigned a, b, c, d, ok = 0;
        if (__get_cpuid_max(0, NULL) >= 7) {
            __cpuid(1, a, b, c, d);
            ok = (c >> 9 & 1) && (c >> 19 & 1); /* SSSE3, SSE4.1 */
            __cpuid_count(7, 0, a, b, c, d);
            ok = ok && (b >> 29 & 1); /* SHA */
        }
        known = (int)ok;
    }
    return known;
}

static const _Alignas(16) uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

/* The SHA instructions keep the eight state words a..h in two registers, in the order the round
 * instruction wants them: `abef` holds f, e, b, a in lanes 0..3 and `cdgh` holds h, g, d, c.
 * sha256rnds2(cdgh, abef, wk) runs two rounds with W[t]+K[t] taken from lanes 0 and 1 of wk and
 * returns the new abef. Two rounds move a, b into c, d and e, f into g, h, so the old abef is
 * exactly the new cdgh: the two registers swap roles after one instruction and swap back after
 * the next, which is why four rounds below need no moves. */
typedef struct { __m128i abef, cdgh; } sha_state;

SHA_NI_INLINE sha_state initial_state(void)
{
    sha_state s = {_mm_set_epi32(0x6a09e667, (int)0xbb67ae85, 0x510e527f, (int)0x9b05688c),
                   _mm_set_epi32(0x3c6ef372, (int)0xa54ff53a, 0x1f83d9ab, 0x5be0cd19)};
    return s;
}

/* Swaps the bytes of each 32-bit lane: SHA-256 reads and writes big-endian words. */
SHA_NI_INLINE __m128i bswap32(__m128i x)
{
    return _mm_shuffle_epi8(x, _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3));
}

/* The message schedule runs four words at a time, in lanes 0..3 of one register. From the
 * sixteen words before them, W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16]: sha256msg1
 * gives W[t-16] + s0(W[t-15]) for four t, alignr cuts W[t-7..t-4] out of the two registers that
 * hold it, and sha256msg2 adds s1(W[t-2]), finishing lanes 0 and 1 before lanes 2 and 3 use them.
 * w0..w3 hold W[t-16..t-1]. */
SHA_NI_INLINE __m128i next_words(__m128i w0, __m128i w1, __m128i w2, __m128i w3)
{
    __m128i x = _mm_add_epi32(_mm_sha256msg1_epu32(w0, w1), _mm_alignr_epi8(w3, w2, 4));
    return _mm_sha256msg2_epu32(x, w3);
}

/* Rounds 4g..4g+3 with w = W[4g..4g+3]. */
SHA_NI_INLINE void rounds4(sha_state *s, __m128i w, int g)
{
    __m128i wk = _mm_add_epi32(w, _mm_load_si128((const __m128i *)&K[4 * g]));
    s->cdgh = _mm_sha256rnds2_epu32(s->cdgh, s->abef, wk);
    s->abef = _mm_sha256rnds2_epu32(s->abef, s->cdgh, _mm_unpackhi_epi64(wk, wk));
}

/* One 64-byte block into each of n states (n is 1 or 2, a constant once inlined). With two, the
 * streams are independent and their instructions interleave, so the CPU runs one's rounds
 * while the other's wait. w[k][j] starts as W[4j..4j+3] of stream k; once rounds 4g..4g+3 have
 * used slot g % 4, it is refilled with W[4g+16..4g+19], the words due four steps later. */
SHA_NI_INLINE void compress(int n, sha_state st[], const unsigned char *const blk[])
{
    sha_state saved[2];
    __m128i w[2][4];
    for (int k = 0; k < n; k++) {
        saved[k] = st[k];
        for (int j = 0; j < 4; j++)
            w[k][j] = bswap32(_mm_loadu_si128((const __m128i *)(blk[k] + 16 * j)));
    }
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++) {
        for (int k = 0; k < n; k++)
            rounds4(&st[k], w[k][g & 3], g);
        if (g < 12)
            for (int k = 0; k < n; k++)
                w[k][g & 3] = next_words(w[k][g & 3], w[k][(g + 1) & 3], w[k][(g + 2) & 3],
                                         w[k][(g + 3) & 3]);
    }
    for (int k = 0; k < n; k++) {
        st[k].abef = _mm_add_epi32(st[k].abef, saved[k].abef);
        st[k].cdgh = _mm_add_epi32(st[k].cdgh, saved[k].cdgh);
    }
}

static SHA_NI void compress1(sha_state st[1], const unsigned char *const blk[1])
{
    compress(1, st, blk);
}

static SHA_NI void compress2(sha_state st[2], const unsigned char *const blk[2])
{
    compress(2, st, blk);
}

/* The first `bytes` (16 or 32) bytes of the digest: a..h, big-endian. */
SHA_NI_INLINE void store_digest(const sha_state *s, unsigned char *out, size_t bytes)
{
    __m128i abef = _mm_shuffle_epi32(s->abef, 0x1B);     /* lanes a, b, e, f */
    __m128i ghcd = _mm_shuffle_epi32(s->cdgh, 0xB1);     /* lanes g, h, c, d */
    __m128i abcd = _mm_blend_epi16(abef, ghcd, 0xF0);    /* lanes 0-1 of abef, 2-3 of ghcd */
    _mm_storeu_si128((__m128i *)out, bswap32(abcd));
    if (bytes > 16) {
        __m128i efgh = _mm_alignr_epi8(ghcd, abef, 8); /* lanes 2-3 of abef, 0-1 of ghcd */
        _mm_storeu_si128((__m128i *)(out + 16), bswap32(efgh));
    }
}

/* The final block(s) of a `total`-byte message whose last total % 64 bytes start at `rest`:
 * those bytes, 0x80, zeros, and the length in bits as a 64-bit big-endian number at the end.
 * Writes one block to buf, or two when the length does not fit; returns how many. */
static size_t pad_tail(unsigned char buf[2 * BLOCK], const unsigned char *rest, size_t total)
{
    size_t r = total % BLOCK, n = r < BLOCK - 8 ? 1 : 2;
    uint64_t bits = (uint64_t)total * 8;
    memset(buf, 0, n * BLOCK);
    memcpy(buf, rest, r);
    buf[r] = 0x80;
    for (int i = 0; i < 8; i++)
        buf[n * BLOCK - 1 - i] = (unsigned char)(bits >> (8 * i));
    return n;
}

/* One block of each of n (1 or 2) streams. */
static SHA_NI void compress_n(int n, sha_state st[2], const unsigned char *const blk[2])
{
    if (n == 2)
        compress2(st, blk);
    else
        compress1(st, blk);
}

/* SHA-256 of n (1 or 2) pages of `bytes` bytes each, in lockstep; digest k goes to d[k]. */
static SHA_NI void page_digests(int n, const unsigned char *const page[2], size_t bytes,
                                unsigned char *const d[2])
{
    sha_state st[2] = {initial_state(), initial_state()};
    unsigned char tail[2][2 * BLOCK];
    size_t full = bytes / BLOCK, n_tail = 0;
    for (size_t b = 0; b < full; b++) {
        const unsigned char *blk[2] = {page[0] + b * BLOCK, page[1] + b * BLOCK};
        compress_n(n, st, blk);
    }
    for (int k = 0; k < n; k++)
        n_tail = pad_tail(tail[k], page[k] + full * BLOCK, bytes);
    for (size_t t = 0; t < n_tail; t++) {
        const unsigned char *blk[2] = {tail[0] + t * BLOCK, tail[1] + t * BLOCK};
        compress_n(n, st, blk);
    }
    for (int k = 0; k < n; k++)
        store_digest(&st[k], d[k], DIGEST_BYTES);
}

static SHA_NI void chain_sha_ni(const unsigned char *seed, const unsigned char *pages,
                                size_t page_bytes, size_t n_pages, unsigned char *out)
{
    /* The chain step's message for two pages: key[i-1] in bytes 0..15, d[i] in 16..47, then the
     * padding of a 48-byte message (0x80, zeros, the length 384 bits = 0x0180). */
    unsigned char msg[2][BLOCK] = {{0}};
    for (int k = 0; k < 2; k++) {
        msg[k][48] = 0x80;
        msg[k][BLOCK - 2] = 0x01;
        msg[k][BLOCK - 1] = 0x80;
    }
    unsigned char *const d[2] = {msg[0] + KEY_BYTES, msg[1] + KEY_BYTES};
    const unsigned char *prev = seed;
    for (size_t i = 0; i < n_pages; i += 2) {
        int n = i + 1 < n_pages ? 2 : 1; /* a trailing odd page is hashed alone */
        const unsigned char *page[2] = {pages + i * page_bytes, pages + (i + n - 1) * page_bytes};
        /* Prompts often come from memory the CPU caches no longer hold: ask for the pair after
         * next now, so that its lines arrive while this pair and the next are hashed. */
        if (i + 4 < n_pages) {
            const unsigned char *ahead = pages + (i + 4) * page_bytes;
            const size_t end = (n_pages - i - 4 < 2 ? n_pages - i - 4 : 2) * page_bytes;
            for (size_t off = 0; off < end; off += 64) __builtin_prefetch(ahead + off);
        }
        page_digests(n, page, page_bytes, d);
        for (int k = 0; k < n; k++) {
            sha_state st = initial_state();
            const unsigned char *blk[1] = {msg[k]};
            memcpy(msg[k], prev, KEY_BYTES);
            compress1(&st, blk);
            prev = out + (i + k) * KEY_BYTES;
            store_digest(&st, out + (i + k) * KEY_BYTES, KEY_BYTES);
        }
    }
}
#endif

static int use_sha_ni(void)
{
#if defined(__x86_64__)
    return !force_portable && sha_ni_usable();
#else
    return 0;
#endif
}

/* Writes n_pages keys of 16 bytes to out. Returns 0. */
int hicache_chain(void *init, void *update, void *final, const unsigned char *seed,
                  const unsigned char *pages, size_t page_bytes, size_t n_pages,
                  unsigned char *out)
{
#if defined(__x86_64__)
    if (use_sha_ni()) {
        chain_sha_ni(seed, pages, page_bytes, n_pages, out);
        return 0;
    }
#endif
    chain_portable((init_fn)init, (update_fn)update, (final_fn)final, seed, pages, page_bytes,
                   n_pages, out);
    return 0;
}

/* Tests only (not thread-safe): on != 0 makes hicache_chain take the OpenSSL path even where
 * SHA-NI is available. Returns 1 when hicache_chain uses SHA-NI from now on, else 0. */
int hicache_chain_force_portable(int on)
{
    force_portable = on != 0;
    return use_sha_ni();
}
