"""Tenants' shares and quotas on a store tier (issue 60): the disk tier evicts by tenant, from
the tenant over its quota first, then the one furthest over its share; a tenant's objects carry
its name, so the tier knows them from a listing and after a restart; vLLM's scheduler names
them as the workers do; the metrics show each tenant's bytes; the configuration refuses terms
on a tier that cannot keep them, in one line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from extras import import_problem, require
from fake_engine import FakeEngine, config, settle
from prometheus_client import CollectorRegistry

from hicache.backends.disk.lru import LruBook
from hicache.backends.disk.records import file_name
from hicache.config import load_config
from hicache.core.keys import KeyChain, chain_seed, object_tenant, store_key
from hicache.core.shares import Terms, owners
from hicache.errors import ConfigError
from hicache.observability.metrics import register, unmapped

PAGE = 1024
RECORD = 4096 + 2 * PAGE  # a record of a two-page group: its header block, then its pages


def rec(tenant: str, i: int) -> str:
    digest = hashlib.sha256(f"{tenant}{i}".encode()).hexdigest()
    return f"{digest[:2]}/{digest}" + (f"~{tenant}" if tenant else "")


def fill(book: LruBook, tenant: str, n: int, start: int = 0) -> list[str]:
    """Write `n` records of `tenant`, one after another; the records each evicted."""
    evicted = []
    for i in range(start, start + n):
        victims = book.reserve(rec(tenant, i), 100)
        assert victims is not None
        evicted += victims
        book.settle(rec(tenant, i), written=True)
    return evicted


def held(book: LruBook, tenant: str) -> int:
    return sum(1 for name in book.names() if name.endswith(f"~{tenant}"))


def test_quota_disk_book_a_flood_evicts_itself_while_it_is_furthest_over_its_share():
    """A 1,000-byte book: keep (a share of 400) writes 6 records, then flood 20. Flood, over
    its share (none) by more than keep is over its own, evicts only its own records: keep
    still holds its 6, flood its latest 4."""
    book = LruBook(1000, {"keep": Terms(share=400)})
    fill(book, "keep", 6)
    evicted = fill(book, "flood", 20)
    assert evicted == [rec("flood", i) for i in range(16)]
    assert (held(book, "keep"), held(book, "flood")) == (6, 4)
    assert book.tenants() == {"keep": (600, 0), "flood": (400, 1600)}


def test_quota_disk_book_without_terms_is_plain_lru():
    """Without terms the same writes leave flood's 10 latest records: keep lost all 6."""
    book = LruBook(1000)
    fill(book, "keep", 6)
    fill(book, "flood", 20)
    assert (held(book, "keep"), held(book, "flood")) == (0, 10)
    assert book.names() == [rec("flood", i) for i in range(10, 20)]


def test_quota_disk_book_the_tenant_furthest_over_its_share_gives_first():
    """keep (share 200) holds 6 records, flood (share 200) 4: each of flood's writes takes
    from whoever is further over its share before it (on a tie, the tenant that wrote first):
    keep's two oldest (400 over, then 300 against 300), then only flood's own."""
    book = LruBook(1000, {"keep": Terms(share=200), "flood": Terms(share=200)})
    fill(book, "keep", 6)
    fill(book, "flood", 4)
    evicted = fill(book, "flood", 10, start=4)
    assert evicted == [rec("keep", 0), rec("keep", 1)] + [rec("flood", i) for i in range(8)]
    assert (held(book, "keep"), held(book, "flood")) == (4, 6)


def test_quota_disk_book_a_tenant_within_its_share_evicts_its_own_for_its_own():
    """keep (share 600) and other (share 400) fill the book at their shares: keep's next two
    writes evict its own two oldest records (a share guards from the others, not from
    oneself); other keeps all 4."""
    book = LruBook(1000, {"keep": Terms(share=600), "other": Terms(share=400)})
    fill(book, "keep", 6)
    fill(book, "other", 4)
    evicted = fill(book, "keep", 2, start=6)
    assert evicted == [rec("keep", 0), rec("keep", 1)]
    assert (held(book, "keep"), held(book, "other")) == (6, 4)


