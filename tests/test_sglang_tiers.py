"""hicache's store tiers under an SGLang-shaped host pool, without SGLang
(`hicache.integrations.sglang.tiers.StoreTiers` over `drive.PlainPool`): what SGLang's
threads may do at once, the driver's own checks, and the input SGLang should never give."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Literal

import pytest
import torch
from memory_tier import MemoryConfig, MemoryTier

from hicache.config import Layout
from hicache.integrations.sglang.drive import Drive, PlainPool
from hicache.integrations.sglang.pool import EnginePages
from hicache.integrations.sglang.settings import settings
from hicache.integrations.sglang.tiers import StoreTiers
from hicache.registry import register_tier

P = 4
ROOT = Path(__file__).resolve().parent.parent


class GateConfig(MemoryConfig):
    type: Literal["memory_gate"] = "memory_gate"  # type: ignore[assignment]


@register_tier("memory_gate", GateConfig)
class GateTier(MemoryTier):
    """A memory tier whose put lets its bytes be read only once a second put has come in too
    (or a second has passed): two puts at once, inside the store, whenever they can be."""

    gate = threading.Barrier(2, timeout=1.0)

    def put_from(self, keys, buffers):
        with contextlib.suppress(threading.BrokenBarrierError):
            self.gate.wait()
        return super().put_from(keys, buffers)


def tiers_over(pool: PlainPool, *tiers: dict) -> StoreTiers:
    pages = EnginePages(pool)
    layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, segments=pages.pages.seg_bytes)
    cfg = settings({"interface_v1": 1, "hicache": {"tiers": list(tiers)}}).config
    out = StoreTiers(cfg.tiers, pages, layout)
    assert out.wait_ready()
    return out


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * P + t for p in pages for t in range(P)])


def test_puts_from_two_threads_into_a_codec_tier_store_every_page(tmp_path):
    """SGLang's backup thread puts while its prefetch thread promotes (puts what a lower tier
    brought): two puts of one tier at once. With `codec: lossless` each encodes into the
    tier's staging memory before its store call; every page of both must read back whole.
    (Before the fix, the second put encoded over the first's staged objects while the first
    was in its call: the first's pages read back corrupt.)"""
    pool = PlainPool(256, P, 16384)
    rows = pool.kv_buffer.view(256, -1)
    for page in range(256):  # compressible pages (the codec stores them encoded), each its own
        rows[page] = torch.arange(16384, dtype=torch.int64).remainder(7 + page % 5).to(torch.uint8)
        rows[page, :8] = torch.tensor(list(page.to_bytes(8, "little")), dtype=torch.uint8)
    tiers = tiers_over(pool, {"type": "memory_gate", "space": "codec-race", "codec": "lossless"})
    keys = [f"{i:064x}" for i in range(1, 17)]
    try:

        def put(half: int) -> None:
            at = half * 8
            assert tiers.put(keys[at : at + 8], indices(list(range(at, at + 8)))) == [True] * 8

        threads = [threading.Thread(target=put, args=(h,)) for h in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert tiers.get(keys, indices(list(range(128, 144)))) == [True] * 16
        assert torch.equal(rows[128:144], rows[0:16])
    finally:
        tiers.close()


def test_the_driver_sees_a_backend_that_serves_wrong_bytes():
    """The driver is not blind: a backend whose get reports pages it never read, or reads
    another key's page, is caught."""
    pool = PlainPool(128, P, 512)
    tiers = tiers_over(pool, {"type": "memory", "space": "blind"})
    try:

        def lazy_get(keys, host_indices):
            return [True] * len(keys)

        def swapped_get(keys, host_indices):
            return tiers.get(list(reversed(keys)), host_indices)

        for get in (lazy_get, swapped_get):
            tally = Drive(tiers.put, tiers.exists, get, pool, seed=3).run(40)
            assert any("other bytes" in p or "never put" in p for p in tally.problems), get
        calm = Drive(tiers.put, tiers.exists, tiers.get, pool, seed=4)
        assert calm.run(40).problems == []
    finally:
        tiers.close()


def test_input_sglang_should_never_give_is_refused_in_one_line():
    pool = PlainPool(16, P, 256)
    tiers = tiers_over(pool, {"type": "memory", "space": "input"})
    try:
        with pytest.raises(ValueError, match="page key 'not-hex' is not a hex digest"):
            tiers.exists(["00ff", "not-hex"])
        with pytest.raises(ValueError, match="7 host slots for 2 pages of 4 tokens"):
            tiers.put(["00", "01"], torch.arange(7))
        with pytest.raises(ValueError, match="not whole pages"):
            tiers.put(["00"], torch.tensor([1, 2, 3, 4]))  # a page that starts mid-page
        with pytest.raises(ValueError, match="not whole pages"):
            tiers.get(["00"], torch.arange(16 * P, 17 * P))  # past the pool
    finally:
        tiers.close()


@pytest.mark.parametrize(
    "path", sorted((ROOT / "configs" / "sglang").glob("*.yaml")), ids=lambda p: p.name
)
def test_the_shipped_sglang_configurations_are_valid(path):
    """configs/sglang/ holds configurations of SGLang's backend (store tiers only, no host
    tier): each loads as the backend loads it."""
    assert settings({"interface_v1": 1, "config": str(path)}).config.tiers
