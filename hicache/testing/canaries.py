"""Defects put back at run time (`--canary NAME`), to show that the simulation finds each class.

Each canary patches the real code for the duration of a run and restores it after, and names
the violation it must cause (`EXPECT`, a regular expression over the simulation's error): a
canary caught for another reason (its patch raising, say) is not caught."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Install = Callable[[], Callable[[], None]]
"""Puts a defect in place; returns the function that takes it out again."""

CANARIES: dict[str, Install] = {}
EXPECT: dict[str, str] = {}
"""The violation each canary must cause: a regular expression its error matches."""


def canary(name: str, expect: str) -> Callable[[Install], Install]:
    def wrap(install: Install) -> Install:
        CANARIES[name] = install
        EXPECT[name] = expect
        return install

    return wrap


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    undo = CANARIES[name]()
    try:
        yield
    finally:
        undo()


ABSENT = object()
"""What `PATCHED` records for an attribute its owner did not hold itself (inherited)."""
PATCHED: list[tuple[object, str, object]] = []
"""(owner, attribute, what the owner held before) of every patch made (tests read it)."""


def _patch(owner: object, attr: str, value: object) -> Callable[[], None]:
    """Set `owner.attr` to `value`; the function that puts back exactly what the owner held (a
    staticmethod as a staticmethod; an inherited attribute by deleting the owner's own)."""
    old = vars(owner).get(attr, ABSENT)
    PATCHED.append((owner, attr, old))
    setattr(owner, attr, value)
    if old is ABSENT:
        return lambda: delattr(owner, attr)
    return lambda: setattr(owner, attr, old)


@canary("pin-not-released", r"lease of \d+ host slots was dropped holding its pins")
def _pin_not_released() -> Callable[[], None]:
    """`release` forgets the request but keeps what its match pinned."""
    from hicache.match import Matcher

    def release(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.fetch is not None and self._chain is not None:
            self._chain.forget(req.fetch)

    return _patch(Matcher, "release", release)


@canary(
    "publish-before-copy",
    r"put read host slot\(s\) of \w+ before their copy|has wrong bytes \(read before its copy"
    r"|put of \w+: its header's checksum or length is wrong",  # its bytes changed under it
)
def _publish_before_copy() -> Callable[[], None]:
    """Write-behind puts do not wait for the GPU -> host copy of their pages."""
    from hicache.chain.walk import TierChain
    from hicache.kernels.completions import DONE

    stored = TierChain.stored

    def eager(self, keys, ready, *args, **kwargs):  # type: ignore[no-untyped-def]
        return stored(self, keys, DONE, *args, **kwargs)

    return _patch(TierChain, "stored", eager)


@canary("keep-caller-array", r"got key \w+, which names another page")
def _keep_caller_array() -> Callable[[], None]:
    """The prefix memo keeps the caller's token array (which the engine reuses) after release."""
    from hicache.match import Matcher
    from hicache.store import WriteThrough

    match, store, release = Matcher.match, WriteThrough.store, Matcher.release
    callers: dict[tuple[int, str], object] = {}
    """The caller's arrays, by (the cache's request table, request): the matcher and the
    write-through share that table."""

    def matched(self, request_id, tokens, **kwargs):  # type: ignore[no-untyped-def]
        callers[id(self.requests), request_id] = tokens
        return match(self, request_id, tokens, **kwargs)

    def stored(self, request_id, tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        callers[id(self._requests), request_id] = tokens
        return store(self, request_id, tokens, *args, **kwargs)

    def released(self, request_id):  # type: ignore[no-untyped-def]
        req = self.requests.get(request_id)
        caller = callers.pop((id(self.requests), request_id), None)
        held = req.chain.tokens if req is not None else None
        ours = held is not None and isinstance(caller, type(held)) and caller.dtype == held.dtype
        if ours and caller.shape[0] >= held.shape[0]:  # the memo keeps the caller's own array
            req.chain.tokens = caller[: held.shape[0]]
        return release(self, request_id)

    undo = [
        _patch(Matcher, "match", matched),
        _patch(WriteThrough, "store", stored),
        _patch(Matcher, "release", released),
    ]
    return lambda: [u() for u in undo] and None


@canary(
    "short-codes-accepted",
    r"^(IndexError|TypeError|ValueError) in .*\((fetch|writes|link)\.py:\d+\)$",
)
def _short_codes_accepted() -> Callable[[], None]:
    """A store's answer is used whatever its length or type (the worker checks nothing)."""
    from hicache.chain import jobs

    return _patch(jobs, "_answer", lambda out, job: out)


def _salt_patch(salt: Callable[..., str | None]) -> Callable[[], None]:
    from hicache.integrations.vllm import scheduler

    return _patch(scheduler, "request_salt", salt)


@canary("lora-not-in-key", r"got key \w+, which names another page")
def _lora_not_in_key() -> Callable[[], None]:
    """The LoRA adapter is left out of the namespace: two adapters share pages."""
    from hicache.core.keys import namespace

    return _salt_patch(lambda request: namespace(salt=request.cache_salt))


@canary("raw-salt-namespace", r"got key \w+, which names another page")
def _raw_salt_namespace() -> Callable[[], None]:
    """A request without an adapter has its raw cache_salt as its namespace: a client's salt
    can spell an adapter's namespace."""
    from hicache.integrations.vllm import inputs

    encode = inputs.namespace

    def raw(**fields):  # type: ignore[no-untyped-def]
        if set(k for k, v in fields.items() if v is not None) == {"salt"}:
            return fields["salt"].encode()
        return encode(**fields)

    return _patch(inputs, "namespace", raw)


@canary(
    "failed-load-stored",
    r"host slot \d+ holds other bytes than its key|put of group \w+: page \d+ of \d+ has wrong"
    r"|page \d+ loaded wrong bytes",
)
def _failed_load_stored() -> Callable[[], None]:
    """The vLLM worker stores blocks whose load failed (what they held before)."""
    from hicache.integrations.vllm.worker import WorkerCache

    store = WorkerCache._store

    def stored(self, s):  # type: ignore[no-untyped-def]
        self._failed_blocks = set()
        self._bad_from.pop(s.request_id, None)
        return store(self, s)

    return _patch(WorkerCache, "_store", stored)


@canary(
    "drop-superseded-question",
    r"the worker holds a question the scheduler closed without telling it",
)
def _drop_superseded_question() -> Callable[[], None]:
    """The vLLM scheduler drops a question superseded by vLLM's own hit without telling the
    workers (`unused`): its books forget it before `matched_tokens` can close it."""
    from hicache.integrations.vllm.scheduler import SchedulerBooks

    matched = SchedulerBooks.matched_tokens

    def matched_tokens(self, request, computed):  # type: ignore[no-untyped-def]
        rid, page = request.request_id, self._page
        granted = self._granted.get(rid)
        covered = (request.num_tokens - 1) // page * page <= computed
        kept = granted is not None and granted.computed == computed
        if not covered and not kept and self._asked.get(rid) != computed:
            for books in (self._granted, self._answers, self._asked):
                books.pop(rid, None)
        return matched(self, request, computed)

    return _patch(SchedulerBooks, "matched_tokens", matched_tokens)


@canary("fp8-formats-share-keys", r"got key \w+, which names another page")
def _fp8_formats_share_keys() -> Callable[[], None]:
    """The page keys name the KV tensors' dtype only: vLLM's fp8, fp8_e4m3 and fp8_e5m2 caches
    (all uint8) share pages (#48.2)."""
    from hicache.integrations.vllm import worker

    return _patch(worker, "kv_format", lambda vllm_config, dtype: f"kv-cache={dtype}")


@canary(
    "stored-over-another-ranks-failed-load",
    r"host slot \d+ holds other bytes than its key|put of group \w+: page \d+ of \d+ has wrong"
    r"|page \d+ loaded wrong bytes",
)
def _stored_over_another_ranks_failed_load() -> Callable[[], None]:
    """A TP rank stores the pages it computed over another rank's failed load: each rank knows
    only its own failures (#48.1)."""
    from hicache.integrations.vllm.worker import WorkerCache

    init = WorkerCache.__init__

    def alone(self, config, layout, pin_share=0.5, agree=None):  # type: ignore[no-untyped-def]
        init(self, config, layout, pin_share, None)

    return _patch(WorkerCache, "__init__", alone)


@canary("images-fold-31-bits", r"got key \w+, which names another page")
def _images_fold_31_bits() -> Callable[[], None]:
    """On pages of one token, an image's page carries 31 bits of its hash (its folded word):
    two images whose words agree share pages (#48.4)."""
    from hicache.integrations.vllm import inputs

    return _patch(inputs, "features_salt", lambda salt, page_tokens, features: salt)


@canary("state-of-a-shorter-run", r"host state slot \d+ holds other bytes|wrong state at \d+")
def _state_of_a_shorter_run() -> Callable[[], None]:
    """A get that lost a group inside its run but brought the state at the run's end keeps the
    groups before the lost one, and the state under the shorter run's last key (#48.3)."""
    from hicache.chain.fetch import Fetcher

    on_get = Fetcher.on_get

    def shortened(self, job, codes):  # type: ignore[no-untyped-def]
        state_bytes, fetch = self.layout.state_bytes, job.fetch
        if codes is not None and fetch.state_lease is not None and codes[-1] == state_bytes:
            group, ok = self.G * self.layout.page_size, 0  # a state layout's runs have no tail
            while ok < job.groups and codes[ok] == group:
                ok += 1
            if 0 < ok < job.groups:  # as if the run had ended there, with that state
                job.groups, codes = ok, [*codes[:ok], codes[-1]]
        return on_get(self, job, codes)

    return _patch(Fetcher, "on_get", shortened)


@canary("worker-dies-on-base-exception", r"worker thread hicache-\S+ died with jobs in flight")
def _worker_dies_on_base_exception() -> Callable[[], None]:
    """A store call's BaseException (asyncio's CancelledError) goes through the worker, which
    dies with its job unanswered and its pins held (#48.5)."""
    from hicache.chain import link

    class Through:
        def __getattr__(self, name: str) -> object:
            return getattr(log, name)

        def warning(self, msg: str, *args: object) -> None:
            err = args[-1] if args else None
            if isinstance(err, BaseException) and not isinstance(err, Exception):
                raise err  # out of the worker's handler, as when it caught Exception only
            log.warning(msg, *args)

    log = link.log
    return _patch(link, "log", Through())


@canary("dropped-group-kept-as-held", r"takes as held \w+, which the tier said it lacks")
def _dropped_group_kept_as_held() -> Callable[[], None]:
    """A group the tier no longer holds stays in the link's books as held: never put again
    (#48.6)."""
    from hicache.chain.fetch import Fetcher

    return _patch(Fetcher, "_forget_missing", lambda self, *args: None)


@canary("codec-left-out-of-names", r"cannot read the encoded object \S+ another instance put")
def _codec_left_out_of_names() -> Callable[[], None]:
    """Instances with and without codec: lossless name their objects alike on a store that
    reads prefixes only with a codec (Mooncake): one without cannot read the other's (#48.7)."""
    from hicache.backends.base import StoreTier

    return _patch(StoreTier, "object_prefix", lambda self, prefix, codec: prefix)


@canary("odd-size-header-names-planes", r"put of \w+: its payload does not decode")
def _odd_size_header_names_planes() -> Callable[[], None]:
    """An object of an odd size, encoded with plain zstd, gets a header naming the tier's codec
    (byte planes): no reader decodes it (#48.8)."""
    from hicache.backends import envelope
    from hicache.chain.jobs import JobRunner

    encode = JobRunner._encode

    def named_by_tier(self, name, ptrs, sizes, k):  # type: ignore[no-untyped-def]
        out = encode(self, name, ptrs, sizes, k)
        at, view = ptrs[0] - self.envelopes._base, self.envelopes._view
        if self.codec is not None and view[at + 6] != envelope.RAW:
            view[at + 5] = self.codec.ident
        return out

    return _patch(JobRunner, "_encode", named_by_tier)


@canary("stray-entry-disables-disk", r"did not become available")
def _stray_entry_disables_disk() -> Callable[[], None]:
    """The disk tier's listing takes every entry of objects/ for a shard: one stray file leaves
    the tier unavailable for good (#48.9)."""
    from hicache.backends.disk.tier import DiskTier

    listing = DiskTier._list

    def strict(self):  # type: ignore[no-untyped-def]
        for entry in self._objects.iterdir():
            if not entry.is_dir():
                raise NotADirectoryError(20, "Not a directory", str(entry))
        return listing(self)

    return _patch(DiskTier, "_list", strict)


@canary("available-raises-into-match", r"sim store: available raised")
def _available_raises_into_match() -> Callable[[], None]:
    """A store tier whose `available` raises raises into `match` and `store` (#48.10)."""
    from hicache.chain.link import StoreLink

    return _patch(StoreLink, "_available", lambda self: self.store.available)


SERVED_WRONG = (
    r"host slot \d+ holds other bytes than its key|page \d+ loaded wrong bytes"
    r"|put of group \w+: page \d+ of \d+ has wrong|host state slot \d+ holds other bytes"
    r"|wrong state at \d+|put of state \w+: wrong bytes"
)
"""The byte oracle's violations: a host slot, a loaded page (or state) or a put holds bytes
that are not its key's."""


@canary("checksum-verdict-ignored", SERVED_WRONG)
def _checksum_verdict_ignored() -> Callable[[], None]:
    """A get takes an object whose payload's checksum does not match its header's as whole:
    a payload changed behind an intact header (damaged at rest, a torn put) is served."""
    from hicache.backends.envelope import Envelopes

    return _patch(Envelopes, "verifies", staticmethod(lambda *args: True))


@canary("partial-get-publishes-failed-group", SERVED_WRONG)
def _partial_get_publishes_failed_group() -> Callable[[], None]:
    """A get that returned a leading run of its groups, not all, publishes the first group
    after the run too, which did not arrive (its slots hold what the failed transfer left)."""
    from hicache.chain.fetch import Fetcher

    on_get = Fetcher.on_get

    def one_more(self, job, codes):  # type: ignore[no-untyped-def]
        if codes is not None:
            span, page = job.fetch.span, self.layout.page_size
            sizes = [self.G * page if i < span.groups else span.tail * page
                     for i in range(job.groups)]  # fmt: skip
            ok = 0
            while ok < job.groups and codes[ok] == sizes[ok]:
                ok += 1
            if 0 < ok < job.groups:  # taken as arrived
                codes = [*codes[:ok], sizes[ok], *codes[ok + 1 :]]
        return on_get(self, job, codes)

    return _patch(Fetcher, "on_get", one_more)


@canary("s3fifo-evicts-pinned-main", r"host slot \d+ was evicted while pinned")
def _s3fifo_evicts_pinned_main() -> Callable[[], None]:
    """S3-FIFO's main queue takes a pinned key as a victim (its small queue still passes over
    them): a page being loaded or put is evicted and its slot reused under it."""
    from hicache.core.eviction import S3FIFO

    victim = S3FIFO.victim

    def main_ignores_pins(self, busy):  # type: ignore[no-untyped-def]
        return victim(self, lambda key: key not in self._main and busy(key))

    return _patch(S3FIFO, "victim", main_ignores_pins)


@canary(
    "forgotten-get-loses-slots",
    r"writes into host slot \d+, which is not reserved for it|" + SERVED_WRONG,
)
def _forgotten_get_loses_slots() -> Callable[[], None]:
    """A request forgotten while its get runs releases the get's slots at once: the store
    writes into slots that another page may hold by then (its result then only ends it)."""
    from hicache.chain.fetch import Fetcher
    from hicache.chain.walk import TierChain

    on_get = Fetcher.on_get

    def forget(self, fetch):  # type: ignore[no-untyped-def]
        for part in fetch.parts():
            part.abandoned = True
            part.release()

    def gone(self, job, codes):  # type: ignore[no-untyped-def]
        fetch = job.fetch
        if fetch.abandoned and fetch.lease is None:  # its slots went with the request
            self.load[job.worker] -= 1
            if job.unprobed:
                self._lent -= len(job.page_slots)
            self.on_done(fetch)
            return None
        return on_get(self, job, codes)

    undo = [_patch(TierChain, "forget", forget), _patch(Fetcher, "on_get", gone)]
    return lambda: [u() for u in undo] and None


NEEDS = {
    "keep-caller-array": {"reuse-buffers"},
    "short-codes-accepted": {"bad-codes"},
    "raw-salt-namespace": {"alias-salt"},
    "drop-superseded-question": {"cache-grows"},
}
"""The parts of the workload a canary needs (`--skip` does not leave them out for it)."""
