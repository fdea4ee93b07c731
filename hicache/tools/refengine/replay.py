"""``hicache replay``: a multi-turn agentic workload run by an engine alone and with hicache.

The engine keeps a GPU prefix cache, as vLLM and SGLang do (`hicache.tools.refengine.prefix`), in a
pool smaller than the workload's working set (``--pool-share``): the case hicache exists for. The
two runs use the same weights, the same engine and the same conversations (each turn's prompt =
the previous prompt + the previous answer + a new message); the second adds hicache's tiers, and
on a GPU loads its hits layer by layer under the prefill (``--whole-loads`` turns that off). The
report compares TTFT (p50/p90), end-to-end time, requests per hour and the prompt tokens served
from the GPU prefix cache and each tier, and checks that every answer is token-identical.
``--no-prefix-row`` adds, labelled as such, a run of an engine with no prefix cache at all.
``--floor`` adds, for the last turn of every conversation, the lowest TTFT a hit can have: the
KV bytes loaded / host link bandwidth and the measured prefill of the recomputed suffix, summed
when loads are whole, overlapped (their max + one layer's load) when they go by layer.
``--dp N`` then replays the conversations over N engine ranks on one store
(`hicache.tools.refengine.dp`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from hicache.backends.mooncake.config import SHOW_NATIVE_LOG
from hicache.config import load_config
from hicache.errors import HiCacheError
from hicache.tools.mooncake_local import LocalMaster
from hicache.tools.provenance import commit, machine
from hicache.tools.refengine.build import EngineSpec, build_engine, load_model
from hicache.tools.refengine.engine import Engine, Request
from hicache.tools.refengine.replay_args import DEFAULT_CACHE, find_problem, parser
from hicache.tools.refengine.replay_measure import floor_rows, run_interleaved, second_instance
from hicache.tools.refengine.replay_repeats import fold
from hicache.tools.refengine.replay_report import report
from hicache.tools.refengine.runs import LOCAL_STORE_BYTES, warmup
from hicache.tools.refengine.workload import Conversation, make_workload

__all__ = ["DEFAULT_CACHE", "main"]


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 after a run; 2, with one line on stderr, for arguments or a setup that
    cannot work (checked before the run where that can be known)."""
    args = parser().parse_args(argv)
    if args.verbose:
        os.environ[SHOW_NATIVE_LOG] = "1"
    problem = find_problem(args)
    if problem is not None:
        print(f"hicache replay: {problem}", file=sys.stderr)
        return 2
    try:
        if args.config or args.store == "off":
            return _main(args, argv, args.config or DEFAULT_CACHE)
        with LocalMaster(segment_bytes=LOCAL_STORE_BYTES) as master:  # --store local
            return _main(args, argv, {"tiers": [*DEFAULT_CACHE["tiers"], master.engine_tier()]})
    except HiCacheError as err:  # e.g. host memory that could not be allocated after all
        print(f"hicache replay: {err}", file=sys.stderr)
        return 2


@dataclass(frozen=True)
class _Setup:
    """What every phase of one replay uses: the arguments, the engine's spec and model, the
    workload, and hicache's tiers."""

    args: argparse.Namespace
    spec: EngineSpec
    model: tuple[Any, str]
    convs: list[Conversation]
    cache_config: Any

    @property
    def cuda(self) -> bool:
        return self.args.device.startswith("cuda")

    def engine_stream(self) -> contextlib.AbstractContextManager[Any]:
        """On CUDA, a new stream made current: the engine runs on its own stream, as serving
        engines do (hicache's copies go on the current stream; the copy engines' batched copies
        refuse the legacy default stream). Elsewhere nothing."""
        return torch.cuda.stream(torch.cuda.Stream()) if self.cuda else contextlib.nullcontext()


@dataclass(frozen=True)
class _Runs:
    """The measured runs over the workload: the engine alone (`off`), with hicache (`on`, and
    its engine, still open), and with ``--no-prefix-row`` an engine with no prefix cache
    (`none`); each conversation's requests by turn for the first two; the machine's load
    average (1, 5 and 15 minutes) before and after them."""

    off: dict[str, Any]
    on: dict[str, Any]
    none: dict[str, Any] | None
    done_off: list[list[Request]]
    done_on: list[list[Request]]
    on_engine: Engine
    load_average: dict[str, list[float]]


