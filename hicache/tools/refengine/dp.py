"""``hicache replay --dp N``: N engine ranks on one Mooncake store, each conversation's turns
spread over them.

Each rank is a process of its own (on CUDA, rank r on GPU r) with its own engine, KV pool, GPU
prefix cache and hicache host tier; every rank's hicache has the same Mooncake store below its
host tier: a master and a store node started for the phase, so the store holds nothing from
another run. Turn t of conversation c runs on rank (c + t) % N: consecutive turns land on
different ranks, so a turn's prefix reaches its rank through the store (the pages its rank kept
from an earlier turn of the conversation come from its own host tier first).

A rank hands a finished turn back once its store writes have landed (it polls its cache until
the tiers are idle), as a router sends the next turn only after the answer reached the client:
the next turn, on another rank, finds every full page group of the previous turn in the store.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from hicache.config import HiCacheConfig, load_config, tier_name
from hicache.tools.mooncake_local import LocalMaster, mooncake_missing
from hicache.tools.refengine.build import EngineSpec, build_engine
from hicache.tools.refengine.engine import Engine, Request
from hicache.tools.refengine.runs import LOCAL_STORE_BYTES, Progress, percentile, warmup
from hicache.tools.refengine.workload import Conversation

SETTLE_S = 120.0
"""The longest a rank waits for its store writes before it hands a turn back anyway."""
RANK_START_S = 600.0
"""The longest a rank may take to load its model, build its cache and warm up."""


class RankError(RuntimeError):
    """A rank failed or exited; the message names the rank and the cause."""


def rank_of(cid: int, turn: int, ranks: int) -> int:
    """The rank of turn `turn` of conversation `cid`: consecutive turns on different ranks."""
    return (cid + turn) % ranks


@dataclass
class Turn:
    """One finished turn, as a rank reports it."""

    cid: int
    turn: int
    rank: int
    prompt_tokens: int
    output: list[int]
    ttft_s: float
    gpu_hit_tokens: int  # from the rank's own GPU prefix cache
    host_hit_tokens: int  # from the rank's own host tier
    store_hit_tokens: int  # from the shared store

    @property
    def recomputed_tokens(self) -> int:
        return (
            self.prompt_tokens - self.gpu_hit_tokens - self.host_hit_tokens - self.store_hit_tokens
        )


def dp_problem(n: int, config: HiCacheConfig, device: str) -> str | None:
    """Why `--dp n` cannot run with `config` (the replay's hicache configuration) on `device`,
    or None when it can."""
    if n < 2:
        return f"--dp must be at least 2 (one rank is the run without it), got {n}"
    others = [tier_name(t) for t in config.tiers if tier_name(t) != "host"]
    if others:
        return (
            "--dp runs its ranks on the host tier and a Mooncake store started for them: "
            f"the configuration may name a host tier only, not {', '.join(others)}"
        )
    if device.startswith("cuda") and torch.cuda.device_count() < n:
        return f"--dp {n} on CUDA needs {n} GPUs, {torch.cuda.device_count()} visible"
    problem = mooncake_missing()
    return f"--dp: {problem}" if problem else None


def rank_config(config: HiCacheConfig, master: LocalMaster) -> dict[str, Any]:
    """The ranks' hicache configuration: `config`'s host tier and policy over `master`'s store
    (plain data, for another process)."""
    host = config.tier("host")
    if host is None or len(config.tiers) != 1:
        raise ValueError("--dp needs a configuration with a host tier only")
    data = config.model_dump(mode="json")
    data["tiers"] = [host.model_dump(mode="json"), master.engine_tier()]
    load_config(data)  # a ConfigError now rather than in every rank
    return data


def settle(engine: Engine, timeout_s: float = SETTLE_S) -> bool:
    """Poll the engine's cache until its store tiers are idle; False if `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not engine.cache.tiers_idle:
        if time.monotonic() > deadline:
            return False
        engine.cache.poll()
        time.sleep(0.002)
    return True


def _serve(rank: int, spec: EngineSpec, cache_config: dict[str, Any], conn: Connection) -> None:
    """A rank's process: build the engine, say ``ready``, run the turns it is sent, answer each
    with a `Turn` once its store writes landed, and its cache's stats on ``stop``."""
    engine = None
    try:
        cuda = spec.device.startswith("cuda")
        if cuda:
            spec = replace(spec, device=f"cuda:{rank}")
            torch.cuda.set_device(rank)
        stream = torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext()
        with stream:
            engine = build_engine(spec, cache_config)
            warmup(engine)
            settle(engine)
            conn.send(("ready", rank))
            _loop(rank, engine, conn)
            conn.send(("stats", engine.cache.stats()))
    except Exception as err:  # reported to the driver, which stops the run
        with contextlib.suppress(OSError):  # unless the driver is gone
            conn.send(("error", f"rank {rank}: {type(err).__name__}: {err}"))
    finally:
        if engine is not None and engine.cache is not None:
            engine.cache.close()


def _loop(rank: int, engine: Engine, conn: Connection) -> None:
    turns: dict[str, tuple[int, int]] = {}
    while True:
        while not engine.busy or conn.poll():  # wait for work when idle, else take what came
            msg = conn.recv()
            if msg[0] == "stop":
                return
            _, cid, turn, prompt, max_new = msg
            rid = f"c{cid}t{turn}"
            turns[rid] = (cid, turn)
            engine.add(Request(rid, prompt, max_new))
        done = engine.step()
        if done and not settle(engine):
            raise RuntimeError(f"the store writes did not land within {SETTLE_S:.0f} s")
        for req in done:
            cid, turn = turns.pop(req.rid)
            conn.send(
                (
                    "done",
                    Turn(
                        cid=cid,
                        turn=turn,
                        rank=rank,
                        prompt_tokens=len(req.prompt),
                        output=req.output,
                        ttft_s=float(req.ttft or 0.0),
                        gpu_hit_tokens=req.gpu_hit_tokens,
                        host_hit_tokens=req.hit_tokens - req.l3_tokens,
                        store_hit_tokens=req.l3_tokens,
                    ),
                )
            )


@dataclass
class Ranks:
    """N rank processes and the driver's end of their pipes."""

    spec: EngineSpec
    cache_config: dict[str, Any]
    n: int
    conns: list[Connection] = field(default_factory=list)
    procs: list[Any] = field(default_factory=list)
    stats: list[dict[str, int]] = field(default_factory=list)

    def __enter__(self) -> Ranks:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch or store threads
        for rank in range(self.n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(rank, self.spec, self.cache_config, theirs), daemon=True
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        try:
            for rank in range(self.n):
                self.receive(rank, "ready", RANK_START_S)
        except BaseException as err:
            self.__exit__(type(err), err, err.__traceback__)
            raise
        return self

    def submit(self, rank: int, cid: int, turn: int, prompt: list[int], max_new: int) -> None:
        self.conns[rank].send(("run", cid, turn, prompt, max_new))

    def receive(self, rank: int | None, kind: str, timeout_s: float | None = None) -> Any:
        """The next message of `kind` from `rank` (None: from any rank); a `RankError` if a rank
        reports an error, exits, or `timeout_s` passes."""
        ranks = range(self.n) if rank is None else [rank]
        watched = {self.conns[r]: r for r in ranks} | {self.procs[r].sentinel: r for r in ranks}
        ready = wait(list(watched), timeout_s)
        if not ready:
            raise RankError(f"no rank answered within {timeout_s:.0f} s")
        conn = next((c for c in ready if isinstance(c, Connection)), None)
        r = watched[conn if conn is not None else ready[0]]
        try:
            msg = conn.recv() if conn is not None else None  # an exited rank's last word first
        except EOFError:
            msg = None
        if msg is None:
            raise RankError(f"rank {r} exited (status {self.procs[r].exitcode})")
        if msg[0] == "error":
            raise RankError(msg[1])
        if msg[0] != kind:
            raise RankError(f"rank {r}: {msg[0]!r} where {kind!r} was due")
        return msg[1]

    def __exit__(self, *exc: object) -> None:
        """Stop every rank (its cache closes before the store's master stops), collecting
        their cache stats when the run went well."""
        for rank, conn in enumerate(self.conns):
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            if exc[0] is None:
                self.stats.append(self.receive(rank, "stats", 120.0))
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()


def drive_ranks(
    ranks: Ranks, convs: list[Conversation], on_finish: Callable[[Turn], None]
) -> list[list[Turn]]:
    """Run every conversation to its last turn, turn t of conversation c on rank (c + t) % N;
    return each conversation's turns in order."""
    done: list[list[Turn]] = [[] for _ in convs]
    prompts: dict[tuple[int, int], list[int]] = {}

    def submit(conv: Conversation, turn: int, prompt: list[int]) -> None:
        prompts[conv.cid, turn] = prompt
        ranks.submit(rank_of(conv.cid, turn, ranks.n), conv.cid, turn, prompt, conv.answer_tokens)

    for conv in convs:
        submit(conv, 0, list(conv.first))
    running = len(convs)
    while running:
        t: Turn = ranks.receive(None, "done")
        running -= 1
        done[t.cid].append(t)
        on_finish(t)
        conv, nxt = convs[t.cid], t.turn + 1
        if nxt < conv.turns:
            submit(conv, nxt, prompts.pop((t.cid, t.turn)) + t.output + conv.messages[t.turn])
            running += 1
    return done


def _figures(turns: list[Turn]) -> dict[str, Any]:
    ttft = [t.ttft_s for t in turns]
    return {
        "requests": len(turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "gpu_hit_tokens": sum(t.gpu_hit_tokens for t in turns),
        "host_hit_tokens": sum(t.host_hit_tokens for t in turns),
        "store_hit_tokens": sum(t.store_hit_tokens for t in turns),
        "recomputed_tokens": sum(t.recomputed_tokens for t in turns),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
    }


def run_dp(
    n: int,
    spec: EngineSpec,
    config: HiCacheConfig,
    convs: list[Conversation],
    reference: list[list[list[int]]],
    quiet: bool,
) -> dict[str, Any]:
    """Run `convs` over `n` ranks (module docstring) on a store started for the purpose; compare
    each answer with `reference` (each conversation's outputs by turn, from one rank)."""
    with LocalMaster(segment_bytes=LOCAL_STORE_BYTES) as master:
        cache_config = rank_config(config, master)
        with Ranks(spec, cache_config, n) as ranks:
            bar = Progress(sum(c.turns for c in convs), f"dp {n} ranks", not quiet)
            t0 = time.perf_counter()
            done = drive_ranks(ranks, convs, lambda _t: bar.tick())
            e2e = time.perf_counter() - t0
    turns = [t for conv in done for t in conv]
    pairs = [(t.output, ref[t.turn]) for conv, ref in zip(done, reference) for t in conv]
    later = [t.ttft_s for t in turns if t.turn > 0]
    return {
        "ranks_n": n,
        "placement": "turn t of conversation c on rank (c + t) % ranks",
        "identical": all(a == b for a, b in pairs),
        "identical_requests": sum(a == b for a, b in pairs),
        "ranks": [
            {"rank": r, **_figures([t for t in turns if t.rank == r]), "cache_stats": stats}
            for r, stats in enumerate(ranks.stats)
        ],
        "total": _figures(turns),
        "later_turns_ttft_p50_s": percentile(later, 50),
        "e2e_s": e2e,
        "turns": [
            {k: v for k, v in vars(t).items() if k != "output"}
            | {"recomputed_tokens": t.recomputed_tokens}
            for t in turns
        ],
        "cache_config": cache_config,
    }


def dp_lines(dp: dict[str, Any], single_later_p50_s: float, engine_later_p50_s: float) -> list[str]:
    """The report's lines for the ranks: a row per rank and one for all."""
    head = ("", "requests", "prompt", "GPU prefix", "host tier", "store", "recomputed", "TTFT p50",
            "TTFT p90")  # fmt: skip
    rows = [(f"rank {r['rank']}", r) for r in dp["ranks"]] + [("all", dp["total"])]
    lines = [
        f"{dp['ranks_n']} ranks, one store, {dp['placement']}: prompt tokens from",
        "".join(f"{h:>11}" for h in head),
    ]
    for name, r in rows:
        cells = [r[k] for k in ("requests", "prompt_tokens", "gpu_hit_tokens", "host_hit_tokens",
                                "store_hit_tokens", "recomputed_tokens")]  # fmt: skip
        times = [f"{r['ttft_p50_s'] * 1e3:.1f} ms", f"{r['ttft_p90_s'] * 1e3:.1f} ms"]
        lines.append(f"{name:>11}" + "".join(f"{c:>11}" for c in [*cells, *times]))
    lines.append(
        f"turns after the first, TTFT p50: {dp['later_turns_ttft_p50_s'] * 1e3:.1f} ms over "
        f"{dp['ranks_n']} ranks, {single_later_p50_s * 1e3:.1f} ms on one rank with hicache, "
        f"{engine_later_p50_s * 1e3:.1f} ms engine alone"
    )
    same = "yes" if dp["identical"] else "NO"
    lines.append(f"outputs identical to the one-rank run: {same}")
    return lines
