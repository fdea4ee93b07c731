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
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from hicache.config import ConfigError, load_config
from hicache.errors import HiCacheError
from hicache.tiers.mooncake.tier import SHOW_NATIVE_LOG
from hicache.tools.mooncake_local import LocalMaster, master_problem, mooncake_missing
from hicache.tools.refengine.build import EngineSpec, build_engine, load_model
from hicache.tools.refengine.engine import Engine, Request
from hicache.tools.refengine.model import Item
from hicache.tools.refengine.runs import LOCAL_STORE_BYTES, Progress, percentile, warmup
from hicache.tools.refengine.workload import Conversation, drive, make_workload
from hicache.tools.trace.report import write_problem

DEFAULT_CACHE = {"tiers": [{"type": "host", "size": "2GiB"}]}
"""The store node's segment under ``--store local``."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache replay",
        description="Replay a multi-turn agentic workload through refengine (with its GPU "
        "prefix cache), alone and with hicache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="small-llama",
        help="a folder with config.json + safetensors, or a named shape with random "
        "weights (tiny-llama, small-llama, tiny-qwen3-swa, llama-1b, llama-8b)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", help="None: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument(
        "--store",
        choices=("off", "local"),
        default="off",
        help="without --config: 'off' uses a host tier alone; 'local' adds a Mooncake store "
        "tier on a master and a store node started for the run (needs the mooncake extra)",
    )
    p.add_argument("--l3", choices=("off", "local"), dest="store", help=argparse.SUPPRESS)
    p.add_argument("--config", help="hicache YAML for the tiers, instead of a 2GiB host tier")
    p.add_argument("--conversations", type=_positive, default=4, help="conversations at once")
    p.add_argument("--turns", type=_positive, default=6, help="turns per conversation")
    p.add_argument("--first-tokens", type=_positive, default=1536, help="first prompt length")
    p.add_argument("--message-tokens", type=_positive, default=96, help="new tokens per turn")
    p.add_argument("--answer-tokens", type=_positive, default=16, help="tokens generated per turn")
    p.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    p.add_argument("--page-tokens", type=_positive, default=None, help="None: 32 (CPU), 128 (CUDA)")
    p.add_argument(
        "--chunk-tokens", type=_positive, default=None, help="None: 512 (CPU), 8192 (CUDA)"
    )
    p.add_argument(
        "--pool-share",
        type=float,
        default=0.6,
        help="the engine's KV pool as a share of the working set (every conversation's last "
        "prompt and answer); at least the longest request fits",
    )
    p.add_argument(
        "--prefix-share",
        type=float,
        default=1.0,
        help="share of the pool the engine's GPU prefix cache may keep (0: no prefix cache)",
    )
    p.add_argument(
        "--no-prefix-row",
        action="store_true",
        help="also run an engine with no prefix cache at all (a labelled extra row)",
    )
    p.add_argument(
        "--whole-loads",
        action="store_true",
        help="on a GPU, load each hit whole before the prefill instead of layer by layer",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="measure the TTFT floor of the last turns (load at --link-gbps + suffix)",
    )
    p.add_argument(
        "--dp",
        type=_positive,
        metavar="N",
        help="also run N engine ranks (processes; one per GPU on CUDA) on one Mooncake store "
        "started for them, consecutive turns of a conversation on different ranks",
    )
    p.add_argument("--link-gbps", type=float, default=55.0, help="host->GPU GB/s for --floor")
    p.add_argument("--plot", help="write a PNG of the TTFT per turn to this file (matplotlib)")
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, a line per phase elsewhere)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help=f"show Mooncake's own log lines (hidden otherwise; or set {SHOW_NATIVE_LOG})",
    )
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _problem(args: argparse.Namespace) -> str | None:
    """What makes the arguments unusable, found before anything runs; None if nothing does."""
    for path, what in ((args.json, "--json"), (args.plot, "--plot")):
        problem = path and write_problem(path, what)
        if problem:
            return problem
    if args.plot:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    if args.pool_share <= 0.0 or not 0.0 <= args.prefix_share <= 1.0:
        return "--pool-share must be above 0 and --prefix-share in [0, 1]"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda but CUDA is not available"
    if args.config is None and args.store == "local":
        problem = mooncake_missing()
        if problem:
            return problem
    try:
        config = load_config(args.config or DEFAULT_CACHE)
        config.check_machine(args.config or "")
    except ConfigError as err:
        return str(err)
    if args.dp is not None:
        from hicache.tools.refengine.dp import dp_problem

        problem = dp_problem(args.dp, config, args.device)
        if problem:
            return problem
    for tier in config.tiers:  # a store that does not answer fails now, not in 120 s
        address = getattr(tier, "master_address", None)
        problem = address and master_problem(address)
        if problem:
            return f"{args.config}: {problem}"
    return None


def _run(engine: Engine, convs: list[Conversation], label: str, quiet: bool) -> dict[str, Any]:
    total = sum(c.turns for c in convs)
    bar = Progress(total, label, not quiet)
    t0 = time.perf_counter()
    done = drive(engine, convs, on_finish=bar.tick)
    e2e = time.perf_counter() - t0
    reqs = [r for conv in done for r in conv]
    ttft = [float(r.ttft or 0.0) for r in reqs]
    prompt = sum(len(r.prompt) for r in reqs)
    stored = sum(r.l3_tokens for r in reqs)  # from the store tiers
    host = sum(r.hit_tokens for r in reqs) - stored
    gpu = sum(r.gpu_hit_tokens for r in reqs)
    turns = max(c.turns for c in convs)
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
    out["_done"] = done
    if engine.cache is not None:
        out["cache_stats"] = engine.cache.stats()
    return out


def _second_instance(
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


def _floor(engine: Engine, done: list[list[Request]], gbps: float) -> list[dict[str, float]]:
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
        suffix = _time_prefill(engine, req.prompt, req.gpu_hit_tokens + h)
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


def _time_prefill(engine: Engine, prompt: list[int], start: int, repeats: int = 3) -> float:
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


def _plot(
    path: str, off: list[float], on: list[float], title: str, none: list[float] | None = None
) -> None:
    import matplotlib  # there: checked before the run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = list(range(1, len(off) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if none is not None:
        ax.plot(turns, [t * 1e3 for t in none], "x:", label="engine, no prefix cache")
    ax.plot(turns, [t * 1e3 for t in off], "o-", label="engine with GPU prefix cache")
    ax.plot(turns, [t * 1e3 for t in on], "s-", label="same engine + hicache")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, median over conversations (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(res: dict[str, Any]) -> str:
    off, on = res["off"], res["on"]
    share = res["cached_token_share"]
    rows = [
        ("TTFT p50", f"{off['ttft_p50_s'] * 1e3:.1f} ms", f"{on['ttft_p50_s'] * 1e3:.1f} ms"),
        ("TTFT p90", f"{off['ttft_p90_s'] * 1e3:.1f} ms", f"{on['ttft_p90_s'] * 1e3:.1f} ms"),
        ("end-to-end", f"{off['e2e_s']:.2f} s", f"{on['e2e_s']:.2f} s"),
        ("requests/hour", f"{off['requests_per_hour']:.0f}", f"{on['requests_per_hour']:.0f}"),
        ("prompt tokens", f"{off['prompt_tokens']}", f"{on['prompt_tokens']}"),
        ("from GPU prefix", f"{off['cached_tokens_gpu']}", f"{on['cached_tokens_gpu']}"),
        ("from host tier", "0", f"{on['cached_tokens_host']}"),
        *([("from store tiers", "0", f"{on['cached_tokens_store']}")] if res["store"] else []),
        ("cached share", f"{res['gpu_cached_share_off'] * 100:.1f}%", f"{share * 100:.1f}%"),
    ]
    lines = [f"{'':16}{'engine':>16}{'+ hicache':>16}"]
    lines += [f"{a:16}{b:>16}{c:>16}" for a, b, c in rows]
    lines.append(f"{'outputs identical':16}{'yes' if res['identical'] else 'NO':>32}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 after a run; 2, with one line on stderr, for arguments or a setup that
    cannot work (checked before the run where that can be known)."""
    args = _parser().parse_args(argv)
    if args.verbose:
        os.environ[SHOW_NATIVE_LOG] = "1"
    problem = _problem(args)
    if problem is not None:
        print(f"hicache replay: {problem}", file=sys.stderr)
        return 2
    try:
        if args.config or args.store == "off":
            return _main(args, argv, args.config or DEFAULT_CACHE)
        with LocalMaster(segment_bytes=LOCAL_STORE_BYTES) as master:  # --store local
            return _main(args, argv, {"tiers": [*DEFAULT_CACHE["tiers"], master.engine_tier()]})
    except (ConfigError, HiCacheError) as err:  # e.g. a host tier larger than this machine has
        print(f"hicache replay: {err}", file=sys.stderr)
        return 2


