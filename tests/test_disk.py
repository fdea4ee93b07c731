"""The disk tier against real files and real processes.

Every object's bytes are a function of its key (`payload`), so a byte read from the wrong
record, a torn record or another key shows up as a mismatch. Other processes run this file as a
script (`python tests/test_disk.py MODE PATH ...`, see `main`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hicache.backends.base import Buffers, StoreUnavailable  # noqa: E402
from hicache.backends.disk.config import DiskTierConfig  # noqa: E402
from hicache.backends.disk.records import HEADER, file_name  # noqa: E402
from hicache.backends.disk.tier import DiskTier, DiskTierError  # noqa: E402
from hicache.backends.memory import HostMemory  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def payload(key: str, n: int) -> np.ndarray:
    """The bytes of object `key` when it is `n` bytes long."""
    seed = hashlib.sha256(key.encode()).digest()
    return np.frombuffer((seed * (-(-n // len(seed))))[:n], dtype=np.uint8)


class Memory:
    """Registered host memory (page-aligned, as the host tier's pools) with objects laid out one
    after another from `skew` bytes in (a skew of 64 makes O_DIRECT impossible)."""

    def __init__(self, tier: DiskTier, nbytes: int, skew: int = 0) -> None:
        self.host = HostMemory(nbytes + skew, pin=False)
        self.tensor = self.host.tensor
        tier.register(self.tensor)
        self.base = self.tensor.data_ptr() + skew
        self.skew = skew

    def buffers(self, sizes: list[list[int]]) -> Buffers:
        """Objects of these piece sizes, back to back."""
        ptrs, at = [], self.base
        for obj in sizes:
            ptrs.append([])
            for size in obj:
                ptrs[-1].append(at)
                at += size
        return Buffers(ptrs, sizes)

    def fill(self, keys: list[str], sizes: list[list[int]]) -> Buffers:
        """Write each key's payload into its pieces; the buffers."""
        buffers = self.buffers(sizes)
        for key, ptrs, obj in zip(keys, buffers.ptrs, sizes, strict=True):
            data = payload(key, sum(obj))
            start = ptrs[0] - self.tensor.data_ptr()
            self.tensor[start : start + sum(obj)] = torch.from_numpy(data.copy())
        return buffers

    def wrong(self, keys: list[str], sizes: list[list[int]], codes: list[int]) -> list[str]:
        """Keys read (code > 0) whose bytes are not their payload."""
        buffers = self.buffers(sizes)
        out = []
        for key, ptrs, obj, code in zip(keys, buffers.ptrs, sizes, codes, strict=True):
            start = ptrs[0] - self.tensor.data_ptr()
            got = self.tensor[start : start + sum(obj)].numpy()
            if code > 0 and not np.array_equal(got, payload(key, sum(obj))):
                out.append(key)
        return out

    def clear(self) -> None:
        self.tensor.zero_()


def started(path: Path, size: int = 64 * MiB, **kw) -> DiskTier:
    tier = DiskTier(DiskTierConfig(path=str(path), size=size, **kw))
    tier.start()
    if not tier.wait_ready(30):
        raise AssertionError("the disk tier did not list its records in 30 s")
    return tier


@pytest.fixture
def tiers() -> Iterator:
    made: list[DiskTier] = []

    def make(path: Path, **kw) -> DiskTier:
        made.append(started(path, **kw))
        return made[-1]

    yield make
    for t in made:
        t.close()


def run_self(*args: str, rlimit_fsize: int | None = None, **kw) -> subprocess.Popen:
    """This file as a script in a new process."""

    def limit() -> None:
        if rlimit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (rlimit_fsize, rlimit_fsize))

    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


# -- scenarios -----------------------------------------------------------------------------------


def test_drop_prefix_removes_one_namespace_for_good(tmp_path, tiers):
    """`drop_prefix` removes exactly the records whose keys start with the prefix: they are
    misses at once and after a restart on the directory; the others still read whole."""
    tier = tiers(tmp_path / "d")
    mem = Memory(tier, 8 * 64 * KiB)
    keys = [f"hicache/{ns}/g1/{i:02x}" for ns in ("aa", "bb") for i in range(4)]
    sizes = [[256, 64 * KiB - 256]] * len(keys)
    assert tier.put_from(keys, mem.fill(keys, sizes)) == [0] * len(keys)
    assert tier.drop_prefix("hicache/aa/") == 4
    assert tier.exists(keys) == [False] * 4 + [True] * 4
    assert tier.stats().dropped == 4 and tier.stats().records == 4
    tier.close()
    again = tiers(tmp_path / "d")
    mem = Memory(again, 8 * 64 * KiB)
    assert again.exists(keys) == [False] * 4 + [True] * 4
    codes = again.get_into(keys[4:], mem.buffers(sizes[4:]))
    assert codes == [64 * KiB] * 4 and mem.wrong(keys[4:], sizes[4:], codes) == []


