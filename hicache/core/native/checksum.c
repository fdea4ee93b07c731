/* The payload checksum of stored objects (hicache/core/checksum.py has its contract and a numpy
 * twin that gives the same value).
 *
 * The bytes of an object's pieces, in order, are one stream of little-endian 64-bit words w_i
 * (the last zero-padded). Each word is mixed with its position and summed:
 *     sum = SUM_i mix(w_i ^ (i * GOLDEN))   (mod 2^64)
 * and the checksum is mix(sum + mix(nbytes ^ seed)). `mix` is a bijection of 64-bit words, so a
 * change of any one word always changes the sum; the terms are independent, so the loop has no
 * chain from one word to the next (two multiplies a word, no table, no special instructions).
 */
#include <stdint.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define MIXER 0xD6E8FEB86659FD93ULL

static inline uint64_t mix(uint64_t x)
{
    x ^= x >> 32;
    x *= MIXER;
    x ^= x >> 32;
    x *= MIXER;
    x ^= x >> 32;
    return x;
}

typedef struct {
    uint64_t sum, nbytes, carry;
} State;

static void feed_word(State *s, uint64_t w)
{
    s->sum += mix(w ^ (((s->nbytes >> 3) - 1) * GOLDEN));
}

static void feed(State *s, const unsigned char *p, uint64_t n)
{
    while ((s->nbytes & 7) && n) { /* finish a word begun by an earlier piece */
        s->carry |= (uint64_t)*p++ << (8 * (s->nbytes & 7));
        n--;
        if ((++s->nbytes & 7) == 0) {
            feed_word(s, s->carry);
            s->carry = 0;
        }
    }
    const uint64_t words = n >> 3;
    uint64_t key = (s->nbytes >> 3) * GOLDEN, a = 0, b = 0;
    uint64_t k = 0;
    for (; k + 1 < words; k += 2) { /* two sums: the adds of consecutive words overlap */
        uint64_t w0, w1;
        memcpy(&w0, p + 8 * k, 8);
        memcpy(&w1, p + 8 * k + 8, 8);
        a += mix(w0 ^ key);
        b += mix(w1 ^ (key + GOLDEN));
        key += 2 * GOLDEN;
    }
    if (k < words) {
        uint64_t w;
        memcpy(&w, p + 8 * k, 8);
        a += mix(w ^ key);
    }
    s->sum += a + b;
    s->nbytes += 8 * words;
    p += 8 * words;
    n -= 8 * words;
    for (uint64_t j = 0; j < n; j++) s->carry |= (uint64_t)p[j] << (8 * j);
    s->nbytes += n;
}

/* The checksum of the stream made by n pieces (ptrs[k], sizes[k] bytes), seeded by `seed`. */
uint64_t hicache_checksum(const uint64_t *ptrs, const uint64_t *sizes, int64_t n, uint64_t seed)
{
    State s = {0, 0, 0};
    for (int64_t k = 0; k < n; k++)
        feed(&s, (const unsigned char *)(uintptr_t)ptrs[k], sizes[k]);
    if (s.nbytes & 7) s.sum += mix(s.carry ^ ((s.nbytes >> 3) * GOLDEN));
    return mix(s.sum + mix(s.nbytes ^ seed));
}
