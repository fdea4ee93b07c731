"""TTFT of a host hit loaded layer by layer, and of a hit from a slow tier with a partial fetch.

Part 1 (host hits): a context of ``--context`` tokens is stored, then turns of ``--turns`` new
tokens each ask for it again. Per measured turn: the TTFT with the hit loaded layer by layer
(``ttft_on_s``) and loaded whole before the prefill (``ttft_whole_s``), beside the floors: the
load at ``--link-gbps`` (``load_s_at_link``), the prefill of the suffix with the KV in place
(``suffix_prefill_s``, measured), the old floor (their sum) and the overlap floor (their max plus
one layer's load), and ``ratio_to_overlap_floor``.

Part 2 (a slow tier): a hit of ``--slow-hit`` tokens followed by ``--slow-suffix`` new ones,
held only by a store tier whose reads are throttled to B bytes/s (`ThrottledTier`, registered
through hicache's tier registry; its copies run on `COPY_THREADS` threads, so that the tier
reaches B). A writer engine stores the prefixes; per B, a reader engine with an empty host tier
and a fetch reserve the size of the hit (one get, no exists first) measures, in the same run:
fetch all (``match``), recompute all (a prompt no tier holds) and the chain's own plan
(``match(partial=True)``, the cost model given B and the measured prefill rate). Where the
cost model judges the tier slower than a recompute, ``match`` does not fetch: "fetch all" is
then reported as refused (null) and the partial fetch is compared with the recompute alone.
B spans tiers whose time for the whole hit is ``--tier-ratios`` times its recompute time.
Each row records the tokens each way got from the cache and the tier's gets. Every turn size
and mode warms up once, unreported. The store tier holds one row's prefixes at a time (sized to
them, and dropped with the row's engines after it), and the JSON records the host's memory:
available before the run, after each row and after the run, and the process's peak resident
size.

    python bench/replay.py               # GPU if there is one: llama-8b shape, 32K context
    python bench/replay.py --cpu         # a tiny model on the CPU (a check that it runs)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import platform
import resource
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the memory tier
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import command, commit
from memory_tier import MISSING, MemoryConfig, MemoryTier

from hicache.backends.memory import available_bytes
from hicache.registry import register_tier
from hicache.tools.refengine.build import DTYPES, EngineSpec, build_engine, load_model
from hicache.tools.refengine.engine import Engine, Request
from hicache.tools.refengine.replay_measure import time_prefill  # as replay's floor


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (default where no GPU)")
    p.add_argument("--model", default=None, help="named shape (llama-8b on GPU, tiny-llama CPU)")
    p.add_argument("--context", type=int, default=None, help="hit tokens (32768 GPU, 512 CPU)")
    p.add_argument("--turns", default=None, help="new tokens per turn (512,2048 GPU; 32,128 CPU)")
    p.add_argument("--repeats", type=int, default=3, help="measured turns per turn size")
    p.add_argument("--link-gbps", type=float, default=55.0, help="host->GPU GB/s of the floor")
    p.add_argument("--slow-hit", type=int, default=None, help="hit tokens (16384 GPU, 512 CPU)")
    p.add_argument("--slow-suffix", type=int, default=None, help="new tokens (512 GPU, 32 CPU)")
    p.add_argument("--tier-ratios", default=None, help="default 0.25,0.5,0.75,1,1.5,2,4 (GPU)")
    p.add_argument("--json", default=None, help="default bench/results/ttft_<machine>.json")
    p.add_argument("--machine", default=None, help="default h200 / cpu from the device")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    available_before = available_bytes()
    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    machine = args.machine or (_gpu_name() if cuda else "cpu")
    context = args.context or (32768 if cuda else 512)
    turns = [int(t) for t in (args.turns or ("512,2048" if cuda else "32,128")).split(",")]
    slow_hit = args.slow_hit or (16384 if cuda else 512)
    slow_suffix = args.slow_suffix or (512 if cuda else 32)
    ratios = args.tier_ratios or ("0.25,0.5,0.75,1,1.5,2,4" if cuda else "0.5,1,2")
    page = 128 if cuda else 16
    longest = max(context + max(turns), slow_hit + slow_suffix) + page
    spec = EngineSpec(
        model=args.model or ("llama-8b" if cuda else "tiny-llama"),
        device=device,
        dtype="bfloat16" if cuda else "float32",
        page_tokens=page,
        num_blocks=2 * -(-longest // page) + 8,
        num_slots=4,
        chunk_tokens=8192 if cuda else 256,
        by_layer=True,
        prefix_share=0.0,  # every hit is hicache's: the engine's own prefix cache is off
    )
    model = load_model(spec)
    cfg = model[0].cfg  # a page: K and V of every full layer
    elem = torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
    page_bytes = len(cfg.full_layers) * 2 * page * cfg.num_kv_heads * cfg.head_dim * elem
    host_bytes = (3 * longest // page + 8) * page_bytes
    cache = {"tiers": [{"type": "host", "size": host_bytes}]}
    engine = build_engine(spec, cache, model=model)
    engine.idle_sleep_s = 0.0002  # a throttled tail is waited for in steps this short
    _warmup(engine)
    out: dict[str, Any] = {
        "commit": commit(),
        "machine": machine,
        "command": command(),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "model": spec.model,
        "dtype": spec.dtype,
        "page_tokens": page,
        "chunk_tokens": spec.chunk_tokens,
        "link_gbps": args.link_gbps,
        "host_hits": _host_hits(engine, context, turns, args.repeats, args.link_gbps),
        "slow_tier": _slow_tier(
            engine,
            spec,
            model,
            slow_hit,
            slow_suffix,
            [float(r) for r in ratios.split(",")],
            args.repeats,
        ),
    }
    engine.cache.close()
    del engine
    gc.collect()
    out["host_memory"] = {"available_before_bytes": available_before, **_host_memory()}
    path = Path(args.json or Path(__file__).parent / "results" / f"ttft_{machine}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    _print(out)
    print(f"wrote {path}")
    return out


def _host_memory() -> dict[str, int | None]:
    """The host memory available now (MemAvailable) and this process's peak resident size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"available_bytes": available_bytes(), "peak_rss_bytes": peak}