def test_objects_come_back_with_exact_bytes_whatever_their_pieces_and_alignment(tmp_path, tiers):
    tier = tiers(tmp_path / "d")
    keys = ["one-piece", "four-pages", "state", "empty-tail"]
    sizes = [[256 * KiB], [64 * KiB] * 4, [1000], [4 * KiB, 24]]
    for skew in (0, 64):  # aligned (O_DIRECT where the file system takes it), then not
        mem = Memory(tier, 2 * MiB, skew)
        named = [f"{k}/{skew}" for k in keys]
        assert tier.put_from(named, mem.fill(named, sizes)) == [0, 0, 0, 0]
        mem.clear()
        codes = tier.get_into(named, mem.buffers(sizes))
        assert codes == [sum(s) for s in sizes]
        assert mem.wrong(named, sizes, codes) == []
    stats = tier.stats()
    assert (stats.records, stats.keys_put, stats.keys_got, stats.failed_gets) == (8, 8, 8, 0)
    assert stats.buffered_calls >= 8  # every skewed object went through the page cache
    if tier._direct_align is not None:  # the aligned objects of whole blocks did not
        assert stats.direct_calls >= 4


def test_a_missing_key_is_the_missing_code_and_a_wrong_size_is_no_hit(tmp_path, tiers):
    tier = tiers(tmp_path / "d")
    mem = Memory(tier, MiB)
    assert tier.put_from(["a"], mem.fill(["a"], [[8 * KiB]])) == [0]
    assert tier.exists(["a", "b"]) == [True, False]
    assert tier.get_into(["b"], mem.buffers([[8 * KiB]])) == [tier.missing_code] == [-errno.ENOENT]
    assert tier.get_into(["a"], mem.buffers([[4 * KiB]])) == [-errno.EMSGSIZE]
    assert tier.exists(["a"]) == [True]  # the record is fine; the caller asked for another size
    assert tier.put_from(["a"], mem.buffers([[8 * KiB]])) == [0]  # held already: not rewritten
    assert tier.stats().keys_put == 1
    with pytest.raises(ValueError, match="outside registered memory"):
        tier.get_into(["a"], Buffers([[12345]], [[8 * KiB]]))
    with pytest.raises(ValueError, match="longer than a record header holds"):
        tier.put_from(["k" * HEADER], mem.buffers([[8 * KiB]]))
    assert tier.close() is True
    with pytest.raises(StoreUnavailable, match="disk get_into: tier is closed"):
        tier.get_into(["a"], mem.buffers([[8 * KiB]]))


def test_a_new_process_hits_what_an_earlier_one_stored_with_exact_bytes(tmp_path, tiers):
    path = tmp_path / "d"
    wrote = finish(run_self("write", str(path), "20", "0", str(256 * KiB)))
    assert wrote["codes"] == [0] * 20
    tier = tiers(path)
    keys = [f"obj{i}" for i in range(20)]
    sizes = [[64 * KiB] * 4] * 20
    mem = Memory(tier, 8 * MiB)
    codes = tier.get_into(keys, mem.buffers(sizes))
    assert codes == [256 * KiB] * 20
    assert mem.wrong(keys, sizes, codes) == []


def test_sigkill_in_the_middle_of_writes_leaves_no_record_with_wrong_bytes(tmp_path, tiers):
    path = tmp_path / "d"
    writer = run_self("write", str(path), "100000", "0", str(MiB), "nosync")
    objects = path / "objects"

    def published() -> int:
        return sum(1 for _ in objects.glob("*/*")) if objects.exists() else 0

    deadline = time.monotonic() + 60
    while published() < 40:
        assert writer.poll() is None and time.monotonic() < deadline, writer.stderr.read()
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    written = published()

    tier = tiers(path)
    assert list((path / "tmp").iterdir()) == []  # half-written records are gone
    keys = [f"obj{i}" for i in range(written + 40)]  # past the last one published
    sizes = [[256 * KiB] * 4] * len(keys)
    mem = Memory(tier, len(keys) * MiB)
    codes = tier.get_into(keys, mem.buffers(sizes))
    assert mem.wrong(keys, sizes, codes) == []
    assert set(codes) <= {MiB, -errno.ENOENT}
    assert codes.count(MiB) == written >= 40


