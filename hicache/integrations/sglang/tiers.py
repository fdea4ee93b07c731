"""hicache's store tiers under SGLang's host pool: the three calls SGLang's cache controller
makes (which pages a tier holds, get them into host pages, put host pages), on the
controller's own threads. Imports no SGLang.

Each store tier of the configuration gets what the tier chain gives it under hicache's own
host tier: the store (`hicache.registry`), a `hicache.chain.jobs.JobRunner` that names its
objects under the namespace, writes and checks their headers (checksum, codec) and makes the
store's batch calls straight from and into SGLang's host pool (no copy), and a circuit breaker.
An object is one SGLang page, named by SGLang's page key (a SHA-256 chained over the prompt,
seeded by its namespace: `bytes.fromhex`) under hicache's fingerprint of SGLang's layout.

- `exists`: the leading run of pages the tiers hold, asked tier by tier in walk order: each
  tier for the pages after the run of the tiers before it.
- `get`: the same walk, each tier asked which of the rest it holds and then for those; a page
  counts only where its object arrived whole and verified. Pages a lower tier brought are put
  to the tiers above it whose ``write`` is ``behind`` (promotion), before the call returns:
  SGLang may hand the pages to a request right after.
- `put`: every page to every tier whose ``write`` is ``behind``; a page is stored where every
  such tier took it.

A tier that is not usable (not registered yet, not answering, breaker open) is passed over and
counted; a call that raises is counted and ends that tier's part with nothing. Calls never
raise for a store's failure; they raise ValueError for input SGLang should never give (keys
that are not hex digests, host slots that are not whole pages).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.backends import codec as codecs
from hicache.backends.base import StoreTier, StoreUnavailable
from hicache.backends.breaker import CircuitBreaker
from hicache.chain.jobs import Job, JobRunner
from hicache.config import Layout, StoreTierConfig, tier_name
from hicache.core.keys import fingerprint, store_key
from hicache.integrations.sglang.pool import EnginePages
from hicache.observability.stats import TierStats
from hicache.registry import tier_class

log = logging.getLogger("hicache.sglang")

REGISTER_WAIT_S = 10.0
"""How long the start waits for the tiers to register SGLang's host pool and answer."""
CALLS_KEPT = 4096
"""Calls remembered for SGLang's storage metrics between two of its reads (the oldest go)."""


@dataclass
class Tier:
    """One store tier under SGLang: the store, its job runner and breaker, its counters."""

    name: str
    store: StoreTier
    runner: JobRunner
    write: bool
    """Whether SGLang's stored pages go to this tier (``write: behind``)."""
    breaker: CircuitBreaker
    own_breaker: bool
    prefix: str
    """The names of this namespace's objects begin with it (what a clear drops)."""
    stats: TierStats = field(default_factory=TierStats)
    registered: threading.Event = field(default_factory=threading.Event)
    putting: threading.Lock = field(default_factory=threading.Lock)
    """Held by a put: one at a time (the runner encodes a put's objects into one staging
    memory, and SGLang's backup thread puts while its prefetch thread promotes)."""

    fenced: bool = False
    """A clear could not drop this namespace's objects here: the tier is used no more (until
    a clear succeeds), so that none of them is served."""

    def usable(self) -> bool:
        """Registered, answering, not fenced, and the breaker lets a call through."""
        if self.fenced or not (self.registered.is_set() and self.store.available):
            return False
        return self.breaker.closed or (self.own_breaker and self.breaker.allow())


@dataclass(frozen=True)
class Call:
    """One get or put, for SGLang's storage metrics."""

    kind: str  # "get" | "put"
    pages: int
    seconds: float
    nbytes: int


