"""hicache's backend through SGLang's own lifecycle calls, on the controller its server builds
for a plain model (`HybridCacheController` over a `HostPoolGroup`, tests/sglang_env.py): a
start that fails leaves nothing behind (no directory lock, thread or open tier) and a retry
attaches; runtime detach and re-attach; SGLang's clear of the storage."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from pathlib import Path

import pytest
import sglang_env as env
import torch
from sglang_env import P

pytestmark = pytest.mark.sglang

PAGES = 6
TOKENS = list(range(9000, 9000 + PAGES * P))


@pytest.fixture(scope="module")
def device():
    return env.device_pools()["mha"]


def disk(path: Path, **more) -> dict:
    return {"tiers": [{"type": "disk", "path": str(path), "size": "64MiB", "sync": False}], **more}


def hicache_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hicache"))


def lock_is_free(directory: Path) -> bool:
    """Whether another process could take the disk tier's directory now (its flock is free)."""
    fd = os.open(directory / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_failed_start_leaves_nothing_and_a_retry_attaches(device, tmp_path):
    """SGLang's runtime attach with a metrics port another process holds fails in one line, and
    leaves no store tier open: the disk tier's directory lock is free and no hicache thread
    runs. The controller's retry with a free port attaches on the same directory, and stores
    and prefetches every page."""
    host = env.host_pool(device, "page_first")
    env.fill(host, seed=4)
    ctl = env.server_controller(device, host)
    assert ctl.storage_backend is None
    rank_dir = tmp_path / "d" / "rank0"
    before = hicache_threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"hicache: .*{port}|hicache: .*in use"):
            env.attach(ctl, env.extra(disk(tmp_path / "d", metrics={"port": port})))
    assert ctl.storage_backend is None and not ctl.enable_storage
    assert lock_is_free(rank_dir)
    assert hicache_threads() == before

    env.attach(ctl, env.extra(disk(tmp_path / "d", metrics={"port": 0})))
    try:
        _, stored = env.backup(ctl, host, TOKENS)
        assert stored == len(TOKENS)
        assert env.prefetch(ctl, host, TOKENS)[1] == len(TOKENS)
    finally:
        env.stop(ctl)
    assert lock_is_free(rank_dir)
    assert hicache_threads() == before


def test_runtime_detach_and_reattach_keep_the_pages(device, tmp_path):
    """SGLang's runtime detach closes every tier (lock, threads); a later attach of the same
    configuration on the same controller finds the pages the first attachment stored, byte for
    byte; a second attach while attached is SGLang's refusal and changes nothing."""
    host = env.host_pool(device, "page_first_direct")
    env.fill(host, seed=5)
    extra = env.extra(disk(tmp_path / "d"))
    ctl = env.server_controller(device, host, extra)
    before = hicache_threads()
    indices, stored = env.backup(ctl, host, TOKENS)
    want = [env.page_bytes(host, indices, i) for i in range(PAGES)]
    with pytest.raises(RuntimeError, match="already attached"):
        env.attach(ctl, extra)
    ctl.detach_storage_backend()
    assert stored == len(TOKENS)
    assert lock_is_free(tmp_path / "d" / "rank0")
    assert [n for n in hicache_threads() if n not in before] == []
    host.free(indices)
    env.fill(host, seed=6)

    env.attach(ctl, extra)
    try:
        at, got, _ = env.prefetch(ctl, host, TOKENS)
        assert got == len(TOKENS)
        assert all(torch.equal(env.page_bytes(host, at, i), want[i]) for i in range(PAGES))
    finally:
        env.stop(ctl)
