"""`HiCache.close` gives back what the cache took: its threads, its open files and sockets, and
its host memory, with a host tier, a disk tier and a Mooncake tier on a real master.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine, config, settle

pytestmark = pytest.mark.mooncake


def held() -> tuple[Counter[str], int, Counter[str]]:
    """This process's Python threads (by name), OS threads, and open descriptors (by what
    they point at: a file's path, ``socket:``, ``pipe:``, ...)."""
    names = Counter(t.name for t in threading.enumerate())
    tasks = len(os.listdir("/proc/self/task"))
    fds: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            continue
        fds[target.split("[")[0]] += 1
    return names, tasks, fds


def test_close_gives_back_threads_files_sockets_and_host_memory(mooncake_master, tmp_path: Path):
    cfg = config(host_pages=64)
    cfg["tiers"] += [
        {"type": "disk", "path": str(tmp_path / "d"), "size": "16MiB", "group_pages": 2},
        # (its first access starts the store node, once)
        {"type": "mooncake", **mooncake_master.tier_config, "group_pages": 2},
    ]
    tokens = np.arange(42, dtype=np.int32)

    def cycle() -> weakref.ref:
        e = FakeEngine(cfg)
        e.run("a", tokens)
        settle(e)
        memory = weakref.ref(e.cache.host._page_memory)
        e.cache.close()
        return memory

    # The first caches load libraries, whose own threads and descriptors stay (Mooncake's
    # transfer engine makes a thread and three event descriptors at its second client, once)
    cycle(), cycle()
    gc.collect()
    before = held()
    memory = [cycle() for _ in range(2)]
    deadline = time.monotonic() + 120  # Mooncake's close may finish on a thread of its own
    while True:
        gc.collect()
        after = held()
        if after == before and all(m() is None for m in memory):
            break
        if time.monotonic() > deadline:
            more = [
                what - was for what, was in ((after[0], before[0]), (after[2], before[2]))
            ]  # fmt: skip
            raise AssertionError(
                f"threads {more[0]}, OS threads {before[1]} -> {after[1]}, descriptors {more[1]}"
                f", host memory freed: {[m() is None for m in memory]}"
            )
        time.sleep(0.2)
