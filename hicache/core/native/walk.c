/* match's walk over the host tier: hash a prompt's pages two at a time and look each key up as
 * soon as it exists, stopping at the first key the index lacks. One call does what would take
 * Python a hash call and a lookup call per step, and hashes no page past the first miss's pair.
 */
#include <stddef.h>
#include <stdint.h>

#include "native.h"

/* Pages [0, n_pages) of `pages` (page_bytes each), chained from `prev` (16 bytes): writes each
 * hashed page's key to out_keys and the slots of the leading run found in the index (`table`,
 * mask + 1 entries) to out_slots. Stops after the pair holding the first miss. Stores the run's
 * length in *found and returns the number of pages hashed (a multiple of two, or n_pages). */
int64_t hicache_walk(void *init, void *update, void *final, const unsigned char *prev,
                     const unsigned char *pages, size_t page_bytes, size_t n_pages,
                     const Entry *table, uint64_t mask, unsigned char *out_keys,
                     int32_t *out_slots, int64_t *found)
{
    size_t done = 0;
    int64_t run = 0;
    while (done < n_pages) {
        const size_t n = n_pages - done < 2 ? n_pages - done : 2;
        const unsigned char *from = done ? out_keys + (done - 1) * HICACHE_KEY_BYTES : prev;
        if (done + 4 < n_pages) { /* the pair after next: its lines arrive while these hash */
            const unsigned char *ahead = pages + (done + 4) * page_bytes;
            const size_t span = (n_pages - done - 4 < 2 ? n_pages - done - 4 : 2) * page_bytes;
            for (size_t off = 0; off < span; off += 64) __builtin_prefetch(ahead + off);
        }
        hicache_chain(init, update, final, from, pages + done * page_bytes, page_bytes, n,
                      out_keys + done * HICACHE_KEY_BYTES);
        const int64_t got = hicache_index_find(table, mask, out_keys + done * HICACHE_KEY_BYTES,
                                               (int64_t)n, out_slots + done, 1);
        done += n;
        run += got;
        if (got < (int64_t)n) break;
    }
    *found = run;
    return (int64_t)done;
}
