"""Defects put back at run time (`--canary NAME`), to show that the simulation finds each class.

Each canary patches the real code for the duration of a run and restores it after."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Install = Callable[[], Callable[[], None]]
"""Puts a defect in place; returns the function that takes it out again."""

CANARIES: dict[str, Install] = {}


def canary(name: str) -> Callable[[Install], Install]:
    def wrap(install: Install) -> Install:
        CANARIES[name] = install
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


def _patch(owner: object, attr: str, value: object) -> Callable[[], None]:
    old = getattr(owner, attr)
    setattr(owner, attr, value)
    return lambda: setattr(owner, attr, old)


@canary("pin-not-released")
def _pin_not_released() -> Callable[[], None]:
    """`release` forgets the request but keeps what its match pinned."""
    from hicache.match import Matcher

    def release(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.fetch is not None and self._chain is not None:
            self._chain.forget(req.fetch)

    return _patch(Matcher, "release", release)


@canary("publish-before-copy")
def _publish_before_copy() -> Callable[[], None]:
    """Write-behind puts do not wait for the GPU -> host copy of their pages."""
    from hicache.chain.walk import TierChain
    from hicache.kernels.completions import DONE

    stored = TierChain.stored

    def eager(self, keys, ready, *args, **kwargs):  # type: ignore[no-untyped-def]
        return stored(self, keys, DONE, *args, **kwargs)

    return _patch(TierChain, "stored", eager)


@canary("keep-caller-array")
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


@canary("short-codes-accepted")
def _short_codes_accepted() -> Callable[[], None]:
    """A store's answer is used whatever its length or type (the worker checks nothing)."""
    from hicache.chain import jobs

    return _patch(jobs, "_answer", lambda out, job: out)


def _salt_patch(salt: Callable[..., str | None]) -> Callable[[], None]:
    from hicache.integrations.vllm import scheduler

    return _patch(scheduler, "request_salt", salt)


@canary("lora-not-in-key")
def _lora_not_in_key() -> Callable[[], None]:
    """The LoRA adapter is left out of the namespace: two adapters share pages."""
    return _salt_patch(lambda request: request.cache_salt)


@canary("raw-salt-namespace")
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


@canary("failed-load-stored")
def _failed_load_stored() -> Callable[[], None]:
    """The vLLM worker stores blocks whose load failed (what they held before)."""
    from hicache.integrations.vllm.worker import WorkerCache

    store = WorkerCache._store

    def stored(self, s):  # type: ignore[no-untyped-def]
        self._failed_blocks = set()
        self._bad_from.pop(s.request_id, None)
        return store(self, s)

    return _patch(WorkerCache, "_store", stored)


@canary("drop-superseded-question")
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


NEEDS = {
    "keep-caller-array": {"reuse-buffers"},
    "short-codes-accepted": {"bad-codes"},
    "raw-salt-namespace": {"alias-salt"},
    "drop-superseded-question": {"cache-grows"},
}
"""The parts of the workload a canary needs (`--skip` does not leave them out for it)."""

VLLM = {"lora-not-in-key", "raw-salt-namespace", "failed-load-stored", "drop-superseded-question"}
"""Canaries of vLLM's side: only seeds whose engine is vLLM's can catch them."""