class StoreTiers:
    """The store tiers of `configs` under SGLang's host pool `pages`, objects named under
    `layout`'s fingerprint. `writer`: whether this rank puts (MLA ranks other than SGLang's
    writer hold the same pages and only read). Starts the tiers (a tier's start error is
    raised as it is: one line) and registers the host pool with them in the background."""

    def __init__(
        self,
        configs: Sequence[StoreTierConfig],
        pages: EnginePages,
        layout: Layout,
        writer: bool = True,
        keep_calls: bool = False,
    ) -> None:
        self.pages = pages
        self.layout = layout
        self.fingerprint = fingerprint(layout)
        self.writer = writer
        self.calls: deque[Call] | None = deque(maxlen=CALLS_KEPT) if keep_calls else None
        """Gets and puts since SGLang last read them (None: SGLang does not ask)."""
        self._lock = threading.Lock()  # the counters: SGLang's threads call at once
        self.tiers: list[Tier] = []
        try:
            for cfg in configs:
                self.tiers.append(self._tier(cfg))
        except BaseException:
            self.close()
            raise
        self._threads = [
            threading.Thread(target=self._register, args=(t,), name=f"hicache-{t.name}-register")
            for t in self.tiers
        ]
        for t in self._threads:
            t.start()

    def rekey(self, layout: Layout) -> None:
        """Name the pages of every call from now on under `layout`'s fingerprint (the weights
        changed in place: pages of the old ones are never read again)."""
        self.layout, self.fingerprint = layout, fingerprint(layout)
        for tier in self.tiers:
            tier.runner.rename(self.fingerprint)

    def _tier(self, cfg: StoreTierConfig) -> Tier:
        store: StoreTier = tier_class(cfg.type)(cfg)
        codec = codecs.for_dtype(self.layout.kv_dtype) if cfg.codec == "lossless" else None
        runner = JobRunner(
            store, self.pages, cfg.key_prefix, self.fingerprint, 1, self.pages.page_tokens,
            False, codec, cfg.codec_threads,
        )  # fmt: skip
        own = store.breaker is None
        breaker = store.breaker or CircuitBreaker(cfg.breaker_failures, cfg.breaker_reprobe_s)
        write = cfg.write == "behind"
        prefix = store_key(cfg.key_prefix, self.fingerprint, b"", None).removesuffix("s/")
        tier = Tier(tier_name(cfg), store, runner, write, breaker, own, prefix)
        store.start()
        return tier

    def _register(self, tier: Tier) -> None:
        """Register SGLang's host pool and the runner's memory with the tier (registering
        tens of GiB for RDMA takes seconds); the tier is used once this is done."""
        try:
            for memory in (self.pages.memory, *tier.runner.memory()):
                tier.store.register(memory)
        except Exception as err:  # the tier stays unused; SGLang goes on without it
            log.error("hicache tier %s: registering SGLang's host pool failed: %r", tier.name, err)
            return
        tier.registered.set()

    def wait_ready(self, timeout_s: float = REGISTER_WAIT_S) -> bool:
        """Wait until every tier has registered the pool and answers; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        while not all(t.registered.is_set() and t.store.available for t in self.tiers):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # -- SGLang's calls ---------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading pages of `keys` the tiers hold, walking them in order."""
        ends = page_keys(keys)
        held = 0
        for tier in self.tiers:
            if held == len(ends):
                break
            held += self._leading(tier, ends[held:])
        return held

    def get(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Read the pages of `keys` into SGLang's host pages `host_indices` (``page_size`` slots
        a page): True for the leading pages that arrived whole and verified, False from the
        first that did not on (its bytes and those after it are not to be used)."""
        ends = page_keys(keys)
        slots = self.pages.slots(host_indices, len(ends))
        start = time.perf_counter()
        got = 0
        for i, tier in enumerate(self.tiers):
            if got == len(ends):
                break
            held = self._leading(tier, ends[got:])
            if not held:
                continue
            arrived = self._get(tier, ends[got : got + held], slots[got : got + held])
            if arrived:
                self._promote(i, ends[got : got + arrived], slots[got : got + arrived])
            got += arrived
        self._record("get", got, start)
        return [True] * got + [False] * (len(ends) - got)

    def put(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Write SGLang's host pages `host_indices` under `keys` to every tier whose ``write``
        is ``behind``: True where every such tier took the page. A rank that is not a writer
        puts nothing and answers True (the writer rank stores these very pages)."""
        ends = page_keys(keys)
        slots = self.pages.slots(host_indices, len(ends))
        if not self.writer or not ends:
            return [True] * len(ends)
        start = time.perf_counter()
        stored = [True] * len(ends)
        for tier in self.tiers:
            if tier.write:
                for j, ok in enumerate(self._put(tier, ends, slots)):
                    stored[j] = stored[j] and ok
        self._record("put", sum(stored), start)
        return stored

    def clear(self) -> dict[str, int | str]:
        """Drop every object of this namespace from each tier that SGLang's pages are written
        to (``write: behind``), its puts held meanwhile: per tier the objects dropped, or why
        none were. A tier that could not drop them is fenced (`Tier.fenced`) until a later
        clear drops them there."""
        out: dict[str, int | str] = {}
        for tier in self.tiers:
            if not tier.write:
                continue
            with tier.putting:
                try:
                    out[tier.name] = tier.store.drop_prefix(tier.prefix)
                except Exception as err:  # NotImplementedError, StoreUnavailable, OSError
                    tier.fenced = True
                    out[tier.name] = str(err).strip().splitlines()[0] or type(err).__name__
                else:
                    tier.fenced = False
        return out

    # -- one tier ---------------------------------------------------------------------------------

    def _leading(self, tier: Tier, ends: list[bytes]) -> int:
        """How many leading pages of `ends` `tier` holds (0 where it is not usable)."""
        if not tier.usable():
            self._count(tier, skipped_down=1)
            return 0
        answer = self._call(tier, Job("probe", ends=ends), "hicache_tier_exists_seconds")
        if answer is None:
            return 0
        held = 0
        for found in answer:
            if not found:
                break
            held += 1
        return held

    def _get(self, tier: Tier, ends: list[bytes], slots: list[int]) -> int:
        """Get the pages `ends` from `tier` into host pages `slots`; how many leading ones
        arrived whole and verified."""
        job = Job("get", ends=ends, page_slots=slots)
        codes = self._call(tier, job, "hicache_tier_get_seconds")
        self._count(tier, fetches=1, corrupt=job.corrupt)
        if codes is None:
            self._count(tier, get_failed=len(ends))
            return 0
        size = self.pages.page_bytes
        arrived = 0
        for code in codes:
            if code != size:
                break
            arrived += 1
        P = self.pages.page_tokens
        self._count(
            tier, pages_fetched=arrived, get_bytes=arrived * size, hit_tokens=arrived * P,
            get_failed=sum(1 for c in codes if c != size),
        )  # fmt: skip
        return arrived

    def _put(self, tier: Tier, ends: list[bytes], slots: list[int]) -> list[bool]:
        """Put host pages `slots` under `ends` to `tier`: which it took."""
        if not tier.usable():
            self._count(tier, puts_skipped=len(ends))
            return [False] * len(ends)
        job = Job("put", ends=ends, page_slots=slots)
        with tier.putting:
            codes = self._call(tier, job, "hicache_tier_put_seconds")
        if codes is None:
            self._count(tier, put_failed=len(ends))
            return [False] * len(ends)
        ok = [c == 0 for c in codes]
        n = sum(ok)
        size = self.pages.page_bytes
        self._count(tier, objects_put=n, put_bytes=n * size, put_failed=len(ok) - n)
        return ok

    def _promote(self, below: int, ends: list[bytes], slots: list[int]) -> None:
        """Put pages tier `below` brought to the writing tiers above it."""
        if not self.writer:
            return
        for tier in self.tiers[:below]:
            if tier.write:
                self._put(tier, ends, slots)

    def _call(self, tier: Tier, job: Job, latency: str) -> Any:
        """Run `job` on `tier`: its answer, or None where the call failed (counted; the
        tier's breaker told)."""
        start = time.perf_counter()
        try:
            out = tier.runner.run(job)
        except Exception as err:
            if not isinstance(err, StoreUnavailable):
                log.warning("hicache tier %s: %s failed: %r", tier.name, job.kind, err)
            if tier.own_breaker:
                tier.breaker.record_failure()
            self._count(tier, call_errors=1)
            return None
        if tier.own_breaker:
            tier.breaker.record_success()
        with self._lock:
            tier.stats.latency[latency].observe(time.perf_counter() - start)
        return out

    def _count(self, tier: Tier, **added: int) -> None:
        with self._lock:
            for name, n in added.items():
                setattr(tier.stats, name, getattr(tier.stats, name) + n)

    def _record(self, kind: str, pages: int, start: float) -> None:
        if self.calls is not None and pages:
            seconds = time.perf_counter() - start
            self.calls.append(Call(kind, pages, seconds, pages * self.pages.page_bytes))

    # -- stats and the end ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Each tier's counters (``<counter>_<tier>``, `TierStats`) and whether it is
        available now (``available_<tier>``): the keys hicache's metrics export."""
        out: dict[str, int] = {}
        with self._lock:
            for t in self.tiers:
                out.update(t.stats.as_dict(t.name))
                up = t.registered.is_set() and t.store.available and t.breaker.closed
                out[f"available_{t.name}"] = int(up)
        return out

    def histograms(self) -> dict[str, dict[str, Any]]:
        """Each tier's latency histograms, as `hicache.observability.metrics` takes them."""
        out = {}
        with self._lock:
            for t in self.tiers:
                for name, h in t.stats.latency.items():
                    out[f"{name}:{t.name}"] = {
                        **h.snapshot(), "family": name, "labels": {"tier": t.name},
                    }  # fmt: skip
        return out

    def close(self) -> None:
        """Close every tier (after SGLang's threads have stopped). Blocks."""
        for t in getattr(self, "_threads", ()):
            t.join()
        for tier in self.tiers:
            tier.runner.close()
            tier.store.close()
        self.tiers = []


def page_keys(keys: Sequence[str]) -> list[bytes]:
    """SGLang's page keys (hex digests) as the bytes hicache names objects by; ValueError
    naming the first that is not one."""
    out = []
    for key in keys:
        try:
            out.append(bytes.fromhex(key))
        except (ValueError, TypeError):
            out.append(b"")
        if not out[-1]:
            raise ValueError(f"hicache: SGLang's page key {key!r} is not a hex digest")
    return out
