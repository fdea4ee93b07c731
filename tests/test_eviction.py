"""Eviction policies: what each evicts and in what order, by hand; the offline reference of the
trace tool against hand-computed optima; a tier's `policy:` reaching its books."""

from __future__ import annotations

import random

import pytest

from hicache.config import ConfigError, load_config
from hicache.core.eviction import make_policy, policy_names
from hicache.core.slots import SlotPool
from hicache.tools.trace.simulate import FarthestNextUse, PolicySim, next_uses


def evict_all(policy, busy=lambda _k: False) -> list:
    out = []
    while (key := policy.victim(busy)) is not None:
        policy.remove(key)
        out.append(key)
    return out


def test_registry_names_the_known_policies() -> None:
    assert policy_names() == ["lru", "arc", "s3fifo", "prefix"]
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; known: lru, arc"):
        make_policy("mru", 4)


def test_lru_evicts_the_least_recent_and_passes_busy_keys_once() -> None:
    p = make_policy("lru", 4)
    for k in (1, 2, 3):
        p.insert(k)
    p.touch(1)
    assert p.order() == [2, 3, 1]
    assert p.victim(lambda k: k == 2) == 3  # 2 is in use: moved to the young end
    assert p.order() == [3, 1, 2]
    assert evict_all(p) == [3, 1, 2]


def test_arc_moves_a_ghost_hit_to_the_frequent_list() -> None:
    p = make_policy("arc", 2)
    p.insert(1)
    p.insert(2)
    p.touch(1)  # 1 seen twice: T2
    assert p.victim() == 2  # T1 goes first while it is at least its target size
    p.remove(2)  # 2 becomes a ghost of T1
    p.insert(3)
    p.insert(2)  # a ghost of T1 comes back: the target of T1 grows, 2 enters T2
    assert p.p == 1
    assert p.order() == [3, 1, 2]
    assert evict_all(p) == [3, 1, 2]


def test_s3fifo_drops_one_offs_and_keeps_what_was_used_again() -> None:
    p = make_policy("s3fifo", 10)  # small FIFO of one key
    for k in (1, 2, 3):
        p.insert(k)
    p.touch(2)
    assert p.victim() == 1
    p.remove(1)  # 1 leaves the small FIFO: a ghost
    assert p.victim() == 3  # 2 was used again: moved to the main FIFO on the way
    p.remove(3)
    p.insert(1)  # a ghost comes back: straight into the main FIFO
    assert p.order() == [2, 1]
    assert evict_all(p) == [2, 1]


def test_prefix_weighs_pages() -> None:
    q = make_policy("prefix", 4)
    q.insert(1)
    q.insert(2, weight=0.5)  # a lower tier holds it: first to go, leaves no ghost
    q.insert(3, weight=2.0)  # a state page: straight into the frequency list
    q.insert(4)
    assert q.order() == [2, 1, 4, 3]
    assert evict_all(q) == [2, 1, 4, 3]
    assert list(q._b1._q) == [1, 4] and list(q._b2._q) == [3]
    q.insert(5, weight=0.5)
    q.touch(5)  # used again: an ordinary page of T2, a ghost when it goes
    assert evict_all(q) == [5] and list(q._b2._q) == [3, 5]


def test_prefix_without_weights_orders_as_arc() -> None:
    arc, prefix = PolicySim(16, 1, policy="arc"), PolicySim(16, 1, policy="prefix")
    rng = random.Random(5)
    for _ in range(300):
        head = rng.randrange(6)
        pages = [head * 100 + i for i in range(rng.randint(1, 6))]
        pages += [rng.randrange(10**6) for _ in range(rng.randint(0, 4))]
        assert arc.request(pages, len(pages) + 1) == prefix.request(pages, len(pages) + 1)
    assert arc.evictions == prefix.evictions and len(arc.evictions) > 100


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "prefix"])
def test_a_prompts_tail_goes_before_its_head(name: str) -> None:
    """Through the simulation's placement rules every policy gives up a cold prompt from its
    last page to its first."""
    sim = PolicySim(8, page_tokens=1, policy=name)
    sim.request([1, 2, 3, 4], 5)
    sim.request([5, 6, 7, 8], 5)
    sim.request([9, 10], 3)
    assert sim.evictions == [4, 3]


def offline_share(prompts: list[list[int]], capacity: int) -> tuple[int, list[int]]:
    """Hit tokens and evictions of the offline reference (page_tokens 1, one extra token per
    prompt so that every held page can hit)."""
    policy = FarthestNextUse(capacity)
    sim = PolicySim(capacity, 1, 1, policy)
    for pages, upcoming in zip(prompts, next_uses(prompts)):
        policy.upcoming = upcoming
        sim.request(pages, len(pages) + 1)
    return sim.result.hit_tokens, sim.evictions


def test_offline_reference_on_a_loop_is_optimal() -> None:
    """a b c a b c with room for two: LRU never hits; the optimum keeps a for its next use,
    then c (evicting a, never used again): two hits, and no choice gives more."""
    loop = [[1], [2], [3], [1], [2], [3]]
    assert offline_share(loop, 2) == (2, [2, 1])
    lru = PolicySim(2, 1, 1, "lru")
    for pages in loop:
        lru.request(pages, 2)
    assert lru.result.hit_tokens == 0


def test_offline_reference_gives_up_children_before_parents() -> None:
    """Pages 1 and 2 are next used by the same prompt: 2, the deeper, goes; 1 then hits."""
    prompts = [[1, 2], [3], [1, 4], [3]]
    hits, evicted = offline_share(prompts, 2)
    # [1, 4] needs room: 3 goes (1 is pinned); the last [3] then gives up 4 (deeper than 1)
    assert evicted == [2, 3, 4]
    assert hits == 1  # 1 in the third prompt; 3 was given up for 4
    assert offline_share(prompts, 3) == (2, [2])


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "prefix"])
def test_a_tier_policy_reaches_the_slot_books(name: str) -> None:
    cfg = load_config({"tiers": [{"type": "host", "size": 1024, "policy": name}]}, env={})
    assert cfg.tier("host").policy == name
    pool = SlotPool(3, policy=name)
    keys = [bytes([k]) * 16 for k in range(5)]
    for key in keys[:3]:
        lease = pool.reserve(1)
        pool.publish(lease.slots, [key])
        lease.release()
    pool.check()
    held = pool.lease([pool.slot_of(keys[0])])  # pinned: never the victim
    lease = pool.reserve(2)
    assert keys[0] in pool and keys[1] not in pool and keys[2] not in pool
    pool.publish(lease.slots, keys[3:5])
    lease.release()
    held.release()
    pool.check()
    assert pool.used == 3 and pool.evicted == 2


def test_an_unknown_tier_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown eviction policy 'fifo'"):
        load_config({"tiers": [{"type": "host", "size": 1024, "policy": "fifo"}]}, env={})
