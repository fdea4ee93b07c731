"""The host tier (L2): pinned pools of page slots and state slots, indexed by page key.

The pools are allocated at the first store (an engine that never stores pays nothing), pinned
when CUDA is present so that the copy kernel reaches them directly, plain memory otherwise.
`page_slots` and `state_slots` keep the books (index, pins, LRU); this class owns the memory.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from hicache.backends.base import PoolTier
from hicache.backends.registry import register_tier
from hicache.config import Bytes, ConfigError, Layout, TierConfig
from hicache.kernels import PagedBuffer
from hicache.memory import HostMemory
from hicache.slots import EvictHook, SlotPool


class HostTierConfig(TierConfig):
    """``- type: host``: pinned host memory of this process."""

    type: Literal["host"] = "host"
    size: Bytes = Field(gt=0)
    """Bytes of page slots (``64GiB``); the number of slots is size // page bytes."""
    state_slots: int = Field(default=256, ge=0)
    """State slots, used only where the layout has states."""
    pin: Literal["auto", "yes", "no"] = "auto"
    """Page-lock the pools: auto pins where CUDA is available."""


@register_tier("host", HostTierConfig)
class HostTier(PoolTier):
    """Page slots and state slots in host memory of this process."""

    shared = False
    persistent = False

    def __init__(
        self, config: HostTierConfig, layout: Layout, on_evict: EvictHook | None = None
    ) -> None:
        self.config = config
        self.layout = layout
        slots = config.size // layout.page_size
        if slots == 0:
            raise ConfigError(
                f"host tier size {config.size} is smaller than one page ({layout.page_size} bytes)"
            )
        self.page_slots = SlotPool(slots, on_evict)
        self.state_slots = SlotPool(config.state_slots if layout.state_bytes else 0)
        self._pin = {"auto": torch.cuda.is_available(), "yes": True, "no": False}[config.pin]
        self._page_memory: HostMemory | None = None
        self._state_memory: HostMemory | None = None
        self._pages: PagedBuffer | None = None
        self._states: torch.Tensor | None = None

    @property
    def allocated(self) -> bool:
        return self._page_memory is not None

    @property
    def pinned(self) -> bool:
        return self._pin

    @property
    def pages(self) -> PagedBuffer:
        """The page slots, [slots, page_bytes] — allocated at the first access."""
        if self._pages is None:
            n, size = self.page_slots.capacity, self.layout.page_size
            self._page_memory = HostMemory(n * size, self._pin)
            self._pages = PagedBuffer.page_first(self._page_memory.tensor.view(n, size))
        return self._pages

    def state(self, slot: int) -> torch.Tensor:
        """State slot `slot` as a 1-D uint8 tensor of state_bytes (allocated at first access)."""
        if self._states is None:
            n, size = self.state_slots.capacity, self.layout.state_bytes
            self._state_memory = HostMemory(n * size, self._pin)
            self._states = self._state_memory.tensor.view(n, size)
        return self._states[slot]

    def memory(self) -> list[torch.Tensor]:
        """The allocated pools, for registration with a store that reads and writes them."""
        return [m.tensor for m in (self._page_memory, self._state_memory) if m is not None]

    def close(self) -> None:
        for m in (self._page_memory, self._state_memory):
            if m is not None:
                m.close()
