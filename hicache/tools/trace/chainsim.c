/* The planner's tier chain (hicache/trace/chainsim.py's ChainSim) with an LRU host tier,
 * compiled: the same steps in the same order, so that the results are equal (tests compare
 * them). Pages are dense ids [0, n_ids). No Python objects: the caller drops the GIL.
 *
 * Host books: a page is published or not; a published page has a pin count and is "fresh"
 * until it first becomes idle; the LRU list holds the published pages that have been idle
 * (insert = touch = to the young end); victims are the oldest idle ones (pinned ones met on
 * the way go to the young end). A store tier is an LRU list of objects (page groups and
 * tails) named by their last page, in units (an object of k pages: overhead + k * page_cost),
 * and the link's books of what it put or fetched (`known`).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RESERVED (-1)
enum { EXPLORE_EVERY = 32, MAX_STORES = 8 };

typedef struct {
    int32_t *prev, *next;
    int32_t head, tail;
    int64_t len;
    uint8_t *in;
} Lru;

static int lru_init(Lru *l, int64_t n)
{
    l->prev = malloc((size_t)n * sizeof(int32_t));
    l->next = malloc((size_t)n * sizeof(int32_t));
    l->in = calloc((size_t)n, 1);
    l->head = l->tail = -1;
    l->len = 0;
    return l->prev && l->next && l->in;
}

static void lru_free(Lru *l) { free(l->prev); free(l->next); free(l->in); }

static void lru_push(Lru *l, int32_t k)
{
    l->prev[k] = l->tail;
    l->next[k] = -1;
    if (l->tail >= 0) l->next[l->tail] = k; else l->head = k;
    l->tail = k;
    l->len++;
    l->in[k] = 1;
}

static void lru_unlink(Lru *l, int32_t k)
{
    if (l->prev[k] >= 0) l->next[l->prev[k]] = l->next[k]; else l->head = l->next[k];
    if (l->next[k] >= 0) l->prev[l->next[k]] = l->prev[k]; else l->tail = l->prev[k];
    l->len--;
    l->in[k] = 0;
}

static void lru_touch(Lru *l, int32_t k) { lru_unlink(l, k); lru_push(l, k); }

typedef struct {
    int64_t capacity, published, reserved, evicted, written;
    uint8_t *pub, *fresh;
    int32_t *refs;
    Lru lru;
} Host;

typedef struct {
    int64_t capacity, group, overhead, page_cost, used, skipped, fetches, read, written;
    int behind, worth;
    Lru objects;
    int32_t *size; /* pages of the object that ends at a page */
    uint8_t *known;
} Store;

static void pin(Host *h, const int32_t *pages, int64_t n)
{
    for (int64_t i = 0; i < n; i++) h->refs[pages[i]]++;
}

static void release(Host *h, const int32_t *items, int64_t n)
{
    for (int64_t i = n - 1; i >= 0; i--) {
        int32_t p = items[i];
        if (p == RESERVED) { h->reserved--; continue; }
        if (--h->refs[p]) continue;
        if (h->fresh[p]) { h->fresh[p] = 0; lru_push(&h->lru, p); }
        else lru_touch(&h->lru, p);
    }
}

static int64_t reserve(Host *h, int64_t n)
{
    int64_t free_slots = h->capacity - h->published - h->reserved;
    int64_t got = n < free_slots ? n : (free_slots > 0 ? free_slots : 0);
    while (got < n) {
        int32_t victim = -1;
        for (int64_t i = 0, len = h->lru.len; i < len; i++) {
            int32_t k = h->lru.head;
            if (!h->refs[k]) { victim = k; break; }
            lru_touch(&h->lru, k);
        }
        if (victim < 0) break;
        lru_unlink(&h->lru, victim);
        h->pub[victim] = 0;
        h->published--;
        h->evicted++;
        got++;
    }
    h->reserved += got;
    return got;
}