# -- part 1: host hits -----------------------------------------------------------------------


def _host_hits(
    engine: Engine, context: int, turns: list[int], repeats: int, gbps: float
) -> list[dict[str, Any]]:
    mem = engine.memory
    prefix = _tokens(context, seed=1)
    _serve(engine, Request("prefix", prefix, 1))  # stored in the host tier
    rows = []
    for n in turns:
        for r in range(-1, repeats):  # turn -1 warms this shape up and is not reported
            prompt = prefix + _tokens(n, seed=100 * n + r)
            req = _serve(engine, Request(f"t{n}-{r}", prompt, 1))
            other = prefix + _tokens(n, seed=100 * n + r + 50)  # its suffix is not stored
            whole = _serve(engine, Request(f"w{n}-{r}", other, 1), by_layer=False)
            if r < 0:
                continue
            hit = req.hit_tokens
            load_bytes = hit // mem.page_tokens * _page_bytes(engine)
            load_s = load_bytes / (gbps * 1e9)
            suffix = time_prefill(engine, prompt, hit)
            one_layer = load_s / max(1, len(mem.full_index))
            overlap = max(load_s, suffix) + one_layer
            ttft = float(req.ttft or 0.0)
            rows.append(
                {
                    "new_tokens": n,
                    "prompt_tokens": len(prompt),
                    "hit_tokens": hit,
                    "load_bytes": load_bytes,
                    "ttft_on_s": ttft,
                    "ttft_whole_s": float(whole.ttft or 0.0),
                    "load_s_at_link": load_s,
                    "suffix_prefill_s": suffix,
                    "one_layer_load_s": one_layer,
                    "overlap_floor_s": overlap,
                    "ratio_to_overlap_floor": ttft / overlap,
                    "old_floor_s": load_s + suffix,
                    "ratio_to_old_floor": ttft / (load_s + suffix),
                }
            )
    return rows


# -- part 2: a slow tier ---------------------------------------------------------------------


COPY_THREADS = 8


class ThrottledConfig(MemoryConfig):
    type: Literal["throttled_memory"] = "throttled_memory"  # type: ignore[assignment]
    read_limit_gbps: float = 1.0
    """The tier's reads take at least their bytes / this many GB/s, all threads together."""


