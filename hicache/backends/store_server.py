"""The store process: one store tier's client, serving the `IsolatedStore` that started it.

    python -m hicache.backends.store_server CONTROL_FD STATUS_FD

`IsolatedStore` starts it; nobody else should. Over the control socket it receives the tier's
config first, then memory files to register (each with its descriptor), channels (a socket per
calling thread of the parent, each served by a thread here) and finally ``close``. On the status
socket it says whether the store is available, whenever that changes. When the parent goes away
(its end of the control socket closes) it closes the store and exits.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hicache import threads
from hicache.backends import wire
from hicache.backends.base import Buffers, StoreTier
from hicache.backends.registry import tier_class, tier_config_model

STATUS_EVERY_S = 0.02
"""How often the store's availability is looked at (a change is sent at once)."""


class Server:
    """Serves one store tier to the parent: the calls of its channels, and its availability."""

    def __init__(self, store: StoreTier, status: socket.socket) -> None:
        self.store = store
        self.status = status
        self.closing = threading.Event()
        self._maps: dict[int, mmap.mmap] = {}
        self._bases: dict[int, tuple[int, int]] = {}  # file index -> (address, nbytes)
        self._base_array = np.zeros(0, dtype=np.int64)

    # -- control ------------------------------------------------------------------------------

    def serve_control(self, control: socket.socket) -> None:
        """Until ``close`` or the parent's end closes: register files, open channels."""
        while True:
            try:
                message, fds = wire.recv(control, with_fds=1)
            except (wire.ChannelClosed, OSError):
                self.store.close()
                return
            op = message[0]
            if op == "register":
                _, index, offset, nbytes = message
                wire.send(control, self._reply(self._register, index, fds[0], offset, nbytes))
            elif op == "channel":
                channel = socket.socket(fileno=fds[0])
                threads.start(self.serve_channel, "hicache-store-channel", args=(channel,))
            elif op == "close":
                self.closing.set()
                wire.send(control, ("ok", self.store.close()))
                return

    def _register(self, index: int, fd: int, offset: int, nbytes: int) -> None:
        """Map file `index` and register it with the store (once: a second time is a no-op)."""
        if index in self._bases:
            os.close(fd)
            return
        try:
            size = os.fstat(fd).st_size
            if offset < 0 or nbytes <= 0 or offset + nbytes > size:
                raise ValueError(
                    f"register: bytes [{offset}, {offset + nbytes}) lie outside a file of {size}"
                )
            # every page mapped now, in the background, not by the first transfer through it
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)  # the mapping stays
        tensor = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset)
        self.store.register(tensor)
        self._maps[index] = memory
        self._bases[index] = (tensor.data_ptr(), nbytes)
        bases = np.zeros(max(self._bases) + 1, dtype=np.int64)
        for i, (address, _) in self._bases.items():
            bases[i] = address
        self._base_array = bases

    # -- calls --------------------------------------------------------------------------------

    def serve_channel(self, channel: socket.socket) -> None:
        """One calling thread of the parent: a call in, its answer out, until it closes."""
        with channel:
            while True:
                try:
                    message, _ = wire.recv(channel)
                    wire.send(channel, self._reply(self._call, *message))
                except (wire.ChannelClosed, OSError):
                    return

    def _call(self, op: str, *args: Any) -> Any:
        store = self.store
        if op == "exists":
            return store.exists(args[0])
        if op == "get_into":
            return store.get_into(args[0], self._buffers(args[1]))
        if op == "put_from":
            return store.put_from(args[0], self._buffers(args[1]))
        if op in ("remove", "stats", "state"):  # what the store has beyond the tier interface
            method = getattr(store, op, None)
            if method is None:
                raise TypeError(f"a {store.type} store has no {op}")
            return method(*args) if callable(method) else method
        raise ValueError(f"unknown call {op!r}")

    def _reply(self, call: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """("ok", result) or ("error", exception class name, message). Availability travels
        on the status socket alone (`report`), so that the parent has one source for it."""
        try:
            result = call(*args)
        except Exception as err:
            return ("error", type(err).__name__, str(err))
        return ("ok", result)

    def _buffers(self, pieces: wire.Pieces) -> Buffers:
        """The parent's pieces at their addresses in this process."""
        files = np.frombuffer(pieces.files, dtype=np.int32)
        if files.size and (files.min() < 0 or files.max() >= self._base_array.size):
            raise ValueError("a piece names a memory file that was never registered")
        offsets = np.frombuffer(pieces.offsets, dtype=np.int64)
        addresses = (self._base_array[files] + offsets).tolist()
        sizes = np.frombuffer(pieces.sizes, dtype=np.int64).tolist()
        ptrs, lens, at = [], [], 0
        for n in pieces.counts:
            ptrs.append(addresses[at : at + n])
            lens.append(sizes[at : at + n])
            at += n
        span = None
        if pieces.span is not None:
            index, low, high = pieces.span
            base = self._bases[index][0]
            span = (base + low, base + high)
        return Buffers(ptrs, lens, span)

    # -- status -------------------------------------------------------------------------------

    def report(self) -> None:
        """Send the store's availability whenever it changes (and once at the start)."""
        last = None
        while not self.closing.is_set():
            now = self.store.available
            if now != last:
                try:
                    wire.send(self.status, ("available", now))
                except OSError:
                    return
                last = now
            time.sleep(STATUS_EVERY_S)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="hicache store process: %(message)s")
    control = socket.socket(fileno=int(argv[1]))
    status = socket.socket(fileno=int(argv[2]))
    (_, type_, fields), _ = wire.recv(control)
    config = tier_config_model(type_).model_validate(fields)
    store = tier_class(type_)(config)
    store.start()
    server = Server(store, status)
    threads.start(server.report, "hicache-store-status")
    server.serve_control(control)


if __name__ == "__main__":
    main(sys.argv)