def test_a_damaged_record_is_a_miss_and_is_removed(tmp_path, tiers):
    path = tmp_path / "d"
    tier = tiers(path)
    mem = Memory(tier, MiB)
    keys = ["torn", "bad-header", "other-key", "fine"]
    sizes = [[16 * KiB]] * 4
    assert tier.put_from(keys, mem.fill(keys, sizes)) == [0] * 4
    files = [path / "objects" / file_name(k) for k in keys]
    os.truncate(files[0], HEADER + 8 * KiB)  # as a torn write would leave it
    with open(files[1], "r+b") as f:  # a flipped bit in the header
        f.seek(3)
        f.write(b"X")
    files[2].write_bytes(files[3].read_bytes())  # a whole record, of another key
    mem.clear()
    codes = tier.get_into(keys, mem.buffers(sizes))
    assert codes == [-errno.ENOENT] * 3 + [16 * KiB]
    assert mem.wrong(keys, sizes, codes) == []
    assert [f.exists() for f in files] == [False, False, False, True]
    assert tier.exists(keys) == [False, False, False, True]
    assert tier.stats().damaged == 3


def test_eviction_removes_the_least_recently_used_and_the_order_survives_a_restart(tmp_path, tiers):
    path = tmp_path / "d"
    record = HEADER + 64 * KiB
    tier = tiers(path, size=3 * record)
    mem = Memory(tier, MiB)
    size = [[64 * KiB]]

    def put(key: str) -> int:
        return tier.put_from([key], mem.fill([key], size))[0]

    assert [put(k) for k in "abc"] == [0, 0, 0]
    assert tier.get_into(["a"], mem.buffers(size)) == [64 * KiB]  # a is now the most recent
    assert put("d") == 0
    assert tier.exists(list("abcd")) == [True, False, True, True]
    assert put("e") == 0
    assert tier.exists(list("abcde")) == [True, False, False, True, True]
    assert tier.stats().evicted == 2
    assert (path / "objects" / file_name("b")).exists() is False
    tier.close()

    tier = tiers(path, size=3 * record)  # a restart keeps the order: a, d, e
    mem = Memory(tier, MiB)
    assert tier.stats().bytes_used == 3 * record
    assert put("f") == 0
    assert tier.exists(list("adef")) == [False, True, True, True]
    assert tier.put_from(["huge"], mem.buffers([[3 * record]])) == [-errno.ENOSPC]
    assert tier.exists(["huge", "d", "e", "f"]) == [False, True, True, True]

    tier.close()  # a restart with a smaller size trims the oldest at once
    tier = tiers(path, size=record)
    assert tier.exists(list("def")) == [False, False, True]


def test_entries_of_the_directory_that_are_not_records_are_skipped_and_counted(tmp_path, tiers):
    """A file and a directory beside the shards in objects/, and a file and a directory in a
    shard whose names are no record's (what an operator, a backup or fsck may leave): a restart
    lists the records, skips those four entries (counted as `stray`), leaves them as they are,
    and serves the records. Before, one such entry left the tier unavailable for good."""
    path = tmp_path / "d"
    tier = tiers(path)
    mem = Memory(tier, MiB)
    size = [[8 * KiB]]
    assert tier.put_from(["a"], mem.fill(["a"], size)) == [0]
    tier.close()
    objects = path / "objects"
    shard = (objects / file_name("a")).parent
    stray = [objects / "NOTES.txt", objects / "lost+found", shard / "x.swp", shard / "sub"]
    stray[0].write_text("kept by an operator")
    stray[1].mkdir()
    stray[2].write_bytes(b"an editor's")
    stray[3].mkdir()
    tier = tiers(path)
    mem = Memory(tier, MiB)
    assert tier.get_into(["a"], mem.buffers(size)) == [8 * KiB]
    assert mem.wrong(["a"], size, [8 * KiB]) == []
    stats = tier.stats()
    assert (stats.records, stats.stray) == (1, 4)
    assert all(p.exists() for p in stray)