@register_tier("throttled_memory", ThrottledConfig)
class ThrottledTier(MemoryTier):
    """The in-memory store tier of the tests, its reads held to `read_limit_gbps`: a store
    slower than the prefill, plugged in through hicache's tier registry as a backend is."""

    reads: ClassVar[list[tuple[float, float, float, int]]] = []
    """Every get: (start, copied, end) on `time.perf_counter`, and its bytes; the benchmark
    reads and clears it around each request."""

    def __init__(self, config: ThrottledConfig) -> None:
        super().__init__(config)
        self._busy_until = 0.0
        self._pace = threading.Lock()
        self._held = sum(len(v) for v in self.objects.values())
        self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="throttled-copy")

    def put_from(self, keys, buffers):  # type: ignore[no-untyped-def]
        """As the memory tier's, but each object is copied into a bytearray by `memmove`, which
        lets go of the GIL, and the bytes held are counted, not summed at every put: the memory
        tier's `string_at` and `join` hold the GIL for every byte, starving the engine thread's
        prefill while the write-behind of a 16 MiB page runs."""
        self._check("put", len(keys))
        out = []
        for i, key in enumerate(keys):
            data = bytearray(buffers.nbytes(i))
            base, at = np.frombuffer(data, dtype=np.uint8).ctypes.data, 0
            for ptr, size in zip(buffers.ptrs[i], buffers.sizes[i]):
                ctypes.memmove(base + at, ptr, size)
                at += size
            with self._lock:
                old = self.objects.get(key)
                grown = len(data) - (len(old) if old is not None else 0)
                if old is None and self._held + grown > self.config.capacity:
                    out.append(-1)
                    continue
                self.objects[key] = data
                self._held += grown
            out.append(0)
        return out

    def get_into(self, keys, buffers):  # type: ignore[no-untyped-def]
        """Reads at `read_limit_gbps` at most: the bytes are copied by `COPY_THREADS` threads
        (one thread's `memmove` ran at 2-3 GB/s here beside the engine, below the limits the
        benchmark asks for), then the call sleeps until the limit's time is up."""
        start = time.perf_counter()
        nbytes = sum(buffers.nbytes(i) for i in range(len(keys)))
        with self._pace:  # the link is shared: reads queue behind each other
            done = max(time.perf_counter(), self._busy_until) + nbytes / (
                self.config.read_limit_gbps * 1e9
            )
            self._busy_until = done
        out, copies = [], []
        for i, key in enumerate(keys):  # copied from the object's own bytes (no slice copies)
            data = self.objects.get(key)
            if data is None or len(data) != buffers.nbytes(i):
                out.append(MISSING if data is None else -1)
                continue
            base, at = np.frombuffer(data, dtype=np.uint8).ctypes.data, 0
            for ptr, size in zip(buffers.ptrs[i], buffers.sizes[i]):
                copies.append((ptr, base + at, size))
                at += size
            out.append(len(data))
        list(self._copiers.map(lambda c: ctypes.memmove(*c), copies))
        copied = time.perf_counter()
        time.sleep(max(0.0, done - copied))
        self.reads.append((start, copied, time.perf_counter(), nbytes))
        return out

    def close(self) -> None:
        self._copiers.shutdown(wait=True)
        super().close()


