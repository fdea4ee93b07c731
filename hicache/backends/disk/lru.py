"""The disk tier's book of its files: sizes, LRU order and the room writes reserve."""

from __future__ import annotations

import threading
from collections import OrderedDict


class LruBook:
    """Which records the tier holds, their bytes, and the eviction order (least recently used
    first). Eviction is decided here and nowhere else. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.size = capacity
        """The bound the book started with (the tier's `size`)."""
        self.capacity = capacity
        """The bound now: `size`, or less while the file system is short of space."""
        self._lock = threading.Lock()
        self._held: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first
        self._writing: dict[str, int] = {}  # name -> bytes reserved by a put in progress
        self.used = 0  # bytes of held and reserved records

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def add(self, name: str, nbytes: int) -> None:
        """Record a held record as the most recently used (at start-up, oldest first)."""
        with self._lock:
            if name not in self._held:
                self._held[name] = nbytes
                self.used += nbytes

    def names(self) -> list[str]:
        """The records held now (least recently used first)."""
        with self._lock:
            return list(self._held)

    def touch(self, name: str) -> None:
        """A hit: `name` becomes the most recently used."""
        with self._lock:
            if name in self._held:
                self._held.move_to_end(name)

    def reserve(self, name: str, nbytes: int) -> list[str] | None:
        """Make room for a new record: returns the records to remove first (least recently used
        first; already out of the book: the caller removes them), or None when `name` is held or
        being written already. ValueError, with nothing changed, if `nbytes` exceeds the
        capacity or no eviction can make room (the rest is reserved by puts in progress)."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the tier's size of {self.capacity}")
        with self._lock:
            if name in self._held or name in self._writing:
                return None
            if sum(self._writing.values()) + nbytes > self.capacity:
                raise ValueError("no room: the tier's size is taken by records being written")
            victims = []
            while self.used + nbytes > self.capacity:  # held records alone can make the room
                victim, size = self._held.popitem(last=False)
                self.used -= size
                victims.append(victim)
            self._writing[name] = nbytes
            self.used += nbytes
            return victims

    def settle(self, name: str, written: bool) -> None:
        """End a `reserve`: the record is now held (most recently used), or was not written."""
        with self._lock:
            nbytes = self._writing.pop(name)
            if written:
                self._held[name] = nbytes
            else:
                self.used -= nbytes

    def drop(self, name: str) -> bool:
        """Forget a record that is gone (damaged); whether it was held."""
        with self._lock:
            nbytes = self._held.pop(name, None)
            if nbytes is not None:
                self.used -= nbytes
            return nbytes is not None

    def lower(self) -> None:
        """The file system ran out of space below the capacity: what is held and being written
        now becomes the capacity, so that later puts evict the least recently used records
        instead of failing (until `lift`)."""
        with self._lock:
            self.capacity = min(self.capacity, self.used)

    @property
    def lowered(self) -> bool:
        """The bound is below the size (`lower`)."""
        return self.capacity < self.size

    def lift(self, free: int) -> None:
        """The file system has `free` bytes of room: a lowered bound rises to what is held and
        being written plus that room, at most to the size (a full file system is transient)."""
        with self._lock:
            self.capacity = max(self.capacity, min(self.size, self.used + free))

    def shrink(self) -> list[str]:
        """Records to remove so that the held ones fit the capacity (after a restart with a
        smaller size), least recently used first."""
        with self._lock:
            victims = []
            while self.used > self.capacity and self._held:
                victim, size = self._held.popitem(last=False)
                self.used -= size
                victims.append(victim)
            return victims
