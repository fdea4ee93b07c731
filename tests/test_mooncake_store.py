"""MooncakeStore against a real mooncake_master on loopback, plus the breaker and the timeout
path with stand-in clients (those need no Mooncake).

Facts these tests pin (Mooncake 0.3.13): a missing key is OBJECT_NOT_FOUND; a put of an existing
key answers OK and keeps the first bytes; an object larger than every segment is NO_SPACE; a full
store answers NO_SPACE per key, never an exception; a killed master makes calls fail fast and
opens the breaker; a master restarted on the same ports is found again without help.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_master import MooncakeMaster

from hicache.backends.base import Buffers, StoreUnavailable
from hicache.backends.breaker import BreakerState, CircuitBreaker
from hicache.backends.memory import HostMemory
from hicache.backends.mooncake.codes import StoreCode, StoreState
from hicache.backends.mooncake.config import MooncakeConfig
from hicache.backends.mooncake.tier import MooncakeStore
from hicache.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20


# -- breaker (fake clock) ------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_refuses() -> None:
    clock = FakeClock()
    b = CircuitBreaker(3, 10.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.CLOSED
    assert b.allow()
    b.record_success()  # a success in between resets the run
    for _ in range(3):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.OPEN
    assert [b.allow() for _ in range(4)] == [False] * 4
    s = b.stats()
    assert (s.refused, s.opened, s.failures, s.successes) == (4, 1, 5, 1)


def test_breaker_half_open_lets_one_probe_and_its_outcome_decides() -> None:
    clock = FakeClock()
    b = CircuitBreaker(1, 5.0, clock=clock)
    b.record_failure()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # only one probe at a time
    b.record_failure()  # probe failed: open for another interval
    assert b.state is BreakerState.OPEN
    clock.now += 4.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert b.allow() and b.allow()
    assert b.stats().probes == 2


def test_breaker_lost_probe_is_replaced_after_an_interval() -> None:
    clock = FakeClock()
    b = CircuitBreaker(1, 2.0, clock=clock)
    b.record_failure()
    clock.now += 2.0
    assert b.allow()  # probe taken, outcome never reported
    clock.now += 1.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()
    assert b.stats().probes == 2


def test_breaker_is_consistent_under_threads() -> None:
    b = CircuitBreaker(1_000_000, 1.0)
    n, per = 4, 5000

    def work() -> None:
        for _ in range(per):
            b.allow()
            b.record_failure()

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.stats().failures == n * per
    assert b.stats().consecutive_failures == n * per


@pytest.mark.parametrize(
    ("args", "error"),
    [((0, 1.0), ValueError), ((1, 0.0), ValueError), ((1.5, 1.0), TypeError)],
)
def test_breaker_rejects_bad_settings(args: tuple, error: type[Exception]) -> None:
    with pytest.raises(error):
        CircuitBreaker(*args)


# -- config --------------------------------------------------------------------------------------


def _tiers(**mooncake: Any) -> dict:
    return {"tiers": [{"type": "host", "size": "1MiB"}, {"type": "mooncake", **mooncake}]}


def test_config_accepts_units_and_defaults() -> None:
    cfg = load_config(_tiers(global_segment_size="4GiB", local_buffer_size=1024), env={})
    mc = cfg.tier("mooncake")
    assert isinstance(mc, MooncakeConfig)
    assert (mc.global_segment_size, mc.local_buffer_size) == (4 << 30, 1024)
    assert (mc.group_pages, mc.key_prefix, mc.replicas, mc.protocol) == (4, "hicache", 1, "tcp")


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("master_address", "localhost", "tiers.1.master_address"),
        ("master_address", "h:70000", "tiers.1.master_address"),
        ("global_segment_size", "lots", "tiers.1.global_segment_size"),
        ("global_segment_size", "8MiB", "tiers.1.global_segment_size"),
        ("local_buffer_size", -1, "tiers.1.local_buffer_size"),
        ("group_pages", 0, "tiers.1.group_pages"),
        ("key_prefix", "a/b", "tiers.1.key_prefix"),
        ("call_timeout_s", 0, "tiers.1.call_timeout_s"),
        ("breaker_failures", 0, "tiers.1.breaker_failures"),
        ("breaker_reprobe_s", -1, "tiers.1.breaker_reprobe_s"),
        ("write_queue_depth", 0, "tiers.1.write_queue_depth"),
        ("fetch_workers", 0, "tiers.1.fetch_workers"),
        ("fetch_workers", 17, "tiers.1.fetch_workers"),
        ("device_names", "mlx5_0, mlx5_1", "tiers.1.device_names"),
        ("protocol", "udp", "tiers.1.protocol"),
        ("no_such_field", 1, "tiers.1"),  # the section; the message names the key
    ],
)
def test_config_errors_name_the_field(field: str, value: Any, names: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_tiers(**{field: value}), env={})
    assert str(err.value).startswith(names + ":")


# -- stand-in clients: timeout, unreachable codes, reconnect -------------------------------------


class FakeClient:
    """Implements the raw calls MooncakeStore makes; `gate` holds the data calls."""

    def __init__(self, setup_rc: int = 0, codes: list[int] | None = None) -> None:
        self.setup_rc = setup_rc
        self.codes = codes
        self.gate = threading.Event()
        self.gate.set()
        self.registered: list[tuple[int, int]] = []
        self.calls = 0
        self.closed = False

    def setup(self, *args: Any) -> int:
        return self.setup_rc

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def _answer(self, n: int, default: int) -> list[int]:
        self.calls += 1
        self.gate.wait()
        return list(self.codes) if self.codes is not None else [default] * n

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._answer(len(keys), 1)

    def batch_get_into_multi_buffers(self, keys: list[str], ptrs: Any, sizes: Any) -> list[int]:
        return self._answer(len(keys), sum(sizes[0]))

    def batch_put_from_multi_buffers(self, keys: list[str], p: Any, s: Any, r: Any) -> list[int]:
        return self._answer(len(keys), 0)

    def batch_remove(self, keys: list[str], force: bool) -> list[int]:
        return self._answer(len(keys), 0)

    def close(self) -> int:
        self.closed = True
        return 0


def _fake_store(clients: list[FakeClient], **overrides: Any) -> MooncakeStore:
    """A store over fake clients; calls are given 30 s (a loaded machine's calls are not
    failures), the tests of the bound a short one of their own."""
    settings = dict(call_timeout_s=30.0, breaker_failures=2, breaker_reprobe_s=3600.0)
    settings.update(overrides)
    made = iter(clients)
    store = MooncakeStore(MooncakeConfig(**settings), client_factory=lambda: next(made))
    store.start()
    return store


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `call` on a thread of its own, as an L3 worker would; its outcome lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as err:
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_call_out_past_the_bound_counts_as_a_failure_while_it_runs() -> None:
    fake = FakeClient()
    store = _fake_store([fake], breaker_failures=5, call_timeout_s=0.2)
    try:
        assert store.wait_ready(60)
        mem = torch.zeros(64 * KiB, dtype=torch.uint8)
        store.register(mem)
        fake.gate.clear()  # Mooncake holds the call (and the buffer)
        thread, out = _in_thread(
            lambda: store.get_into(["k"], Buffers.of([[(mem.data_ptr(), 4 * KiB)]]))
        )
        deadline = time.monotonic() + 60
        while store.stats().timeouts == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.stats().timeouts == 1  # counted at 0.2 s, while the call is still out
        assert store.breaker.stats().consecutive_failures == 1
        assert thread.is_alive() and out == []
        fake.gate.set()
        thread.join(60)
        assert out == [[4 * KiB]]  # its answer still arrives, and is a good one
        assert store.stats().timeouts == 1
    finally:
        fake.gate.set()
        store.close()


def test_hanging_calls_open_the_breaker_and_further_calls_are_refused_at_once() -> None:
    fake = FakeClient()
    store = _fake_store([fake], call_timeout_s=0.2)  # and breaker_failures=2
    try:
        assert store.wait_ready(60)
        fake.gate.clear()
        hung = [_in_thread(lambda: store.exists(["k"])) for _ in range(2)]
        deadline = time.monotonic() + 60
        while store.breaker.state is BreakerState.CLOSED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.breaker.state is BreakerState.OPEN  # both calls are still out
        assert store.state is StoreState.DOWN and not store.available
        with pytest.raises(StoreUnavailable, match="breaker open"):
            store.exists(["k"])
        assert fake.calls == 2  # the refused call never reached the client
        assert store.stats().refused == 1
        fake.gate.set()
        for thread, out in hung:
            thread.join(60)
            assert out == [[True]]
    finally:
        fake.gate.set()
        store.close()


def test_unreachable_codes_raise_only_when_no_key_was_answered() -> None:
    fake = FakeClient(codes=[StoreCode.RPC_FAIL, StoreCode.RPC_FAIL])
    store = _fake_store([fake], breaker_failures=5)
    try:
        assert store.wait_ready(60)
        with pytest.raises(StoreUnavailable, match="RPC_FAIL"):
            store.exists(["a", "b"])
        fake.codes = [1, StoreCode.RPC_TIMEOUT]
        assert store.exists(["a", "b"]) == [True, False]
        assert store.breaker.stats().consecutive_failures == 2
        fake.codes = [0, 1]
        assert store.exists(["a", "b"]) == [False, True]
        assert store.breaker.stats().consecutive_failures == 0
    finally:
        store.close()


def test_failed_setup_is_retried_and_memory_is_registered_on_the_new_client() -> None:
    failing, working = FakeClient(setup_rc=-1), FakeClient()
    mem = torch.zeros(4 * KiB, dtype=torch.uint8)
    store = MooncakeStore(
        MooncakeConfig(reconnect_backoff_s=0.05),
        client_factory=iter([failing, working]).__next__,
    )
    store.register(mem)  # before any connection
    with pytest.raises(StoreUnavailable, match="not connected"):
        store.exists(["k"])
    store.start()
    try:
        assert store.wait_ready(60)
        assert store.state is StoreState.READY
        assert failing.closed and failing.registered == []
        assert working.registered == [(mem.data_ptr(), 4 * KiB)]
        assert store.stats().setup_failures == 1
    finally:
        store.close()
    assert working.closed and store.state is StoreState.CLOSED


def test_bad_arguments_are_refused_before_any_call() -> None:
    store = MooncakeStore(MooncakeConfig())
    mem = torch.zeros(4 * KiB, dtype=torch.uint8)
    store.register(mem)
    p = mem.data_ptr()
    with pytest.raises(
        ValueError, match=r"key 'k': piece \(0x[0-9a-f]+, 16\) is outside registered"
    ):
        store.put_from(["k"], Buffers.of([[(p + 4 * KiB - 8, 16)]]))
    outside = Buffers([[p + 4 * KiB - 8]], [[16]], span=(p + 4 * KiB - 8, p + 4 * KiB + 8))
    with pytest.raises(ValueError, match=r"key 'k': piece \(0x[0-9a-f]+, 16\) is outside"):
        store.put_from(["k"], outside)  # a span outside registered memory: each piece checked
    inside = Buffers([[p], [p + 64]], [[64], [64]], span=(p, p + 128))
    with pytest.raises(StoreUnavailable, match="not connected"):  # checked, then refused
        store.put_from(["a", "b"], inside)
    with pytest.raises(ValueError, match="key 'b': piece size must be > 0, got 0"):
        store.put_from(["a", "b"], Buffers.of([[(p, 8)], [(p + 8, 8), (p + 16, 0)]]))
    with pytest.raises(ValueError, match="key 'b' has no pieces"):
        store.put_from(["a", "b"], Buffers([[p], []], [[8], []]))
    with pytest.raises(ValueError, match="as many sizes as pointers"):
        store.put_from(["a"], Buffers([[p, p + 8]], [[8]]))
    with pytest.raises(TypeError, match="buffers must be Buffers"):
        store.put_from(["a"], [[(p, 8)]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 keys but 1"):
        store.get_into(["a", "b"], Buffers.of([[(p, 8)]]))
    with pytest.raises(TypeError):
        store.exists("abc")
    with pytest.raises(ValueError, match="overlaps"):
        store.register(mem[16:])
    with pytest.raises(ValueError, match="contiguous"):
        store.register(mem.view(64, 64)[:, :8])
    store.register(mem)  # the same tensor again: no-op
    store.close()


# -- real master ---------------------------------------------------------------------------------


def _store(master: MooncakeMaster, **overrides: Any) -> MooncakeStore:
    settings: dict[str, Any] = dict(
        master_address=master.address,
        global_segment_size=16 * MiB,
        local_buffer_size=1 * MiB,
        call_timeout_s=30.0,  # a loaded machine's calls are not failures; the bound's tests: 1 s
        breaker_failures=2,
        breaker_reprobe_s=0.5,
        reconnect_backoff_s=0.2,
    )
    settings.update(overrides)
    store = MooncakeStore(MooncakeConfig(**settings))
    master.track(store)
    store.start()
    if not store.wait_ready(20):
        raise RuntimeError(f"store did not connect to {master.address}: {store.stats()}")
    return store


@pytest.fixture
def stores() -> Iterator[list[MooncakeStore]]:
    """Stores to close at the end of the test (before the masters stop)."""
    opened: list[MooncakeStore] = []
    yield opened
    for s in reversed(opened):
        s.close()


def _memory(nbytes: int, seed: int) -> torch.Tensor:
    mem = HostMemory(nbytes, pin=torch.cuda.is_available())
    gen = torch.Generator().manual_seed(seed)
    mem.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    mem.tensor.owner = mem  # keep the registration alive as long as the tensor
    return mem.tensor


def _names(n: int) -> list[str]:
    run = uuid.uuid4().hex[:12]
    return [f"hicache-test/{run}/g4/{i:04x}" for i in range(n)]


@pytest.mark.mooncake
def test_round_trip_gives_the_exact_bytes(
    mooncake_master: MooncakeMaster, stores: list[MooncakeStore]
) -> None:
    store = _store(mooncake_master)
    stores.append(store)
    mem = _memory(4 * MiB, seed=1)
    store.register(mem)
    base = mem.data_ptr()
    keys = _names(4)
    # Each object is two pieces far apart (a layer-first page: one row in each of two tensors).
    src = [
        [(base + i * 96 * KiB, 64 * KiB), (base + MiB + i * 32 * KiB, 32 * KiB)] for i in range(4)
    ]
    dst = [
        [(base + 2 * MiB + i * 96 * KiB, 64 * KiB), (base + 3 * MiB + i * 32 * KiB, 32 * KiB)]
        for i in range(4)
    ]
    mem[2 * MiB :].zero_()
    assert store.put_from(keys, Buffers.of(src)) == [StoreCode.OK] * 4
    assert store.exists(keys) == [True] * 4
    assert store.get_into(keys, Buffers.of(dst)) == [96 * KiB] * 4
    for s, d in zip(src, dst, strict=True):
        for (sp, n), (dp, _) in zip(s, d, strict=True):
            assert torch.equal(mem[dp - base : dp - base + n], mem[sp - base : sp - base + n])
    stats = store.stats()
    assert (stats.keys_put, stats.bytes_put, stats.keys_got, stats.bytes_got) == (
        4,
        4 * 96 * KiB,
        4,
        4 * 96 * KiB,
    )


@pytest.mark.mooncake
def test_missing_keys_and_wrong_sizes_are_codes_not_exceptions(
    mooncake_master: MooncakeMaster, stores: list[MooncakeStore]
) -> None:
    store = _store(mooncake_master)
    stores.append(store)
    mem = _memory(1 * MiB, seed=2)
    store.register(mem)
    p = mem.data_ptr()
    present, missing = _names(2)
    assert store.put_from([present], Buffers.of([[(p, 1000)]])) == [StoreCode.OK]
    assert store.exists([missing, present]) == [False, True]
    got = store.get_into([missing, present], Buffers.of([[(p + 4096, 1000)], [(p + 8192, 1000)]]))
    assert got == [StoreCode.OBJECT_NOT_FOUND, 1000]
    assert store.get_into([present], Buffers.of([[(p + 4096, 2000)]])) == [StoreCode.TRANSFER_FAIL]
    assert store.get_into([present], Buffers.of([[(p + 4096, 500)]])) == [StoreCode.INVALID_PARAMS]
    assert store.get_into([present], Buffers.of([[(p + 4096, 400), (p + 9000, 600)]])) == [1000]
    assert store.remove([missing]) == [StoreCode.OBJECT_NOT_FOUND]
    assert store.remove([present]) == [StoreCode.OBJECT_HAS_LEASE]  # read just now
    assert store.remove([present], force=True) == [StoreCode.OK]
    assert store.exists([present]) == [False]


@pytest.mark.mooncake
def test_put_of_an_existing_key_keeps_the_first_bytes(
    mooncake_master: MooncakeMaster, stores: list[MooncakeStore]
) -> None:
    store = _store(mooncake_master)
    stores.append(store)
    mem = _memory(1 * MiB, seed=3)
    store.register(mem)
    p = mem.data_ptr()
    (key,) = _names(1)
    assert store.put_from([key], Buffers.of([[(p, 4096)]])) == [StoreCode.OK]
    assert store.put_from([key], Buffers.of([[(p + 4096, 4096)]])) == [StoreCode.OK]
    assert store.get_into([key], Buffers.of([[(p + 65536, 4096)]])) == [4096]
    assert torch.equal(mem[65536 : 65536 + 4096], mem[:4096])
    assert not torch.equal(mem[4096:8192], mem[:4096])


_READER = """
import hashlib, json, sys
import torch
from hicache.backends.base import Buffers
from hicache.backends.mooncake.config import MooncakeConfig
from hicache.backends.mooncake.tier import MooncakeStore
address, keys, size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
store = MooncakeStore(MooncakeConfig(master_address=address, global_segment_size=0,
                                     local_buffer_size=1 << 20, call_timeout_s=30.0))