static void publish(Host *h, const int32_t *pages, int64_t n, int32_t *items)
{
    for (int64_t i = 0; i < n; i++) {
        int32_t p = pages[i];
        if (h->pub[p]) { items[i] = RESERVED; continue; }
        h->pub[p] = 1;
        h->fresh[p] = 1;
        h->refs[p]++;
        h->published++;
        h->reserved--;
        h->written++;
        items[i] = p;
    }
}

static int64_t prefix(const Host *h, const int32_t *pages, int64_t n)
{
    int64_t k = 0;
    while (k < n && h->pub[pages[k]]) k++;
    return k;
}

static int64_t store_cost(const Store *s, int64_t pages) { return s->overhead + pages * s->page_cost; }

/* StoreSim.put: the object of k pages that ends at page `end` */
static void store_put(Store *s, int32_t end, int64_t k)
{
    s->known[end] = 1;
    s->written += k;
    if (s->objects.in[end]) return;
    int64_t cost = store_cost(s, k);
    while (s->used + cost > s->capacity && s->objects.len) {
        int32_t old = s->objects.head;
        s->used -= store_cost(s, s->size[old]);
        lru_unlink(&s->objects, old);
    }
    if (cost <= s->capacity) {
        lru_push(&s->objects, end);
        s->size[end] = (int32_t)k;
        s->used += cost;
    }
}

/* ChainSim._put: the full groups of pages[0, n) and its tail not known whose pages are held;
 * their pages pinned and released at once. `scratch` holds n entries. */
static void put_groups(Host *h, Store *s, const int32_t *pages, int64_t n, int32_t *scratch)
{
    int64_t G = s->group, m = 0;
    for (int64_t g = 0; g * G < n; g++) {
        const int32_t *grp = pages + g * G;
        int64_t k = n - g * G < G ? n - g * G : G;
        if (s->known[grp[k - 1]]) continue;
        int held = 1;
        for (int64_t j = 0; j < k && held; j++) held = h->pub[grp[j]];
        if (!held) continue;
        store_put(s, grp[k - 1], k);
        memcpy(scratch + m, grp, (size_t)k * sizeof(int32_t));
        m += k;
    }
    pin(h, scratch, m);
    release(h, scratch, m);
}

typedef struct {
    int tier;
    int64_t host_pages, lo, hi;
    int32_t *items; /* NULL: brought nothing */
} Part;

/* ChainSim._walk */
static void walk(Host *h, Store *st, int n_stores, const int32_t *pages, int64_t n,
                 int64_t reached, int64_t cap, int after, Part *parts, int *n_parts,
                 int64_t *reads, int32_t *buf, int32_t *scratch)
{
    for (int i = after; i < n_stores; i++) {
        Store *s = &st[i];
        /* hicache.core.span.Span.of */
        int64_t G = s->group, first = reached / G;
        int64_t last = (cap + G - 1) / G;
        if (n / G < last) last = n / G;
        if (last < first) last = first;
        int64_t groups = last - first, tail = last == n / G && cap > last * G ? n % G : 0;
        int64_t objects = groups + (tail > 0);
        if (!objects) continue;
        if (!s->worth && ++s->skipped % EXPLORE_EVERY) continue;
        s->fetches++;
        Part *part = &parts[(*n_parts)++];
        part->tier = i;
        part->host_pages = reached;
        part->lo = part->hi = 0;
        part->items = NULL;
        int64_t run = 0;
        while (run < groups && s->objects.in[pages[(first + run + 1) * G - 1]]) run++;
        if (run == groups && tail && s->objects.in[pages[n - 1]]) run++;
        for (int64_t o = run; o < objects; o++) { /* Fetcher._forget_missing */
            int32_t end = o < groups ? pages[(first + o + 1) * G - 1] : pages[n - 1];
            if (!s->objects.in[end]) s->known[end] = 0;
        }
        int64_t want = run > groups ? groups * G + tail : run * G;
        if (run) {
            int64_t got = reserve(h, want);
            if (got < want) {
                run = got / G < groups ? got / G : groups;
                want = run * G;
                h->reserved -= got - want;
            }
        }
        if (run) {
            for (int64_t o = 0; o < run; o++) {
                int32_t end = o < groups ? pages[(first + o + 1) * G - 1] : pages[n - 1];
                lru_touch(&s->objects, end);
                s->known[end] = 1;
            }
            s->read += want;
            reads[i] += want;
            part->lo = first * G;
            part->hi = first * G + want;
            part->items = buf + part->lo; /* buf: one slot per page of the prompt per part */
            publish(h, pages + part->lo, part->hi - part->lo, part->items);
            for (int j = 0; j < i; j++)
                if (st[j].behind) put_groups(h, &st[j], pages, part->hi, scratch);
        }
        int64_t next = part->host_pages > part->hi ? part->host_pages : part->hi;
        if (next < cap)
            walk(h, st, n_stores, pages, n, next, cap, i + 1, parts, n_parts, reads,
                 buf + n, scratch);
        return;
    }
}