def test_quota_disk_book_caps_a_tenant_at_its_quota_from_its_own_records():
    """flood's quota is 300: its fourth record evicts its first, and nobody else's."""
    book = LruBook(1000, {"flood": Terms(quota=300)})
    fill(book, "keep", 3)
    evicted = fill(book, "flood", 5)
    assert evicted == [rec("flood", 0), rec("flood", 1)]
    assert (held(book, "keep"), held(book, "flood")) == (3, 3)
    with pytest.raises(ValueError, match="400 bytes exceed flood's quota of 300"):
        book.reserve(rec("flood", 99), 400)


def test_quota_disk_book_no_room_when_the_others_are_within_their_shares_changes_nothing():
    """Two tenants at their shares fill the book: a third tenant's write gets no room (a
    share is a guarantee), and the book is as it was."""
    book = LruBook(1000, {"a": Terms(share=500), "b": Terms(share=500)})
    fill(book, "a", 5)
    fill(book, "b", 5)
    before = book.names(), dict(book.used_by), book.used
    with pytest.raises(ValueError, match="other tenants hold no more than their shares"):
        book.reserve(rec("c", 0), 100)
    assert (book.names(), dict(book.used_by), book.used) == before


def test_quota_disk_book_shrinks_a_tenant_past_its_quota_after_a_restart():
    """Listed again under a smaller quota (a restart with new terms), a tenant's oldest records
    go first, down to the quota."""
    book = LruBook(1000, {"flood": Terms(quota=200)})
    for i in range(5):
        book.add(rec("flood", i), 100)
    book.add(rec("keep", 0), 100)
    assert book.shrink() == [rec("flood", i) for i in range(3)]
    assert (held(book, "flood"), held(book, "keep")) == (2, 1)


def test_quota_object_names_carry_the_tenant_and_the_disk_file_names_too():
    fp = bytes(range(16))
    name = store_key("hicache", fp, b"\x01\x02", 4, "acme")
    assert name == f"hicache/{fp.hex()}/~acme/g4/0102"
    assert object_tenant(name) == "acme"
    assert object_tenant(store_key("hicache", fp, b"\x01", None, "a.b-c")) == "a.b-c"
    assert object_tenant(store_key("hicache", fp, b"\x01", 4)) == ""
    assert file_name(name).endswith("~acme") and "~" not in file_name(store_key("h", fp, b"", 4))


def tenants_config(tmp_path: Path, terms: bool) -> dict:
    """A 32-page host tier over a 16-record disk tier (`RECORD` bytes each); where `terms`,
    keep has a share of 6 records of the disk and flood a quota of 12."""
    cfg = config(page_bytes=PAGE, host_pages=32)
    cfg["tiers"].append(
        {
            "type": "disk",
            "path": str(tmp_path / "d"),
            "size": 16 * RECORD,
            "group_pages": 2,
            "sync": False,
        }
    )
    cfg["tenants"] = [{"name": "keep"}, {"name": "flood"}]
    if terms:
        cfg["tenants"][0]["share"] = {"disk": 6 * RECORD}
        cfg["tenants"][1]["quota"] = {"disk": 12 * RECORD}
    return cfg


def records(tmp_path: Path, tenant: str) -> int:
    """The disk tier's records of `tenant`, by their file names."""
    files = (tmp_path / "d" / "objects").rglob(f"*~{tenant}")
    return sum(1 for p in files if p.is_file())


@pytest.mark.parametrize("terms", [True, False])
def test_quota_disk_share_through_the_cache_keeps_the_replayed_prompt_a_disk_hit(tmp_path, terms):
    """Through `HiCache`: keep stores a 10-page prompt (5 records); flood stores 20 unique
    4-page prompts (40 records), which push every earlier page out of the host tier. With the
    terms, flood evicts its own records (it is furthest over its share, and at its quota),
    keep's prompt asked again is a whole disk hit (40 tokens), and each tenant's bytes are on
    the metrics endpoint; without them, LRU took all of keep's records: a miss."""
    e = FakeEngine(load_config(tenants_config(tmp_path, terms), env={}))
    try:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 50_000, 41).astype(np.int32)
        e.run("k0", prompt, salt="keep")
        settle(e)
        for i in range(20):
            e.run(f"f{i}", rng.integers(0, 50_000, 17).astype(np.int32), salt="flood")
            settle(e)
        want = (5, 11) if terms else (0, 16)
        assert (records(tmp_path, "keep"), records(tmp_path, "flood")) == want
        again = e.run("k1", prompt, salt="keep")
        assert (again.hit_tokens, again.tier_tokens) == (
            (40, (("disk", 40),)) if terms else (0, ())
        )
        if not terms:
            return
        registry = CollectorRegistry()
        register(e.cache, registry)
        sample = registry.get_sample_value
        assert sample("hicache_tenant_bytes", {"tier": "disk", "tenant": "keep"}) == 5 * RECORD
        assert sample("hicache_tenant_bytes", {"tier": "disk", "tenant": "flood"}) == 11 * RECORD
        evicted = sample("hicache_tenant_bytes_evicted_total", {"tier": "disk", "tenant": "flood"})
        assert evicted == (40 - 11) * RECORD
        assert not unmapped(e.cache.stats())
    finally:
        e.cache.close()


