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
    from hicache.cache import HiCache

    def release(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req.fetch is not None and self._chain is not None:
            self._chain.forget(req.fetch)

    return _patch(HiCache, "release", release)


@canary("publish-before-copy")
def _publish_before_copy() -> Callable[[], None]:
    """Write-behind puts do not wait for the GPU -> host copy of their pages."""
    from hicache.tiers.chain import TierChain
    from hicache.transfer.completions import DONE

    stored = TierChain.stored

    def eager(self, keys, done, slots=None):  # type: ignore[no-untyped-def]
        return stored(self, keys, DONE, slots)

    return _patch(TierChain, "stored", eager)


@canary("keep-caller-array")
def _keep_caller_array() -> Callable[[], None]:
    """The prefix memo keeps the caller's token array (which the engine reuses) after release."""
    from hicache.cache import HiCache

    match, release = HiCache.match, HiCache.release

    def matched(self, request_id, tokens, **kwargs):  # type: ignore[no-untyped-def]
        self.__dict__.setdefault("_caller_tokens", {})[request_id] = tokens
        return match(self, request_id, tokens, **kwargs)

    def released(self, request_id):  # type: ignore[no-untyped-def]
        req = self._requests.get(request_id)
        caller = self.__dict__.get("_caller_tokens", {}).pop(request_id, None)
        if req is not None and caller is not None and len(caller) >= req.chain.tokens.shape[0]:
            req.chain.tokens = caller[: req.chain.tokens.shape[0]]
        return release(self, request_id)

    undo = [_patch(HiCache, "match", matched), _patch(HiCache, "release", released)]
    return lambda: [u() for u in undo] and None


@canary("short-codes-accepted")
def _short_codes_accepted() -> Callable[[], None]:
    """A store's code list is used whatever its length or type (the worker checks nothing)."""
    from hicache.tiers.worker import Worker

    def run(self, job):  # type: ignore[no-untyped-def]
        if job.hash_from is not None:
            self._hash(job)
        if job.page_keys and not job.ends:
            self._name_groups(job)
        self._place(job)
        if job.kind == "probe":
            return self.store.exists(job.names)
        if job.kind == "get":
            return self.store.get_into(job.names, job.buffers)
        job.ready.wait()
        return self.store.put_from(job.names, job.buffers)

    return _patch(Worker, "run", run)


def _salt_patch(salt: Callable[..., str | None]) -> Callable[[], None]:
    from hicache.integrations.vllm import scheduler

    return _patch(scheduler, "request_salt", salt)


@canary("lora-not-in-key")
def _lora_not_in_key() -> Callable[[], None]:
    """The LoRA adapter is left out of the namespace: two adapters share pages."""
    return _salt_patch(lambda request: request.cache_salt)


@canary("raw-salt-namespace")
def _raw_salt_namespace() -> Callable[[], None]:
    """The namespace is the raw cache_salt without an adapter and a JSON text with one: a
    client's salt can spell an adapter's namespace."""
    import json

    def salt(request):  # type: ignore[no-untyped-def]
        lora = request.lora_request
        if lora is None:
            return request.cache_salt
        both = {"salt": request.cache_salt, "lora": [lora.lora_name, lora.lora_path]}
        return json.dumps(both, separators=(",", ":"))

    return _salt_patch(salt)


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
    workers (`unused`)."""
    from hicache.integrations.vllm import scheduler
    from hicache.integrations.vllm.meta import Lookup

    def matched_tokens(self, request, computed):  # type: ignore[no-untyped-def]
        rid = request.request_id
        tracked = self._tracked.get(rid)
        if tracked is None:
            tracked = self._tracked[rid] = scheduler._Tracked(
                request, scheduler.request_salt(request)
            )
        if (request.num_tokens - 1) // self._page * self._page <= computed:
            self._withdraw(rid)
            return 0, False
        granted = self._granted.get(rid)
        if granted is not None and granted.computed == computed:
            return granted.hit - computed, False
        if self._asked.get(rid) != computed:
            self._granted.pop(rid, None)
            self._answers.pop(rid, None)
            self._asked.pop(rid, None)
            tokens = scheduler.keyed_tokens(request, 0, request.num_tokens)
            hit = self._from_view(rid, tokens, tracked.salt, computed, request.num_tokens)
            if hit is not None:
                return hit - computed, False
            self._asked[rid] = computed
            self._step.lookups.append(Lookup(rid, tokens, computed, tracked.salt))
        return None, False

    return _patch(scheduler.SchedulerBooks, "matched_tokens", matched_tokens)


NEEDS = {
    "keep-caller-array": {"reuse-buffers"},
    "short-codes-accepted": {"bad-codes"},
    "raw-salt-namespace": {"alias-salt"},
    "drop-superseded-question": {"cache-grows"},
}
"""The parts of the workload a canary needs (`--skip` does not leave them out for it)."""

VLLM = {"lora-not-in-key", "raw-salt-namespace", "failed-load-stored", "drop-superseded-question"}
"""Canaries of vLLM's side: only seeds whose engine is vLLM's can catch them."""
