"""The disk tier under many prompts, restarts and a full directory: a fresh cache hits exactly
what the directory holds, no more (a missing group is never a hit) and no less (a held prefix
is never passed over)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from fake_engine import FakeEngine, config

from hicache.backends.disk.records import HEADER
from hicache.backends.disk.tier import DiskTier
from hicache.core.keys import chain_seed, fingerprint, page_keys, store_key

P, G, PAGES = 4, 2, 10  # 42-token prompts: 10 pages, 5 groups of 2
ROUNDS, PER_ROUND = 4, 120
RECORD_BYTES = HEADER + G * 64  # `config()`'s pages are 64 bytes
HELD = ROUNDS * PER_ROUND * PAGES // G // 3
"""Records the directory has room for: a third of what is written (full after round one)."""


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, 42).astype(np.int32)


def disk_config(path: Path, write: str) -> dict:
    cfg = config(host_pages=256)
    cfg["tiers"].append(
        {
            "type": "disk",
            "path": str(path),
            "size": HELD * RECORD_BYTES,
            "group_pages": G,
            "write": write,
        }
    )
    # what the directory holds is the question, not whether reading it beats recomputing: a
    # prefill this slow makes every read worth it however slow a busy machine makes the disk
    cfg.setdefault("policy", {})["prefill_tokens_per_s"] = 1.0
    return cfg


def settle(engine: FakeEngine) -> None:
    deadline = time.monotonic() + 300
    while not engine.cache.tiers_idle:
        assert time.monotonic() < deadline, "the disk writes did not finish in 300 s"
        engine.cache.poll()
        time.sleep(0.001)
    engine.cache.poll()


def held_groups(engine: FakeEngine, tokens: np.ndarray) -> int:
    """How many of the prompt's groups, from its first on, the directory holds now."""
    layout = engine.layout
    fp = fingerprint(layout)
    keys = page_keys(chain_seed(fp), tokens, P)
    names = [store_key("hicache", fp, k, G) for k in keys[G - 1 :: G]]
    tier = next(link.store for link in engine.cache._chain.links if link.name == "disk")
    assert isinstance(tier, DiskTier)
    held = tier.exists(names)
    return held.index(False) if False in held else len(held)


def test_a_fresh_cache_hits_what_the_directory_holds_through_rounds_and_restarts(tmp_path):
    path = tmp_path / "disk"
    seeds: list[int] = []
    for r in range(ROUNDS):
        writer = FakeEngine(disk_config(path, "behind"), num_blocks=64)
        try:
            for i in range(PER_ROUND):
                seeds.append(1000 * r + i)
                writer.run(f"w{r}-{i}", prompt(seeds[-1]))
                settle(writer)  # so that no page is dropped for want of host slots
            written = writer.cache.stats()
        finally:
            writer.cache.close()  # a restart follows
        assert written["pages_dropped"] == 0
        assert written["objects_put_disk"] == PER_ROUND * PAGES // G
        # a reader that writes nothing, so that what it reads stays what the directory holds
        reader = FakeEngine(disk_config(path, "off"), num_blocks=64)
        try:
            reader.cache.wait_ready(60)
            expected, hits = [], []
            for seed in seeds:
                p = prompt(seed)
                expected.append(held_groups(reader, p) * G * P)
                hits.append(reader.run(f"r{r}-{seed}", p).hit_tokens)  # every byte checked
            stats = reader.cache.stats()
        finally:
            reader.cache.close()
        assert hits == expected, f"round {r}: {sum(hits)} hit tokens, {sum(expected)} held"
        records = sum(1 for f in (path / "objects").rglob("*") if f.is_file())
        assert records == min(HELD, (r + 1) * PER_ROUND * PAGES // G)  # full from round two
        assert stats["hit_tokens_disk"] == sum(expected) > 0
