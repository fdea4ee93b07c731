"""The scheduler's own look into a store tier that any process can ask (`StoreProbe`).

vLLM's scheduler holds no pages, and its view of the workers' tiers (`TierView`) cannot tell
what a shared store tier holds: other instances write it. Where the config's one store tier
says it answers existence cheaply from any process (`StoreTier.exists_from_any_process`:
Mooncake), the scheduler keeps a client of that tier of its own and asks it, in one batched
`exists`, which of a prompt's next page groups (and its tail) it holds. The scheduler waits
for the answer at most `wait_s`: a call still out then is left to finish on the probe's
thread, and the question goes to the workers as before (no second probe is sent while one is
out).

An answer is a claim, checked when the worker loads: an object gone by then is a load error
that vLLM recomputes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from hicache.backends.base import StoreTier
from hicache.config import HiCacheConfig, StoreTierConfig, TenantConfig
from hicache.core.keys import KeyChain, store_key
from hicache.core.shares import owners
from hicache.core.span import Span
from hicache.registry import tier_class

log = logging.getLogger("hicache.vllm")


class StoreProbe:
    """A client of the config's store tier in the scheduler process, asked with a bounded wait.

    Make it with `for_config` (None where the config has no such tier). `groups` names a
    prompt's groups as the workers' tier chain names them; `exists` asks the tier."""

    def __init__(
        self,
        tier: StoreTier,
        config: StoreTierConfig,
        wait_s: float,
        tenants: Sequence[TenantConfig] = (),
    ) -> None:
        self._tier = tier
        self._tenants = tuple(tenants)
        self._owners: tuple[bytes, dict[bytes, str]] = (b"", {})  # of the last fingerprint
        self.group_pages = config.group_pages
        self._prefix = tier.object_prefix(config.key_prefix, config.codec)
        self._wait_s = wait_s
        self._out: Future[list[bool]] | None = None
        self._lock = threading.Lock()
        self.answered = 0
        """Probes answered within the wait."""
        self.late = 0
        """Probes not answered within it (or not sent: the tier down, or a probe still out)."""
        tier.start()

    @classmethod
    def for_config(cls, config: HiCacheConfig, wait_s: float) -> StoreProbe | None:
        """A probe of the config's store tier: only where it has exactly one, and that tier
        answers existence from any process (with more tiers, a walk down them could bring pages
        a probe of one does not see, and the workers are asked)."""
        stores = config.tiers[1:]
        if len(stores) != 1 or not isinstance(stores[0], StoreTierConfig):
            return None
        cls_ = tier_class(stores[0].type)
        if not getattr(cls_, "exists_from_any_process", False):
            return None
        return cls(cls_(stores[0]), stores[0], wait_s, config.tenants)

    def objects(
        self, fingerprint: bytes, chain: KeyChain, host_pages: int, cap: int
    ) -> tuple[Span, list[str]]:
        """The objects a worker's fetch would ask for past a host hit of `host_pages` pages,
        capped at page `cap` (`hicache.chain.fetch.Fetcher.start`): their span and names, each
        named by its last page's key under the request's tenant (`store_key`)."""
        G = self.group_pages
        span = Span.of(host_pages, cap, chain.pages, G)
        if not span.objects:
            return span, []
        keys = chain.hash_to(span.first_page + span.pages_of(span.objects))
        sizes = [G] * span.groups + ([span.tail] if span.tail else [])
        if self._owners[0] != fingerprint:
            self._owners = fingerprint, owners(self._tenants, fingerprint)
        tenant = self._owners[1].get(chain.seed, "")
        names = [
            store_key(self._prefix, fingerprint, keys[end], size, tenant)
            for end, size in zip(span.ends(), sizes)
        ]
        return span, names

    def exists(self, names: Sequence[str]) -> list[bool] | None:
        """Which objects the tier holds, or None where it did not answer within the wait (or
        is down, or an earlier probe is still out)."""
        if not names:
            return []
        with self._lock:
            if not self._tier_available() or (self._out is not None and not self._out.done()):
                self.late += 1
                return None
            out = self._out = Future()
        names = list(names)

        def ask() -> None:
            try:
                out.set_result(self._tier.exists(names))
            except BaseException as err:  # whatever the tier raises: a probe not answered
                out.set_exception(RuntimeError(f"the tier raised {err!r}"))

        threading.Thread(target=ask, name="hicache-probe", daemon=True).start()
        try:
            got = out.result(timeout=self._wait_s)
        except FutureTimeout:
            self.late += 1
            return None
        except Exception as err:  # any failure of the tier: the workers are asked
            log.debug("hicache: store probe failed: %s", err)
            self.late += 1
            return None
        self.answered += 1
        return got

    def _tier_available(self) -> bool:
        """The tier's `available`; one that raises reads as down (the scheduler never sees
        the exception)."""
        try:
            return bool(self._tier.available)
        except Exception as err:
            log.debug("hicache: the store tier's available raised %r", err)
            return False

    def close(self) -> None:
        self._tier.close()
