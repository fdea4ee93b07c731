"""The scheduler half: a view of the workers' tiers, questions and answers, no pages.

The scheduler process holds no pages. For each waiting request it first consults its
`TierView` (what the workers reported their tiers hold): when the view can tell the whole
answer (a host-tier hit, or a miss no store tier can turn into a hit) it answers in the same
step, and the worker matches and pins the pages only when it loads them. Where the view cannot
tell because a shared store tier may hold the next pages, and that tier can be asked from this
process (`StoreProbe`), the scheduler asks it which of the prompt's next groups it holds,
waiting a bounded few milliseconds, and answers in the step too: the worker's load fetches
those groups into host slots and loads them like a host hit. Otherwise it asks the
workers (a `Lookup` in the next step's metadata) and answers "not yet" (None) until every TP
rank has answered; vLLM asks again on a later step, so the scheduler never waits. The hit it
grants is the smallest of the ranks' answers. After vLLM has allocated blocks, a granted hit
becomes a `Load`; each step that completes a page of a running request becomes a `Store`.

Every question the workers were sent ends in exactly one of: a `Load` (the grant was taken),
`unused` (vLLM took none of it, or its own prefix cache came to cover the prompt meanwhile) or
`forget` (the request finished): each lets the worker's pins of that question go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache.core.marks import mark
from hicache.integrations.vllm.inputs import keyed_tokens, request_salt, with_features
from hicache.integrations.vllm.meta import Answer, Answers, Load, Lookup, StepMeta, Store
from hicache.integrations.vllm.probe import StoreProbe
from hicache.integrations.vllm.view import TierView

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    """A request the scheduler half has seen: how many of its tokens the worker was sent and
    how many pages of it were stored."""

    request: Request
    salt: bytes | None
    sent: int = 0
    stored_pages: int = 0


class SchedulerBooks:
    """The connector's scheduler role. `page_tokens` is vLLM's block size; `ranks` the number of
    TP ranks whose answers are awaited; `reprefillable` the last computed tokens whose KV is not
    final yet (a speculative drafter's prefill lookahead, vLLM's `num_prefill_lookahead_tokens`
    less one): they are not stored, as vLLM does not cache them; `min_recompute` the policy's
    `min_recompute_tokens` (a hit leaves at least these to compute); `in_step` whether to answer
    from the view where it can tell (else every question is asked); `probe` the store tier it
    may ask itself where the view cannot tell (used only with `in_step`)."""

    def __init__(
        self,
        page_tokens: int,
        ranks: int,
        reprefillable: int = 0,
        min_recompute: int = 1,
        in_step: bool = True,
        probe: StoreProbe | None = None,
    ) -> None:
        self._page = page_tokens
        self._ranks = ranks
        self._reprefillable = reprefillable
        self._min_recompute = min_recompute
        self.view = TierView(ranks, page_tokens) if in_step else None
        self.probe = probe if in_step else None
        self._claims: dict[str, list[int]] = {}  # granted from the view: the prompt, for its Load
        self._tracked: dict[str, _Tracked] = {}
        self._asked: dict[str, int] = {}  # request -> the computed tokens of its open question
        self._answers: dict[str, dict[int, Answer]] = {}  # open question -> answers by rank
        self._granted: dict[str, Answer] = {}  # every rank answered: the smallest answer
        self._loads: dict[str, Answer] = {}  # granted and allocated: a Load in the next step
        self._sources: dict[str, Answer] = {}  # for get_external_cache_hit_sources
        self._step = StepMeta()

    def matched_tokens(self, request: Request, computed: int) -> tuple[int | None, bool]:
        """vLLM's `get_num_new_matched_tokens`: tokens hicache can load beyond `computed`, or
        None while the ranks have not all answered. Loads are synchronous (False)."""
        rid = request.request_id
        tracked = self._tracked.get(rid)
        if tracked is None:
            salt = with_features(request_salt(request), request, self._page)
            tracked = self._tracked[rid] = _Tracked(request, salt)
        # vLLM computes at least the prompt's last token: a hit ends a page before it
        if (request.num_tokens - 1) // self._page * self._page <= computed:
            self._withdraw(rid)  # vLLM's own cache came to cover what was asked
            return 0, False
        granted = self._granted.get(rid)
        if granted is not None and granted.computed == computed:
            return granted.hit - computed, False
        if self._asked.get(rid) != computed:  # a new question (or vLLM's own hit changed)
            self._withdraw(rid)  # the old one, answered or not, is closed on the workers too
            tokens = keyed_tokens(request, 0, request.num_tokens, self._page)
            hit = self._from_view(rid, tokens, tracked.salt, computed, request.num_tokens)
            if hit is not None:
                return hit - computed, False
            self._asked[rid] = computed
            self._step.lookups.append(Lookup(rid, tokens, computed, tracked.salt))
        return None, False

    def _from_view(
        self, rid: str, tokens: list[int], salt: bytes | None, computed: int, n: int
    ) -> int | None:
        """The hit (in tokens, >= computed) the view can answer with, granted; None to ask."""
        if self.view is None:
            return None
        cap = max(0, n - self._min_recompute) // self._page
        first = computed // self._page
        pages = self.view.hit_pages(tokens, salt, first, cap)
        sources: tuple[tuple[str, int], ...] = ()
        if pages is None and self.probe is not None:
            found = self._from_store(tokens, salt, first, cap)
            if found is None:
                return None
            pages, host = found
            if pages > host:
                mark("vllm.store-hit-granted-in-step")
            sources = (("p2p", (pages - host) * self._page),)
        else:
            host = pages
        if pages is None:
            return None
        hit = pages * self._page
        if hit > computed:
            in_host = ("host", max(0, host * self._page - computed))
            self._granted[rid] = Answer(rid, computed, hit, (in_host, *sources))
            self._claims[rid] = tokens
        return max(hit, computed)

    def _from_store(
        self, tokens: list[int], salt: bytes | None, first: int, cap: int
    ) -> tuple[int, int] | None:
        """The pages [first, h) every rank can load, its host tier's run followed by the leading
        run of groups the store tier holds (one batched probe for every rank), and the host
        part of it; None where the probe did not answer in time (the workers are asked)."""
        view, probe = self.view, self.probe
        if view is None or probe is None:
            return None
        runs = view.host_runs(tokens, salt, first, cap)
        if runs is None:
            return None
        if not runs:
            return first, first
        asked = [probe.objects(fp, chain, h, cap) for fp, chain, h in runs]
        present = probe.exists([name for _, names in asked for name in names])
        if present is None:
            return None
        at, hit, host = 0, cap, cap
        for (_, _, h), (span, names) in zip(runs, asked):
            held = 0
            while held < len(names) and present[at + held]:
                held += 1
            at += len(names)
            reach = min(cap, span.first_page + span.pages_of(held)) if held else h
            hit, host = min(hit, max(h, reach)), min(host, h)
        return max(first, hit), max(first, min(host, hit))

    def _withdraw(self, rid: str) -> None:
        """Close `rid`'s question, if one is open (asked, answered, granted or allocated and not
        yet loaded): unsent, it is dropped; sent, the workers let its pins go (`unused`). Every
        question ends here, in a `Load` (`build`) or in `finished`."""
        asked = self._asked.pop(rid, None) is not None
        granted = self._granted.pop(rid, None) is not None
        loading = self._loads.pop(rid, None) is not None
        self._answers.pop(rid, None)
        self._sources.pop(rid, None)
        if self._claims.pop(rid, None) is not None:
            return  # granted from the view: nothing on the workers to let go
        if asked or granted or loading:
            step = self._step
            step.lookups = [q for q in step.lookups if q.request_id != rid]
            step.unused.append(rid)

    def allocated(self, request: Request, external_tokens: int) -> None:
        """vLLM's `update_state_after_alloc`: load the granted hit, or let its pins go."""
        rid = request.request_id
        granted = self._granted.get(rid)
        if external_tokens and granted is not None:
            del self._granted[rid]
            self._asked.pop(rid, None)
            self._loads[rid] = self._sources[rid] = granted
        else:
            self._withdraw(rid)

    def hit_sources(self, request: Request, external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's `get_external_cache_hit_sources`: the granted hit split by kind of tier."""
        answer = self._sources.pop(request.request_id, None)
        if answer is None or not external_tokens:
            return {}
        return {CacheHitSource(kind): n for kind, n in answer.sources if n}

    def build(self, out: SchedulerOutput) -> StepMeta:
        """vLLM's `build_connector_meta`: this step's loads and stores, and what was asked."""
        step, self._step = self._step, StepMeta()
        blocks = out.kv_connector_block_state
        step.prefill_tokens = self._prefill_tokens(out)
        for rid, answer in self._loads.items():
            table = blocks.get_block_ids(rid) if blocks is not None else None
            if table is None:  # allocated but not scheduled this step: keep it for the next
                continue
            claim = self._claims.pop(rid, None)
            salt = self._tracked[rid].salt if claim is not None else None
            step.loads.append(Load(rid, answer.computed, answer.hit, list(table[0]), claim, salt))
        for load in step.loads:
            del self._loads[load.request_id]
        for rid, scheduled in out.num_scheduled_tokens.items():
            store = self._store(rid, scheduled, out, blocks)
            if store is not None:
                step.stores.append(store)
        return step

    def _prefill_tokens(self, out: SchedulerOutput) -> int:
        """Prompt tokens this step computes (for the workers' measure of prefill speed)."""
        total = 0
        for rid, scheduled in out.num_scheduled_tokens.items():
            tracked = self._tracked.get(rid)
            if tracked is not None:
                req = tracked.request
                total += max(0, min(scheduled, req.num_prompt_tokens - req.num_computed_tokens))
        return total

    def _store(self, rid: str, scheduled: int, out: SchedulerOutput, blocks) -> Store | None:
        """A Store when this step completes a page of `rid` that was not stored yet."""
        tracked = self._tracked.get(rid)
        if tracked is None or blocks is None:
            return None
        req = tracked.request
        speculative = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        # the KV final after this step (a drafter may re-prefill the last `reprefillable`),
        # capped at the tokens known (async scheduling samples later)
        final = req.num_computed_tokens + scheduled - speculative - self._reprefillable
        upto = min(final, len(req.all_token_ids)) // self._page * self._page  # whole pages
        if upto // self._page <= tracked.stored_pages:
            return None
        table = blocks.get_block_ids(rid)
        if table is None:
            return None
        sent = tracked.sent
        new = keyed_tokens(req, sent, upto, self._page) if upto > sent else []
        tracked.sent, tracked.stored_pages = max(sent, upto), upto // self._page
        tail = upto == req.num_prompt_tokens // self._page * self._page
        return Store(rid, sent, new, upto, list(table[0]), tracked.salt, tail)

    def answered(self, output: KVConnectorOutput) -> None:
        """vLLM's `update_connector_output`: take the ranks' answers to open questions, and
        send again from the first token the stores of a request a worker lost step with."""
        answers = output.kv_connector_worker_meta
        if not isinstance(answers, Answers):
            return
        if self.view is not None and answers.news:
            self.view.update(answers.news)
        for rid in answers.resync:
            tracked = self._tracked.get(rid)
            if tracked is not None:
                tracked.sent = 0
        for rank, items in answers.by_rank.items():
            for answer in items:
                rid = answer.request_id
                if self._asked.get(rid) != answer.computed:
                    continue  # an answer to a question that is no longer open
                got = self._answers.setdefault(rid, {})
                got[rank] = answer
                if len(got) == self._ranks:
                    self._granted[rid] = min(got.values(), key=lambda a: a.hit)
                    del self._answers[rid]

    def finished(self, request: Request) -> None:
        """vLLM's `request_finished` (finished or aborted): forget it here and on the workers."""
        rid = request.request_id
        for books in (self._tracked, self._asked, self._answers, self._granted, self._loads,
                      self._sources, self._claims):  # fmt: skip
            books.pop(rid, None)
        step = self._step  # a question asked this step must not outlive the request
        step.lookups = [q for q in step.lookups if q.request_id != rid]
        step.forget.append(rid)
