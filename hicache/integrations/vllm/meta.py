"""What the two halves of the connector tell each other, once per engine step.

The scheduler half knows requests and blocks; the worker half owns the HiCache. Everything
crosses vLLM's own channels: `StepMeta` rides in the scheduler's output to every worker, and
`Answers` ride back in each worker's output (vLLM merges the ranks' with `aggregate`). Both are
plain data, pickled by vLLM's executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from hicache.integrations.vllm.view import RankNews


@dataclass(frozen=True)
class Lookup:
    """Ask hicache how much of `tokens` it holds beyond vLLM's `computed` tokens."""

    request_id: str
    tokens: list[int]
    computed: int
    salt: str | bytes | None = None


@dataclass(frozen=True)
class Load:
    """Copy the granted hit into the request's blocks: tokens [computed, hit) of the prompt
    asked about, into ``block_ids[computed // page : hit // page]``. A hit the scheduler
    granted from its view, without asking, carries the prompt (`tokens`, `salt`): the worker
    matches it when it loads."""

    request_id: str
    computed: int
    hit: int
    block_ids: list[int]
    tokens: list[int] | None = None
    salt: str | bytes | None = None


@dataclass(frozen=True)
class Store:
    """The request's KV is now in its blocks for its first `upto` tokens. `new_tokens` extends
    the tokens the worker was sent for this request before (from `sent_before` on). `tail`:
    `upto` ends the prompt's whole pages, so the pages past its last whole group go to the store
    tiers too (`HiCache.store`'s `tail`)."""

    request_id: str
    sent_before: int
    new_tokens: list[int]
    upto: int
    block_ids: list[int]
    salt: str | bytes | None = None
    tail: bool = False


@dataclass
class StepMeta(KVConnectorMetadata):
    """Scheduler -> every worker, for one step: new questions, granted loads, questions closed
    without a load (their pins can go), stores, requests the scheduler has forgotten, and the
    prompt tokens the step computes."""

    lookups: list[Lookup] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    prefill_tokens: int = 0


@dataclass(frozen=True)
class Answer:
    """One rank's answer to a `Lookup`: `hit` tokens (page-aligned, >= computed) of which
    `sources` says how many came from each kind of tier ("host", "disk", "p2p")."""

    request_id: str
    computed: int
    hit: int
    sources: tuple[tuple[str, int], ...] = ()


@dataclass
class Answers(KVConnectorWorkerMetadata):
    """Worker(s) -> scheduler, for one step: the answers of each TP rank, by rank, the requests
    whose stores a worker lost step with (`resync`: send their tokens from the first), and what
    each rank's tiers gained and lost (`news`, for the scheduler's `TierView`)."""

    by_rank: dict[int, list[Answer]] = field(default_factory=dict)
    resync: list[str] = field(default_factory=list)
    news: dict[int, RankNews] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, Answers):
            return self
        merged = {rank: list(answers) for rank, answers in self.by_rank.items()}
        for rank, answers in other.by_rank.items():
            merged.setdefault(rank, []).extend(answers)
        news = dict(self.news)
        for rank, got in other.news.items():
            if rank in news:
                news[rank].merge(got)
            else:
                news[rank] = got
        resync = [*self.resync, *(r for r in other.resync if r not in self.resync)]
        return Answers(merged, resync, news)


REPORTED = (
    "hit_tokens_host", "pages_loaded", "pages_stored", "pages_dropped", "pages_evicted",
)  # fmt: skip
"""The counters of `HiCache.stats` a worker reports to vLLM, besides each store tier's
``hit_tokens_<tier>``."""


@dataclass
class HiCacheStats(KVConnectorStats):
    """hicache's counters for vLLM's periodic "KV Transfer metrics" log line: what changed
    since the last report, summed over the ranks and steps of the interval (`data` maps a
    counter of `HiCache.stats` to its increase)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