def _main(args: argparse.Namespace, argv: list[str] | None, cache_config: Any) -> int:
    """One replay with hicache's tiers `cache_config`: the runs (``--repeats`` times, folded
    into medians and ranges), the extra measurements asked for (on the last repetition's
    engine), the report. Exit status 2 for a workload or model that cannot be made, 1 for a
    data-parallel rank that failed, 0 otherwise."""
    try:
        setup = _setup(args, cache_config)
    except ValueError as err:
        print(f"hicache replay: {err}", file=sys.stderr)
        return 2
    runs, reps = None, []
    for i in range(args.repeats):
        if runs is not None:  # the last repetition's engine stays open for the extras
            runs.on_engine.cache.close()
            runs = None  # its pools go before the next repetition's are made
        runs = _compare(setup, f" {i + 1}/{args.repeats}" if args.repeats > 1 else "")
        reps.append(_results(runs))
    res = {**_provenance(setup, argv), **fold(reps), "setup": _setup_record(setup, argv)}
    res["load_average"] = {  # over all the repetitions
        "before": reps[0]["load_average"]["before"],
        "after": reps[-1]["load_average"]["after"],
    }
    status = _extras(setup, runs, res)
    if status != 0:
        return status
    report(res, args)
    runs.on_engine.cache.close()
    return 0


def _setup(args: argparse.Namespace, cache_config: Any) -> _Setup:
    """The engine's spec (its pool sized from the workload's lengths, before the model loads),
    the model and the workload. Raises ValueError for a workload or model that cannot be made."""
    cuda = args.device.startswith("cuda")
    page = args.page_tokens or (128 if cuda else 32)
    probe = _workload(args, 2)  # the lengths alone size the pool: any vocabulary will do
    blocks = _pool_blocks(probe, page, args.pool_share)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    spec = EngineSpec(
        model=args.model,
        device=args.device,
        dtype=dtype,
        seed=args.seed,
        page_tokens=page,
        num_blocks=blocks,
        num_slots=args.conversations + 2,
        chunk_tokens=args.chunk_tokens or (8192 if cuda else 512),
        by_layer=cuda and not args.whole_loads,
        prefix_share=args.prefix_share,
        exact=args.exact if args.exact is not None else dtype != "float32",
    )
    model = load_model(spec)
    convs = _workload(args, model[0].cfg.vocab_size)
    return _Setup(args, spec, model, convs, cache_config)


def _workload(args: argparse.Namespace, vocab_size: int) -> list[Conversation]:
    """The conversations the arguments ask for, as token ids below `vocab_size`."""
    return make_workload(
        args.conversations,
        args.turns,
        args.first_tokens,
        args.message_tokens,
        args.answer_tokens,
        vocab_size,
        args.seed,
    )