/* Run the trace. stores: n_stores rows of {capacity units, group pages, behind, worth,
 * overhead units, units per page}.
 * Per request r: hit[r] (pages), tier_pages[r * (n_stores + 1) + t] (t = 0 the host),
 * reads[r * n_stores + i] (pages read from store i), written[r * (n_stores + 1) + t] (pages
 * written into the host / put to store i). out[2 + n_stores] = {host pages evicted, pages
 * dropped, then each store's fetches}.
 * Returns 0, or -1 when memory ran out. */
int hicache_chainsim(int64_t host_capacity, int64_t page_tokens, int64_t min_recompute,
                     int n_stores, const int64_t *stores, int64_t n_req, const int64_t *starts,
                     const int32_t *ids, const int64_t *tokens, int64_t n_ids, int32_t *hit,
                     int64_t *tier_pages, int64_t *reads, int64_t *written, int64_t *out)
{
    if (n_stores > MAX_STORES) return -1;
    int64_t longest = 1, n = n_ids > 0 ? n_ids : 1;
    for (int64_t r = 0; r < n_req; r++)
        if (starts[r + 1] - starts[r] > longest) longest = starts[r + 1] - starts[r];
    Host h;
    memset(&h, 0, sizeof h);
    h.capacity = host_capacity;
    Store st[MAX_STORES];
    memset(st, 0, sizeof st);
    int ok = lru_init(&h.lru, n);
    h.pub = calloc((size_t)n, 1);
    h.fresh = calloc((size_t)n, 1);
    h.refs = calloc((size_t)n, sizeof(int32_t));
    for (int i = 0; i < n_stores; i++) {
        const int64_t *row = stores + 6 * i;
        st[i].capacity = row[0];
        st[i].group = row[1];
        st[i].behind = (int)row[2];
        st[i].worth = (int)row[3];
        st[i].overhead = row[4];
        st[i].page_cost = row[5];
        ok = lru_init(&st[i].objects, n) && ok;
        st[i].known = calloc((size_t)n, 1);
        st[i].size = calloc((size_t)n, sizeof(int32_t));
        ok = ok && st[i].known && st[i].size;
    }
    int32_t *lease = malloc((size_t)longest * 2 * sizeof(int32_t));
    int32_t *buf = malloc((size_t)longest * (n_stores + 1) * sizeof(int32_t));
    int32_t *scratch = malloc((size_t)longest * 3 * sizeof(int32_t));
    int rc = 0;
    if (!ok || !h.pub || !h.fresh || !h.refs || !lease || !buf || !scratch) { rc = -1; goto done; }
    int64_t dropped = 0;
    Part parts[MAX_STORES];
    const int T = n_stores + 1;
    for (int64_t r = 0; r < n_req; r++) {
        const int32_t *pages = ids + starts[r];
        const int64_t np = starts[r + 1] - starts[r];
        int64_t usable = tokens[r] - min_recompute;
        int64_t cap = usable > 0 ? usable / page_tokens : 0;
        int64_t found = prefix(&h, pages, np);
        int64_t got = found < cap ? found : cap;
        int64_t *tp = tier_pages + r * T, *rd = reads + r * n_stores, *wr = written + r * T;
        int64_t host_written = h.written, store_written[MAX_STORES];
        for (int i = 0; i < n_stores; i++) store_written[i] = st[i].written;
        memcpy(lease, pages, (size_t)got * sizeof(int32_t));
        int64_t n_lease = got;
        pin(&h, lease, n_lease);
        int n_parts = 0;
        if (n_stores && found < cap)
            walk(&h, st, n_stores, pages, np, found, cap, 0, parts, &n_parts, rd, buf, scratch);
        if (n_parts) {
            Part *one = NULL;
            int brought = 0;
            for (int k = 0; k < n_parts; k++)
                if (parts[k].items) { brought++; one = &parts[k]; }
            int shortcut = brought == 1 && one->hi >= cap && one->lo <= got && got < cap;
            if (shortcut)
                for (int64_t p = got; p < one->hi && shortcut; p++)
                    shortcut = one->items[p - one->lo] != RESERVED;
            if (shortcut) {
                release(&h, one->items + (cap - one->lo), one->hi - cap);
                release(&h, one->items, got - one->lo);
                memcpy(lease + n_lease, one->items + (got - one->lo),
                       (size_t)(cap - got) * sizeof(int32_t));
                n_lease += cap - got;
                tp[one->tier + 1] += cap - got;
                got = cap;
            } else {
                release(&h, lease, n_lease);
                int64_t again = prefix(&h, pages, np);
                got = again < cap ? again : cap;
                memcpy(lease, pages, (size_t)got * sizeof(int32_t));
                n_lease = got;
                pin(&h, lease, n_lease);
                int64_t done_to = 0;
                for (int k = 0; k < n_parts; k++) {
                    int64_t begin = done_to > parts[k].host_pages ? done_to : parts[k].host_pages;
                    if (parts[k].lo > begin) begin = parts[k].lo;
                    int64_t end = got < parts[k].hi ? got : parts[k].hi;
                    if (end > begin) { tp[parts[k].tier + 1] += end - begin; done_to = end; }
                }
                for (int k = 0; k < n_parts; k++)
                    if (parts[k].items)
                        release(&h, parts[k].items, parts[k].hi - parts[k].lo);
            }
        }
        int64_t from_stores = 0;
        for (int i = 0; i < n_stores; i++) from_stores += tp[i + 1];
        tp[0] = got - from_stores;
        hit[r] = (int32_t)got;
        release(&h, lease, n_lease); /* the load */
        /* store: held pages pinned, missing ones placed as far as room allows */
        int32_t *present = scratch, *missing = scratch + longest;
        int64_t n_present = 0, n_missing = 0;
        for (int64_t i = 0; i < np; i++) {
            if (h.pub[pages[i]]) present[n_present++] = pages[i];
            else missing[n_missing++] = pages[i];
        }
        pin(&h, present, n_present);
        int64_t placed = 0;
        if (n_missing) {
            placed = reserve(&h, n_missing);
            dropped += n_missing - placed;
            publish(&h, missing, placed, lease);
        }
        release(&h, lease, placed);
        release(&h, present, n_present);
        for (int i = 0; i < n_stores; i++)
            if (st[i].behind) put_groups(&h, &st[i], pages, np, scratch + 2 * longest);
        wr[0] = h.written - host_written;
        for (int i = 0; i < n_stores; i++) wr[i + 1] = st[i].written - store_written[i];
    }
    out[0] = h.evicted;
    out[1] = dropped;
    for (int i = 0; i < n_stores; i++) out[2 + i] = st[i].fetches;
done:
    lru_free(&h.lru);
    free(h.pub); free(h.fresh); free(h.refs);
    for (int i = 0; i < n_stores; i++) {
        lru_free(&st[i].objects);
        free(st[i].known);
        free(st[i].size);
    }
    free(lease); free(buf); free(scratch);
    return rc;
}
