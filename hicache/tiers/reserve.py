"""A store link's fetch reserve: free host slots kept for fetches that skip the probe
(`ReserveSide`, a part of `hicache.tiers.link.StoreLink`; engine thread).

A fetch that fits the reserve is one `get_into` those slots (see `hicache.tiers.fetch`); the
slots a get did not fill come back to the reserve, and `poll` tops it up to `reserve_pages`
(at most an eighth of the host tier), evicting if needed.
"""

from __future__ import annotations

from typing import Any

from hicache.core.slots import Lease
from hicache.tiers.host import HostTier


class ReserveSide:
    """The reserve part of a `StoreLink`."""

    host: HostTier
    settings: Any
    _reserve: Lease | None
    _lent: int

    def refill(self) -> None:
        """Top the fetch reserve up to `reserve_pages` free host slots (evicting if needed), at
        most an eighth of the host tier."""
        if not self.host.ready:
            return
        short = self._reserve_short()
        if short > 0:
            self._add_to_reserve(self.host.page_slots.reserve(short))

    def _take_back(self, lease: Lease, keep: int) -> None:
        """A get into slots lent by the reserve has read `keep` pages: the lease's other slots
        (reserved, never published) return to the reserve, as far as it has room, and the rest
        to the free list. A fetch of objects the store does not hold leaves nothing to refill,
        so misses cost the engine thread no evictions and no refill."""
        spare = lease.split(len(lease) - keep)
        room = max(0, self._reserve_short())
        if len(spare) > room:
            spare.split(len(spare) - room).release()
        self._add_to_reserve(spare)

    def _add_to_reserve(self, lease: Lease) -> None:
        """Move `lease`'s reserved slots, with their pins, into the reserve."""
        if self._reserve is None:
            self._reserve = lease
        else:
            self._reserve.absorb(lease)

    def _reserve_short(self) -> int:
        """Slots the reserve lacks: its size, less the slots lent to running gets and those it
        holds (negative when it holds more)."""
        return self._reserve_size() - self._lent - self._reserve_free()

    def _reserve_free(self) -> int:
        """Free slots in the reserve now (none before the first refill)."""
        return len(self._reserve) if self._reserve is not None else 0

    def _reserve_size(self) -> int:
        """Free slots held for fetches when none is out: `reserve_pages`, at most an eighth of
        the host tier."""
        return min(self.settings.reserve_pages, self.host.page_slots.capacity // 8)
