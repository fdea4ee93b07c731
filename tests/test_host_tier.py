"""The host tier's allocation: a pool that cannot be had is an error the embedder sees, never
a tier that silently stores nothing."""

from __future__ import annotations

import pytest

from hicache.backends.host import HostTier, HostTierConfig
from hicache.config import ConfigError, Layout
from hicache.errors import HiCacheError

LAYOUT = Layout(model="m", kv_dtype="uint8", page_tokens=4, page_bytes=4096)


def test_a_pool_larger_than_the_machine_is_refused_at_construction():
    with pytest.raises(ConfigError, match=r"^size: .* is more than this machine has"):
        HostTier(HostTierConfig(size=1 << 50), LAYOUT)


def test_a_failed_allocation_is_raised_by_wait_ready():
    def fail(_tier: HostTier) -> None:
        raise RuntimeError("no memory for the copies")

    tier = HostTier(HostTierConfig(size=1 << 20), LAYOUT, on_ready=fail)
    with pytest.raises(HiCacheError, match=r"^the host tier could not be allocated: no memory"):
        tier.wait_ready(30)
    assert not tier.ready
    tier.close()


def test_wait_ready_then_the_pools_are_there():
    tier = HostTier(HostTierConfig(size=1 << 20), LAYOUT)
    assert tier.wait_ready(30) and tier.ready
    assert tuple(tier.pages.segments[0].shape) == (256, 4096)  # size // page_bytes slots
    tier.close()
