/* hicache's key index: 16-byte page keys -> int32 slots, in one flat open-addressing table.
 *
 * Why not a Python dict: a lookup in a dict of 100K bytes keys touches three cold cache lines
 * (the index, the entry, the key object) and costs ~0.35 us once the engine's copies have flushed
 * the CPU caches. Here an entry holds its key inline, so a lookup touches one line, and batch
 * lookups, inserts and removals prefetch the buckets of the keys a few places ahead so that those
 * misses overlap.
 *
 * Layout: `cap` (a power of two) entries of {k0, k1, slot}; slot < 0 marks an empty bucket.
 * Keys are digests, so k0 (the first 8 bytes) is already uniform and serves as the hash. Linear
 * probing; removal shifts the following run back (no tombstones), so lookups stay short however
 * many inserts and removals have happened. The caller keeps the load at or below one half.
 *
 * Contract: the caller (hicache/native/index.py) passes a table of `cap` entries, keys as n
 * consecutive 16-byte strings, and never inserts more than cap / 2 keys. Not thread-safe.
 */
#include <stdint.h>
#include <string.h>

#include "native.h" /* Entry: {k0, k1, slot}; slot < 0: empty */

enum { AHEAD = 8 }; /* how many keys ahead a batch lookup prefetches */

static inline void load_key(const unsigned char *p, uint64_t *k0, uint64_t *k1)
{
    memcpy(k0, p, 8);
    memcpy(k1, p + 8, 8);
}

static inline void prefetch(const Entry *t, uint64_t mask, const unsigned char *key)
{
    uint64_t k0;
    memcpy(&k0, key, 8);
    __builtin_prefetch(&t[k0 & mask]);
}

/* The bucket that holds the key, or the empty bucket where its probe run ends. */
static inline uint64_t probe(const Entry *t, uint64_t mask, uint64_t k0, uint64_t k1)
{
    uint64_t i = k0 & mask;
    while (t[i].slot >= 0 && (t[i].k0 != k0 || t[i].k1 != k1)) i = (i + 1) & mask;
    return i;
}

/* Slots of keys[0..n) into out (-1 where missing). With stop_at_miss, stops at the first
 * missing key. Returns the number of keys looked up that were found. */
int64_t hicache_index_find(const Entry *t, uint64_t mask, const unsigned char *keys, int64_t n,
                           int32_t *out, int stop_at_miss)
{
    int64_t found = 0;
    for (int64_t j = 0; j < n && j < AHEAD; j++) prefetch(t, mask, keys + 16 * j);
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(t, mask, keys + 16 * (j + AHEAD));
        uint64_t k0, k1;
        load_key(keys + 16 * j, &k0, &k1);
        const Entry *e = &t[probe(t, mask, k0, k1)];
        if (e->slot < 0) {
            out[j] = -1;
            if (stop_at_miss) break;
            continue;
        }
        out[j] = (int32_t)e->slot;
        found++;
    }
    return found;
}

/* Splits keys[0..n) into the slots of those found (present, in order) and the positions of the
 * others (missing, in order); both hold room for n. Returns the number found. */
int64_t hicache_index_split(const Entry *t, uint64_t mask, const unsigned char *keys, int64_t n,
                            int32_t *present, int32_t *missing)
{
    hicache_index_find(t, mask, keys, n, present, 0);
    int64_t found = 0, lost = 0;
    for (int64_t j = 0; j < n; j++) { /* in place: found <= j */
        if (present[j] < 0)
            missing[lost++] = (int32_t)j;
        else
            present[found++] = present[j];
    }
    return found;
}

/* Inserts keys[j] -> slots[j] where the key is absent; fresh[j] says whether it was. Returns the
 * number inserted. */
int64_t hicache_index_insert(Entry *t, uint64_t mask, const unsigned char *keys,
                             const int32_t *slots, int64_t n, uint8_t *fresh)
{
    int64_t inserted = 0;
    for (int64_t j = 0; j < n && j < AHEAD; j++) prefetch(t, mask, keys + 16 * j);
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(t, mask, keys + 16 * (j + AHEAD));
        uint64_t k0, k1;
        load_key(keys + 16 * j, &k0, &k1);
        Entry *e = &t[probe(t, mask, k0, k1)];
        fresh[j] = e->slot < 0;
        if (e->slot < 0) {
            e->k0 = k0;
            e->k1 = k1;
            e->slot = slots[j];
            inserted++;
        }
    }
    return inserted;
}

/* Removes keys[0..n) where present. Returns the number removed. */
int64_t hicache_index_remove(Entry *t, uint64_t mask, const unsigned char *keys, int64_t n)
{
    int64_t removed = 0;
    for (int64_t j = 0; j < n && j < AHEAD; j++) prefetch(t, mask, keys + 16 * j);
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(t, mask, keys + 16 * (j + AHEAD));
        uint64_t k0, k1;
        load_key(keys + 16 * j, &k0, &k1);
        uint64_t hole = probe(t, mask, k0, k1);
        if (t[hole].slot < 0) continue;
        removed++;
        /* Backward shift: move each later entry of the run into the hole when the hole lies
         * on its probe path (between its home bucket and where it sits, cyclically). */
        for (uint64_t i = (hole + 1) & mask; t[i].slot >= 0; i = (i + 1) & mask) {
            const uint64_t home = t[i].k0 & mask;
            if (((i - home) & mask) >= ((i - hole) & mask)) {
                t[hole] = t[i];
                hole = i;
            }
        }
        t[hole].slot = -1;
    }
    return removed;
}