def test_close_stops_the_start_up_listing_before_the_directory_is_let_go(tmp_path, monkeypatch):
    """A tier started with a smaller size than its directory holds lists (and would trim) its
    records in the background; it is closed while the listing is still on its first shard.
    close() returns only once the listing has stopped, and the stopped listing removes nothing:
    a tier that takes the directory over next (the old size) serves every record. Before, the
    old listing went on after close had let the directory go, and trimmed it under the new
    tier."""
    path = tmp_path / "d"
    record = HEADER + 64 * KiB
    tier = started(path, size=4 * record)
    mem = Memory(tier, MiB)
    keys, size = list("abcd"), [[64 * KiB]] * 4
    assert tier.put_from(keys, mem.fill(keys, size)) == [0] * 4
    tier.close()

    objects, entered, go = str(path / "objects"), threading.Event(), threading.Event()
    real = os.scandir

    def gated(where=".", *args):  # the first listing of objects/ waits for `go`
        if str(where) == objects and not entered.is_set():
            entered.set()
            assert go.wait(60)
        return real(where, *args)

    monkeypatch.setattr(os, "scandir", gated)
    small = DiskTier(DiskTierConfig(path=str(path), size=record))  # would keep one record
    small.start()
    assert entered.wait(60)
    listing = next(t for t in threading.enumerate() if t.name == "hicache-disk-load")
    closing = threading.Thread(target=small.close)
    closing.start()
    deadline = time.monotonic() + 60
    while not small._closed:  # close has begun (it does not return while the listing runs)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    go.set()
    closing.join(60)
    listing.join(60)
    assert not closing.is_alive() and not listing.is_alive()
    monkeypatch.undo()
    assert all((path / "objects" / file_name(k)).exists() for k in keys)
    tier = started(path, size=4 * record)
    try:
        mem = Memory(tier, MiB)
        codes = tier.get_into(keys, mem.buffers(size))
        assert codes == [64 * KiB] * 4
        assert mem.wrong(keys, size, codes) == []
    finally:
        tier.close()


def test_a_put_that_cannot_fit_beside_a_write_in_progress_evicts_nothing(tmp_path, tiers):
    """A put that no eviction can make room for (the rest of the size is reserved by a put
    still writing) fails with ENOSPC and leaves every record held, in the book and on disk.
    (Before the fix the book dropped the victims and then refused, so their files were never
    removed: orphaned, outside the size bound, and no longer found.)"""
    path = tmp_path / "d"
    record = HEADER + 64 * KiB
    tier = tiers(path, size=3 * record)
    mem = Memory(tier, 4 * MiB)
    one, two = [[64 * KiB]], [[2 * record - HEADER]]
    assert tier.put_from(["a"], mem.fill(["a"], one)) == [0]
    writing, release = threading.Event(), threading.Event()
    real = tier._write

    def slow(tmp: Path, key: str, *args) -> None:
        if key == "slow":
            writing.set()
            release.wait(60)
        real(tmp, key, *args)

    tier._write = slow
    with ThreadPoolExecutor(1) as pool:
        slow_put = pool.submit(tier.put_from, ["slow"], mem.fill(["slow"], two))
        assert writing.wait(60)
        assert tier.put_from(["c"], mem.fill(["c"], two)) == [-errno.ENOSPC]
        assert tier.exists(["a"]) == [True]
        release.set()
        assert slow_put.result(60) == [0]
    assert tier.get_into(["a"], mem.buffers(one)) == [64 * KiB]
    assert mem.wrong(["a"], one, [64 * KiB]) == []
    objects = path / "objects"
    on_disk = sorted(str(p.relative_to(objects)) for p in objects.rglob("*") if p.is_file())
    assert on_disk == sorted(file_name(k) for k in ("a", "slow"))
    assert tier.stats().bytes_used == 3 * record


def test_puts_and_gets_from_several_threads_under_eviction_keep_bytes_and_books_exact(
    tmp_path, tiers
):
    record = HEADER + 64 * KiB
    tier = tiers(tmp_path / "d", size=8 * record, io_threads=4)
    keys = [f"k{i}" for i in range(40)]
    size = [[16 * KiB] * 4]
    wrong: list[str] = []
    hits = [0]

    def work(seed: int, puts: bool) -> None:
        mem = Memory(tier, MiB)
        rng = np.random.default_rng(seed)
        for _ in range(150):
            key = keys[int(rng.integers(len(keys)))]
            if puts:
                assert tier.put_from([key], mem.fill([key], size)) == [0]
            else:
                mem.clear()
                codes = tier.get_into([key], mem.buffers(size))
                assert codes[0] in (64 * KiB, -errno.ENOENT)
                wrong.extend(mem.wrong([key], size, codes))
                hits[0] += codes[0] > 0

    with ThreadPoolExecutor(4) as pool:  # .result() raises what a thread raised
        for done in [pool.submit(work, i, i % 2 == 0) for i in range(4)]:
            done.result()
    assert wrong == [] and hits[0] > 0
    files = list((tmp_path / "d" / "objects").glob("*/*"))
    stats = tier.stats()
    assert stats.records == len(files) == 8
    assert stats.bytes_used == sum(f.stat().st_size for f in files) == 8 * record
    assert stats.evicted == stats.keys_put - 8 and stats.failed_puts == 0


