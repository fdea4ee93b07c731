"""The Mooncake tier: a blocking, batched client of Mooncake Store.

`MooncakeStore` is called by the tier chain's worker threads only, never by the engine thread. Every
call is one batched Mooncake call, made on the caller's thread (no hand-off to another thread:
on the H200's host that hop cost ~0.3 ms a call).

What happens when things fail (the contract the chain's workers rely on):

- `start()` returns at once. A background thread runs Mooncake's ``setup()`` and retries it with
  exponential backoff while the master is absent; until it succeeds `state` is ``connecting``
  (first attempt) or ``down`` (after a failed attempt), and every call raises `StoreUnavailable`.
- Per-key outcomes are integers in the returned list (`StoreCode`): a missing key, a full store or
  a failed transfer of one object is never an exception.
- A call that gets no answer from the master raises `StoreUnavailable`: the master is unreachable
  (every key came back ``RPC_FAIL``/``RPC_TIMEOUT``) or the breaker is open. Such calls count as
  breaker failures; after `breaker_failures` in a row the breaker opens and calls are refused at
  once. While it is open a background monitor probes the master every `breaker_reprobe_s` (a
  caller may also be the probe), and the first answered call closes it again.
- A call returns when Mooncake returns it: within about 4.3 s when the master's port refuses
  connections, and within ``MC_RPC_TIMEOUT_MS`` (set to 80 % of `call_timeout_s`) when the master
  stalls. A watchdog counts every call still running after `call_timeout_s` as a breaker failure
  at that moment, so that a hanging store reads unavailable (and is offered no more work) while
  the call is still out. The caller's buffers are Mooncake's until the call returns.
- A master restarted on the same address is found again by Mooncake's own client (it remounts
  this client's segment); the objects the old master knew are gone.

Bad arguments (pieces outside registered memory, mismatched lengths) raise ValueError/TypeError.
Mooncake is imported in `start()`, so this module (and its config) loads without it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hicache import threads
from hicache.backends.base import Buffers, StoreTier, StoreUnavailable
from hicache.backends.breaker import BreakerState, CircuitBreaker
from hicache.backends.mooncake.codes import UNREACHABLE, StoreState, StoreStats, code_name
from hicache.backends.mooncake.config import SHOW_NATIVE_LOG, MooncakeConfig
from hicache.backends.regions import Region, Regions, check_keys
from hicache.config import Layout
from hicache.registry import register_tier

log = logging.getLogger(__name__)

_open: weakref.WeakSet[MooncakeStore] = weakref.WeakSet()
"""Stores started and not closed (see `_close_at_exit`)."""


@atexit.register
def _close_at_exit(timeout_s: float = 5.0) -> None:
    """At interpreter exit, close the stores the process left open (each bounded by
    `timeout_s`): a Mooncake client torn down with its threads still running aborts the
    process (std::terminate)."""
    for store in list(_open):
        store.close(timeout_s)


T = TypeVar("T")

# -- environment ---------------------------------------------------------------------------------


def _quiet_native_log() -> None:
    """Keep Mooncake's own log lines (glog, written to stderr: "Logging before
    InitGoogleLogging()", and ``E… Local segment descriptor not found`` in runs that succeed)
    off the embedding process's stderr: hicache reports what matters through its own logger and
    stats. Left alone where the operator asked for them (`SHOW_NATIVE_LOG`, or Mooncake's own
    MC_LOG_LEVEL). glog ignores its GLOG_* variables here and Mooncake sets its level from
    MC_LOG_LEVEL when it loads, so the level is set in the loaded glog itself (every later
    message is dropped, fatal ones excepted)."""
    if os.environ.get(SHOW_NATIVE_LOG, "0") != "0" or "MC_LOG_LEVEL" in os.environ:
        return
    try:
        with open("/proc/self/maps") as maps:
            lib = next(
                (line.split()[-1] for line in maps if "libglog" in line.rsplit("/", 1)[-1]),
                None,
            )
        if lib is None:
            return
        level = ctypes.c_int.in_dll(ctypes.CDLL(lib), "_ZN3fLI17FLAGS_minloglevelE")
    except (OSError, ValueError):  # not Linux, or a glog built otherwise: leave it
        return
    level.value = 3  # FATAL


_ENV_LOCK = threading.Lock()
_ENV_OURS: set[str] = set()


def _apply_env(values: dict[str, str]) -> None:
    """Set Mooncake's MC_* variables for the next setup, unless the operator set them.

    The variables are process-wide; a variable found in the environment before hicache first
    touched it is the operator's and is left as it is. Call with _ENV_LOCK held.
    """
    for name, value in values.items():
        if name in os.environ and name not in _ENV_OURS:
            continue
        os.environ[name] = value
        _ENV_OURS.add(name)


# -- the client ----------------------------------------------------------------------------------


@dataclass
class _Call:
    """A Mooncake call out now (for the watchdog)."""

    started: float
    overdue: bool = False
    """Counted as a breaker failure by the watchdog already."""


@register_tier("mooncake", MooncakeConfig)
class MooncakeStore(StoreTier):
    """Batched, blocking client of one Mooncake Store. Thread-safe; call from worker threads.

    `layout` is accepted for the same constructor as the other tiers and is not used.
    """

    shared = True
    persistent = True
    exists_from_any_process = True  # one batched RPC to the master
    missing_code = -704  # StoreCode.OBJECT_NOT_FOUND (defined below)
    read_gbps = 4.0  # batched gets of 32 x 512 KiB over loopback TCP, H200 host (bench/results)
    prefix_with_codec = True  # a get then asks the master for the objects' sizes first

    def __init__(
        self,
        config: MooncakeConfig,
        layout: Layout | None = None,
        *,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        """`client_factory` makes the raw client (default: Mooncake's MooncakeDistributedStore);
        tests pass a stand-in with the same methods."""
        if not isinstance(config, MooncakeConfig):
            raise TypeError(f"config must be a MooncakeConfig, got {type(config).__name__}")
        self.config = config
        self.layout = layout
        self.reads_prefix = config.codec != "none"
        """With a codec, a get reads each object into the front of its pieces: it asks the
        master for the objects' sizes first (one batched call), as Mooncake reads an object
        only into pieces of its exact size."""
        self._cpus = threads.check_cpus(config.worker_cpus)  # of every thread this store starts
        self._client_factory = client_factory
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._client: Any = None
        self._closing = False
        self._started = False
        self._failed_setups = 0
        self._setups = 0
        self._memory: Regions[None] = Regions()
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_reprobe_s)
        self._running: dict[int, _Call] = {}  # calls out now, by id; under _lock
        self._drained = threading.Condition(self._lock)  # closing, and no call is out
        self._thread: threading.Thread | None = None
        self._replicate: Any = None
        self._counts = dict.fromkeys(
            (
                "calls",
                "timeouts",
                "unreachable",
                "refused",
                "keys_put",
                "keys_got",
                "bytes_put",
                "bytes_got",
            ),
            0,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Begin connecting on a background thread and return at once (idempotent)."""
        with self._lock:
            if self._closing:
                raise RuntimeError("MooncakeStore.start after close")
            if self._started:
                return
            self._started = True
            _open.add(self)
            # Mooncake's own threads, made by its client's setup on this thread, inherit its CPUs
            self._thread = threads.start(self._run, "hicache-mooncake-connect", self._cpus)

    @property
    def available(self) -> bool:
        """Connected and the breaker closed: calls are expected to be answered now. Takes no
        lock (the engine thread reads it); a change made a moment ago may not show yet."""
        return self._client is not None and not self._closing and self._breaker.closed

    @property
    def state(self) -> StoreState:
        """connecting / ready / down / closed (see the module docstring)."""
        with self._lock:
            if self._closing:
                return StoreState.CLOSED
            if self._client is None:
                return StoreState.DOWN if self._failed_setups else StoreState.CONNECTING
        if self._breaker.state is BreakerState.CLOSED:
            return StoreState.READY
        return StoreState.DOWN

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the first setup has succeeded or `timeout_s` passed; True if connected.

        For tools and tests; the cache itself never waits for the store.
        """
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self._client is None and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return self._client is not None and not self._closing

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop reconnecting, wait for calls in flight, close the Mooncake client.

        Blocks up to about `timeout_s` (Mooncake's close takes 1-2.5 s with the master up and
        10-15 s with it gone). Returns True if everything ended within it; otherwise the rest
        ends on a daemon thread that keeps the registered memory alive until then.
        """
        deadline = time.monotonic() + timeout_s
        with self._wake:
            if self._closing:
                return True
            self._closing = True
            _open.discard(self)
            client, self._client = self._client, None
            regions = self._memory.all()
            self._wake.notify_all()
        thread = self._thread

        def finish() -> None:
            if thread is not None:
                thread.join()
            with self._drained:  # no Mooncake call may be out on the client it closes
                while self._running:
                    self._drained.wait()
            if client is not None:
                rc = client.close()
                if rc != 0:
                    log.warning("mooncake close returned %s", code_name(rc))
            del regions[:]

        closer = threads.start(finish, "hicache-mooncake-close", self._cpus)
        closer.join(max(0.0, deadline - time.monotonic()))
        return not closer.is_alive()

    def _run(self) -> None:
        """Background thread: connect with backoff, start the watchdog, then probe while the
        breaker is open."""
        delay = self.config.reconnect_backoff_s
        while True:
            with self._lock:
                if self._closing:
                    return
            client = self._setup_once()
            with self._wake:
                if client is not None and not self._closing:
                    self._client = client
                    self._breaker.reset()
                    self._wake.notify_all()
                    break
                if client is None:
                    self._failed_setups += 1
                    self._wake.wait(delay)
                    delay = min(delay * 2, self.config.reconnect_backoff_max_s)
                    continue
            client.close()  # closed while connecting
            return
        # calls can be made from now on: watch them
        threads.start(self._watch, "hicache-mooncake-watchdog", self._cpus)
        while True:
            with self._wake:
                if not self._closing:  # a close before this wait must not be slept through
                    self._wake.wait(self.config.breaker_reprobe_s)
                if self._closing:
                    return
            if self._breaker.state is not BreakerState.CLOSED:
                with contextlib.suppress(StoreUnavailable):
                    self.exists([f"{self.config.key_prefix}/probe"])

    def _setup_once(self) -> Any:
        """One Mooncake setup with all registered memory; the client, or None on failure."""
        cfg = self.config
        env = {
            "MC_STORE_CLIENT_SETUP_RETRIES": str(cfg.setup_retries),
            # Mooncake ends a stalled master RPC by itself, a little before the watchdog would
            # count the call as overdue.
            "MC_RPC_TIMEOUT_MS": str(max(1, math.floor(cfg.call_timeout_s * 800))),
            "MC_RPC_CONNECT_TIMEOUT_MS": str(max(1, math.floor(cfg.call_timeout_s * 800))),
        }
        if cfg.protocol == "tcp":
            env["MC_TCP_BIND_ADDRESS"] = cfg.local_hostname.rsplit(":", 1)[0]
        if self._client_factory is None:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig

            _quiet_native_log()

            if self._replicate is None:
                rep = ReplicateConfig()
                rep.replica_num = cfg.replicas
                self._replicate = rep
            client = MooncakeDistributedStore()
        else:
            client = self._client_factory()
        with _ENV_LOCK:
            _apply_env(env)
            self._setups += 1
            rc = client.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_size,
                cfg.local_buffer_size,
                cfg.protocol,
                cfg.device_names,
                cfg.master_address,
            )
        if rc != 0:
            # A client whose setup failed must not be used again (calls on it crash); close
            # is safe and frees its ports.
            log.warning("mooncake setup with master %s failed: %s", cfg.master_address, rc)
            client.close()
            return None
        for r in self._memory.all():
            self._register_raw(client, r)
        return client

    # -- memory ------------------------------------------------------------------------------

    def register(self, memory: object) -> None:
        """Register a contiguous CPU tensor (a pinned host pool) for zero-copy transfers.

        The store keeps a reference to it until `close`; it is registered again with every new
        connection. Registering the same tensor twice is a no-op; overlapping regions are refused.
        """
        region = self._memory.add(memory, None)
        if region is None:
            return
        client = self._client
        if client is not None:
            self._register_raw(client, region)

    @staticmethod
    def _register_raw(client: Any, region: Region[None]) -> None:
        rc = client.register_buffer(region.start, region.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer of {region.nbytes} bytes failed: {rc}")

    # -- calls -------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the store holds, in one batched call. A key whose own query failed reads
        as absent. Reading a key gives it a lease (10 s by default) that protects it from
        eviction and removal, so a get right after this finds it."""
        keys = check_keys(keys)
        if not keys:
            return []
        codes = self._call("exists", lambda c: c.batch_is_exist(keys), len(keys))
        return [c == 1 for c in codes]

    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """Read each object into its pieces; per key the bytes read or a negative `StoreCode`.

        The pieces of a key must add up to the object's exact size (larger: TRANSFER_FAIL,
        smaller: INVALID_PARAMS), unless `reads_prefix`: then an object smaller than its pieces
        is read into their front; a missing key is OBJECT_NOT_FOUND.
        """
        keys = check_keys(keys)
        self._memory.check(keys, buffers)
        if not keys:
            return []
        ptrs, sizes = buffers.ptrs, buffers.sizes
        if self.reads_prefix:
            ptrs, sizes = _fit(ptrs, sizes, self._sizes(keys))
        codes = self._call(
            "get_into", lambda c: c.batch_get_into_multi_buffers(keys, ptrs, sizes), len(keys)
        )
        got = [c for c in codes if c > 0]
        with self._lock:
            self._counts["keys_got"] += len(got)
            self._counts["bytes_got"] += sum(got)
        return codes

    def _sizes(self, keys: list[str]) -> list[int]:
        """The size of each object from its first replica, 0 where the master knows none (one
        batched call to the master)."""

        def ask(client: Any) -> list[int]:
            found = client.batch_get_replica_desc(keys)
            return [_replica_size(found.get(key) or ()) for key in keys]

        return self._call("sizes", ask, len(keys))

    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """Write each object from its pieces; per key OK or a negative `StoreCode`.

        A key that exists already is left as it is and reads OK (objects are named by content).
        NO_SPACE means no segment had room now; the object is simply not stored.
        """
        keys = check_keys(keys)
        self._memory.check(keys, buffers)
        if not keys:
            return []
        ptrs, sizes, rep = buffers.ptrs, buffers.sizes, self._replicate
        codes = self._call(
            "put_from",
            lambda c: c.batch_put_from_multi_buffers(keys, ptrs, sizes, rep),
            len(keys),
        )
        done = [sum(s) for c, s in zip(codes, sizes, strict=True) if c == 0]
        with self._lock:
            self._counts["keys_put"] += len(done)
            self._counts["bytes_put"] += sum(done)
        return codes

    def remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """Remove objects; per key OK, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE (read recently; pass
        `force` to remove anyway) or another negative code."""
        keys = check_keys(keys)
        if not keys:
            return []
        return self._call("remove", lambda c: c.batch_remove(keys, force), len(keys))

    def discard(self, keys: Sequence[str]) -> None:
        """Remove `keys` at the master (leases overridden), for every client at once."""
        self.remove(keys, force=True)

    def drop_prefix(self, prefix: str) -> int:
        """Remove every object of the store whose key starts with `prefix` (leases overridden:
        the master forgets them for every client at once); how many were removed."""
        pattern = "^" + re.escape(prefix)
        (code,) = self._call("drop", lambda c: [c.remove_by_regex(pattern, True)], 1)
        if code < 0:
            raise StoreUnavailable(f"mooncake drop: {code_name(code)}")
        return code

    def _call(self, op: str, fn: Callable[[Any], list[int]], n: int) -> list[int]:
        """Run one batched Mooncake call on this thread, watched (see `_watch`)."""
        client = self._client
        if client is None:
            raise StoreUnavailable(f"mooncake {op}: not connected (state {self.state.value})")
        if not self._breaker.allow():
            with self._lock:
                self._counts["refused"] += 1
            raise StoreUnavailable(f"mooncake {op}: breaker open after repeated failures")
        call = _Call(time.monotonic())
        with self._lock:
            if self._closing:
                self._breaker.record_success()  # not the master's fault; free the probe slot
                raise StoreUnavailable(f"mooncake {op}: store is closing")
            self._counts["calls"] += 1
            self._running[id(call)] = call
        try:
            codes = list(map(int, fn(client)))
        except BaseException:
            if not call.overdue:  # the watchdog counted an overdue call already
                self._breaker.record_failure()
            raise
        finally:
            with self._lock:
                del self._running[id(call)]
                if self._closing and not self._running:
                    self._drained.notify_all()
        if len(codes) != n:
            self._breaker.record_failure()
            raise StoreUnavailable(f"mooncake {op}: {len(codes)} results for {n} keys")
        # every code >= 0 (the usual case): one pass in C, no scan for the unreachable ones
        unreachable = 0 if min(codes, default=0) >= 0 else sum(c in UNREACHABLE for c in codes)
        if unreachable:
            if not call.overdue:
                self._breaker.record_failure()
            with self._lock:
                self._counts["unreachable"] += 1
            if unreachable == n:
                raise StoreUnavailable(f"mooncake {op}: master unreachable ({code_name(codes[0])})")
        else:
            self._breaker.record_success()
        return codes

    def _watch(self) -> None:
        """Background thread: a call still out `call_timeout_s` after it began counts as one
        breaker failure (and one timeout) at once, while it runs, so that a hanging store opens
        its breaker and is offered no more work without waiting for Mooncake to give up."""
        limit = self.config.call_timeout_s
        while True:
            with self._wake:
                self._wake.wait(limit / 4)
                if self._closing:
                    return
                now = time.monotonic()
                late = [
                    c for c in self._running.values() if not c.overdue and now - c.started > limit
                ]
                for call in late:
                    call.overdue = True
                self._counts["timeouts"] += len(late)
            for _ in late:
                self._breaker.record_failure()

    # -- stats -------------------------------------------------------------------------------

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker guarding the calls (read its state and counters)."""
        return self._breaker

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        state = self.state
        with self._lock:
            c = dict(self._counts)
            setups, failed = self._setups, self._failed_setups
        return StoreStats(
            state=state,
            setups=setups,
            setup_failures=failed,
            breaker=self._breaker.stats(),
            **c,
        )


