/* The CPU twin of the page-copy kernel: page src_ids[k] -> page dst_ids[k], segment by segment.
 *
 * numpy's fancy indexing does the same in two passes per segment (a gather into a temporary,
 * then a scatter) and costs about 50 us for 64 pages of 4 KiB; one memcpy a row costs a third.
 * Segment tables are PagedBuffer.rows: per segment {address of page 0's row, row stride, row
 * bytes}, int64. Contract: the caller (hicache/kernels/cpu.py) has checked that both tables
 * have n_seg rows of equal row bytes, every id against both buffers, and that no destination
 * row is written twice.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void hicache_copy_pages_cpu(const int64_t *src_rows, const int64_t *dst_rows, int64_t n_seg,
                            const int32_t *src_ids, const int32_t *dst_ids, int64_t n)
{
    for (int64_t s = 0; s < n_seg; s++) {
        const unsigned char *src = (const unsigned char *)(uintptr_t)src_rows[3 * s];
        unsigned char *dst = (unsigned char *)(uintptr_t)dst_rows[3 * s];
        const int64_t src_stride = src_rows[3 * s + 1], dst_stride = dst_rows[3 * s + 1];
        const size_t bytes = (size_t)src_rows[3 * s + 2];
        for (int64_t k = 0; k < n; k++)
            memcpy(dst + dst_stride * dst_ids[k], src + src_stride * src_ids[k], bytes);
    }
}

/* Block ids for a copy: ids[0..n) (int32 or int64, `wide`) into out as int32, each checked
 * against [0, limit). Returns -1, or the position of the first id out of range. */
int64_t hicache_ids_int32(const void *ids, int wide, int64_t n, int64_t limit, int32_t *out)
{
    for (int64_t k = 0; k < n; k++) {
        const int64_t id = wide ? ((const int64_t *)ids)[k] : ((const int32_t *)ids)[k];
        if (id < 0 || id >= limit) return k;
        out[k] = (int32_t)id;
    }
    return -1;
}

/* out[k] = ids[at[k]] for k < n (positions checked by the caller). */
void hicache_gather_int32(const int32_t *ids, const int32_t *at, int64_t n, int32_t *out)
{
    for (int64_t k = 0; k < n; k++) out[k] = ids[at[k]];
}

/* +1 when v[0..n) strictly ascends, -1 when it strictly descends, 0 otherwise. */
static int direction(const int32_t *v, int64_t n)
{
    int up = 1, down = 1;
    for (int64_t k = 1; k < n && (up || down); k++) {
        up = up && v[k] > v[k - 1];
        down = down && v[k] < v[k - 1];
    }
    return up ? 1 : (down ? -1 : 0);
}

static int ascending(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Fresh slots for pages whose block ids run one way (ascending or descending): orders `slots`
 * the same way, so that consecutive blocks go to consecutive slots wherever the slots allow and
 * the copy merges their rows. Returns 1 if it did, 0 (slots untouched) when the ids run neither
 * way. Sorting is skipped for slots already in order or in reverse order (the usual cases). */
int hicache_align_slots(const int32_t *ids, int32_t *slots, int64_t n)
{
    const int want = direction(ids, n);
    if (n < 2 || want == 0) return 0;
    const int have = direction(slots, n);
    if (have == want) return 1;
    if (have != -want) qsort(slots, (size_t)n, sizeof(int32_t), ascending);
    if (have == -want || want < 0) { /* reverse: from the other order, or ascending -> descending */
        for (int64_t i = 0, j = n - 1; i < j; i++, j--) {
            const int32_t t = slots[i];
            slots[i] = slots[j];
            slots[j] = t;
        }
    }
    return 1;
}