def test_quota_disk_a_restart_knows_each_records_tenant_from_its_file_name(tmp_path):
    """A cache closed and started again on the same directory counts each tenant's bytes from
    the listing alone, and keeps flood's quota, made smaller meanwhile, at once."""
    cfg = tenants_config(tmp_path, terms=True)
    e = FakeEngine(load_config(cfg, env={}))
    try:
        rng = np.random.default_rng(1)
        for i in range(6):
            e.run(f"f{i}", rng.integers(0, 50_000, 17).astype(np.int32), salt="flood")
        settle(e)
    finally:
        e.cache.close()
    cfg["tenants"][1]["quota"]["disk"] = 8 * RECORD
    e = FakeEngine(load_config(cfg, env={}))
    try:
        settle(e)
        stats = e.cache.stats()
        assert stats["tenant_store_bytes_disk.flood"] == 8 * RECORD
        assert records(tmp_path, "flood") == 8
    finally:
        e.cache.close()


def test_quota_vllm_scheduler_probe_names_a_tenants_objects_as_the_workers_do():
    """The scheduler's probe of a shared store names a tenant's objects under the tenant, as
    the tier chain does (else it would answer misses for every tenant's pages)."""
    from hicache.chain.jobs import Job, JobRunner
    from hicache.integrations.vllm.probe import StoreProbe

    cfg = load_config(
        {**config(page_bytes=PAGE), "tenants": [{"name": "acme", "salt": "s"}]}, env={}
    )
    fp = b"\x07" * 16
    seed = chain_seed(fp, "s")
    assert owners(cfg.tenants, fp)[seed] == "acme"
    tokens = np.arange(41, dtype=np.int32)
    probe = StoreProbe.__new__(StoreProbe)  # its naming alone: no tier is asked
    probe.group_pages, probe._prefix, probe._tenants = 2, "hicache", cfg.tenants
    probe._owners = (b"", {})
    _, names = probe.objects(fp, KeyChain(seed, 4, tokens), 0, 10)
    runner = JobRunner.__new__(JobRunner)
    runner.G, runner.key_prefix, runner.owners = 2, "hicache", owners(cfg.tenants, fp)
    runner._names = runner._prefixes(fp)
    job = Job(kind="probe", seed=seed)
    job.ends = KeyChain(seed, 4, tokens).hash_to(10)[1::2]
    job.tail, job.state_ends = 0, []
    runner._place(job)
    assert names == job.names and all(object_tenant(n) == "acme" for n in names)


@pytest.mark.parametrize(
    ("terms", "error"),
    [
        (
            {"quota": {"dsk": "1KiB"}},
            "tenants.0.quota.dsk: no tier is named 'dsk' (tiers: host, disk); did you mean 'disk'?",
        ),
        (
            {"share": {"disk": "1MiB"}},
            "tenants: the disk shares add up to 1048576 bytes, more than tiers.1.size",
        ),
    ],
)
def test_quota_store_config_errors_name_the_field(tmp_path, terms, error):
    cfg = tenants_config(tmp_path, terms=False)
    cfg["tenants"] = [{"name": "a", **terms}]
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    assert error in str(err.value) and "\n" not in str(err.value)


def test_quota_on_a_tier_that_keeps_no_terms_is_refused(tmp_path):
    """Mooncake's master evicts by its own policy: terms on it are refused, in one line."""
    require("mooncake", import_problem("mooncake.store", "mooncake"))
    cfg = config(page_bytes=PAGE)
    cfg["tiers"].append({"type": "mooncake"})
    cfg["tenants"] = [{"name": "a", "quota": {"mooncake": "1MiB"}}]
    with pytest.raises(ConfigError, match="the mooncake tier keeps no shares or quotas"):
        load_config(cfg, env={})
