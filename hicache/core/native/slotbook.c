/* The books of a slot pool (hicache/slots.py) in C: pins, the LRU list, the free stack, and each
 * published slot's key, kept next to the key index (keyindex.c) that maps keys to slots.
 *
 * Why: a store of 64 pages reserves, evicts, publishes and unpins 64 slots. In Python that is a
 * few hundred object operations (OrderedDict moves, list stores, numpy fancy indexing), about
 * 2 us a page; here it is a few array writes a page, and one call per operation.
 *
 * Every array is owned by the Python side (numpy) and lives as long as the pool; this file only
 * reads and writes through the pointers in `Books`. Slot states: FREE (on the free stack),
 * RESERVED (handed out, no key yet, or its key was found held already), PUBLISHED (indexed, in
 * the LRU list). The LRU list is doubly linked through prev/next, oldest at `head`.
 *
 * The semantics are those of the Python books in slots.py, step for step (the tests run both
 * and compare): reserve pops the free stack then evicts from the LRU head, moving pinned slots
 * it meets to the tail; unpin makes idle slots most recent from the last to the first, so that
 * a sequence's head ends up newer than its tail. Not thread-safe: the engine thread only.
 */
#include <stdint.h>
#include <string.h>

#include "native.h"

enum { FREE = 0, RESERVED = 1, PUBLISHED = 2 };

typedef struct {
    Entry *table;        /* the key index's table (keyindex.c) */
    uint64_t mask;       /* its size - 1 */
    int64_t *index_len;  /* its key count, shared with the Python side */
    int64_t cap;
    int32_t *refs;
    uint8_t *state;
    unsigned char *keys; /* cap * 16 bytes: the key of each published slot */
    int32_t *prev, *next;
    int32_t head, tail;  /* oldest, newest; -1 when the list is empty */
    int64_t lru_len;
    int32_t *free_stack;
    int64_t n_free;
} Books;

static void lru_unlink(Books *b, int32_t s)
{
    int32_t p = b->prev[s], n = b->next[s];
    if (p >= 0) b->next[p] = n; else b->head = n;
    if (n >= 0) b->prev[n] = p; else b->tail = p;
    b->lru_len--;
}

static void lru_append(Books *b, int32_t s)
{
    b->prev[s] = b->tail;
    b->next[s] = -1;
    if (b->tail >= 0) b->next[b->tail] = s; else b->head = s;
    b->tail = s;
    b->lru_len++;
}

/* Returns -1 - j for the first slot j out of range, else 0. */
static int64_t check_range(const Books *b, const int32_t *slots, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        if (slots[j] < 0 || slots[j] >= b->cap) return -1 - j;
    return 0;
}

int64_t hicache_books_pin(Books *b, const int32_t *slots, int64_t n)
{
    int64_t bad = check_range(b, slots, n);
    if (bad) return bad;
    for (int64_t j = 0; j < n; j++) b->refs[slots[j]]++;
    return 0;
}

/* Drops one pin of each slot. Slots nobody pins any more become the most recent (published) or
 * go back on the free stack (reserved), from the last slot to the first. Returns 0, or -1 - j
 * (changing nothing) when slot j holds no pin or is out of range. */
int64_t hicache_books_unpin(Books *b, const int32_t *slots, int64_t n)
{
    int64_t bad = check_range(b, slots, n);
    if (bad) return bad;
    for (int64_t j = 0; j < n; j++)
        if (b->refs[slots[j]] <= 0) return -1 - j;
    for (int64_t j = n - 1; j >= 0; j--) {
        int32_t s = slots[j];
        if (--b->refs[s]) continue;
        if (b->state[s] == PUBLISHED) {
            lru_unlink(b, s);
            lru_append(b, s);
        } else if (b->state[s] == RESERVED) {
            b->state[s] = FREE;
            b->free_stack[b->n_free++] = s;
        }
    }
    return 0;
}

/* Up to n slots into out, pinned: the free stack first (top first), then unpinned published
 * slots from the LRU head, unpublished (their keys go to evicted_keys, 16 bytes each, and leave
 * the index). Pinned slots met on the way move to the tail; each slot is looked at once.
 * Returns the number of slots given; *n_evicted says how many of them were evicted. */
int64_t hicache_books_reserve(Books *b, int64_t n, int32_t *out, unsigned char *evicted_keys,
                              int64_t *n_evicted)
{
    int64_t got = 0, evicted = 0;
    while (got < n && b->n_free > 0) {
        int32_t s = b->free_stack[--b->n_free];
        b->state[s] = RESERVED;
        out[got++] = s;
    }
    for (int64_t unseen = b->lru_len; got < n && unseen > 0; unseen--) {
        int32_t s = b->head;
        lru_unlink(b, s);
        if (b->refs[s]) { /* in use, so recently used */
            lru_append(b, s);
            continue;
        }
        memcpy(evicted_keys + 16 * evicted, b->keys + 16 * (int64_t)s, 16);
        evicted++;
        b->state[s] = RESERVED;
        out[got++] = s;
    }
    *b->index_len -= hicache_index_remove(b->table, b->mask, evicted_keys, evicted);
    for (int64_t j = 0; j < got; j++) b->refs[out[j]]++;
    *n_evicted = evicted;
    return got;
}

/* Makes reserved slots findable under their keys (n keys of 16 bytes). A key held already is
 * not published twice: fresh[j] = 0 and slot j stays reserved. Returns the number published,
 * or -1 - j (changing nothing) when slot j is out of range or not reserved. */
int64_t hicache_books_publish(Books *b, const int32_t *slots, const unsigned char *keys,
                              int64_t n, uint8_t *fresh)
{
    int64_t bad = check_range(b, slots, n);
    if (bad) return bad;
    for (int64_t j = 0; j < n; j++)
        if (b->state[slots[j]] != RESERVED) return -1 - j;
    int64_t added = hicache_index_insert(b->table, b->mask, keys, slots, n, fresh);
    *b->index_len += added;
    for (int64_t j = 0; j < n; j++) {
        if (!fresh[j]) continue;
        int32_t s = slots[j];
        memcpy(b->keys + 16 * (int64_t)s, keys + 16 * j, 16);
        b->state[s] = PUBLISHED;
        lru_append(b, s);
    }
    return added;
}

/* The LRU list, oldest first, into out (room for lru_len). Returns its length. */
int64_t hicache_books_lru(const Books *b, int32_t *out)
{
    int64_t n = 0;
    for (int32_t s = b->head; s >= 0 && n <= b->cap; s = b->next[s]) out[n++] = s;
    return n;
}
