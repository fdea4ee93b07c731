"""The slot books: LRU order, pins that protect, leases released once."""

from __future__ import annotations

import functools
import random

import pytest

from hicache.core.slots import SlotPool


@pytest.fixture(params=["compiled", "python"])
def new_pool(request):
    """Makes pools with compiled books, or with the Python ones: every scenario runs on both."""
    return functools.partial(SlotPool, compiled=request.param == "compiled")


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def fill(pool: SlotPool, keys: list[bytes]) -> list[int]:
    lease = pool.reserve(len(keys))
    pool.publish(lease.slots, keys)
    lease.release()
    return lease.slots


def test_a_sequence_tail_is_evicted_before_its_head(new_pool):
    evicted: list[bytes] = []
    pool = new_pool(4, on_evict=evicted.extend)
    fill(pool, [k(0), k(1), k(2), k(3)])  # one sequence of four pages
    lease = pool.reserve(2)
    assert evicted == [k(3), k(2)]
    assert pool.prefix([k(0), k(1), k(2), k(3)]) == pool.lookup([k(0), k(1)])
    lease.release()
    pool.check()


def test_a_hit_makes_pages_most_recent(new_pool):
    evicted: list[bytes] = []
    pool = new_pool(4, on_evict=evicted.extend)
    fill(pool, [k(0), k(1)])
    fill(pool, [k(2), k(3)])
    pool.lease(pool.prefix([k(0), k(1)])).release()  # request 1's pages hit again
    pool.reserve(2).release()
    assert evicted == [k(3), k(2)]
    pool.check()


def test_pinned_slots_are_never_evicted_and_reserve_returns_fewer(new_pool):
    pool = new_pool(3)
    fill(pool, [k(0), k(1), k(2)])
    held = pool.lease(pool.lookup([k(0), k(2)]))
    got = pool.reserve(3)
    assert len(got) == 1 and k(1) not in pool and k(0) in pool and k(2) in pool
    assert pool.reserve(1).slots == []
    held.release()
    held.release()  # a second release does nothing
    got.release()  # never published: back to the free list
    assert pool.free == 1 and pool.used == 2 and pool.pinned == 0
    pool.check()


def test_publish_skips_keys_held_already(new_pool):
    pool = new_pool(4)
    fill(pool, [k(0)])
    lease = pool.reserve(2)
    fresh = pool.publish(lease.slots, [k(0), k(1)])
    assert fresh == [lease.slots[1]] and pool.used == 2
    lease.release()
    assert pool.free == 2  # the duplicate's slot went back
    pool.check()


def test_unpinning_more_than_pinned_is_an_error(new_pool):
    pool = new_pool(2)
    slots = fill(pool, [k(0)])
    with pytest.raises(RuntimeError, match="unpinned more often"):
        pool._books.unpin(slots)  # what a lease's release calls


def test_a_lease_split_and_merged_keeps_every_pin_exactly_once(new_pool):
    pool = new_pool(8)
    whole = pool.reserve(6)
    slots = list(whole.slots)
    part = whole.split(4)  # the last four, with their pins; none is taken or dropped
    assert (whole.slots, part.slots, pool.pinned) == (slots[:2], slots[2:], 6)
    more = pool.reserve(1)
    whole.absorb(more)
    assert len(whole) == 3 and not more.held and pool.pinned == 7
    more.release()  # released with the merge: releasing it again does nothing
    assert pool.pinned == 7
    part.release()
    whole.release()
    assert pool.pinned == 0 and pool.free == 8
    pool.check()
    with pytest.raises(ValueError, match=r"cannot split 1 slots off a lease of 3 \(held: False\)"):
        whole.split(1)
    with pytest.raises(ValueError, match="different pools, or a released one"):
        pool.reserve(1).absorb(new_pool(2).reserve(1))


def test_eviction_passes_over_pinned_slots_and_moves_them_to_the_end(new_pool):
    evicted: list[bytes] = []
    pool = new_pool(6, on_evict=evicted.extend)
    slots = fill(pool, [k(i) for i in range(6)])
    held = pool.lease(slots[:3])  # the three oldest are in use
    lease = pool.reserve(2)
    assert evicted == [k(5), k(4)]  # the least recent unpinned ones, tail first
    held.release()
    lease.release()
    pool.check()


def test_compiled_and_python_books_agree_on_random_operations():
    """A long random mix of reserve, publish, lease and release: both books hand out the same
    slots, evict the same keys in the same order and end with the same LRU list."""
    rng = random.Random(7)
    evicted: dict[bool, list[bytes]] = {True: [], False: []}
    pools = {c: SlotPool(32, on_evict=evicted[c].extend, compiled=c) for c in (True, False)}
    leases: dict[bool, list] = {True: [], False: []}
    next_key = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 12)
            keys = [k(next_key + i) for i in range(n)]
            keys += [k(rng.randrange(max(next_key, 1)))]  # maybe a key held already
            next_key += n
            got = {c: pools[c].reserve(len(keys)) for c in pools}
            assert got[True].slots == got[False].slots, step
            fresh = {c: pools[c].publish(got[c].slots, keys[: len(got[c])]) for c in pools}
            assert fresh[True] == fresh[False], step
            for c in pools:
                leases[c].append(got[c])
        elif op < 0.6:
            probe = [k(rng.randrange(max(next_key, 1))) for _ in range(8)]
            found = {c: [s for s in pools[c].lookup(probe) if s is not None] for c in pools}
            assert found[True] == found[False], step
            for c in pools:
                leases[c].append(pools[c].lease(sorted(set(found[c]))))
        elif leases[True]:
            i = rng.randrange(len(leases[True]))
            for c in pools:
                leases[c].pop(i).release()
        assert evicted[True] == evicted[False], step
    for c in pools:
        pools[c].check()
    assert pools[True].lru() == pools[False].lru()
    assert pools[True].free == pools[False].free and pools[True].pinned == pools[False].pinned
    assert len(evicted[True]) > 100  # the mix did evict


def test_a_slot_is_published_once(new_pool):
    pool = new_pool(2)
    lease = pool.reserve(1)
    pool.publish(lease.slots, [k(0)])
    with pytest.raises(RuntimeError, match="is not reserved"):
        pool.publish(lease.slots, [k(1)])
    assert pool.lookup([k(0), k(1)]) == [lease.slots[0], None]
    lease.release()
    pool.check()