def test_unusable_paths_fail_at_start_with_one_line_naming_them(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for path, why in [
        (a_file / "d", "Not a directory"),
        (tmp_path / "missing" / "d", "No such file or directory"),
    ]:
        tier = DiskTier(DiskTierConfig(path=str(path), size=MiB))
        with pytest.raises(DiskTierError) as err:
            tier.start()
        assert str(path) in str(err.value) and why in str(err.value)
        assert "\n" not in str(err.value)
        # it crosses a process boundary whole (a pool of worker processes pickles it)
        err.value.tier = 1
        back = pickle.loads(pickle.dumps(err.value))
        assert type(back) is DiskTierError and str(back) == str(err.value)
        with pytest.raises(StoreUnavailable):
            tier.exists(["a"])
    # a file size limit below one block: nothing can be written (root ignores permissions)
    child = run_self("start", str(tmp_path / "d"), rlimit_fsize=1000)
    assert finish(child)["error"].endswith("cannot write a record: File too large")


def test_writes_past_a_file_size_limit_are_counted_failures_never_hits(tmp_path):
    path = tmp_path / "d"
    got = finish(run_self("write", str(path), "4", "0", str(MiB), rlimit_fsize=600 * KiB))
    assert got["codes"] == [-errno.EFBIG] * 4
    assert got["stats"]["failed_puts"] == 4 and got["stats"]["records"] == 0
    got = finish(run_self("read", str(path), "4", str(MiB)))
    assert got["codes"] == [-errno.ENOENT] * 4 and got["wrong"] == []
    assert list((path / "tmp").iterdir()) == []


@contextlib.contextmanager
def small_file_system(tmp_path: Path) -> Iterator[Path]:
    """A file system of 2 MiB (a tmpfs) mounted at a directory of `tmp_path`; skips where
    mounting needs rights this process lacks."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)])
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_up(path: Path) -> None:
    """Another program's file at `path` takes every byte the file system has left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"x" * (4 * KiB))
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)


def test_a_full_file_system_is_a_counted_failure_and_later_puts_evict_and_land(tmp_path, tiers):
    with small_file_system(tmp_path) as mount:
        tier = tiers(mount / "d", size=64 * MiB)  # the size bound is not what stops it
        mem = Memory(tier, 8 * MiB)
        keys = [f"obj{i}" for i in range(6)]
        record = HEADER + 512 * KiB
        # three records fit in 2 MiB; the fourth fails, and the bound becomes what is held
        codes = [tier.put_from([k], mem.fill([k], [[512 * KiB]]))[0] for k in keys[:4]]
        assert codes == [0, 0, 0, -errno.ENOSPC]
        stats = tier.stats()
        assert (stats.failed_puts, stats.capacity, stats.bytes_used) == (1, 3 * record, 3 * record)
        assert list((mount / "d" / "tmp").iterdir()) == []
        # later puts evict the least recently used and land
        codes = [tier.put_from([k], mem.fill([k], [[512 * KiB]]))[0] for k in keys[4:]]
        assert codes == [0, 0]
        held = [False, False, True, False, True, True]
        assert tier.exists(keys) == held
        mem.clear()
        sizes = [[512 * KiB]] * 6
        got = tier.get_into(keys, mem.buffers(sizes))
        assert got == [512 * KiB if h else -errno.ENOENT for h in held]
        assert mem.wrong(keys, sizes, got) == []
        tier.close()


