/* The trace tool's one-tier simulation (hicache/trace/fastsim.py): a cache of `capacity` pages
 * under one eviction policy, driven by a trace's prompts, with the placement rules of
 * hicache/trace/simulate.py's PolicySim, step for step:
 *
 *   the leading run held is the hit (capped so that min_recompute tokens are computed); the
 *   hit's pages are touched, last to first; the prompt's held pages are pinned; victims are
 *   evicted for its missing pages (no more than there is room for); the leading missing pages
 *   that fit are inserted, last to first; the held pages are touched, last to first.
 *
 * The policies are those of hicache/eviction.py (LRU, ARC, S3-FIFO) and the offline reference
 * FarthestNextUse, with the same tie-breaks, so that the results are equal, not close. Pages
 * are dense ids [0, n_ids) given in the order of the trace's own page ids (the reference
 * breaks ties by id). No Python objects: the caller drops the GIL.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LRU = 0, ARC = 1, S3FIFO = 2, BELADY = 3 };
enum { OUT = 0 }; /* where[k]: 0 = in no list; else the list's tag */
enum { MAX_FREQ = 3 };

typedef struct {
    int32_t head, tail;
    int64_t len;
} List;

typedef struct {
    int64_t next;
    int32_t depth, key;
} Due;

typedef struct {
    int policy;
    int64_t capacity, small_cap, held, p;
    int32_t *prev, *nxt, *pin;
    uint8_t *where, *freq;
    List l[5]; /* LRU: 1 queue; ARC: 1 T1, 2 T2, 3 B1, 4 B2; S3FIFO: 1 small, 2 main, 3 ghosts */
    /* the reference: each held key's next use and depth, and a lazy heap of (next, depth, key) */
    int64_t *due_next;
    int32_t *due_depth;
    Due *heap;
    int64_t heap_len, heap_cap;
    int oom;
} Sim;

static void push_back(Sim *s, int tag, int32_t k)
{
    List *q = &s->l[tag];
    s->prev[k] = q->tail;
    s->nxt[k] = -1;
    if (q->tail >= 0) s->nxt[q->tail] = k; else q->head = k;
    q->tail = k;
    q->len++;
    s->where[k] = (uint8_t)tag;
}

static void unlink_key(Sim *s, int32_t k)
{
    List *q = &s->l[s->where[k]];
    if (s->prev[k] >= 0) s->nxt[s->prev[k]] = s->nxt[k]; else q->head = s->nxt[k];
    if (s->nxt[k] >= 0) s->prev[s->nxt[k]] = s->prev[k]; else q->tail = s->prev[k];
    q->len--;
    s->where[k] = OUT;
}

static void move_to_back(Sim *s, int32_t k)
{
    int tag = s->where[k];
    unlink_key(s, k);
    push_back(s, tag, k);
}

/* A bounded FIFO of ghosts (eviction.py's _Ghosts): add at the young end, drop the oldest. */
static void ghost_add(Sim *s, int tag, int32_t k)
{
    if (s->capacity <= 0) return;
    push_back(s, tag, k);
    if (s->l[tag].len > s->capacity) unlink_key(s, s->l[tag].head);
}

/* -- the reference's heap: the largest next use first, then the deepest, then the smallest id */
static int before(const Due *a, const Due *b)
{
    if (a->next != b->next) return a->next > b->next;
    if (a->depth != b->depth) return a->depth > b->depth;
    return a->key < b->key;
}

static void heap_push(Sim *s, Due e)
{
    if (s->heap_len == s->heap_cap) {
        int64_t cap = s->heap_cap ? 2 * s->heap_cap : 1024;
        Due *grown = realloc(s->heap, (size_t)cap * sizeof(Due));
        if (!grown) { s->oom = 1; return; }
        s->heap = grown;
        s->heap_cap = cap;
    }
    int64_t i = s->heap_len++;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!before(&e, &s->heap[up])) break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = e;
}

