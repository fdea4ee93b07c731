"""`hicache trace FILE`: replay a Mooncake-format trace through hicache and report hit shares.

`hicache trace import DIR OUT` converts a folder of kv-cache-tester sessions into a trace
(hicache.tools.trace.importer).

Exit status: 0 when every loaded page had the right bytes, 1 when some did not, 2 on a usage or
input error.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from hicache.config import Bytes, ConfigError, HiCacheConfig, load_config
from hicache.core.eviction import DEFAULT_POLICY, policy_names
from hicache.tools.preflight import start_problem
from hicache.tools.trace import plancli
from hicache.tools.trace.cluster_report import add_arguments as add_cluster_arguments
from hicache.tools.trace.cluster_report import run as run_cluster
from hicache.tools.trace.importer import main as import_main
from hicache.tools.trace.progress import Progress
from hicache.tools.trace.report import plot, sweep_lines, table, write_json, write_problem
from hicache.tools.trace.workload import BLOCK_TOKENS, DEFAULT_FRACTIONS, Workload, read_trace

DEFAULT_HOST_SIZE = "50%"


def parse_host_size(spec: str, unique_pages: int, model_page_bytes: int | None) -> int:
    """Host capacity in pages from ``50%`` (of the distinct pages), ``20000`` (pages) or a byte
    size such as ``64GiB`` (divided by the configured layout's page size)."""
    text = spec.strip()
    try:
        number = float(text[:-1] if text.endswith("%") else text)
    except ValueError:
        number = None
    if number is not None and number <= 0:
        raise ValueError(f"--host-size {spec!r} must be positive")
    if text.endswith("%"):
        try:
            frac = float(text[:-1]) / 100
        except ValueError:
            raise ValueError(f"--host-size {spec!r}: not a percentage") from None
        if frac <= 0:
            raise ValueError(f"--host-size {spec!r} must be positive")
        return max(1, round(frac * unique_pages))
    if text.isdigit():
        if int(text) <= 0:
            raise ValueError(f"--host-size {spec!r} must be positive")
        return int(text)
    if model_page_bytes is None:
        raise ValueError(
            f"--host-size {spec!r}: a byte size needs --config with a layout (its page size "
            "turns bytes into pages); give a percentage or a page count instead"
        )
    try:
        size = TypeAdapter(Bytes).validate_python(text)
    except ValidationError:
        raise ValueError(
            f"--host-size {spec!r}: not a percentage, page count or byte size"
        ) from None
    pages = size // model_page_bytes
    if pages <= 0:
        raise ValueError(f"--host-size {spec!r} is smaller than one page ({model_page_bytes} B)")
    return pages


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of fractions: {text!r}") from None
    if not values or any(not 0 < v <= 10 for v in values):
        raise argparse.ArgumentTypeError("fractions must be in (0, 10]")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache trace",
        description="Replay a Mooncake-format trace (JSONL with hash_ids per 512-token block) "
        "through hicache with a model-less engine; compare with an exact LRU and an infinite "
        "cache; check every loaded byte.",
    )
    p.add_argument(
        "trace",
        type=Path,
        help="the trace file (JSON Lines, .jsonl or .jsonl.gz); `hicache trace import DIR OUT` "
        "makes one from kv-cache-tester sessions",
    )
    p.add_argument("--config", type=Path, help="a hicache YAML: its tiers and policy are used")
    p.add_argument(
        "--host-size",
        help="host capacity: '50%%' of the distinct pages (default without --config), a page "
        "count, or a byte size with --config (e.g. 64GiB over the config's page size)",
    )
    p.add_argument(
        "--page-tokens",
        type=_positive,
        help="tokens per page (default: the config's, else 128; the planner: --block-tokens)",
    )
    p.add_argument(
        "--kv-bytes", type=int, default=128, help="synthetic bytes per page (multiple of 16)"
    )
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--json", type=Path, dest="json_out", help="write the report as JSON here")
    p.add_argument("--plot", type=Path, help="write the capacity sweep as a PNG here")
    p.add_argument(
        "--policy",
        choices=policy_names(),
        help=f"the host tier's eviction policy (default: the config's, else {DEFAULT_POLICY})",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="simulate every eviction policy and the offline reference at each capacity of "
        "--fractions (without it the sweep runs only the host tier's policy)",
    )
    p.add_argument(
        "--fractions",
        type=_fractions,
        default=DEFAULT_FRACTIONS,
        help="sweep capacities as fractions of the distinct pages, comma-separated "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="show a progress bar on stderr (shown anyway when stderr is a terminal)",
    )
    p.add_argument(
        "--simulate-only",
        action="store_true",
        help="run the simulations alone (the sweep), not the real cache: no byte check",
    )
    plancli.add_arguments(p)
    p.add_argument(
        "--block-tokens",
        type=_positive,
        default=BLOCK_TOKENS,
        help="tokens per hash id of the trace (default: %(default)s)",
    )
    add_cluster_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import"]:
        return import_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, ValueError, OSError) as err:
        print(f"hicache trace: {err}", file=sys.stderr)
        return 2


