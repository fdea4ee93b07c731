"""The host tier (L2): pinned pools of page slots and state slots, indexed by page key.

The pools are allocated on a background thread when the tier is built (pinning or touching tens
of GiB takes seconds, and the engine thread never waits): until then the tier is not `ready` and
the cache neither stores nor fetches. They are pinned when CUDA is present, so that the copy
kernel reaches them directly, and touched (zeroed) otherwise, so that no transfer pays page faults.
`page_slots` and `state_slots` keep the books (index, pins, LRU); this class owns the memory.

Pools larger than the memory the machine has available are refused at construction (touching
them would wake the OOM killer, not raise). An allocation that fails later is kept in `error`
and raised by `wait_ready`. `close` cancels an allocation still running and waits for it, and
so does the interpreter's exit: a thread still inside torch or CUDA when the interpreter
finalizes is torn down mid-call, which aborts the process.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field, field_validator

from hicache.backends.base import PoolTier
from hicache.backends.memory import Cancelled, HostMemory, available_bytes, describe
from hicache.config import Bytes, Layout, TierConfig
from hicache.core.eviction import DEFAULT_POLICY, make_policy
from hicache.core.shares import Shares
from hicache.core.slots import EvictHook, SlotPool
from hicache.errors import HiCacheError, TierStartError
from hicache.kernels import PagedBuffer
from hicache.registry import register_tier

log = logging.getLogger(__name__)


class HostTierConfig(TierConfig):
    """``- type: host``: pinned host memory of this process."""

    type: Literal["host"] = "host"
    size: Bytes = Field(gt=0)
    """Bytes of page slots (``64GiB``); the number of slots is size // page bytes."""
    state_slots: int = Field(default=256, ge=0)
    """State slots, used only where the layout has states."""
    pin: Literal["auto", "yes", "no"] = "auto"
    """Page-lock the pools: auto pins where CUDA is available."""
    policy: str = DEFAULT_POLICY
    """Eviction policy of the page slots: lru, arc, s3fifo or prefix (docs/eviction.md)."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        make_policy(name, 0)  # ValueError naming the known policies
        return name

    def check_machine(self) -> None:
        free = available_bytes()
        if free is not None and self.size > free:
            raise ValueError(
                f"size: {describe(self.size)} is more than this machine has available "
                f"({describe(free)})"
            )

    def check_layout(self, layout: Layout) -> None:
        if self.size < layout.page_size:
            raise ValueError(
                f"size: {describe(self.size)} is smaller than one page "
                f"({describe(layout.page_size)}, the layout's page_bytes)"
            )


@register_tier("host", HostTierConfig)
class HostTier(PoolTier):
    """Page slots and state slots in host memory of this process."""

    shared = False
    persistent = False

    def __init__(
        self,
        config: HostTierConfig,
        layout: Layout,
        on_evict: EvictHook | None = None,
        on_ready: Callable[[HostTier], None] | None = None,
        shares: Shares | None = None,
    ) -> None:
        """`on_ready` runs on the allocating thread once the pools exist, before the tier reads
        `ready` (the cache prepares its copies there); if it raises, the tier stays unready
        with the error in `error`, which `wait_ready` raises. TierStartError (field ``size``)
        for pools larger than the memory this machine has available, or smaller than one page.
        `shares`: the tenants' shares and quotas of the page slots (`hicache.core.shares`)."""
        self.config = config
        self.layout = layout
        try:
            config.check_machine()  # touching more would wake the OOM killer, not raise
        except ValueError as err:
            field, _, reason = str(err).partition(": ")
            raise TierStartError(field, reason) from None
        slots = config.size // layout.page_size
        if slots == 0:
            raise TierStartError(
                "size",
                f"{describe(config.size)} is smaller than one page ({describe(layout.page_size)})",
            )
        self.page_slots = SlotPool(slots, on_evict, policy=config.policy, shares=shares)
        self.state_slots = SlotPool(config.state_slots if layout.state_bytes else 0)
        self._pin = {"auto": torch.cuda.is_available(), "yes": True, "no": False}[config.pin]
        self._page_memory: HostMemory | None = None
        self._state_memory: HostMemory | None = None
        self._pages: PagedBuffer | None = None
        self._states: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._on_ready = on_ready
        self.ready = False
        """Whether the pools are allocated: a plain attribute, set once by the allocating
        thread after the pools exist (read without a call on every store and fetch)."""
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._allocate, name="hicache-host-alloc", daemon=True
        )
        _allocating.add(self)
        self._thread.start()

    def _allocate(self) -> None:
        """Allocate (and pin, or touch) both pools off the engine thread: tens of GiB take
        seconds. Until this is done the tier is not `ready` and the cache stores nothing."""
        try:
            n, size = self.page_slots.capacity, self.layout.page_size
            pages = HostMemory(n * size, self._pin, self._stop)
            m, state_size = self.state_slots.capacity, self.layout.state_bytes
            states = HostMemory(m * state_size, self._pin, self._stop)
            self._page_memory, self._state_memory = pages, states
            self._pages = PagedBuffer.page_first(pages.tensor.view(n, size))
            self._states = states.tensor.view(m, state_size)
            if self._on_ready is not None:
                self._on_ready(self)
        except Cancelled:
            self.error = HiCacheError("the host tier was closed before its pools were allocated")
            return
        except BaseException as err:  # raised by `wait_ready`; the tier stays unready
            self.error = err
            log.error("hicache: preparing the host tier failed: %r", err)
            return
        finally:
            _allocating.discard(self)
        self.ready = True
        self._ready.set()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the pools are allocated; False if `timeout_s` passed first. Raises
        HiCacheError naming the cause if the allocation failed. (For tools, tests and
        embedders that want every store to count; the cache itself never waits.)"""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.error is not None:
            raise HiCacheError(f"the host tier could not be allocated: {self.error}")
        return self._ready.is_set()

    @property
    def pinned(self) -> bool:
        return self._pin

    @property
    def pages(self) -> PagedBuffer:
        """The page slots, [slots, page_bytes]. Only while `ready`."""
        if self._pages is None:
            raise RuntimeError("the host tier is not allocated yet (check `ready` first)")
        return self._pages

    def state(self, slot: int) -> torch.Tensor:
        """State slot `slot` as a 1-D uint8 tensor of state_bytes. Only while `ready`."""
        if self._states is None:
            raise RuntimeError("the host tier is not allocated yet (check `ready` first)")
        return self._states[slot]

    def memory(self) -> list[torch.Tensor]:
        """The allocated pools, for registration with a store that reads and writes them."""
        return [m.tensor for m in (self._page_memory, self._state_memory) if m and m.tensor.numel()]

    def cancel(self) -> None:
        """Stop an allocation still running and wait for it (at most one zeroing step, or a
        pinning call, which cannot be cut short)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def close(self) -> None:
        self.cancel()
        for m in (self._page_memory, self._state_memory):
            if m is not None:
                m.close()


_allocating: set[HostTier] = set()
"""Tiers whose allocating thread runs (each removes itself when done)."""


@atexit.register
def _cancel_allocations() -> None:
    for tier in list(_allocating):
        tier.cancel()