static Due heap_pop(Sim *s)
{
    Due top = s->heap[0], last = s->heap[--s->heap_len];
    int64_t i = 0, n = s->heap_len;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

static void plan(Sim *s, int32_t k, int64_t next, int32_t depth)
{
    s->due_next[k] = next;
    s->due_depth[k] = depth;
    Due e = {next, depth, k};
    heap_push(s, e);
}

/* -- the policy's calls ------------------------------------------------------------------------ */

/* Held keys are in list 1 or 2 (every policy); ghosts in lists 3 and 4. */
static int holds(const Sim *s, int32_t k)
{
    return s->where[k] == 1 || s->where[k] == 2;
}

static void insert(Sim *s, int32_t k, int64_t next, int32_t depth)
{
    s->held++;
    switch (s->policy) {
    case LRU: push_back(s, 1, k); break;
    case ARC: {
        int64_t b1 = s->l[3].len, b2 = s->l[4].len;
        if (s->where[k] == 3) {
            unlink_key(s, k);
            int64_t step = b2 / (b1 > 1 ? b1 : 1);
            s->p += step > 1 ? step : 1;
            if (s->p > s->capacity) s->p = s->capacity;
            push_back(s, 2, k);
        } else if (s->where[k] == 4) {
            unlink_key(s, k);
            int64_t step = b1 / (b2 > 1 ? b2 : 1);
            s->p -= step > 1 ? step : 1;
            if (s->p < 0) s->p = 0;
            push_back(s, 2, k);
        } else {
            push_back(s, 1, k);
        }
        break;
    }
    case S3FIFO:
        s->freq[k] = 0;
        if (s->where[k] == 3) { unlink_key(s, k); push_back(s, 2, k); }
        else push_back(s, 1, k);
        break;
    default: /* BELADY */
        s->where[k] = 1;
        plan(s, k, next, depth);
    }
}

static void touch(Sim *s, int32_t k, int64_t next, int32_t depth)
{
    switch (s->policy) {
    case LRU: move_to_back(s, k); break;
    case ARC:
        if (s->where[k] == 1) { unlink_key(s, k); push_back(s, 2, k); }
        else move_to_back(s, k);
        break;
    case S3FIFO:
        if (s->freq[k] < MAX_FREQ) s->freq[k]++;
        break;
    default: plan(s, k, next, depth);
    }
}

static void remove_key(Sim *s, int32_t k)
{
    s->held--;
    switch (s->policy) {
    case LRU: unlink_key(s, k); break;
    case ARC: {
        int from = s->where[k];
        unlink_key(s, k);
        ghost_add(s, from == 1 ? 3 : 4, k);
        break;
    }
    case S3FIFO: {
        int from = s->where[k];
        unlink_key(s, k);
        if (from == 1) ghost_add(s, 3, k);
        break;
    }
    default: s->where[k] = OUT;
    }
}

/* eviction.py's _first_idle: the oldest key of list `tag` not pinned; pinned keys met on the
 * way go to the young end. -1 if every key is pinned. */
static int32_t first_idle(Sim *s, int tag, int32_t stamp)
{
    for (int64_t i = 0, n = s->l[tag].len; i < n; i++) {
        int32_t k = s->l[tag].head;
        if (s->pin[k] != stamp) return k;
        move_to_back(s, k);
    }
    return -1;
}

static int32_t victim(Sim *s, int32_t stamp)
{
    switch (s->policy) {
    case LRU: return first_idle(s, 1, stamp);
    case ARC: {
        int64_t t1 = s->l[1].len;
        int t1_first = t1 > 0 && t1 >= (s->p > 1 ? s->p : 1);
        int32_t k = first_idle(s, t1_first ? 1 : 2, stamp);
        return k >= 0 ? k : first_idle(s, t1_first ? 2 : 1, stamp);
    }
    case S3FIFO: {
        List *small = &s->l[1], *main = &s->l[2];
        int64_t rounds = 2 * small->len + (MAX_FREQ + 2) * main->len + 1;
        for (int64_t i = 0; i < rounds; i++) {
            if (small->len && (small->len >= s->small_cap || !main->len)) {
                int32_t k = small->head;
                if (s->pin[k] == stamp) move_to_back(s, k);
                else if (s->freq[k]) { unlink_key(s, k); push_back(s, 2, k); s->freq[k] = 0; }
                else return k;
            } else if (main->len) {
                int32_t k = main->head;
                if (s->pin[k] == stamp) move_to_back(s, k);
                else if (s->freq[k]) { s->freq[k]--; move_to_back(s, k); }
                else return k;
            } else {
                return -1;
            }
        }
        return -1;
    }
    default: {
        Due skipped_buf[64], *skipped = skipped_buf;
        int64_t n_skipped = 0, cap_skipped = 64;
        int32_t found = -1;
        while (s->heap_len) {
            Due top = s->heap[0];
            int valid = s->where[top.key] == 1 && s->due_next[top.key] == top.next &&
                        s->due_depth[top.key] == top.depth;
            if (!valid) {
                heap_pop(s);
            } else if (s->pin[top.key] == stamp) {
                if (n_skipped == cap_skipped) {
                    Due *grown = malloc((size_t)cap_skipped * 2 * sizeof(Due));
                    if (!grown) { s->oom = 1; break; }
                    memcpy(grown, skipped, (size_t)n_skipped * sizeof(Due));
                    if (skipped != skipped_buf) free(skipped);
                    skipped = grown;
                    cap_skipped *= 2;
                }
                skipped[n_skipped++] = heap_pop(s);
            } else {
                found = top.key;
                break;
            }
        }
        for (int64_t i = 0; i < n_skipped; i++) heap_push(s, skipped[i]);
        if (skipped != skipped_buf) free(skipped);
        return found;
    }
    }
}

/* Run the trace: request r is pages ids[starts[r] .. starts[r+1]) of a prompt of tokens[r]
 * tokens. next_use (BELADY only) gives, per position of ids, the index of the next request
 * holding that page (or a number larger than any). Fills out[4] = {hit tokens, limited tokens,
 * evicted pages, dropped pages}, and hit_pages[r] (if not NULL) with each request's hit in
 * pages. Returns 0, or -1 when memory ran out. */
int hicache_tiersim(int policy, int64_t capacity, int64_t small_cap, int64_t page_tokens,
                    int64_t min_recompute, int64_t n_req, const int64_t *starts,
                    const int32_t *ids, const int64_t *tokens, int64_t n_ids,
                    const int64_t *next_use, int32_t *hit_pages, int64_t *out)
{
    Sim s;
    memset(&s, 0, sizeof s);
    s.policy = policy;
    s.capacity = capacity;
    s.small_cap = small_cap;
    for (int t = 0; t < 5; t++) { s.l[t].head = s.l[t].tail = -1; }
    int64_t longest = 0;
    for (int64_t r = 0; r < n_req; r++)
        if (starts[r + 1] - starts[r] > longest) longest = starts[r + 1] - starts[r];
    size_t n = (size_t)(n_ids > 0 ? n_ids : 1);
    s.prev = malloc(n * sizeof(int32_t));
    s.nxt = malloc(n * sizeof(int32_t));
    s.pin = calloc(n, sizeof(int32_t));
    s.where = calloc(n, 1);
    s.freq = calloc(n, 1);
    int32_t *present = malloc((size_t)(longest + 1) * sizeof(int32_t) * 2);
    if (policy == BELADY) {
        s.due_next = malloc(n * sizeof(int64_t));
        s.due_depth = malloc(n * sizeof(int32_t));
    }
    int rc = 0;
    if (!s.prev || !s.nxt || !s.pin || !s.where || !s.freq || !present ||
        (policy == BELADY && (!s.due_next || !s.due_depth))) {
        rc = -1;
        goto done;
    }
    int32_t *missing = present + longest + 1;
    int64_t hit_tokens = 0, limited = 0, evicted_all = 0, dropped = 0;
    for (int64_t r = 0; r < n_req && !s.oom; r++) {
        const int32_t *pg = ids + starts[r];
        const int64_t *nu = next_use ? next_use + starts[r] : NULL;
        const int64_t np = starts[r + 1] - starts[r];
        const int32_t stamp = (int32_t)(r + 1);
        int64_t found = 0;
        while (found < np && holds(&s, pg[found])) found++;
        int64_t usable = tokens[r] - min_recompute;
        int64_t cap = usable > 0 ? usable / page_tokens : 0;
        int64_t hit = found < cap ? found : cap;
        hit_tokens += hit * page_tokens;
        limited += (found - hit) * page_tokens;
        if (hit_pages) hit_pages[r] = (int32_t)hit;
        for (int64_t i = hit - 1; i >= 0; i--) touch(&s, pg[i], nu ? nu[i] : 0, (int32_t)i);
        int64_t n_present = 0, n_missing = 0;
        for (int64_t i = 0; i < np; i++) {
            if (holds(&s, pg[i])) { present[n_present++] = (int32_t)i; s.pin[pg[i]] = stamp; }
            else missing[n_missing++] = (int32_t)i;
        }
        int64_t room = s.capacity - s.held, evicted = 0;
        while (evicted < n_missing - room) {
            int32_t v = victim(&s, stamp);
            if (v < 0) break;
            remove_key(&s, v);
            evicted++;
        }
        evicted_all += evicted;
        int64_t placed = n_missing < room + evicted ? n_missing : room + evicted;
        dropped += n_missing - placed;
        for (int64_t j = placed - 1; j >= 0; j--) {
            int32_t i = missing[j];
            insert(&s, pg[i], nu ? nu[i] : 0, i);
        }
        for (int64_t j = n_present - 1; j >= 0; j--) {
            int32_t i = present[j];
            touch(&s, pg[i], nu ? nu[i] : 0, i);
        }
    }
    out[0] = hit_tokens;
    out[1] = limited;
    out[2] = evicted_all;
    out[3] = dropped;
    if (s.oom) rc = -1;
done:
    free(s.prev); free(s.nxt); free(s.pin); free(s.where); free(s.freq); free(present);
    free(s.due_next); free(s.due_depth); free(s.heap);
    return rc;
}

/* next_use[i] for every position i of ids (request r spans starts[r] .. starts[r+1]): the
 * index of the next request that holds the same page, or `never`. `last` is scratch of n_ids
 * entries. */
void hicache_next_uses(int64_t n_req, const int64_t *starts, const int32_t *ids, int64_t never,
                       int64_t *last, int64_t n_ids, int64_t *next_use)
{
    for (int64_t k = 0; k < n_ids; k++) last[k] = never;
    for (int64_t r = n_req - 1; r >= 0; r--) {
        for (int64_t i = starts[r]; i < starts[r + 1]; i++) next_use[i] = last[ids[i]];
        for (int64_t i = starts[r]; i < starts[r + 1]; i++) last[ids[i]] = r;
    }
}
