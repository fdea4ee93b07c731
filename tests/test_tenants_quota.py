"""Tenants' shares and quotas of the host tier, isolated eviction (issue 60): a tenant flooding
the cache evicts its own pages once the others are down to their shares; a tenant never holds
more than its quota once its pages are idle; the per-tenant counters reach the metrics; the
configuration's errors name their field."""

from __future__ import annotations

import numpy as np
import pytest
from fake_engine import FakeEngine, config
from prometheus_client import CollectorRegistry

from hicache.config import load_config
from hicache.core.keys import chain_seed
from hicache.core.shares import Shares, host_shares
from hicache.core.slots import SlotPool
from hicache.errors import ConfigError
from hicache.observability.metrics import register, unmapped

KEEP, FLOOD = b"k" * 16, b"f" * 16  # the two tenants' chain seeds


def pool(share: int = 0, quota: int = 16, capacity: int = 16) -> SlotPool:
    shares = Shares(("", "keep", "flood"), {KEEP: 1, FLOOD: 2}, (0, share, 0), (16, 16, quota))
    return SlotPool(capacity, shares=shares)


def put(p: SlotPool, seed: bytes, tag: str, n: int) -> list[bytes]:
    """Publish `n` new pages of the tenant of `seed` and let them go idle; their keys."""
    keys = [f"{tag}{i}".encode().ljust(16, b".") for i in range(n)]
    lease = p.reserve(n)  # fewer where no more can be evicted
    p.publish_as(lease.slots, keys[: len(lease.slots)], seed)
    lease.release()
    return keys


def test_quota_share_keeps_a_tenants_pages_while_another_floods():
    """keep (share 6 of 16 slots) stores 8 pages; flood then stores 64 unique pages: eviction
    takes from the tenant furthest over its share, flood (8 over, to keep's 2), so keep holds
    all 8 and flood evicts its own. A burst of 12 pages of no tenant's then takes flood's 8 and
    keep's 2 over its share, and no more: it gets 10 slots, and keep's 6 most recent pages (its
    head) stay. Without shares, keep loses every
    page to plain LRU."""
    p = pool(share=6)
    kept = put(p, KEEP, "k", 8)
    for r in range(16):
        put(p, FLOOD, f"f{r}-", 4)
    p.check()
    assert all(k in p for k in kept)
    stats = p.tenant_stats()
    assert (stats["tenant_host_pages_keep"], stats["tenant_host_pages_flood"]) == (8, 8)
    assert (stats["tenant_host_evicted_keep"], stats["tenant_host_evicted_flood"]) == (0, 56)
    put(p, b"x" * 16, "x", 12)  # no tenant's (tenant 0): 12 pages at once; 10 can be had
    p.check()
    assert [k in p for k in kept] == [True] * 6 + [False] * 2  # a release leaves the head recent
    stats = p.tenant_stats()
    assert (stats["tenant_host_pages_keep"], stats["tenant_host_pages_flood"]) == (6, 0)
    assert stats["tenant_host_pages_none"] == 10
    lru = SlotPool(16)
    plain = [f"k{i}".encode().ljust(16, b".") for i in range(8)]
    lease = lru.reserve(8)
    lru.publish(lease.slots, plain)
    lease.release()
    for r in range(16):
        keys = [f"f{r}-{i}".encode().ljust(16, b".") for i in range(4)]
        lease = lru.reserve(4)
        lru.publish(lease.slots, keys)
        lease.release()
    assert not any(k in lru for k in plain)


def test_quota_share_a_tenant_within_its_share_evicts_its_own_pages_for_its_own():
    """keep (share 12 of 16) holds 12 pages, flood 4 (within no share: evictable). keep asks
    for 8 more: flood's 4 go first, then keep's own least recent 4 (a share guards a tenant from
    the others, not from itself); a reserve of no tenant's then gets nothing from keep."""
    p = pool(share=12)
    first = put(p, KEEP, "a", 12)
    put(p, FLOOD, "f", 4)
    keys = [f"b{i}".encode().ljust(16, b".") for i in range(8)]
    lease = p.reserve_as(8, KEEP)
    assert len(lease.slots) == 8
    p.publish_as(lease.slots, keys, KEEP)
    lease.release()
    stats = p.tenant_stats()
    assert (stats["tenant_host_pages_keep"], stats["tenant_host_pages_flood"]) == (16, 0)
    assert [k in p for k in first] == [True] * 8 + [False] * 4
    assert len(p.reserve(4).slots) == 4  # keep is 4 over its share: those go
    assert len(p.reserve_as(1, FLOOD).slots) == 0  # keep at its share, flood holds nothing
    p.check()


def test_quota_caps_a_tenant_at_its_idle_pages_and_counts_what_it_evicted():
    """flood (quota 5 slots) stores 3 pages, then 4 more: past its quota, its own least recent
    idle pages go (the tail of its first sequence), though 9 slots are free; keep is
    untouched."""
    p = pool(quota=5)
    keep = put(p, KEEP, "k", 2)
    first = put(p, FLOOD, "a", 3)
    second = put(p, FLOOD, "b", 4)
    p.check()
    assert [k in p for k in first] == [True, False, False] and all(k in p for k in second)
    assert all(k in p for k in keep) and p.free == 16 - 7
    stats = p.tenant_stats()
    assert (stats["tenant_host_pages_flood"], stats["tenant_host_evicted_flood"]) == (5, 2)