store.start()
if not store.wait_ready(120):
    raise SystemExit("reader did not connect")
mem = torch.zeros(size * len(keys), dtype=torch.uint8)
store.register(mem)
base = mem.data_ptr()
found = store.exists(keys)
codes = store.get_into(keys, Buffers.of([[(base + i * size, size)] for i in range(len(keys))]))
digests = [hashlib.sha256(mem[i * size:(i + 1) * size].numpy().tobytes()).hexdigest()
           for i in range(len(keys))]
store.close()
print(json.dumps({"found": found, "codes": codes, "digests": digests}))
"""


@pytest.mark.mooncake
def test_another_process_reads_what_this_one_put(
    mooncake_master: MooncakeMaster, stores: list[MooncakeStore]
) -> None:
    store = _store(mooncake_master)
    stores.append(store)
    size = 256 * KiB
    mem = _memory(3 * size, seed=4)
    store.register(mem)
    keys = _names(3)
    assert store.put_from(
        keys[:2], Buffers.of([[(mem.data_ptr() + i * size, size)] for i in range(2)])
    ) == [
        0,
        0,
    ]
    # the repository first, then whatever the caller's path holds (packages installed there)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, MC_LOG_LEVEL="ERROR")
    out = subprocess.run(
        [sys.executable, "-c", _READER, mooncake_master.address, json.dumps(keys), str(size)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    want = [
        hashlib.sha256(mem[i * size : (i + 1) * size].numpy().tobytes()).hexdigest()
        for i in range(2)
    ]
    assert result["found"] == [True, True, False]
    assert result["codes"] == [size, size, StoreCode.OBJECT_NOT_FOUND]
    assert result["digests"][:2] == want


@pytest.mark.mooncake
def test_object_larger_than_any_segment_is_no_space(
    start_mooncake_master: Callable[..., MooncakeMaster], stores: list[MooncakeStore]
) -> None:
    master = start_mooncake_master()
    store = _store(master, global_segment_size=16 * MiB)
    stores.append(store)
    mem = _memory(20 * MiB, seed=5)
    store.register(mem)
    big, small = _names(2)
    p = mem.data_ptr()
    assert store.put_from([big, small], Buffers.of([[(p, 20 * MiB)], [(p, MiB)]])) == [
        StoreCode.NO_SPACE,
        0,
    ]
    assert store.exists([big, small]) == [False, True]


@pytest.mark.mooncake
def test_filling_the_store_gives_no_space_or_eviction_never_an_exception(
    start_mooncake_master: Callable[..., MooncakeMaster], stores: list[MooncakeStore]
) -> None:
    master = start_mooncake_master("--default_kv_lease_ttl=50")
    segment, obj = 16 * MiB, MiB
    store = _store(master, global_segment_size=segment)
    stores.append(store)
    mem = _memory(8 * obj, seed=6)
    store.register(mem)
    keys = _names(48)
    pieces = [[(mem.data_ptr() + (i % 8) * obj, obj)] for i in range(8)]
    codes: list[int] = []
    for start in range(0, len(keys), 8):
        codes += store.put_from(keys[start : start + 8], Buffers.of(pieces))
    assert set(codes) <= {StoreCode.OK, StoreCode.NO_SPACE}
    assert codes.count(StoreCode.OK) >= segment // obj // 2  # the store took a fair share
    live = sum(store.exists(keys))
    assert live * obj <= segment
    assert live <= codes.count(StoreCode.OK)


@pytest.mark.mooncake
def test_killed_master_opens_the_breaker_and_a_restart_is_found_again(
    start_mooncake_master: Callable[..., MooncakeMaster], stores: list[MooncakeStore]
) -> None:
    master = start_mooncake_master()
    # a call to the dead master is out for up to ~4.3 s (the watchdog counts it at 1 s): the
    # breaker must still be open when the second one has returned, so it re-probes after 6 s
    store = _store(master, call_timeout_s=1.0, breaker_reprobe_s=6.0)
    stores.append(store)
    mem = _memory(MiB, seed=7)
    store.register(mem)
    p = mem.data_ptr()
    old, new = _names(2)
    assert store.put_from([old], Buffers.of([[(p, 4096)]])) == [0]

    master.kill()
    raised: list[StoreUnavailable] = []
    while store.breaker.state is BreakerState.CLOSED and len(raised) < 2:
        with pytest.raises(StoreUnavailable) as err:
            store.exists([old])
        raised.append(err.value)
    assert len(raised) == 2  # breaker_failures
    assert store.breaker.state is not BreakerState.CLOSED
    assert store.state is StoreState.DOWN
    refused = store.stats().refused
    with pytest.raises(StoreUnavailable, match="breaker open"):
        store.put_from([new], Buffers.of([[(p, 4096)]]))
    assert store.stats().refused == refused + 1

    master.restart()
    deadline = time.monotonic() + 30
    put: list[int] = []
    while time.monotonic() < deadline:
        try:
            put = store.put_from([new], Buffers.of([[(p, 4096)]]))
        except StoreUnavailable:
            put = []
        if put == [StoreCode.OK]:
            break
        time.sleep(0.2)  # until the breaker lets a probe through / the segment is remounted
    assert put == [StoreCode.OK]
    assert store.state is StoreState.READY
    assert store.get_into([new], Buffers.of([[(p + 8192, 4096)]])) == [4096]
    assert store.exists([old]) == [False]  # the new master knows nothing of the old objects


@pytest.mark.mooncake
def test_a_stalled_master_never_holds_a_caller_past_the_bound_and_service_resumes(
    start_mooncake_master: Callable[..., MooncakeMaster], stores: list[MooncakeStore]
) -> None:
    master = start_mooncake_master()
    store = _store(master, call_timeout_s=1.0, breaker_failures=5)
    stores.append(store)
    mem = _memory(MiB, seed=8)
    store.register(mem)
    key, fresh = _names(2)
    assert store.put_from([key], Buffers.of([[(mem.data_ptr(), 4096)]])) == [0]
    master.pause()
    try:
        # Mooncake answers some calls without its master (what the client knows already), so
        # whether this one fails varies; what must hold is that it returns while the master is
        # still stalled: ended by the bound hicache sets (80 % of call_timeout_s), not by the
        # master's answer. Mooncake's own RPC timeout, 30 s by default, would outlast the wait.
        returned = threading.Event()

        def call() -> None:
            with contextlib.suppress(StoreUnavailable):
                store.put_from([fresh], Buffers.of([[(mem.data_ptr(), 4096)]]))
            returned.set()

        threading.Thread(target=call, daemon=True).start()
        assert returned.wait(10 * store.config.call_timeout_s), "the call outlived its bound"
    finally:
        master.resume()
    assert store.get_into([key], Buffers.of([[(mem.data_ptr() + 8192, 4096)]])) == [4096]
    assert store.state is StoreState.READY


@pytest.mark.mooncake
def test_start_without_a_master_returns_at_once_and_connects_later(
    start_mooncake_master: Callable[..., MooncakeMaster], stores: list[MooncakeStore]
) -> None:
    master = start_mooncake_master()
    master.kill()  # keep its free ports, no process
    store = MooncakeStore(
        MooncakeConfig(
            master_address=master.address,
            global_segment_size=16 * MiB,
            reconnect_backoff_s=0.2,
            reconnect_backoff_max_s=0.5,
        )
    )
    master.track(store)
    stores.append(store)
    store.start()
    assert store.state is StoreState.CONNECTING
    with pytest.raises(StoreUnavailable, match="not connected"):
        store.exists(["k"])
    deadline = time.monotonic() + 30
    while store.state is StoreState.CONNECTING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.state is StoreState.DOWN  # the first setup failed; retrying
    master.restart()
    assert store.wait_ready(30)
    assert store.state is StoreState.READY
    assert store.exists(["k"]) == [False]


@pytest.mark.mooncake
def test_a_stopped_master_takes_its_own_log_directory_and_keeps_a_given_one(
    start_mooncake_master: Callable[..., MooncakeMaster], tmp_path: Path
) -> None:
    own = start_mooncake_master()
    logs = own.log_dir
    assert [p.name for p in logs.iterdir()] == [f"master-{own.rpc_port}-1.log"]
    own.stop()
    assert not logs.exists()
    own.restart()  # on the same ports, with a fresh directory
    assert own.running and own.log_dir.is_dir()
    own.stop()
    given = MooncakeMaster(log_dir=str(tmp_path)).start()
    given.stop()
    assert [p.name for p in tmp_path.iterdir()] == [f"master-{given.rpc_port}-1.log"]