def _replica_size(replicas: Sequence[Any]) -> int:
    """An object's size from its replica descriptors (Mooncake's), 0 where none tells it."""
    for replica in replicas:
        if replica.is_memory_replica():
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
        if replica.is_disk_replica():
            return int(replica.get_disk_descriptor().object_size)
    return 0


def _fit(
    ptrs: list[list[int]], sizes: list[list[int]], objects: list[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """The pieces cut to the objects' sizes (`objects`): the front of each object's pieces that
    holds exactly its bytes. An object of size 0 (unknown) or larger than its pieces keeps them
    all (its get then fails, as Mooncake reads only into an exact size)."""
    fit_ptrs, fit_sizes = [], []
    for obj_ptrs, obj_sizes, size in zip(ptrs, sizes, objects, strict=True):
        if not 0 < size < sum(obj_sizes):
            fit_ptrs.append(obj_ptrs)
            fit_sizes.append(obj_sizes)
            continue
        cut_ptrs, cut_sizes = [], []
        for ptr, piece in zip(obj_ptrs, obj_sizes):
            cut_ptrs.append(ptr)
            cut_sizes.append(min(piece, size))
            size -= cut_sizes[-1]
            if not size:
                break
        fit_ptrs.append(cut_ptrs)
        fit_sizes.append(cut_sizes)
    return fit_ptrs, fit_sizes
