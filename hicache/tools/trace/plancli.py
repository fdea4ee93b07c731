"""`hicache trace TRACE --model NAME --tier host=SIZE [--tier disk=SIZE] ...`: the planner's
options and its run (hicache.tools.trace.planner does the work)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hicache.config import Bytes, HiCacheConfig
from hicache.core.plan import PrefillSpeed
from hicache.tools.trace import planreport
from hicache.tools.trace.planner import (
    MODELS,
    STORE_TYPES,
    TierPlan,
    TtftModel,
    bytes_per_token,
    chain_from_config,
)
from hicache.tools.trace.progress import Progress
from hicache.tools.trace.report import write_json
from hicache.tools.trace.workload import TraceRequest, Workload

_BYTES = TypeAdapter(Bytes)
_TIER_KEYS = {
    "read_gbps": float,
    "group_pages": int,
    "write": str,
    "policy": str,
    "codec": str,
    "codec_ratio": float,
    "decode_gbps": float,
}


def parse_tier(spec: str) -> TierPlan:
    """``host=64GiB``, ``disk=2TiB,read_gbps=3``, ``mooncake=1TiB,group_pages=8``."""
    head, *extras = spec.split(",")
    kind, sep, size_text = head.partition("=")
    kind = kind.strip()
    if not sep or kind not in ("host", *STORE_TYPES):
        raise ValueError(
            f"--tier {spec!r}: give TYPE=SIZE with TYPE one of host, {', '.join(STORE_TYPES)}"
        )
    try:
        size = _BYTES.validate_python(size_text.strip())
    except ValidationError:
        raise ValueError(f"--tier {spec!r}: {size_text!r} is not a byte size (64GiB)") from None
    if size <= 0:
        raise ValueError(f"--tier {spec!r}: the size must be positive")
    fields: dict[str, Any] = {}
    for extra in extras:
        key, _, value = extra.partition("=")
        key = key.strip()
        if key not in _TIER_KEYS:
            raise ValueError(f"--tier {spec!r}: unknown setting {key!r} ({', '.join(_TIER_KEYS)})")
        try:
            fields[key] = _TIER_KEYS[key](value)
        except ValueError:
            raise ValueError(f"--tier {spec!r}: {key}={value!r} is not usable") from None
    if fields.get("group_pages", 1) <= 0 or fields.get("read_gbps", 1.0) <= 0:
        raise ValueError(f"--tier {spec!r}: group_pages and read_gbps must be positive")
    if fields.get("codec", "none") not in ("none", "lossless"):
        raise ValueError(f"--tier {spec!r}: codec is none or lossless")
    if fields.get("codec_ratio", 1.0) < 1 or fields.get("decode_gbps", 1.0) <= 0:
        raise ValueError(f"--tier {spec!r}: codec_ratio must be at least 1, decode_gbps positive")
    return TierPlan(kind, size, **fields)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "planner",
        "with --tier (or --model and --config): simulate the tier chain and estimate TTFT",
    )
    g.add_argument(
        "--tier",
        action="append",
        metavar="TYPE=SIZE",
        help="a tier of the planned chain, host first, then in walk order: host=256GiB, "
        "disk=2TiB, mooncake=1TiB (settings after commas: read_gbps=, group_pages=, write=, "
        "codec=lossless with codec_ratio= and decode_gbps=, policy= for the host)",
    )
    g.add_argument("--model", choices=sorted(MODELS), help="the model shape (page bytes)")
    g.add_argument("--bytes-per-token", type=int, help="KV bytes per token, instead of --model")
    g.add_argument(
        "--prefill-tokens-per-s", type=float, default=TtftModel().prefill.tokens_per_s,
        help="the engine's prefill speed at no context (default: H200, llama-8b)",
    )  # fmt: skip
    g.add_argument(
        "--prefill-context", type=float, default=TtftModel().prefill.context_s_per_token2,
        help="extra prefill seconds per token per token of context (default: H200, llama-8b)",
    )  # fmt: skip
    g.add_argument(
        "--link-gbps", type=float, default=TtftModel().link_bytes_per_s / 1e9,
        help="host -> GPU GB/s (default: H200's PCIe Gen5 x16)",
    )  # fmt: skip


def wanted(args: argparse.Namespace) -> bool:
    """Whether the arguments ask for the planner."""
    return bool(args.tier or args.model or args.bytes_per_token)


def check(args: argparse.Namespace, base: HiCacheConfig | None) -> list[TierPlan]:
    """The planned chain from the arguments (or the config's tiers); ValueError names what is
    wrong, before any work."""
    if args.model and args.bytes_per_token:
        raise ValueError("give --model or --bytes-per-token, not both")
    if not (args.model or args.bytes_per_token):
        raise ValueError("the planner needs --model NAME or --bytes-per-token N")
    if args.bytes_per_token is not None and args.bytes_per_token <= 0:
        raise ValueError(f"--bytes-per-token must be positive, got {args.bytes_per_token}")
    for name in ("prefill_tokens_per_s", "link_gbps"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.tier:
        tiers = [parse_tier(spec) for spec in args.tier]
    elif base is not None:
        tiers = chain_from_config(base)
    else:
        raise ValueError("the planner needs --tier host=SIZE (or --config with tiers)")
    if tiers[0].type != "host" or any(t.type == "host" for t in tiers[1:]):
        raise ValueError("give the host tier first, and once: --tier host=SIZE")
    return tiers


def run(
    args: argparse.Namespace,
    base: HiCacheConfig | None,
    tiers: list[TierPlan],
    requests: list[TraceRequest],
    page_tokens: int,
) -> int:
    """Plan, print the table, write the JSON and the plot."""
    layers = MODELS[args.model][0] if args.model else 32
    per_token = bytes_per_token(args.model) if args.model else args.bytes_per_token
    page_bytes = per_token * page_tokens
    if tiers[0].size < page_bytes:
        raise ValueError(f"the host tier is smaller than one page ({page_bytes} bytes)")
    model = TtftModel(
        PrefillSpeed(args.prefill_tokens_per_s, args.prefill_context),
        args.link_gbps * 1e9,
        layers,
    )
    floor = base.policy.min_recompute_tokens if base else 1
    verdict = base.policy.prefill_tokens_per_s if base else 20_000.0
    workload = Workload(requests, page_tokens, args.block_tokens)
    runs = 1 + (len(planreport.HOST_SCALES) * (2 if len(tiers) > 1 else 1) if args.plot else 0)
    with Progress(runs * len(requests), show=args.progress or sys.stderr.isatty()) as bar:
        plan_one = planreport.runner(model, floor, verdict, bar.advance)
        result = plan_one(workload, tiers, page_bytes)
        rows = planreport.host_sweep(workload, tiers, page_bytes, plan_one) if args.plot else []
    result.update(trace=str(args.trace), model=args.model, bytes_per_token=per_token)
    if rows:
        result["host_sweep"] = rows
    print(planreport.table(result))
    if args.json_out:
        write_json(result, args.json_out)
    if args.plot:
        stores = " + ".join(t.label for t in tiers[1:]) or "nothing"
        title = f"{args.trace.name}: {args.model or f'{per_token} B/token'}, host + {stores}"
        planreport.plot(rows, stores, args.plot, title)
    return 0
