"""Defects put back at run time (`--canary NAME`), to show that the simulation finds each class.

Each canary patches the real code for the duration of a run and restores it after."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Install = Callable[[], Callable[[], None]]
"""Puts a defect in place; returns the function that takes it out again."""

CANARIES: dict[str, Install] = {}


def canary(name: str) -> Callable[[Install], Install]:
    def wrap(install: Install) -> Install:
        CANARIES[name] = install
        return install

    return wrap


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    undo = CANARIES[name]()
    try:
        yield
    finally:
        undo()


def _patch(owner: object, attr: str, value: object) -> Callable[[], None]:
    old = getattr(owner, attr)
    setattr(owner, attr, value)
    return lambda: setattr(owner, attr, old)


@canary("pin-not-released")
def _pin_not_released() -> Callable[[], None]:
    """`release` forgets the request but keeps what its match pinned."""
    from hicache.cache import HiCache

    def release(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req.fetch is not None and self._chain is not None:
            self._chain.forget(req.fetch)

    return _patch(HiCache, "release", release)
