"""hicache as SGLang's storage backend, driven by SGLang's own code on the CPU: its
`HiCacheController` with its threads (backup, prefetch, prefetch I/O, sync), its host pools in
every layout (MHA and MLA), its page hashing and its failure injector (tests/sglang_env.py).
A scheduler's part (host pages, acks) is played as SGLang's plays it."""

from __future__ import annotations

import hashlib
import logging
import random
import struct
import urllib.request
from pathlib import Path

import pytest
import sglang_env as env
import torch
from memory_tier import MemoryTier
from mooncake_master import require_mooncake
from sglang_env import MHA_LAYOUTS, MLA_LAYOUTS, P, sg

from hicache.config import ConfigError
from hicache.integrations.sglang.drive import Drive
from hicache.integrations.sglang.pool import EnginePages

pytestmark = pytest.mark.sglang

PAGES = 10
TOKENS = list(range(5000, 5000 + PAGES * P))


@pytest.fixture(scope="module")
def devices():
    return env.device_pools()


def disk(path: Path, **more) -> dict:
    return {"tiers": [{"type": "disk", "path": str(path), "size": "64MiB", "sync": False, **more}]}


def memory(space: str, **more) -> dict:
    return {"tiers": [{"type": "memory", "space": space, **more}]}


def stored_pages(host, indices) -> list[torch.Tensor]:
    return [env.page_bytes(host, indices, i) for i in range(len(indices) // P)]


LAYOUTS = [("mha", x) for x in MHA_LAYOUTS] + [("mla", x) for x in MLA_LAYOUTS]
CONTROLLERS = {"server": env.server_controller, "plain": env.controller}
"""SGLang's two controllers: the one its server builds (`HybridCacheController` over a
`HostPoolGroup`), and `HiCacheController` over the host pool alone."""


@pytest.mark.parametrize("made_by", sorted(CONTROLLERS))
@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_a_second_instance_prefetches_every_page_bit_exact_through_disk(
    devices, tmp_path, kind, layout, made_by
):
    """Controller A backs a prompt's pages up to a disk tier and stops (its process ends);
    controller B, a second instance on the same directory, prefetches the prompt: every page
    arrives, byte for byte as A's host pool held it, whatever the layout and whichever of
    SGLang's controllers drives the backend."""
    device, controller = devices[kind], CONTROLLERS[made_by]
    host_a = env.host_pool(device, layout)
    env.fill(host_a, seed=1)
    a = controller(device, host_a, env.extra(disk(tmp_path / "d")))
    indices, stored = env.backup(a, host_a, TOKENS)
    want = stored_pages(host_a, indices)
    env.stop(a)
    assert stored == len(TOKENS)

    host_b = env.host_pool(device, layout)
    env.fill(host_b, seed=2)  # nothing of A's in it
    b = controller(device, host_b, env.extra(disk(tmp_path / "d")))
    try:
        got_at, got, _ = env.prefetch(b, host_b, [*TOKENS, 1, 2])  # two tokens past the pages
        assert got == len(TOKENS)
        assert all(torch.equal(x, y) for x, y in zip(stored_pages(host_b, got_at), want))
        stats = env.backend(b).stats()
        assert (stats["pages_fetched_disk"], stats["corrupt_disk"]) == (PAGES, 0)
    finally:
        env.stop(b)


@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_a_pages_bytes_are_where_sglangs_address_api_puts_them(devices, kind, layout):
    """hicache moves each host page as the runs SGLang's own zero-copy backends move it by
    (`get_page_buffer_meta`: addresses and sizes, in its order), for every page of the pool.
    SGLang's ``page_first_kv_split`` (Ascend NPU) cannot be built here: its host pool reads
    the NPU device pool's split buffers."""
    host = env.host_pool(devices[kind], layout)
    pages = EnginePages(host)
    segments = pages.pages.segments
    for page in range(host.size // P):
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * P, (page + 1) * P))
        assert [(s[page].data_ptr(), s.shape[1]) for s in segments] == list(zip(ptrs, sizes))
    assert pages.page_bytes == host.get_size_per_token() * P


def test_keys_are_sglangs_own_page_hashes_under_hicaches_namespace(devices):
    """The objects are named by SGLang's page keys (SHA-256 over the key before and the page's
    token ids, as SGLang hashes) under hicache's fingerprint: the names a backup made are the
    ones the prefetch thread's own hashing finds."""
    device = devices["mha"]
    host = env.host_pool(device, "page_first")
    env.fill(host, seed=3)
    ctl = env.controller(device, host, env.extra(memory("keys")))
    try:
        env.backup(ctl, host, TOKENS)
        chain, prev = [], b""
        for i in range(PAGES):
            prev = hashlib.sha256(prev + struct.pack(f"<{P}I", *TOKENS[i * P : (i + 1) * P]))
            prev = prev.digest()
            chain.append(prev.hex())
        assert sg.utils.get_hash_str(TOKENS, page_size=P) == chain
        fp = env.backend(ctl).tiers.fingerprint.hex()
        assert set(MemoryTier.spaces["keys"]) == {f"hicache/{fp}/g1/{k}" for k in chain}
        _, got, _ = env.prefetch(ctl, host, TOKENS)
        assert got == len(TOKENS)
    finally:
        env.stop(ctl)


def test_only_pages_of_the_same_bytes_are_shared(devices):
    """Instances share exactly the pages whose bytes are the same: another layout, KV dtype's
    pool or TP rank of MHA (its heads) finds nothing of A's; an MLA rank finds its writer
    rank's pages (MLA ranks hold the same KV, and SGLang backs up from one of them only)."""
    mha, mla = devices["mha"], devices["mla"]

    def run(device, layout, rank=0, size=1, space="share"):
        host = env.host_pool(device, layout)
        env.fill(host, seed=rank)
        return host, env.controller(device, host, env.extra(memory(space)), rank, size)

    host, a = run(mha, "page_first")
    env.backup(a, host, TOKENS)
    env.stop(a)
    for layout, rank, size in (("layer_first", 0, 1), ("page_first", 1, 2)):
        host, b = run(mha, layout, rank, size)
        assert env.prefetch(b, host, TOKENS)[1] == 0, (layout, rank)
        env.stop(b)
    host, same = run(mha, "page_first")
    assert env.prefetch(same, host, TOKENS)[1] == len(TOKENS)
    env.stop(same)

    host0, writer = run(mla, "page_first", 0, 2, "mla")
    host1, reader = run(mla, "page_first", 1, 2, "mla")
    try:
        env.backup(reader, host1, TOKENS)  # SGLang skips a non-writer's backup
        keys = sg.utils.get_hash_str(TOKENS, page_size=P)
        direct = env.backend(reader).batch_set_v1(keys, torch.arange(len(TOKENS)))
        assert direct == [True] * PAGES  # and so does the backend: the writer stores them
        assert MemoryTier.spaces["mla"] == {}
        indices, _ = env.backup(writer, host0, TOKENS)
        at, got, _ = env.prefetch(reader, host1, TOKENS)
        assert got == len(TOKENS)
        assert all(
            torch.equal(x, y) for x, y in zip(stored_pages(host1, at), stored_pages(host0, indices))
        )
    finally:
        env.stop(writer)
        env.stop(reader)


@pytest.mark.mooncake
def test_a_second_instance_reads_through_mooncake_while_the_first_runs(devices, mooncake_master):
    """Two live instances on one Mooncake store (a real master on loopback): what A backs up,
    B prefetches, byte for byte; B's TP rank 1 of MHA finds none of A's rank-0 pages."""
    require_mooncake()
    tier = {"tiers": [{"type": "mooncake", **mooncake_master.tier_config}]}
    device = devices["mha"]
    hosts = [env.host_pool(device, "page_first_direct") for _ in range(3)]
    for i, h in enumerate(hosts):
        env.fill(h, seed=10 + i)
    ctls = [env.controller(device, h, env.extra(tier), r, 2) for h, r in zip(hosts, (0, 0, 1))]
    try:
        indices, stored = env.backup(ctls[0], hosts[0], TOKENS)
        assert stored == len(TOKENS)
        at, got, _ = env.prefetch(ctls[1], hosts[1], TOKENS)
        assert got == len(TOKENS)
        pairs = zip(stored_pages(hosts[1], at), stored_pages(hosts[0], indices))
        assert all(torch.equal(x, y) for x, y in pairs)
        assert env.prefetch(ctls[2], hosts[2], TOKENS)[1] == 0
    finally:
        for c in ctls:
            env.stop(c)


def _corrupt_a_record(root: Path, rng: random.Random) -> None:
    """Flip a byte of a stored page's payload on disk (past the record's header block)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name != "tmp")
    files = [p for p in files if p.stat().st_size > 4096 + 64]
    if files:
        path = rng.choice(files)
        raw = bytearray(path.read_bytes())
        at = 4096 + 32 + rng.randrange(len(raw) - 4096 - 32)
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))


def test_injected_failures_never_give_a_wrong_byte_nor_a_stuck_request(
    devices, tmp_path, monkeypatch
):
    """SGLang's failure injector around the backend (random failed calls and delays), a memory
    tier above a disk tier that fails now and then, and bytes flipped at rest on the disk:
    every prefetch ends (its last ack comes), and every page it reports arrived holds the
    bytes backed up under its key."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.25")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    device = devices["mha"]
    host = env.host_pool(device, "layer_first")
    tiers = {"tiers": [
        {"type": "memory", "space": "faults"},
        {"type": "disk", "path": str(tmp_path / "d"), "size": "64MiB", "sync": False},
    ]}  # fmt: skip
    ctl = env.controller(device, host, env.extra(tiers))
    assert type(ctl.storage_backend).__name__ == "HiCacheStorageFailureInjector"
    mem = env.backend(ctl).tiers.tiers[0].store
    rng = random.Random(5)
    want: dict[str, torch.Tensor] = {}
    hits = 0
    try:
        for round_ in range(12):
            tokens = [7000 + round_ * 3 + t for t in range(P * rng.randrange(2, 7))]
            env.fill(host, seed=round_)
            indices, _ = env.backup(ctl, host, tokens)
            for i, key in enumerate(sg.utils.get_hash_str(tokens, page_size=P)):
                want.setdefault(key, env.page_bytes(host, indices, i))
            host.free(indices)
            mem.fail = rng.random() < 0.3
            _corrupt_a_record(tmp_path / "d", rng)
            probe = tokens[: P * rng.randrange(1, len(tokens) // P + 1)]
            at, got, _ = env.prefetch(ctl, host, probe, rid=f"r{round_}")  # never stuck
            keys = sg.utils.get_hash_str(probe, page_size=P)
            for i in range(got // P):
                assert torch.equal(env.page_bytes(host, at, i), want[keys[i]])
            hits += got // P
            if at is not None:
                host.free(at)
    finally:
        env.stop(ctl)
    assert hits > 0


@pytest.mark.parametrize(
    "change, line",
    [
        ({"interface_v1": 0}, 'give "interface_v1": 1'),
        ({"tier_lcm": 1}, "unknown key 'tier_lcm'"),
        ({"hicache": {"tiers": [{"type": "host", "size": "1GiB"}]}}, "the host tier is SGLang's"),
        ({"hicache": disk("/nonexistent/x", group_pages=4)}, "tiers.0.group_pages"),
        ({"hicache": disk("/nonexistent/d/e")}, "tiers.0.path: /nonexistent/d/e: its parent"),
    ],
)
def test_a_bad_configuration_is_refused_at_start_in_one_line(devices, caplog, change, line):
    device = devices["mha"]
    host = env.host_pool(device, "page_first")
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError) as err:
        env.controller(device, host, {**env.extra({}), **change})
    assert line in str(err.value)
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("hicache")]
    assert len(errors) == 1 and line in errors[0] and "\n" not in errors[0]


def test_hybrid_pools_and_an_mla_model_on_private_tiers_are_refused(devices, tmp_path):
    """A hybrid model's state pool (SGLang's v2 calls) is refused when SGLang registers it; an
    MLA model on several TP ranks with a tier only one process reads is refused at start."""
    device = devices["mha"]
    host = env.host_pool(device, "page_first")
    ctl = env.controller(device, host, env.extra(memory("hybrid")))
    try:
        pool = sg.hicache_storage.PoolName
        env.backend(ctl).register_mem_host_pool_v2(host, pool.KV)  # the KV pool itself: fine
        with pytest.raises(ConfigError, match=r"mamba pool .* is not supported"):
            env.backend(ctl).register_mem_host_pool_v2(host, pool.MAMBA)
    finally:
        env.stop(ctl)
    mla = devices["mla"]
    host = env.host_pool(mla, "page_first")
    with pytest.raises(ValueError, match=r"an MLA model on 2 TP ranks .* a disk tier"):
        env.controller(mla, host, env.extra(disk(tmp_path / "d")), 1, 2)


def test_sglangs_storage_metrics_and_hicaches_own(devices, tmp_path):
    """SGLang's storage metrics (pages and GB/s of each get and put) come from `get_stats`;
    hicache's counters per tier are served on its metrics endpoint beside them."""
    device = devices["mha"]
    host = env.host_pool(device, "page_first")
    config = {**disk(tmp_path / "d"), "metrics": {"port": 0}}
    ctl = env.controller(device, host, env.extra(config), storage_metrics=True)
    try:
        env.backup(ctl, host, TOKENS)
        env.prefetch(ctl, host, TOKENS)
        m = ctl.storage_backend.get_stats()
        assert (m.backup_pgs, m.prefetch_pgs) == ([PAGES], [PAGES])
        assert all(r > 0 for r in m.backup_bandwidth + m.prefetch_bandwidth)
        assert ctl.storage_backend.get_stats().backup_pgs == []  # read once
        port = env.backend(ctl)._metrics.port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        lines = text.decode().splitlines()
        assert f'hicache_tier_objects_put_total{{tier="disk"}} {PAGES}.0' in lines
        assert f'hicache_tier_pages_fetched_total{{tier="disk"}} {PAGES}.0' in lines or any(
            line.startswith('hicache_tier_get_seconds_count{tier="disk"}') for line in lines
        )
    finally:
        env.stop(ctl)


def test_random_calls_as_the_controller_makes_them_with_faults(devices, tmp_path):
    """The driver's random interleavings of SGLang's three calls on an SGLang host pool
    (layer_first: a page is 6 runs): without faults every page stored is found and arrives;
    with SGLang's failure injector, a failing tier and bytes flipped at rest, no wrong byte and
    no claim of a page never put."""
    device = devices["mha"]
    host = env.host_pool(device, "layer_first", ratio=4.0)
    tiers = {"tiers": [
        {"type": "memory", "space": "drive"},
        {"type": "disk", "path": str(tmp_path / "d"), "size": "256MiB", "sync": False},
    ]}  # fmt: skip
    backend = sg.backend.HiCacheBackend(env.storage_config(env.extra(tiers)))
    backend.register_mem_pool_host(host)
    try:
        calm = Drive(backend.batch_set_v1, backend.batch_exists, backend.batch_get_v1, host, 1)
        assert calm.run(40).problems == []
        assert calm.tally.pages_got > 0 and calm.tally.pages_found > 0
        injector = sg.hicache_storage.HiCacheStorageFailureInjector(backend, 0.0, 0.2)
        mem = backend.tiers.tiers[0].store

        def faults(rng: random.Random) -> None:
            mem.fail = rng.random() < 0.25
            if rng.random() < 0.2:
                _corrupt_a_record(tmp_path / "d", rng)

        rough = Drive(
            injector.batch_set_v1, injector.batch_exists, injector.batch_get_v1, host, 2, faults
        )
        assert rough.run(60).problems == []
        assert rough.tally.pages_got > 0
    finally:
        backend.close()


@pytest.mark.mooncake
def test_the_bench_runs_and_records_its_run(tmp_path, monkeypatch):
    """bench/sglang.py (the GPU machine's measurement) runs here at a small size, Mooncake's
    backends on a master it starts itself: every backend's sets and gets come back byte for
    byte in every repetition, its result names its commit, machine and command, and its summary
    has the ratios the targets are about, each with its spread."""
    import importlib.util
    import json
    import sys

    require_mooncake()
    path = Path(__file__).resolve().parent.parent / "bench" / "sglang.py"
    spec = importlib.util.spec_from_file_location("bench_sglang", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    argv = [str(path), "--machine", "ci", "--dir", str(tmp_path), "--layers", "1",
            "--kv-heads", "1", "--head-dim", "32", "--page", "4", "--pages", "8",
            "--prefetch-pages", "8", "--rounds", "2", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = json.loads(out.read_text())
    assert {"commit", "machine", "command"} <= set(result)
    assert result["command"].startswith("python bench/sglang.py --machine ci")
    ops = {(r["backend"], r["op"], r["batch"], r["round"]) for r in result["rows"]}
    assert ops == {
        (b, o, n, r) for b in bench.BACKENDS for o in ("set", "get") for n in (64, 128)
        for r in (0, 1)
    }  # fmt: skip
    assert sorted((p["backend"], p["round"]) for p in result["prefetch"]) == [
        (b, r) for b in sorted(bench.PREFETCH) for r in (0, 1)
    ]
    summary = result["summary"]
    for key in ("hicache_vs_file_get_128", "hicache_vs_file_set_64", "codec_vs_raw_get_64",
                "hicache_mooncake_vs_sglang_mooncake_set_128",
                "prefetch_hicache_vs_file_time"):  # fmt: skip
        low, high = summary["spread"][key]
        assert low <= summary[key] <= high, key
    assert set(result["targets"]) >= {"hicache_vs_file_set_64", "prefetch_hicache_vs_file_time"}
