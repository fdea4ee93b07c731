"""What ``hicache replay`` measures: engines over the workload, interleaved turn by turn
(`run_interleaved`), a second instance on the first one's store (`second_instance`), and the
TTFT floor of the last turns (`floor_rows`, with `time_prefill`, which ``bench/replay.py`` uses
too)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hicache.tools.refengine.build import EngineSpec, build_engine
from hicache.tools.refengine.engine import Engine, Request
from hicache.tools.refengine.model import Item
from hicache.tools.refengine.runs import Progress, percentile, warmup
from hicache.tools.refengine.workload import Conversation, drive_interleaved

__all__ = [
    "figures",
    "floor_rows",
    "run_interleaved",
    "second_instance",
    "time_prefill",
]


def run_interleaved(
    engines: dict[str, Engine], convs: list[Conversation], quiet: bool, label: str = ""
) -> dict[str, tuple[dict[str, Any], list[list[Request]]]]:
    """The conversations through every engine, interleaved turn by turn (`drive_interleaved`),
    one progress line for all unless `quiet` (`label` added to it): per engine label, the run's
    figures (`figures`, the end-to-end time being the time that engine ran) and each
    conversation's requests by turn."""
    total = sum(c.turns for c in convs) * len(engines)
    bar = Progress(total, " / ".join(engines) + f" (by turn){label}", not quiet)
    runs, elapsed = drive_interleaved(list(engines.values()), convs, on_finish=bar.tick)
    return {
        label: (figures(engine, done, e2e), done)
        for (label, engine), done, e2e in zip(engines.items(), runs, elapsed)
    }


def figures(engine: Engine, done: list[list[Request]], e2e: float) -> dict[str, Any]:
    """One engine's figures over the workload: TTFT percentiles and per turn, end-to-end time
    (`e2e`), requests per hour, prompt tokens by where they came from, the cache's stats."""
    reqs = [r for conv in done for r in conv]
    ttft = [float(r.ttft or 0.0) for r in reqs]
    prompt = sum(len(r.prompt) for r in reqs)
    stored = sum(r.l3_tokens for r in reqs)  # from the store tiers
    host = sum(r.hit_tokens for r in reqs) - stored
    gpu = sum(r.gpu_hit_tokens for r in reqs)
    turns = max(len(conv) for conv in done)
    per_turn = [
        statistics.median([float(conv[t].ttft or 0.0) for conv in done if len(conv) > t])
        for t in range(turns)
    ]
    out: dict[str, Any] = {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "later_turns_ttft_p50_s": percentile(
            [float(r.ttft or 0.0) for c in done for r in c[1:]], 50
        ),
        "e2e_s": e2e,
        "requests_per_hour": len(reqs) / e2e * 3600 if e2e > 0 else float("nan"),
        "prompt_tokens": prompt,
        "cached_tokens_gpu": gpu,
        "cached_tokens_host": host,
        "cached_tokens_store": stored,
        "ttft_per_turn_s": per_turn,
    }
    if engine.cache is not None:
        out["cache_stats"] = engine.cache.stats()
    return out


def second_instance(
    spec: EngineSpec,
    model: tuple[Any, str],
    cache_config: Any,
    first: Engine,
    done: list[list[Request]],
    quiet: bool,
) -> dict[str, Any]:
    """What the store tiers buy a new instance (or a restarted one): once the first engine's
    write-behind has landed, it closes (its process could exit: the store node holds the
    objects), and a second engine, its host tier empty, on the same store, serves each
    conversation's last turn again."""
    deadline = time.monotonic() + 60
    while not first.cache.tiers_idle and time.monotonic() < deadline:
        first.cache.poll()
        time.sleep(0.01)
    first.cache.close()
    second = build_engine(spec, cache_config, model=model)
    bar = Progress(len(done), "second instance", not quiet)
    try:
        warmup(second)
        last = [conv[-1] for conv in done]
        again = [Request(f"again-{i}", r.prompt, r.max_new_tokens) for i, r in enumerate(last)]
        second.run(again)
        for r in again:
            bar.tick(r)
    finally:
        second.cache.close()
    return {
        "prompt_tokens": sum(len(r.prompt) for r in again),
        "cached_tokens_store": sum(r.l3_tokens for r in again),
        "ttft_p50_s": percentile([float(r.ttft or 0.0) for r in again], 50),
        "identical": all(a.output == r.output for a, r in zip(again, last)),
    }


def floor_rows(engine: Engine, done: list[list[Request]], gbps: float) -> list[dict[str, float]]:
    """For each conversation's last turn: the bytes loaded / link and the suffix prefill
    (measured, with the hit as context), summed (whole loads) or overlapped: their max plus one
    layer's load (loads by layer)."""
    mem, rows = engine.memory, []
    page_bytes = mem.pool[0].numel() * mem.pool.element_size()
    state = 0
    if mem.rings is not None:
        state = (
            (mem.window - 1)
            * len(mem.sliding_index)
            * 2
            * mem.pool[0, 0, 0, 0].numel()
            * mem.pool.element_size()
        )
    for conv in done:
        req = conv[-1]
        h, n = req.hit_tokens, len(req.prompt)
        if h == 0:
            continue
        load_bytes = h // mem.page_tokens * page_bytes + state
        suffix = time_prefill(engine, req.prompt, req.gpu_hit_tokens + h)
        load_s = load_bytes / (gbps * 1e9)
        service = float((req.first_token_time or 0.0) - (req.admitted or req.arrival))
        if engine.by_layer:
            floor = max(load_s, suffix) + load_s / max(1, len(mem.full_index))
        else:
            floor = load_s + suffix
        rows.append(
            {
                "prompt_tokens": n,
                "gpu_hit_tokens": req.gpu_hit_tokens,
                "hit_tokens": h,
                "load_bytes": load_bytes,
                "load_s_at_link": load_s,
                "suffix_prefill_s": suffix,
                "floor": "overlap" if engine.by_layer else "sum",
                "floor_s": floor,
                "ttft_on_s": float(req.ttft or 0.0),
                # from its admission: a request that waited for blocks behind another
                # conversation's does not count that wait against its load
                "service_s": service,
                "ratio_to_floor": service / floor,
            }
        )
    return rows


def time_prefill(engine: Engine, prompt: list[int], start: int, repeats: int = 3) -> float:
    """Median time of prefilling prompt[start:] (context start tokens; the KV content is junk)."""
    mem, P = engine.memory, engine.memory.page_tokens
    blocks = engine.alloc_blocks(-(-len(prompt) // P))
    slot = mem.alloc_slot() if mem.rings is not None else None
    if blocks is None or (mem.rings is not None and slot is None):
        raise RuntimeError("no free blocks to time the suffix prefill")
    table = torch.tensor(blocks, dtype=torch.int64, device=mem.device)
    times = []
    try:
        for _ in range(repeats):
            if slot is not None:
                mem.slot_len[slot] = start
            _sync(mem.device)
            t0 = time.perf_counter()
            pos = start
            while pos < len(prompt):
                n = min(engine.chunk_tokens, len(prompt) - pos)
                engine.model.forward([Item(prompt[pos : pos + n], pos, table, slot)], mem)
                pos += n
            _sync(mem.device)
            times.append(time.perf_counter() - t0)
    finally:
        mem.free(blocks)
        if slot is not None:
            mem.free_slot(slot)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