def _pool_blocks(convs: list[Conversation], page: int, share: float) -> int:
    """The pool's blocks: `share` of the working set (every conversation's last prompt and
    answer), at least the longest request and two pages more (for the warm-up)."""
    pages = [
        -(-(len(c.first) + sum(map(len, c.messages)) + c.turns * c.answer_tokens) // page)
        for c in convs
    ]
    return max(max(pages) + 2, int(share * sum(pages)))


def _compare(s: _Setup, label: str = "") -> _Runs:
    """One repetition of the runs (`label` names it in the progress lines), interleaved turn by
    turn so that other work on the machine loads them alike (`run_interleaved`), each engine
    built anew and warmed up first: with ``--no-prefix-row`` an engine with no prefix cache, the
    engine alone, and the engine with hicache. The load average is read before and after."""
    if s.cuda:
        torch.cuda.synchronize()
    with s.engine_stream():
        engines = {}
        if s.args.no_prefix_row:
            engines["no prefix"] = build_engine(replace(s.spec, prefix_share=0.0), model=s.model)
        engines["engine"] = build_engine(s.spec, model=s.model)
        engines["+ hicache"] = build_engine(s.spec, s.cache_config, model=s.model)
        for engine in engines.values():
            warmup(engine)
        before = os.getloadavg()
        runs = run_interleaved(engines, s.convs, s.args.quiet, label)
        load = {"before": list(before), "after": list(os.getloadavg())}
    (off, done_off), (on, done_on) = runs["engine"], runs["+ hicache"]
    none = runs["no prefix"][0] if "no prefix" in runs else None
    return _Runs(off, on, none, done_off, done_on, engines["+ hicache"], load)


def _results(runs: _Runs) -> dict[str, Any]:
    """One repetition's comparison of the runs (what the JSON file holds, folded over the
    repetitions, before the setup and the extra measurements)."""
    off, on = runs.off, runs.on
    pairs = [
        (a.output, b.output) for ca, cb in zip(runs.done_off, runs.done_on) for a, b in zip(ca, cb)
    ]
    cached = on["cached_tokens_gpu"] + on["cached_tokens_host"] + on["cached_tokens_store"]
    res: dict[str, Any] = {
        "baseline": "gpu_prefix_cache" if runs.on_engine.prefix is not None else "no_prefix_cache",
        "by_layer": runs.on_engine.by_layer,
        "store": len(runs.on_engine.cache.config.tiers) > 1,
        "identical": all(a == b for a, b in pairs),
        "identical_requests": sum(a == b for a, b in pairs),
        "requests": len(pairs),
        "ttft_p50_off_s": off["ttft_p50_s"],
        "ttft_p50_on_s": on["ttft_p50_s"],
        "ttft_p90_off_s": off["ttft_p90_s"],
        "ttft_p90_on_s": on["ttft_p90_s"],
        "cached_token_share": cached / on["prompt_tokens"] if on["prompt_tokens"] else 0.0,
        "gpu_cached_share_off": off["cached_tokens_gpu"] / max(off["prompt_tokens"], 1),
        "off": off,
        "on": on,
        "ttft_p50_speedup": off["ttft_p50_s"] / max(on["ttft_p50_s"], 1e-12),
        "last_turn_ttft_off_s": off["ttft_per_turn_s"][-1],
        "last_turn_ttft_on_s": on["ttft_per_turn_s"][-1],
        "last_turn_speedup": off["ttft_per_turn_s"][-1] / max(on["ttft_per_turn_s"][-1], 1e-12),
        "e2e_off_s": off["e2e_s"],
        "e2e_on_s": on["e2e_s"],
        "interleaved": "by turn",
        "load_average": runs.load_average,
    }
    if runs.none is not None:
        res["no_prefix_cache"] = runs.none
    return res


def _provenance(s: _Setup, argv: list[str] | None) -> dict[str, str]:
    """What every result file records first: the commit (of the working directory's checkout),
    the machine and the command that re-creates it."""
    gpu = torch.cuda.get_device_name() if s.cuda else None
    words = list(sys.argv[1:] if argv is None else argv)
    return {
        "commit": commit(),
        "machine": machine(gpu),
        "command": " ".join(["hicache", "replay", *map(shlex.quote, words)]),
    }


def _setup_record(s: _Setup, argv: list[str] | None) -> dict[str, Any]:
    """The setup as the JSON file records it: the engine's spec, the workload, the tiers, the
    machine and the command line."""
    args = s.args
    return {
        **asdict(s.spec),
        "conversations": args.conversations,
        "turns": args.turns,
        "first_tokens": args.first_tokens,
        "message_tokens": args.message_tokens,
        "answer_tokens": args.answer_tokens,
        "cache_config": s.cache_config,
        "pool_share": args.pool_share,
        "working_set_blocks": _pool_blocks(s.convs, s.spec.page_tokens, 1.0),
        "device_name": torch.cuda.get_device_name() if s.cuda else "cpu",
        "torch": torch.__version__,
        "argv": list(sys.argv[1:] if argv is None else argv),
    }


def _extras(s: _Setup, runs: _Runs, res: dict[str, Any]) -> int:
    """The extra measurements, added to `res`: the floor (``--floor``), a second instance (with
    store tiers), the data-parallel ranks (``--dp``). Returns the exit status so far: 1 when a
    rank failed (one line on stderr), 0 otherwise."""
    if s.args.floor:
        with s.engine_stream():
            rows = floor_rows(runs.on_engine, runs.done_on, s.args.link_gbps)
        res["floor"] = rows
        if rows:
            res["ratio_to_floor_max"] = max(r["ratio_to_floor"] for r in rows)
    if res["store"]:
        with s.engine_stream():
            res["second_instance"] = second_instance(
                s.spec, s.model, s.cache_config, runs.on_engine, runs.done_on, s.args.quiet
            )
    if s.args.dp is not None:
        from hicache.tools.refengine.dp import RankError, run_dp

        reference = [[r.output for r in conv] for conv in runs.done_on]
        config = load_config(s.args.config or DEFAULT_CACHE)
        try:
            res["dp"] = run_dp(s.args.dp, s.spec, config, s.convs, reference, s.args.quiet)
        except RankError as err:
            print(f"hicache replay: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
