"""Which CUDA copy path ``"auto"`` takes for a pair of pools: the faster one, measured.

The copy engines, the kernel and the staged path each win somewhere, and where depends on the
machine (the link, the driver's cost per row, the direction): on one H200, for 64 KiB pages the
copy engines were faster host to GPU and the kernel GPU to host. So the choice is not a fixed
threshold: the first copy between pools of a new *shape* (direction, rows of each side, whether
the host side holds whole pages) times each path on scratch pools of that shape (`measure` in
`hicache.kernels.cuda`), and the table below keeps the answer for the device, in memory and in
``paths.json`` beside the built extension, so that later processes reuse it. ``python
bench/kernels.py`` fills the same table for the shapes it measures.

The copy engines leave the SMs to the model's kernels, so they are kept unless another path is
faster by more than `MARGIN`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Another path must be this much faster (a share of the copy engines' time) to be taken.
MARGIN = 0.02


def _rows(seg_bytes: tuple[int, ...]) -> str:
    """"64x32768" for 64 rows of 32 KiB, "65536" for one, "262144+16384" for mixed rows."""
    if len(set(seg_bytes)) == 1:
        return str(seg_bytes[0]) if len(seg_bytes) == 1 else f"{len(seg_bytes)}x{seg_bytes[0]}"
    return "+".join(map(str, seg_bytes))


@dataclass(frozen=True)
class Shape:
    """What decides the fastest path: direction, the rows of each side, and whether the host
    side holds whole pages (the staged path needs it)."""

    direction: str  # "h2d", "d2h" or "d2d"
    src_rows: tuple[int, ...]
    dst_rows: tuple[int, ...]
    host_whole_pages: bool

    @property
    def key(self) -> str:
        whole = "whole" if self.host_whole_pages else "rows"
        return f"{self.direction}:{_rows(self.src_rows)}->{_rows(self.dst_rows)}:{whole}"

    @property
    def candidates(self) -> tuple[str, ...]:
        staged = ("staged",) if self.host_whole_pages and self.direction != "d2d" else ()
        return ("copy_engine", "kernel", *staged)


def pick(seconds: Mapping[str, float]) -> str:
    """The fastest path of `seconds` (path -> measured time); the copy engines unless another
    is faster by more than `MARGIN`."""
    if not seconds:
        raise ValueError("no path was measured")
    best = min(seconds, key=lambda p: seconds[p])
    ce = seconds.get("copy_engine")
    if ce is not None and seconds[best] >= ce * (1.0 - MARGIN):
        return "copy_engine"
    return best


class PathTable:
    """Measured choices per shape for one device, kept in a JSON file (None: memory only).

    The file maps a device name to ``{shape key: {"path": ..., "seconds": {path: s}}}``; an
    unreadable or malformed file is ignored (and rewritten at the next measurement)."""

    def __init__(self, file: Path | None, device_name: str) -> None:
        self.file = file
        self.device_name = device_name
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = self._read().get(device_name, {})

    def _read(self) -> dict[str, dict]:
        if self.file is None:
            return {}
        try:
            data = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, shape: Shape) -> str | None:
        entry = self._entries.get(shape.key)
        path = entry.get("path") if isinstance(entry, dict) else None
        return path if path in shape.candidates else None

    def choose(self, shape: Shape, measure: Callable[[Shape], dict[str, float]]) -> str:
        """The table's path for `shape`, measured (and recorded) the first time."""
        with self._lock:
            path = self.get(shape)
            if path is not None:
                return path
            seconds = measure(shape)
            path = pick(seconds)
            self._entries[shape.key] = {"path": path, "seconds": seconds}
            self._write()
            log.info("hicache: copies of shape %s take the %s path (%s)", shape.key, path, seconds)
            return path

    @property
    def entries(self) -> dict[str, dict]:
        return dict(self._entries)

    def _write(self) -> None:
        if self.file is None:
            return
        data = self._read()
        data[self.device_name] = {**data.get(self.device_name, {}), **self._entries}
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".paths-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.file)
        except OSError as err:  # a read-only cache folder: the choice still holds in memory
            log.warning("hicache: could not write the copy-path table %s: %s", self.file, err)
