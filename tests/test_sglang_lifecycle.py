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

import memory_tier  # noqa: F401  (registers the memory tier)
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


def test_sglangs_clear_drops_the_instances_pages_from_disk(device, tmp_path, caplog):
    """SGLang's clear (the controller's `clear_storage_backend`, which its admin endpoint
    calls) drops every page the instance stored: its own next prefetch finds none, and neither
    does an instance started after it on the same directory; the clear says what it dropped."""
    host = env.host_pool(device, "layer_first")
    env.fill(host, seed=7)
    extra = env.extra(disk(tmp_path / "d"))
    ctl = env.server_controller(device, host, extra)
    try:
        _, stored = env.backup(ctl, host, TOKENS)
        assert stored == len(TOKENS)
        assert env.prefetch(ctl, host, TOKENS)[1] == len(TOKENS)
        with caplog.at_level("INFO", logger="hicache.sglang"):
            assert ctl.clear_storage_backend() is True
        assert f"hicache: clear dropped {PAGES} from disk" in caplog.messages
        assert env.prefetch(ctl, host, TOKENS)[1] == 0
        records = tmp_path / "d" / "rank0" / "objects"
        assert [f for f in records.rglob("*") if f.is_file()] == []
    finally:
        env.stop(ctl)
    again = env.server_controller(device, host, extra)
    try:
        assert env.prefetch(again, host, TOKENS)[1] == 0
    finally:
        env.stop(again)


@pytest.mark.mooncake
def test_sglangs_clear_drops_the_namespace_from_mooncake_for_every_instance(
    device, tmp_path, mooncake_master
):
    """On a disk tier above a shared Mooncake store (a real master on loopback), instance A's
    clear drops A's pages from both: a second instance B of the same model, with a disk of its
    own, finds none in Mooncake; an instance of another model (`model_id`) keeps every page it
    stored there."""
    from mooncake_master import require_mooncake

    require_mooncake()
    mooncake = {"type": "mooncake", **mooncake_master.tier_config}

    def tiers(name: str) -> dict:
        local = {"type": "disk", "path": str(tmp_path / name), "size": "64MiB", "sync": False}
        return {"tiers": [local, mooncake]}

    hosts = [env.host_pool(device, "page_first") for _ in range(3)]
    for i, h in enumerate(hosts):
        env.fill(h, seed=20 + i)
    a = env.server_controller(device, hosts[0], env.extra(tiers("a"), model_id="clear-a"))
    other = env.server_controller(device, hosts[2], env.extra(tiers("o"), model_id="clear-o"))
    try:
        assert env.backup(a, hosts[0], TOKENS)[1] == len(TOKENS)
        assert env.backup(other, hosts[2], TOKENS)[1] == len(TOKENS)
        assert a.clear_storage_backend() is True
        assert env.prefetch(a, hosts[0], TOKENS)[1] == 0
    finally:
        env.stop(a)
    b = env.server_controller(device, hosts[1], env.extra(tiers("b"), model_id="clear-a"))
    try:
        assert env.prefetch(b, hosts[1], TOKENS)[1] == 0
        assert env.prefetch(other, hosts[2], TOKENS)[1] == len(TOKENS)
    finally:
        env.stop(b)
        env.stop(other)


def test_a_clear_that_cannot_drop_fences_the_tier_and_says_so(device, caplog):
    """A tier that cannot drop objects by name (a test's memory tier) is fenced by the clear:
    the pages it holds are not served again by this instance, and the clear raises one line
    naming it (SGLang's admin call then reports that the clear failed)."""
    host = env.host_pool(device, "page_first")
    env.fill(host, seed=8)
    ctl = env.server_controller(
        device, host, env.extra({"tiers": [{"type": "memory", "space": "fence"}]})
    )
    try:
        assert env.backup(ctl, host, TOKENS)[1] == len(TOKENS)
        failed = pytest.raises(RuntimeError, match="clear dropped nothing from memory")
        with caplog.at_level("ERROR", logger="hicache.sglang"), failed:
            ctl.clear_storage_backend()
        assert [m for m in caplog.messages if "fenced" in m] != []
        assert env.prefetch(ctl, host, TOKENS)[1] == 0
    finally:
        env.stop(ctl)