def _slow_tier(
    engine: Engine,
    spec: EngineSpec,
    model: tuple[Any, str],
    hit: int,
    suffix: int,
    ratios: list[float],
    repeats: int,
) -> list[dict[str, Any]]:
    """Per tier speed: the TTFT of a hit that only a slow store tier holds, fetched whole
    (``match``), recomputed (a prompt no tier holds) and split by the chain's own plan
    (``match(partial=True)``), through a reader engine whose host tier starts empty."""
    P, page_bytes = engine.memory.page_tokens, _page_bytes(engine)
    hit = hit // P * P
    recompute_s = time_prefill(engine, _tokens(hit, 7), 0)
    modes = ("fetch_all", "recompute_all", "partial")
    # every measured request gets a prefix of its own, stored in the slow tier before its row
    prefixes = {
        (ratio, mode, r): _tokens(hit, seed=10_000 + 1000 * i + 10 * j + r)
        for i, ratio in enumerate(ratios)
        for j, mode in enumerate(modes)
        for r in range(-1, repeats)
    }
    reserve = (hit // P + 4) * page_bytes  # the hit's groups, the last one partly past it
    reader_host = {"type": "host", "size": 8 * reserve}
    rows = []
    for ratio in ratios:
        row = {k: v for k, v in prefixes.items() if k[0] == ratio and k[1] != "recompute_all"}
        # room for the row's objects alone (whole groups of the default 4 pages)
        store = {
            "type": "throttled_memory",
            "space": uuid.uuid4().hex,
            "capacity": len(row) * (hit // P + 4) * page_bytes,
        }
        _store_prefixes(spec, model, store, row, 3 * (hit // P + 2) * page_bytes)
        bps = hit // P * page_bytes / (ratio * recompute_s)
        config = {
            "tiers": [
                reader_host,
                {
                    **store,
                    "write": "off",  # the reader only reads: no puts beside its gets
                    # room to get the whole hit in one call, without an exists first (the
                    # answer to an exists waits for the engine's next step: after the head's
                    # prefill, in a partial fetch); the reserve is at most 1/8 of the host tier
                    "fetch_reserve": reserve,
                    "read_limit_gbps": bps / 1e9,
                    "read_gbps": bps / 1e9,
                },
            ],
            "policy": {"prefill_tokens_per_s": hit / recompute_s, "fetch_max_wait_ms": 60_000},
        }
        reader = build_engine(spec, config, model=model)
        reader.idle_sleep_s = 0.0002
        ttft: dict[str, list[float]] = {m: [] for m in modes}
        cached: dict[str, list[int]] = {m: [] for m in modes}  # tokens the cache supplied
        reads: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        heads: list[int] = []
        for r in range(-1, repeats):  # r = -1: a warm-up of each mode, not reported
            for mode in modes:
                reader.partial = mode == "partial"
                prompt = prefixes[(ratio, mode, r)] + _tokens(suffix, seed=77 + r)
                ThrottledTier.reads.clear()
                req = _serve(reader, Request(f"s{ratio}{mode}{r}", prompt, 1))
                if r < 0:
                    continue
                reads[mode].append(_read_times(req, ThrottledTier.reads))
                ttft[mode].append(float(req.ttft or 0.0))
                cached[mode].append(req.hit_tokens)
                if mode == "partial":
                    heads.append(int(getattr(req.match, "head_tokens", 0) or 0))
        reader.cache.close()
        del reader
        ThrottledTier.spaces.pop(store["space"])  # the row's objects go with it
        ThrottledTier.calls.pop(store["space"], None)
        gc.collect()
        med = {m: statistics.median(v) for m, v in ttft.items()}
        # "fetch all" is a fetch only where every repetition got the whole hit: where the cost
        # model judged the tier slower than a recompute, it recomputed, and is not reported
        fetched_all = all(t == hit for t in cached["fetch_all"])
        best = min(med["fetch_all"], med["recompute_all"]) if fetched_all else med["recompute_all"]
        rows.append(
            {
                "tier_over_recompute": ratio,
                "tier_gbps": bps / 1e9,
                "hit_tokens": hit,
                "new_tokens": suffix,
                "plan_head_tokens": heads,
                "ttft_fetch_all_s": med["fetch_all"] if fetched_all else None,
                "ttft_recompute_all_s": med["recompute_all"],
                "ttft_partial_s": med["partial"],
                "ttft_s": ttft,
                "cached_tokens": cached,
                "tier_reads": reads,
                "partial_over_best": med["partial"] / best,
                "host_memory_after": _host_memory(),
            }
        )
    return rows


def _store_prefixes(
    spec: EngineSpec,
    model: tuple[Any, str],
    store: dict[str, Any],
    prefixes: dict[tuple[float, str, int], list[int]],
    host_bytes: int,
) -> None:
    """Store `prefixes` in the `store` tier through a writer engine of its own (closed after)."""
    writer = build_engine(
        spec, {"tiers": [{"type": "host", "size": host_bytes}, store]}, model=model
    )
    for key, prefix in prefixes.items():
        _serve(writer, Request(f"w{len(writer.finished)}{key}", [*prefix, 1], 1))
        _drain(writer)  # each prefix whole in the store before the host tier evicts it
    writer.cache.close()
    del writer
    gc.collect()


def _read_times(req: Request, reads: list[tuple[float, float, float, int]]) -> dict[str, float]:
    """Where a request's time went on the tier's side, in seconds from its arrival: the first
    get's start, the last get's end, the copies' own time and the bytes read (the TTFT less
    the last get's end is the rest: applying the result, the load to the GPU, the prefill)."""
    if not reads:
        return {"gets": 0}
    return {
        "gets": len(reads),
        "first_get_start_s": min(r[0] for r in reads) - req.arrival,
        "last_get_end_s": max(r[2] for r in reads) - req.arrival,
        "copy_s": sum(r[1] - r[0] for r in reads),
        "bytes": sum(r[3] for r in reads),
    }


def _drain(engine: Engine, timeout_s: float = 120.0) -> None:
    """Wait until the cache's tiers have written everything behind."""
    deadline = time.monotonic() + timeout_s
    while not engine.cache.tiers_idle and time.monotonic() < deadline:
        engine.cache.poll()
        time.sleep(0.01)


# -- helpers ---------------------------------------------------------------------------------


def _serve(
    engine: Engine,
    req: Request,
    *,
    by_layer: bool = True,
    head: int | None = None,
    bytes_per_s: float | None = None,
) -> Request:
    """Run one request alone. `head`: split its hit there (clipped to the hit); `bytes_per_s`:
    the hit's tail is released to the engine at that rate from the request's arrival."""
    P, page_bytes = engine.memory.page_tokens, _page_bytes(engine)
    engine.by_layer = by_layer
    engine.planner = None if head is None else (lambda r, m: min(head, m.hit_tokens))

    def ready(r: Request) -> bool:
        m = r.match
        tail = (m.hit_tokens - min(head or 0, m.hit_tokens)) // P * page_bytes
        return engine.clock() >= r.arrival + tail / bytes_per_s

    engine.fetch_ready = None if bytes_per_s is None else ready
    engine.run([req])
    engine.finished.clear()
    return req


def _warmup(engine: Engine) -> None:
    P = engine.memory.page_tokens
    prompt = _tokens(4 * P, seed=0)
    _serve(engine, Request("warm-a", prompt, 1))
    _serve(engine, Request("warm-b", prompt + _tokens(P, seed=5), 1))


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 2000, (n,), generator=g).tolist()


def _page_bytes(engine: Engine) -> int:
    pool = engine.memory.pool
    return pool[0].numel() * pool.element_size()


def _gpu_name() -> str:
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100", "l40s") if g in name), "gpu")


def _print(out: dict[str, Any]) -> None:
    print(f"{out['model']} on {out['device']}, pages of {out['page_tokens']} tokens")
    print("host hits: new  hit     ttft(by layer)  ttft(whole)  load@link  suffix   ratio(max)")
    for r in out["host_hits"]:
        print(
            f"          {r['new_tokens']:>5} {r['hit_tokens']:>6}  {r['ttft_on_s'] * 1e3:9.1f} ms"
            f"  {r['ttft_whole_s'] * 1e3:8.1f} ms  {r['load_s_at_link'] * 1e3:6.1f} ms"
            f"  {r['suffix_prefill_s'] * 1e3:6.1f} ms  {r['ratio_to_overlap_floor']:.2f}"
        )
    print("slow tier: tier/recompute  GB/s   k (the chain's)  fetch all  recompute  partial  /best")
    for r in out["slow_tier"]:
        heads = ",".join(map(str, sorted(set(r["plan_head_tokens"]))))
        whole = r["ttft_fetch_all_s"]
        fetch_all = "refused" if whole is None else f"{whole * 1e3:8.1f}"
        print(
            f"          {r['tier_over_recompute']:>6.2f}  {r['tier_gbps']:8.3f}"
            f"  {heads:>12}  {fetch_all:>8}"
            f"  {r['ttft_recompute_all_s'] * 1e3:8.1f}  {r['ttft_partial_s'] * 1e3:8.1f}"
            f"  {r['partial_over_best']:.2f}"
        )


if __name__ == "__main__":
    main()