def _problem(args: argparse.Namespace, base: HiCacheConfig | None) -> str | None:
    """What makes the arguments unusable, found before any work; None if nothing does."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib)"
    for path, what in ((args.json_out, "--json"), (args.plot, "--plot")):
        problem = write_problem(path, what)
        if problem:
            return problem
    if base is not None and args.instances:
        return (
            "--instances sizes the tiers by --host-size, --disk-size and --store-size, not --config"
        )
    if base is not None and not (plancli.wanted(args) or args.simulate_only):
        return start_problem(base, str(args.config))  # the real cache starts it here
    return None


def _run(args: argparse.Namespace) -> int:
    # here, not at the top: the real cache brings torch, which `--help` need not wait for
    from hicache.tools.trace.replay import ReplaySetup, replay, simulated, sweep_steps

    base: HiCacheConfig | None = load_config(args.config) if args.config else None
    problem = _problem(args, base)
    if problem:
        raise ValueError(problem)
    if args.instances:
        return run_cluster(args, parse_host_size)
    layout = base.layout if base else None
    planning = plancli.wanted(args)
    tiers = plancli.check(args, base) if planning else []
    default_page = args.block_tokens if planning else layout.page_tokens if layout else 128
    page_tokens = args.page_tokens or default_page
    setup = ReplaySetup(
        page_tokens=page_tokens,
        kv_bytes=args.kv_bytes,
        base=base,
        block_tokens=args.block_tokens,
        policy=args.policy,
    )
    requests = read_trace(args.trace, args.limit, args.block_tokens)
    if not requests:
        raise ValueError(f"{args.trace}: no requests")
    if planning:
        return plancli.run(args, base, tiers, requests, page_tokens)
    workload = Workload(requests, page_tokens, args.block_tokens)
    policies = policy_names() if args.sweep else [setup.eviction]
    show = args.progress or sys.stderr.isatty()
    if args.simulate_only:
        with Progress(sweep_steps(args.fractions, policies), show=show) as bar:
            result = simulated(workload, setup, args.fractions, policies, bar.advance)
        text = "\n".join(
            [
                f"requests {result['requests']:,}, prompt tokens {result['prompt_tokens']:,}, "
                f"page_tokens {page_tokens}, page visits {result['page_visits']:,}, "
                f"distinct pages {result['unique_pages']:,}",
                "",
                *sweep_lines(result),
            ]
        )
    else:
        pages = _host_pages(args.host_size, base, workload.unique_pages)
        steps = len(requests) + sweep_steps(args.fractions, policies)
        with Progress(steps, show=show) as bar:
            result = replay(workload, setup, pages, args.fractions, policies, bar.advance)
        text = table(result)
    result["trace"] = str(args.trace)
    print(text)
    if args.json_out:
        write_json(result, args.json_out)
    if args.plot:
        plot(result, args.plot, title=f"{args.trace.name}: prefix hit share vs host capacity")
    return 1 if result.get("wrong_bytes") else 0


def _host_pages(spec: str | None, base: HiCacheConfig | None, unique_pages: int) -> int:
    """The replayed host tier's pages: `--host-size`, else the config's host size over its
    layout's page size, else DEFAULT_HOST_SIZE of the distinct pages."""
    layout = base.layout if base else None
    model_page = layout.page_size if layout else None
    if spec is not None:
        return parse_host_size(spec, unique_pages, model_page)
    host = base.tier("host") if base else None
    if host is not None and model_page:
        pages = host.size // model_page  # type: ignore[attr-defined]
        if pages <= 0:
            raise ValueError("the config's host tier is smaller than one page of its layout")
        return pages
    return parse_host_size(DEFAULT_HOST_SIZE, unique_pages, None)


if __name__ == "__main__":
    sys.exit(main())