def test_a_file_system_full_while_the_tier_holds_nothing_takes_puts_once_space_returns(
    tmp_path, tiers
):
    """A full file system is transient. A tier that met one while it held nothing lowered its
    bound to what it held, 0 bytes, for the life of the process: every later put failed, though
    the space had come back."""
    with small_file_system(tmp_path) as mount:
        tier = tiers(mount / "d", size=64 * MiB)
        mem = Memory(tier, 4 * MiB)
        keys = [f"obj{i}" for i in range(3)]
        sizes = [[256 * KiB]]
        fill_up(mount / "other-data")
        assert tier.put_from(keys[:1], mem.fill(keys[:1], sizes)) == [-errno.ENOSPC]
        assert (tier.stats().failed_puts, tier.stats().records) == (1, 0)
        (mount / "other-data").unlink()  # the space comes back
        codes = [tier.put_from([k], mem.fill([k], sizes))[0] for k in keys]
        assert codes == [0, 0, 0]
        assert tier.stats().capacity >= 3 * (HEADER + 256 * KiB)
        mem.clear()
        got = tier.get_into(keys, mem.buffers(sizes * 3))
        assert got == [256 * KiB] * 3 and mem.wrong(keys, sizes * 3, got) == []


def test_a_second_process_is_refused_the_directory_until_the_first_is_gone(tmp_path, tiers):
    path = tmp_path / "d"
    holder = run_self("hold", str(path))
    assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
    other = finish(run_self("start", str(path)))
    assert other["error"] == (
        f"path: {path}: in use by another process (pid {holder.pid}); "
        "give each process its own path"
    )
    holder.send_signal(signal.SIGKILL)  # the lock dies with its process
    holder.wait()
    tier = tiers(path)
    mem = Memory(tier, MiB)
    codes = tier.get_into(["held"], mem.buffers([[64 * KiB]]))
    assert codes == [64 * KiB] and mem.wrong(["held"], [[64 * KiB]], codes) == []


def cache_run(path: str) -> int:
    """A fresh cache over host and disk (at `path`) runs one prompt, checking every byte it
    loads, and closes (which drains its writes); its hit in tokens."""
    from fake_engine import FakeEngine, config

    cfg = config(host_pages=64)
    cfg["tiers"].append({"type": "disk", "path": path, "size": MiB, "group_pages": 2})
    engine = FakeEngine(cfg)
    try:
        tokens = np.random.default_rng(1).integers(0, 30_000, 42, dtype=np.int32)
        return engine.run("r", tokens).hit_tokens
    finally:
        engine.cache.close()


def test_a_cache_in_a_new_process_hits_from_disk_with_exact_bytes(tmp_path):
    path = str(tmp_path / "d")
    assert cache_run(path) == 0
    # an empty host tier in a new process: every hit comes from disk; 10 pages of 4 tokens (the
    # 42nd token is recomputed)
    assert finish(run_self("cache", path)) == {"hit": 40}


# -- other processes -----------------------------------------------------------------------------


def main(mode: str, path: str, *args: str) -> None:
    """Modes: ``start`` (report the start-up error, if any), ``hold`` (store one object, say
    ready, wait for stdin to close), ``write N FIRST BYTES [nosync]`` (objects objFIRST..;
    forever-ish with a large N), ``read N BYTES``, ``cache`` (`cache_run`)."""
    if mode == "cache":
        print(json.dumps({"hit": cache_run(path)}))
        return
    cfg = DiskTierConfig(path=path, size=1 << 30, sync="nosync" not in args)
    tier = DiskTier(cfg)
    try:
        tier.start()
    except DiskTierError as err:
        print(json.dumps({"error": str(err)}))
        return
    tier.wait_ready(30)
    if mode == "start":
        print(json.dumps({"error": None}))
    elif mode == "hold":
        mem = Memory(tier, MiB)
        tier.put_from(["held"], mem.fill(["held"], [[64 * KiB]]))
        print("ready", flush=True)
        sys.stdin.read()
    elif mode == "write":
        n, first, nbytes = int(args[0]), int(args[1]), int(args[2])
        sizes = [[nbytes // 4] * 4]
        mem = Memory(tier, nbytes)
        codes = []
        for i in range(first, first + n):
            key = f"obj{i}"
            codes += tier.put_from([key], mem.fill([key], sizes))
        print(json.dumps({"codes": codes, "stats": tier.stats().__dict__}))
    elif mode == "read":
        n, nbytes = int(args[0]), int(args[1])
        keys, sizes = [f"obj{i}" for i in range(n)], [[nbytes // 4] * 4] * n
        mem = Memory(tier, n * nbytes)
        codes = tier.get_into(keys, mem.buffers(sizes))
        print(json.dumps({"codes": codes, "wrong": mem.wrong(keys, sizes, codes)}))
    with contextlib.suppress(Exception):
        tier.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