def test_quota_pinned_pages_are_never_evicted_for_a_quota():
    """Pages a request still pins stay, even past the quota; they go once idle and the tenant
    publishes again."""
    p = pool(quota=2)
    keys = [f"p{i}".encode().ljust(16, b".") for i in range(4)]
    lease = p.reserve(4)
    p.publish_as(lease.slots, keys, FLOOD)
    assert all(k in p for k in keys)  # pinned: over quota for now
    lease.release()
    put(p, FLOOD, "q", 1)
    assert sum(k in p for k in keys) == 1 and p.tenant_stats()["tenant_host_pages_flood"] == 2
    p.check()


def test_quota_a_release_that_leaves_a_tenant_past_its_quota_is_settled_between_calls():
    """flood publishes 6 pages while they are pinned (quota 2): nothing can go then. Their
    release evicts nothing either (a store may be about to pin slots it looked up); `settle`
    (every `HiCache.poll`) then evicts the 4 least recent, as would the next reserve."""
    p = pool(quota=2)
    keys = [f"s{i}".encode().ljust(16, b".") for i in range(6)]
    lease = p.reserve(6)
    p.publish_as(lease.slots, keys, FLOOD)
    lease.release()
    assert p.tenant_stats()["tenant_host_pages_flood"] == 6 and all(k in p for k in keys)
    p.settle()
    assert [k in p for k in keys] == [True, True] + [False] * 4
    assert p.tenant_stats()["tenant_host_evicted_flood"] == 4
    p.check()


PAGE = 64


def tenants_config(share: bool) -> dict:
    """A 32-page host tier; with `share`, tenant keep has 12 of them and flood may hold all
    (its quota); without, the tenants have neither (the host tier evicts by plain LRU)."""
    cfg = config(page_tokens=4, page_bytes=PAGE, host_pages=32)
    keep: dict = {"name": "keep"}
    flood: dict = {"name": "flood"}
    if share:
        keep["share"] = {"host": 12 * PAGE}
        flood["quota"] = {"host": 32 * PAGE}
    cfg["tenants"] = [keep, flood]
    return cfg


@pytest.mark.parametrize("share", [True, False])
def test_quota_share_through_the_cache_keeps_the_replayed_prompt_a_host_hit(share):
    """Through `HiCache`: keep stores a 10-page prompt; flood stores 20 unique 4-page prompts
    into a 32-page host tier; keep's prompt is asked again. With keep's share of 12 pages it is
    a whole host hit (40 tokens); without it, LRU evicted it (0). The tenants' pages and
    evictions are on the metrics endpoint."""
    e = FakeEngine(load_config(tenants_config(share), env={}))
    try:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 50_000, 41).astype(np.int32)
        e.run("k0", prompt, salt="keep")
        for i in range(20):
            e.run(f"f{i}", rng.integers(0, 50_000, 17).astype(np.int32), salt="flood")
        again = e.run("k1", prompt, salt="keep")
        assert again.hit_tokens == (40 if share else 0)
        if not share:
            return
        registry = CollectorRegistry()
        register(e.cache, registry)
        pages = registry.get_sample_value(
            "hicache_tenant_pages", {"tier": "host", "tenant": "keep"}
        )
        evicted = registry.get_sample_value(
            "hicache_tenant_pages_evicted_total", {"tier": "host", "tenant": "flood"}
        )
        assert pages == 10 and evicted == 20 * 4 - 22
        assert not unmapped(e.cache.stats())
    finally:
        e.cache.close()


def test_quota_host_shares_map_a_tenants_salt_to_its_slots():
    cfg = load_config(tenants_config(True), env={})
    shares = host_shares(cfg.tenants, b"f" * 16, PAGE, 32)
    assert shares is not None
    assert (shares.names, shares.share, shares.quota) == (
        ("", "keep", "flood"), (0, 12, 0), (32, 32, 32),
    )  # fmt: skip
    assert shares.by_seed[chain_seed(b"f" * 16, "keep")] == 1
    plain = load_config(tenants_config(False), env={})
    assert host_shares(plain.tenants, b"f" * 16, PAGE, 32) is None


@pytest.mark.parametrize(
    ("tenants", "host", "error"),
    [
        (
            [{"name": "a", "share": {"host": "2KiB"}, "quota": {"host": "1KiB"}}],
            {},
            "tenants.0: share.host: 2048 bytes, more than quota.host (1024)",
        ),
        (
            [{"name": "a", "quota": {"disk": "1KiB"}}],
            {},
            "tenants.0.quota.disk: no tier is named 'disk' (tiers: host)",
        ),
        (
            [{"name": "a", "share": {"host": "2KiB"}}, {"name": "b", "share": {"host": "2KiB"}}],
            {},
            "tenants: the host shares add up to 4096 bytes, more than tiers.0.size",
        ),
        (
            [{"name": "a", "share": {"host": "1KiB"}}],
            {"policy": "arc"},
            "tenants: shares and quotas evict by lru within each tenant; tiers.0.policy is arc",
        ),
        ([{"name": "none"}], {}, "tenants.0: name: 'none' names the requests"),
    ],
)
def test_quota_config_errors_name_the_field(tenants, host, error):
    cfg = config(page_tokens=4, page_bytes=PAGE, host_pages=32)  # 2 KiB of host
    cfg["tiers"][0].update(host)
    cfg["tenants"] = tenants
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    assert error in str(err.value)
