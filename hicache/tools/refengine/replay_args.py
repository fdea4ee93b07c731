"""``hicache replay``'s arguments: the parser (flags, defaults, help), the checks made of them
before anything runs (`find_problem`), and the command's entry point (`main`), which answers
``--help`` and a bad flag before torch and the engine are imported."""

from __future__ import annotations

import argparse
import importlib

from hicache.backends.mooncake.config import SHOW_NATIVE_LOG
from hicache.config import ConfigError, load_config
from hicache.tools.mooncake_local import mooncake_missing
from hicache.tools.preflight import start_problem
from hicache.tools.trace.report import write_problem

__all__ = ["DEFAULT_CACHE", "find_problem", "main", "parser"]

DEFAULT_CACHE = {"tiers": [{"type": "host", "size": "2GiB"}]}
"""The tiers without ``--config``: a host tier alone (``--store local`` adds a Mooncake store
tier to it)."""


def parser() -> argparse.ArgumentParser:
    """The parser of ``hicache replay``'s arguments (``--help`` lists them in this order)."""
    p = argparse.ArgumentParser(
        prog="hicache replay",
        description="Replay a multi-turn agentic workload through refengine (with its GPU "
        "prefix cache), alone and with hicache.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_and_tiers(p)
    _workload(p)
    _engine(p)
    _extra_runs(p)
    _output(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``hicache replay``: the arguments parsed here (``--help`` and a bad flag answer at
    once), then the replay (`hicache.tools.refengine.replay.main`)."""
    parser().parse_args(argv)
    from hicache.tools.refengine.replay import main as replay

    return replay(argv)


def _model_and_tiers(p: argparse.ArgumentParser) -> None:
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


def _workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=_positive, default=4, help="conversations at once")
    p.add_argument("--turns", type=_positive, default=6, help="turns per conversation")
    p.add_argument("--first-tokens", type=_positive, default=1536, help="first prompt length")
    p.add_argument("--message-tokens", type=_positive, default=96, help="new tokens per turn")
    p.add_argument("--answer-tokens", type=_positive, default=16, help="tokens generated per turn")
    p.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    p.add_argument(
        "--repeats",
        type=_positive,
        default=3,
        help="run the comparison this many times (fresh engines and tiers each time) and "
        "report each figure's median and range",
    )


def _engine(p: argparse.ArgumentParser) -> None:
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
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the model's exact mode: chunk- and batch-invariant products, RMSNorm and "
        "attention, so that the runs with and without hicache compute every token alike "
        "(unset: on in bfloat16 and float16, off in float32)",
    )
    p.add_argument(
        "--prefix-share",
        type=float,
        default=1.0,
        help="share of the pool the engine's GPU prefix cache may keep (0: no prefix cache)",
    )


def _extra_runs(p: argparse.ArgumentParser) -> None:
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


def _output(p: argparse.ArgumentParser) -> None:
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def find_problem(args: argparse.Namespace) -> str | None:
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
    import torch  # here: `--help` does not wait for it

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda but CUDA is not available"
    if args.config is not None and args.store == "local":
        return "--store local adds a store to the default tiers: with --config, name it there"
    try:  # the configuration first, then what the flags need beside it
        config = load_config(args.config or DEFAULT_CACHE)
    except ConfigError as err:
        return str(err)
    problem = start_problem(config, args.config or "")
    if problem is None and args.store == "local":
        problem = mooncake_missing()
    if problem is None and args.dp is not None:
        from hicache.tools.refengine.dp import dp_problem

        problem = dp_problem(args.dp, config, args.device)
    return problem