def _pool_blocks(convs: list[Conversation], page: int, share: float) -> int:
    """The pool's blocks: `share` of the working set (every conversation's last prompt and
    answer), at least the longest request and two pages more (for the warm-up)."""
    pages = [
        -(-(len(c.first) + sum(map(len, c.messages)) + c.turns * c.answer_tokens) // page)
        for c in convs
    ]
    return max(max(pages) + 2, int(share * sum(pages)))


def _main(args: argparse.Namespace, argv: list[str] | None, cache_config: Any) -> int:
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    page = args.page_tokens or (128 if cuda else 32)
    chunk = args.chunk_tokens or (8192 if cuda else 512)
    try:
        convs_probe = make_workload(
            args.conversations,
            args.turns,
            args.first_tokens,
            args.message_tokens,
            args.answer_tokens,
            2,
            args.seed,
        )
    except ValueError as err:
        print(f"hicache replay: {err}", file=sys.stderr)
        return 2
    blocks = _pool_blocks(convs_probe, page, args.pool_share)
    spec = EngineSpec(
        model=args.model,
        device=args.device,
        dtype=dtype,
        seed=args.seed,
        page_tokens=page,
        num_blocks=blocks,
        num_slots=args.conversations + 2,
        chunk_tokens=chunk,
        by_layer=cuda and not args.whole_loads,
        prefix_share=args.prefix_share,
    )
    try:
        model = load_model(spec)
    except ValueError as err:
        print(f"hicache replay: {err}", file=sys.stderr)
        return 2
    convs = make_workload(
        args.conversations,
        args.turns,
        args.first_tokens,
        args.message_tokens,
        args.answer_tokens,
        model[0].cfg.vocab_size,
        args.seed,
    )

    # On CUDA the engine runs on its own stream, as serving engines do (hicache's copies go on
    # the current stream; the copy engines' batched copies refuse the legacy default stream).
    if cuda:
        torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
        none = None
        if args.no_prefix_row:
            none_engine = build_engine(replace(spec, prefix_share=0.0), model=model)
            warmup(none_engine)
            none = _run(none_engine, convs, "no prefix", args.quiet)
            del none_engine
            none.pop("_done")
        off_engine = build_engine(spec, model=model)
        warmup(off_engine)
        off = _run(off_engine, convs, "engine", args.quiet)
        del off_engine
        on_engine = build_engine(spec, cache_config, model=model)
        warmup(on_engine)
        on = _run(on_engine, convs, "+ hicache", args.quiet)
    pairs = [
        (a.output, b.output)
        for ca, cb in zip(off.pop("_done"), on["_done"])
        for a, b in zip(ca, cb)
    ]
    identical = all(a == b for a, b in pairs)
    cached = on["cached_tokens_gpu"] + on["cached_tokens_host"] + on["cached_tokens_store"]
    res: dict[str, Any] = {
        "baseline": "gpu_prefix_cache" if on_engine.prefix is not None else "no_prefix_cache",
        "by_layer": spec.by_layer,
        "store": len(on_engine.cache.config.tiers) > 1,
        "identical": identical,
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
        "last_turn_speedup": off["ttft_per_turn_s"][-1] / max(on["ttft_per_turn_s"][-1], 1e-12),
        "setup": {
            **asdict(spec),
            "conversations": args.conversations,
            "turns": args.turns,
            "first_tokens": args.first_tokens,
            "message_tokens": args.message_tokens,
            "answer_tokens": args.answer_tokens,
            "cache_config": cache_config,
            "pool_share": args.pool_share,
            "working_set_blocks": _pool_blocks(convs, page, 1.0),
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "argv": list(sys.argv[1:] if argv is None else argv),
        },
    }
    if none is not None:
        res["no_prefix_cache"] = none
    done_on = on.pop("_done")
    if args.floor:
        with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
            rows = _floor(on_engine, done_on, args.link_gbps)
        res["floor"] = rows
        if rows:
            res["ratio_to_floor_max"] = max(r["ratio_to_floor"] for r in rows)
    if res["store"]:
        with torch.cuda.stream(torch.cuda.Stream()) if cuda else contextlib.nullcontext():
            res["second_instance"] = _second_instance(
                spec, model, cache_config, on_engine, done_on, args.quiet
            )
    if args.dp is not None:
        from hicache.tools.refengine.dp import RankError, run_dp

        reference = [[r.output for r in conv] for conv in done_on]
        config = load_config(args.config or DEFAULT_CACHE)
        try:
            res["dp"] = run_dp(args.dp, spec, config, convs, reference, args.quiet)
        except RankError as err:
            print(f"hicache replay: {err}", file=sys.stderr)
            return 1
    print(_table(res))
    print(
        f"last turn: TTFT {off['ttft_per_turn_s'][-1] * 1e3:.1f} ms (engine with its GPU prefix "
        f"cache), {on['ttft_per_turn_s'][-1] * 1e3:.1f} ms with hicache "
        f"({res['last_turn_speedup']:.1f}x)"
    )
    if none is not None:
        print(
            f"extra row, an engine with no prefix cache at all: last turn TTFT "
            f"{none['ttft_per_turn_s'][-1] * 1e3:.1f} ms, "
            f"TTFT p50 {none['ttft_p50_s'] * 1e3:.1f} ms"
        )
    second = res.get("second_instance")
    if second is not None:
        print(
            f"second instance (empty host tier, same store, the first closed), last turns "
            f"again: {second['cached_tokens_store']} of {second['prompt_tokens']} prompt tokens "
            f"from the store tiers, "
            f"TTFT {second['ttft_p50_s'] * 1e3:.1f} ms (p50; engine alone: "
            f"{off['ttft_per_turn_s'][-1] * 1e3:.1f} ms), outputs identical: "
            f"{'yes' if second['identical'] else 'NO'}"
        )
    if "dp" in res:
        from hicache.tools.refengine.dp import dp_lines

        lines = dp_lines(res["dp"], on["later_turns_ttft_p50_s"], off["later_turns_ttft_p50_s"])
        print("\n".join(lines))
    for row in res.get("floor", []):
        print(
            f"floor at {row['prompt_tokens']} tokens: {row['floor_s'] * 1e3:.1f} ms "
            f"(load {row['load_s_at_link'] * 1e3:.1f} + suffix {row['suffix_prefill_s'] * 1e3:.1f})"
            f", TTFT on {row['ttft_on_s'] * 1e3:.1f} ms, from admission "
            f"{row['service_s'] * 1e3:.1f} ms = {row['ratio_to_floor']:.2f}x floor"
        )
    if args.plot:
        _plot(
            args.plot,
            off["ttft_per_turn_s"],
            on["ttft_per_turn_s"],
            f"{args.model} on {args.device}: TTFT per turn",
            none["ttft_per_turn_s"] if none is not None else None,
        )
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"json: {args.json}")
    on_engine.cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
