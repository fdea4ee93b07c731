"""The lossless codec of store tiers (issue 43): byte-exact round trips, encoded objects through
the memory plugin tier and the disk tier, damaged encoded payloads as counted misses, and the
configuration's one-line errors."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from fake_engine import FakeEngine, FakeStates, config
from memory_tier import MemoryConfig, MemoryTier
from test_chain import settle
from test_integrity import Writer, flip_middle, prompt, read, rewrite

from hicache.backends import codec
from hicache.backends.base import StoreUnavailable
from hicache.backends.disk.records import HEADER as DISK_HEADER
from hicache.backends.disk.records import file_name
from hicache.backends.envelope import _FIELDS, HEADER, RAW
from hicache.backends.host import HostTier, HostTierConfig
from hicache.chain.jobs import Job, JobRunner
from hicache.config import Layout, load_config
from hicache.errors import ConfigError
from hicache.registry import register_tier

pytest.importorskip("zstandard")

KINDS = ["memory", "disk", "mooncake"]


def kv(dtype: torch.dtype, n: int, seed: int = 0) -> np.ndarray:
    """Bytes of `n` KV-like values (normal, a few outliers) of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.5
    x[torch.rand(n, generator=g) < 0.001] *= 20
    return x.to(dtype).view(torch.uint8).numpy().copy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_kv_round_trips_byte_exact_and_shrinks(dtype):
    c = codec.for_dtype(dtype)
    assert c.ident == (codec.ZSTD if dtype == "float8_e4m3fn" else codec.PLANES16)
    src = kv(getattr(torch, dtype), 1 << 18)
    out = np.zeros(src.size, dtype=np.uint8)
    stored = c.encode(src, out)
    assert stored is not None and stored % codec.ALIGN == 0
    assert src.size / stored > (1.3 if dtype == "bfloat16" else 1.1)
    back = np.zeros_like(src)
    assert c.decode(c.ident, out[:stored], back)
    assert np.array_equal(back, src)
    # decoded in place, as a get does (the payload read into the front of the raw buffer)
    assert c.decode(c.ident, out[:stored], out) and np.array_equal(out, src)


def test_bytes_that_do_not_shrink_are_not_encoded_and_odd_lengths_round_trip():
    c = codec.for_dtype("bfloat16")
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    assert c.encode(noise, np.zeros_like(noise)) is None
    odd = np.frombuffer(bytes(3 * codec.ALIGN + 1), dtype=np.uint8)  # not 16-bit values
    out = np.zeros_like(odd)
    stored = c.encode(odd, out)
    assert stored is not None
    back = np.ones_like(odd)
    assert c.decode(codec.ZSTD, out[:stored], back) and np.array_equal(back, odd)


def test_the_byte_planes_match_their_numpy_twin():
    src = kv(torch.bfloat16, 4097)
    lo, hi = np.zeros(4097, np.uint8), np.zeros(4097, np.uint8)
    codec.split(src, lo, hi)
    assert np.array_equal(lo, src[0::2]) and np.array_equal(hi, src[1::2])
    dst = np.zeros_like(src)
    codec.merge(lo, hi, dst)
    assert np.array_equal(dst, src)


def test_a_damaged_payload_does_not_decode():
    c = codec.for_dtype("bfloat16")
    src = kv(torch.bfloat16, 1 << 16)
    out = np.zeros(src.size, dtype=np.uint8)
    stored = c.encode(src, out)
    assert stored is not None
    back = np.zeros_like(src)
    frame_start = 8 + src.size // 2
    bad = out[:stored].copy()
    bad[frame_start : frame_start + 4] ^= 0xFF  # the zstd frame's magic
    assert not c.decode(c.ident, bad, back)
    long = out[:stored].copy()
    long[:8] = np.frombuffer((stored).to_bytes(8, "little"), dtype=np.uint8)  # past the end
    assert not c.decode(c.ident, long, back)
    assert not c.decode(c.ident, out[:stored], np.zeros(src.size - 2, np.uint8))  # wrong size
    assert not c.decode(9, out[:stored], back)  # a codec it does not know


