/* What the C files of hicache/native share: built together into one library (see __init__.py). */
#ifndef HICACHE_NATIVE_H
#define HICACHE_NATIVE_H

#include <stddef.h>
#include <stdint.h>

enum { HICACHE_KEY_BYTES = 16 };

/* An entry of the key index (keyindex.c): a 16-byte key and its slot; slot < 0: empty. */
typedef struct {
    uint64_t k0, k1;
    int64_t slot;
} Entry;

int hicache_chain(void *init, void *update, void *final, const unsigned char *seed,
                  const unsigned char *pages, size_t page_bytes, size_t n_pages,
                  unsigned char *out);

int64_t hicache_index_find(const Entry *t, uint64_t mask, const unsigned char *keys, int64_t n,
                           int32_t *out, int stop_at_miss);
int64_t hicache_index_insert(Entry *t, uint64_t mask, const unsigned char *keys,
                             const int32_t *slots, int64_t n, uint8_t *fresh);
int64_t hicache_index_remove(Entry *t, uint64_t mask, const unsigned char *keys, int64_t n);

#endif
