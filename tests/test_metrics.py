"""Prometheus metrics read back after scenarios run through the fake engine."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from fake_engine import FakeEngine, config
from prometheus_client import REGISTRY, CollectorRegistry

from hicache.observability.metrics import (
    FAMILIES,
    METRICS,
    TIER_METRICS,
    HiCacheCollector,
    register,
    serve,
    unmapped,
)


def tokens(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_two_identical_requests_read_back_exactly() -> None:
    engine = FakeEngine(config(page_tokens=4, page_bytes=64, host_pages=32))
    registry, _ = register(engine.cache)
    prompt = tokens(100, 10)  # two full pages and two tokens
    engine.run("a", prompt)
    engine.run("b", prompt)  # both pages hit: 8 tokens, 2 left to compute

    assert value(registry, "hicache_lookups_total") == 2
    assert value(registry, "hicache_prompt_tokens_total") == 20
    assert value(registry, "hicache_hit_tokens_total", tier="host") == 8
    assert value(registry, "hicache_pages_loaded_total", tier="host") == 2
    assert value(registry, "hicache_pages_stored_total", tier="host") == 2
    assert value(registry, "hicache_pages_evicted_total", tier="host") == 0
    assert value(registry, "hicache_limited_tokens_total") == 0
    assert value(registry, "hicache_pool_slots", tier="host", pool="page") == 32
    assert value(registry, "hicache_pool_used_slots", tier="host", pool="page") == 2
    assert value(registry, "hicache_pool_pinned_slots", tier="host", pool="page") == 0
    assert value(registry, "hicache_requests") == 0
    # the plain dict says the same
    s = engine.cache.stats()
    assert (s["lookups"], s["hit_tokens_host"], s["pages_stored"]) == (2, 8, 2)


def test_cap_and_eviction_are_counted() -> None:
    engine = FakeEngine(config(page_tokens=4, page_bytes=64, host_pages=4))
    registry, _ = register(engine.cache)
    engine.run("a", tokens(0, 8))  # 2 pages
    engine.run("b", tokens(0, 8))  # both held, the cap keeps 1 token: 1 page hit, 4 limited
    engine.run("c", tokens(1000, 8))  # 2 new pages: the pool is full now
    engine.run("d", tokens(2000, 8))  # 2 more: evicts 2

    assert value(registry, "hicache_hit_tokens_total", tier="host") == 4
    assert value(registry, "hicache_limited_tokens_total") == 4
    assert value(registry, "hicache_pages_stored_total", tier="host") == 6
    assert value(registry, "hicache_pages_evicted_total", tier="host") == 2
    assert value(registry, "hicache_pool_used_slots", tier="host", pool="page") == 4


def test_every_stats_key_has_a_metric() -> None:
    engine = FakeEngine(config())
    assert unmapped(engine.cache.stats()) == []


def test_table_is_consistent() -> None:
    for key, (name, labels) in METRICS.items():
        assert name in FAMILIES, f"{key}: family {name} is not declared"
        assert set(labels) == set(FAMILIES[name].labels), f"{key}: labels of {name}"
        assert name.startswith("hicache_") and not name.endswith("_total"), name
    # no two keys export the same series
    series = [(name, tuple(sorted(labels.items()))) for name, labels in METRICS.values()]
    series += [(n, tuple(sorted({**ls, "tier": "x"}.items()))) for n, ls in TIER_METRICS.values()]
    assert len(series) == len(set(series))
    for key, (name, labels) in TIER_METRICS.items():
        assert name in FAMILIES, f"{key}: family {name} is not declared"
        assert {"tier", *labels} == set(FAMILIES[name].labels), f"{key}: labels of {name}"


def test_each_store_tier_exports_under_its_own_name() -> None:
    stats = {
        "put_bytes_mooncake": 4096,
        "get_bytes_disk": 512,
        "skipped_down_mooncake": 3,
        "available_disk": 0,
        "hit_tokens_disk": 64,
        "hit_tokens_host": 16,
        "read_mbps_disk": 2500,
    }
    registry = CollectorRegistry()
    registry.register(HiCacheCollector(stats=lambda: stats))
    assert value(registry, "hicache_tier_bytes_total", tier="mooncake", op="put") == 4096
    assert value(registry, "hicache_tier_bytes_total", tier="disk", op="get") == 512
    assert (
        value(registry, "hicache_fallbacks_total", tier="mooncake", reason="tier_unavailable") == 3
    )
    assert value(registry, "hicache_tier_available", tier="disk") == 0
    assert value(registry, "hicache_hit_tokens_total", tier="disk") == 64
    assert value(registry, "hicache_hit_tokens_total", tier="host") == 16
    assert value(registry, "hicache_tier_read_bytes_per_second", tier="disk") == 2.5e9
    stats["put_bytes_mooncake"] = 8192  # read at scrape time: no second set of books
    assert value(registry, "hicache_tier_bytes_total", tier="mooncake", op="put") == 8192


def test_unknown_keys_are_listed_not_exported() -> None:
    stats = {"lookups": 1, "l3_brand_new": 7}
    assert unmapped(stats) == ["l3_brand_new"]
    registry = CollectorRegistry()
    registry.register(HiCacheCollector(stats=lambda: stats))
    assert value(registry, "hicache_lookups_total") == 1
    names = {m.name for m in registry.collect()}
    assert names == {"hicache_lookups"}


def test_histograms_from_the_source() -> None:
    class Source:
        def stats(self) -> dict[str, int]:
            return {"lookups": 0}

        def histograms(self) -> dict:
            return {
                "hicache_copy_seconds": {
                    "buckets": [(0.001, 3), (0.01, 5), (float("inf"), 6)],
                    "sum": 0.5,
                    "help": "Host<->GPU copy latency.",
                }
            }

    registry, _ = register(Source())
    assert value(registry, "hicache_copy_seconds_bucket", le="0.001") == 3
    assert value(registry, "hicache_copy_seconds_bucket", le="+Inf") == 6
    assert value(registry, "hicache_copy_seconds_count") == 6
    assert value(registry, "hicache_copy_seconds_sum") == 0.5


def test_default_registry_is_fresh_never_the_global_one() -> None:
    engine = FakeEngine(config())
    registry, _ = register(engine.cache)
    assert registry is not REGISTRY
    assert REGISTRY.get_sample_value("hicache_lookups_total") is None
    with pytest.raises(ValueError, match="not both"):
        register(engine.cache, CollectorRegistry(), use_global=True)
    with pytest.raises(TypeError):
        HiCacheCollector()


def test_http_endpoint_on_loopback() -> None:
    engine = FakeEngine(config(page_tokens=4, page_bytes=64))
    engine.run("a", tokens(0, 9))
    registry, _ = register(engine.cache)
    server = serve(registry, port=0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=60) as r:
            text = r.read().decode()
    finally:
        server.close()
    assert "hicache_lookups_total 1.0" in text
    assert 'hicache_pages_stored_total{tier="host"} 2.0' in text
    with pytest.raises(ValueError, match="port"):
        serve(registry, port=70000)


def test_a_metrics_port_another_process_holds_is_named() -> None:
    """Two instances given one metrics port: the second is told which port, and what to do."""
    first = serve(CollectorRegistry(), port=0)
    try:
        with pytest.raises(OSError) as err:
            serve(CollectorRegistry(), port=first.port)
    finally:
        first.close()
    assert str(err.value) == (
        f"metrics port {first.port} on 127.0.0.1 is in use by another process: give "
        "metrics.port another port, or 0 for any free one"
    )


def test_the_cache_exports_latency_histograms_after_a_scenario():
    e = FakeEngine(config())
    prompt = np.arange(40, dtype=np.int32)
    e.run("a", prompt)
    e.run("b", prompt)
    registry = CollectorRegistry()
    register(e.cache, registry)
    assert registry.get_sample_value("hicache_match_seconds_count") == 2
    assert registry.get_sample_value("hicache_match_seconds_bucket", {"le": "+Inf"}) == 2
    assert registry.get_sample_value("hicache_match_seconds_sum") > 0
    assert registry.get_sample_value("hicache_tier_get_seconds_count", {"tier": "memory"}) is None
    # a stored the prompt's pages in one copy; b loaded them in one and had nothing to store
    assert registry.get_sample_value("hicache_store_copy_seconds_count") == 1
    assert registry.get_sample_value("hicache_load_copy_seconds_count") == 1


def test_the_config_can_turn_the_endpoint_on():
    cfg = config()
    cfg["metrics"] = {"port": 0}
    e = FakeEngine(cfg)
    try:
        e.run("a", np.arange(40, dtype=np.int32))
        url = f"http://127.0.0.1:{e.cache.metrics_server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert "hicache_lookups_total 1.0" in text
    finally:
        e.cache.close()
    assert FakeEngine(config()).cache.metrics_server is None  # off by default