PAGE = 8192  # an encoded group of 2 pages (16 KiB) takes 12 KiB; a page of 1 KiB never shrinks


def codec_config(kind: str, tmp_path: Path, page: int = PAGE, master=None) -> dict:
    cfg = config(page_bytes=page, host_pages=64)
    if kind == "memory":
        tier: dict = {"type": "memory", "space": uuid.uuid4().hex}
    elif kind == "disk":
        tier = {"type": "disk", "path": str(tmp_path / "d"), "size": "64MiB"}
    else:
        tier = {"type": "mooncake", **master.tier_config, "key_prefix": uuid.uuid4().hex[:12]}
    cfg["tiers"].append({**tier, "group_pages": 2, "codec": "lossless", "codec_threads": 2})
    return cfg


def stored_object(kind: str, writer: Writer, name: str) -> bytes:
    """An object's bytes as they rest: its header, then its payload."""
    if kind != "disk":
        return read(kind, writer, name)
    data = (Path(writer.store.root) / "objects" / file_name(name)).read_bytes()
    at = data.index(b"HCob")  # the object header, kept in the record's header block
    return data[at : at + HEADER] + data[DISK_HEADER:]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page", [PAGE, 1024])
def test_encoded_objects_hit_byte_exact_and_damaged_ones_are_counted_misses(
    kind, page, tmp_path, request
):
    """A writer stores two prompts through a tier with codec: lossless: each object rests
    encoded (smaller, codec and raw length in its header) where it shrinks, raw (flag RAW)
    where it does not. A fresh engine hits the untouched prompt whole, byte-exact (FakeEngine
    checks every loaded byte); flipped bytes in the other's objects are counted misses. On
    Mooncake (which reads an object only into its exact size) the tier looks sizes up first."""
    master = request.getfixturevalue("mooncake_master") if kind == "mooncake" else None
    cfg = codec_config(kind, tmp_path, page, master)
    writer = Writer(cfg)
    try:
        p, q = prompt(1), prompt(2)
        changed = writer.stored(p)
        kept = writer.stored(q)
        assert len(changed) == len(kept) == 5
        for name in kept:
            data = stored_object(kind, writer, name)
            magic, _, kind_, flags, raw, stored, _ = _FIELDS.unpack_from(data)[:7]
            assert (magic, kind_, raw) == (b"HCob", codec.PLANES16, 2 * page)
            assert len(data) == HEADER + stored
            if page == PAGE:
                assert (flags, stored) == (0, 3 * codec.ALIGN)
            else:
                assert (flags, stored) == (RAW, raw)
        for name in changed:
            rewrite(kind, writer, name, flip_middle)
    finally:
        writer.engine.cache.close()
    reader = FakeEngine(cfg)
    try:
        assert reader.run("r", p).hit_tokens == 0  # checks every loaded byte
        settle(reader)
        assert reader.cache.stats()[f"corrupt_{kind}"] == 5
        assert reader.run("r2", q).hit_tokens == 40
    finally:
        reader.cache.close()


def test_a_tier_without_the_codec_reads_encoded_objects(tmp_path):
    """codec: none only stops a tier from encoding: what it finds encoded it still decodes."""
    cfg = codec_config("disk", tmp_path)
    writer = Writer(cfg)
    try:
        writer.stored(prompt(5))
    finally:
        writer.engine.cache.close()
    cfg["tiers"][1]["codec"] = "none"
    reader = FakeEngine(cfg)
    try:
        assert reader.run("r", prompt(5)).hit_tokens == 40
    finally:
        reader.cache.close()


class _ExactConfig(MemoryConfig):
    type: Literal["exact_memory"] = "exact_memory"  # type: ignore[assignment]


@register_tier("exact_memory", _ExactConfig)
class _ExactTier(MemoryTier):
    """The memory tier, declared to read objects only into buffers of their exact size."""

    reads_prefix = False


