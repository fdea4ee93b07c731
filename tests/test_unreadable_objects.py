"""An object a reader finds unreadable (its bytes changed at rest, or sealed under a key the
reader does not hold) is a counted miss, and is then discarded from the store tier: the
request's recomputed pages are stored again under the same name and the next request hits. A
store whose put of an existing name answers "held" would otherwise keep the bad object, and
every later request of that prefix would miss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fake_engine import FakeEngine, config, settle

PAGE = 1024


def disk_config(tmp_path: Path, key: str | None = None) -> dict:
    cfg = config(page_bytes=PAGE, host_pages=32)
    cfg["tiers"].append(
        {
            "type": "disk",
            "path": str(tmp_path / "d"),
            "size": "16MiB",
            "group_pages": 2,
            "sync": False,
        }
    )
    if key is not None:
        cfg["tenants"] = [{"name": "acme", "key_env": "KEY"}]
    return cfg


def flood(e: FakeEngine) -> None:
    """Push every earlier page out of the 32-page host tier."""
    rng = np.random.default_rng(99)
    for i in range(12):
        e.run(f"flood{i}", rng.integers(0, 50_000, 17).astype(np.int32))
    settle(e)


def records(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "d" / "objects").rglob("*") if p.is_file())


def test_a_record_changed_at_rest_is_a_miss_then_stored_again_and_hit(tmp_path):
    e = FakeEngine(disk_config(tmp_path))
    try:
        prompt = np.random.default_rng(1).integers(0, 50_000, 41).astype(np.int32)
        e.run("p0", prompt)
        settle(e)
        before = set(records(tmp_path))
        flood(e)
        # the prompt's first group: a call's objects are stamped in its order
        first = min(before, key=lambda p: p.stat().st_mtime_ns)
        with open(first, "r+b") as f:  # one payload byte changed
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        m = e.run("p1", prompt)
        assert m.hit_tokens == 0 and e.cache.stats()["corrupt_disk"] == 1
        settle(e)
        flood(e)
        m = e.run("p2", prompt)
        assert (m.hit_tokens, m.tier_tokens) == (40, (("disk", 40),))
    finally:
        e.cache.close()


def test_an_object_sealed_under_a_rotated_key_is_stored_again_under_the_new_one(
    tmp_path, monkeypatch
):
    """acme's key is rotated between two runs of the cache on one disk: the first request
    misses (a key miss), its pages are stored again under the new key, the next one hits."""
    prompt = np.random.default_rng(2).integers(0, 50_000, 41).astype(np.int32)
    monkeypatch.setenv("KEY", "11" * 32)
    e = FakeEngine(disk_config(tmp_path, "KEY"))
    try:
        e.run("p0", prompt, salt="acme")
        settle(e)
    finally:
        e.cache.close()
    monkeypatch.setenv("KEY", "22" * 32)
    e = FakeEngine(disk_config(tmp_path, "KEY"))
    try:
        m = e.run("p1", prompt, salt="acme")
        assert m.hit_tokens == 0 and e.cache.stats()["key_misses_disk"] >= 1
        settle(e)
        flood(e)
        m = e.run("p2", prompt, salt="acme")
        assert (m.hit_tokens, m.tier_tokens) == (40, (("disk", 40),))
    finally:
        e.cache.close()