def test_a_tier_whose_gets_need_the_exact_size_refuses_the_codec():
    cfg = config()
    cfg["tiers"].append({"type": "exact_memory", "codec": "lossless"})
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    assert str(err.value) == (
        "tiers.1: codec: the exact_memory tier cannot hold encoded objects (its "
        "gets need an object's exact size); use codec: none"
    )
    cfg["tiers"][1] = {"type": "mooncake", "master_address": "127.0.0.1:1", "codec": "lossless"}
    assert load_config(cfg, env={}).tiers[1].codec == "lossless"  # it looks sizes up first


def test_lossless_without_zstandard_is_a_one_line_config_error(tmp_path):
    code = (
        "import sys; sys.modules['zstandard'] = None\n"
        "from hicache.config import load_config\n"
        "from hicache.errors import ConfigError\n"
        "cfg = {'layout': {'model': 'm', 'kv_dtype': 'bfloat16', 'page_bytes': 64},\n"
        " 'tiers': [{'type': 'host', 'size': 4096},\n"
        f"  {{'type': 'disk', 'path': {str(tmp_path / 'd')!r}, 'size': '1MiB',"
        " 'codec': 'lossless'}]}\n"
        "try:\n    load_config(cfg, env={})\nexcept ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "tiers.1.codec: lossless needs the zstandard package: pip install zstandard (hicache is "
        "not on the package index: in its clone, pip install -e '.[codec]')"
    )


class _Gated(MemoryTier):
    """The memory tier, whose gets after the first wait (up to a minute) until `ready()` holds,
    and note whether it did; `fail_call` makes that get raise instead of reading."""

    def __init__(self, ready) -> None:
        super().__init__(MemoryConfig(space=uuid.uuid4().hex))
        self.ready = ready
        self.waited: list[bool] = []
        self.fail_call = -1

    def get_into(self, keys, buffers):
        if any(op == "get" for op, _ in self.log):
            deadline = time.monotonic() + 60
            while not self.ready() and time.monotonic() < deadline:
                time.sleep(0.001)
            self.waited.append(self.ready())
        if sum(op == "get" for op, _ in self.log) == self.fail_call:
            self.log.append(("get", len(keys)))
            raise StoreUnavailable("the store went away")
        return super().get_into(keys, buffers)


def _codec_worker(read_chunk_bytes: int):
    """A worker of a gated memory tier with codec: lossless (3 groups of 2 bf16 pages of
    `PAGE` bytes written, slots 0-5; a get reads into slots 6-11), and the host rows."""
    layout = Layout(model="m", kv_dtype="bfloat16", page_tokens=4, page_bytes=PAGE)
    host = HostTier(HostTierConfig(size=12 * PAGE, pin="no"), layout)
    assert host.wait_ready(60)
    rows = host.pages.segments[0].numpy()
    rows[:6] = kv(torch.bfloat16, 6 * PAGE // 2).reshape(6, PAGE)
    # a get's first call has read slots 6-7 (group 0): the gate opens once they are decoded
    store = _Gated(lambda: np.array_equal(rows[6:8], rows[0:2]))
    worker = JobRunner(store, host, "t", b"f", 2, 4, False, codec.for_dtype("bfloat16"), 2,
                    read_chunk_bytes)  # fmt: skip
    worker.memory()  # the staging memory (the memory tier reads any address)
    keys = [bytes([k]) * 16 for k in range(3)]
    assert worker.run(Job("put", ends=keys, page_slots=list(range(6)))) == [0, 0, 0]
    assert all(len(v) == HEADER + 3 * codec.ALIGN for v in store.objects.values())  # encoded
    return worker, store, host, rows, keys


def test_a_codec_tier_decodes_what_one_call_read_while_the_next_reads():
    """A get of 3 encoded groups in calls of one group each: the first call's group is decoded
    (by the codec threads) while the second call is in the store; every group hits
    byte-exact. Before the change a get was one call, decoded after it returned."""
    worker, store, host, rows, keys = _codec_worker(2 * PAGE)
    try:
        store.log.clear()
        codes = worker.run(Job("get", ends=keys, page_slots=list(range(6, 12))))
        assert codes == [2 * PAGE] * 3
        assert store.log == [("get", 1)] * 3
        assert store.waited == [True, True]  # decoding overlapped the later reads
        assert np.array_equal(rows[6:12], rows[0:6])
    finally:
        worker.close()
        host.close()


def test_a_codec_get_that_fails_midway_raises_after_its_started_decodes_end():
    """The second of a get's calls raises: the get raises it (a failed call, never a hit), and
    only after the group the first call read has been decoded (the engine thread frees the
    slots of a failed get); the one call a get of calls larger than its objects makes."""
    worker, store, host, rows, keys = _codec_worker(2 * PAGE)
    try:
        store.log.clear()
        store.fail_call = 1
        store.ready = lambda: True  # no gate: the decode of group 0 may still run
        with pytest.raises(StoreUnavailable):
            worker.run(Job("get", ends=keys, page_slots=list(range(6, 12))))
        assert store.log == [("get", 1), ("get", 1)]
        assert np.array_equal(rows[6:8], rows[0:2])  # decoded before the raise
        store.log.clear()
        worker.read_chunk_bytes = 1 << 30
        store.fail_call = -1
        assert worker.run(Job("get", ends=keys, page_slots=list(range(6, 12)))) == [2 * PAGE] * 3
        assert store.log == [("get", 3)]
    finally:
        worker.close()
        host.close()


def test_an_odd_sized_state_under_the_codec_hits_byte_exact(tmp_path):
    """A hybrid layout of bf16 pages (byte planes) whose state is an odd number of bytes: the
    codec encodes such a state with plain zstd, and its header must say so. A fresh engine
    hits the whole prompt from the disk tier with the state at its end (FakeEngine checks the
    pages and the state); no object is counted corrupt."""
    state = 3 * codec.ALIGN + 1  # not a whole number of 16-bit values
    cfg = config(page_bytes=PAGE, host_pages=64, state_bytes=state, state_slots=8)
    cfg["tiers"].append(
        {"type": "disk", "path": str(tmp_path / "d"), "size": "64MiB", "group_pages": 2,
         "codec": "lossless"}
    )  # fmt: skip
    p = prompt(7, 41)  # 10 pages: 5 groups, a state at each group end it keeps
    writer = FakeEngine(cfg, states=FakeStates(2, state, history_tokens=16))
    try:
        writer.run("w", p)
        settle(writer)
        assert writer.cache.stats()["objects_put_disk"] >= 6  # 5 groups and a state
    finally:
        writer.cache.close()
    reader = FakeEngine(cfg, states=FakeStates(2, state, history_tokens=16))
    try:
        m = reader.run("r", p)  # checks every page and the state it loads
        assert (m.hit_tokens, m.fetched_tokens, m.needs_state) == (40, 40, True)
        assert reader.cache.stats()["corrupt_disk"] == 0
    finally:
        reader.cache.close()


@pytest.mark.mooncake
def test_instances_with_and_without_the_codec_on_one_mooncake_store_miss_nothing_for_ever(
    mooncake_master, tmp_path
):
    """Mooncake reads an object only into its exact size unless the tier has a codec, so an
    instance without one cannot read what one with a codec encoded. Each keeps its own objects:
    a codec-less instance asked a prompt that only a codec instance stored misses cleanly (no
    failed get), stores it, and really puts it: a second codec-less instance hits it from the
    store; a codec instance still hits the encoded objects. Before, the codec-less instance's
    gets failed on the encoded objects and its put of the same names did nothing (counted as
    put), so codec-less instances missed that prompt for as long as the objects lived."""
    lossless = codec_config("mooncake", tmp_path, master=mooncake_master)
    host, tier = lossless["tiers"]
    plain = {**lossless, "tiers": [host, {**tier, "codec": "none"}]}
    p = prompt(8)
    writer = Writer(lossless)
    try:
        assert len(writer.stored(p)) == 5
    finally:
        writer.engine.cache.close()
    for cfg, hit in ((plain, 0), (plain, 40), (lossless, 40)):
        e = FakeEngine(cfg)
        try:
            m = e.run("r", p)  # checks every loaded byte
            settle(e)
            s = e.cache.stats()
            assert (m.hit_tokens, m.fetched_tokens, s["get_failed_mooncake"]) == (hit, hit, 0)
        finally:
            e.cache.close()
