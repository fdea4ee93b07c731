"""``python -m hicache.testing.sim --seeds N --ops M [--seed S] [--canary NAME] [--jobs J]
[--coverage]``: run the simulation over seeds S .. S+N-1, M operations each; exit 0 when no
invariant broke, else 1, printing each failing seed with a shrunk sequence of operations that
reproduces it (``--seed S --seeds 1`` runs it again). A seed whose world runs vLLM's side is
skipped (and counted) where vLLM is not installed. ``--coverage`` prints how often each coverage
mark (`hicache.core.marks`) was reached, one ``name count`` line each, and the store-read
figures, and exits 1 where a mark was never reached."""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import random
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from hicache.core import marks
from hicache.testing import canaries
from hicache.testing.oracle import Violation
from hicache.testing.shrink import shrink
from hicache.testing.workload import FEATURES, Op, Setup, _has_vllm, draw_setup, operations


@dataclass
class Outcome:
    seed: int
    ops: int
    """Operations run."""
    error: str | None = None
    at: int = -1
    """The index of the operation after which the invariant broke."""
    shrunk: list[Op] | None = None
    skipped: bool = False
    """A world of vLLM's side where vLLM is not installed: not run."""
    marks: dict[str, int] | None = None
    """The coverage marks its run reached, and how often."""


def plan(seed: int, count: int, skip: frozenset[str] = frozenset()) -> tuple[Setup, list[Op]]:
    """The world and the operations of `seed` (one generator drives both)."""
    rng = random.Random(seed)
    setup = draw_setup(rng, skip)
    return setup, operations(rng, setup, count)


def replay(seed: int, setup: Setup, ops: list[Op]) -> tuple[int, str | None]:
    """Run `ops` in a fresh world; (operations run, the violation or None)."""
    if setup.engine == "vllm":
        from hicache.testing.vllm_world import VllmWorld as World
    else:
        from hicache.testing.world import World

    gc.collect()
    gc.freeze()  # what the process held before (vLLM's modules): not scanned at each collection
    gc.disable()  # collections at fixed steps only (`GC_EVERY`), so that a seed reproduces
    done, error = 0, None
    try:
        world = World(setup, f"sim-{seed}")
    except Exception as err:  # a seed whose world cannot open is a failure of that seed
        gc.enable()
        gc.unfreeze()
        return 0, f"the world did not open: {type(err).__name__}: {err}"
    try:
        for op in ops:
            world.step(op)
            done += 1
    except Violation as err:
        error = str(err)
    except Exception as err:  # an API call raised where it must not
        where = traceback.extract_tb(err.__traceback__)[-1]
        error = (
            f"{type(err).__name__} in {ops[done]!r}: {err} "
            f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
        )
    try:
        world.close()
    except Violation as err:
        error = error or f"at close: {err}"
    except Exception as err:
        error = error or f"at close: {type(err).__name__}: {err}\n{traceback.format_exc()}"
    finally:
        gc.enable()
        gc.unfreeze()
    if error is None and world.failure is not None:  # found at close, by the collector
        error = f"at close: {world.failure}"
    return done, error


def run_seed(
    seed: int,
    count: int,
    canary: str | None = None,
    shrink_s: float = 60.0,
    skip: frozenset[str] = frozenset(),
    mooncake: bool = False,
) -> Outcome:
    """One seed, with `canary` (a defect reintroduced) if given; the failure shrunk. With
    `mooncake`, the shared store is a real Mooncake master and store node of this process's
    (`mooncake_master`), not in memory."""
    logging.getLogger("hicache").setLevel(logging.CRITICAL)
    from hicache.testing.world import MOONCAKE

    MOONCAKE.address = mooncake_master() if mooncake else None
    if canary is not None:
        skip = skip - canaries.NEEDS.get(canary, set())
    with canaries.applied(canary):
        setup, ops = plan(seed, count, skip)
        if setup.engine == "vllm" and not _has_vllm():
            return Outcome(seed, 0, skipped=True)
        with marks.counting() as reached:
            done, error = replay(seed, setup, ops)
        out = Outcome(seed, done, error, done, marks=dict(reached))
        if error is not None and shrink_s > 0:
            head = ops[: done + 1]
            out.shrunk = shrink(head, lambda t: replay(seed, setup, t)[1] is not None, shrink_s)
    return out


_MASTER: list[Any] = []
"""This process's Mooncake master (with a store node), once `mooncake_master` started it."""
NODE_BYTES = 512 << 20
"""The store node's segment: the objects of every world of the process (Mooncake evicts the
oldest when it fills)."""


def mooncake_master() -> str:
    """The address of this process's Mooncake master, started (with a store node) at first
    use and stopped when the process exits."""
    if not _MASTER:
        from hicache.tools.mooncake_local import LocalMaster

        master = LocalMaster(segment_bytes=NODE_BYTES).start()
        atexit.register(master.stop)
        _MASTER.append(master)
    return _MASTER[0].address


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.testing.sim", description=__doc__)
    p.add_argument("--seeds", type=int, default=10, help="how many seeds (default 10)")
    p.add_argument("--ops", type=int, default=1000, help="operations per seed (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--seed-list", default="", help="these seeds (1,5,9) instead of a range")
    p.add_argument("--canary", choices=sorted(canaries.CANARIES), help="reintroduce a defect")
    p.add_argument("--jobs", type=int, default=1, help="processes running seeds at once")
    p.add_argument("--shrink-s", type=float, default=60.0, help="seconds to shrink a failure")
    p.add_argument(
        "--skip", default="", help=f"parts of the workload to leave out: {', '.join(FEATURES)}"
    )
    p.add_argument(
        "--coverage", action="store_true", help="print the coverage marks reached; fail on a zero"
    )
    p.add_argument(
        "--mooncake", action="store_true", help="the shared store: a real Mooncake master and node"
    )
    args = p.parse_args(argv)
    if args.seeds < 1 or args.ops < 1 or args.jobs < 1:
        p.error("--seeds, --ops and --jobs must be at least 1")
    try:
        listed = [int(s) for s in args.seed_list.split(",") if s]
    except ValueError:
        p.error(f"--seed-list: not a list of seeds: {args.seed_list!r}")
    skip = frozenset(s for s in args.skip.split(",") if s)
    if skip - set(FEATURES):
        unknown = sorted(skip - set(FEATURES))[0]
        p.error(f"--skip: unknown {unknown!r} (known: {', '.join(FEATURES)})")
    seeds = listed or range(args.seed, args.seed + args.seeds)
    started = time.monotonic()
    total, failed, skipped = 0, 0, 0
    reached: dict[str, int] = {}
    call = [(s, args.ops, args.canary, args.shrink_s, skip, args.mooncake) for s in seeds]
    if args.jobs == 1:
        results = (run_seed(*c) for c in call)
    else:
        pool = ProcessPoolExecutor(args.jobs)
        results = pool.map(run_seed, *zip(*call, strict=True))
    for out in results:
        total += out.ops
        skipped += out.skipped
        for name, n in (out.marks or {}).items():
            reached[name] = reached.get(name, 0) + n
        if out.error is not None:
            failed += 1
            print(f"seed {out.seed}: FAILED after {out.at + 1} operations: {out.error}")
            if out.shrunk is not None:
                print(f"  shrunk to {len(out.shrunk)} operations:")
                for op in out.shrunk:
                    print(f"    {op!r}")
            again = f"--seed {out.seed} --seeds 1 --ops {args.ops}"
            again += f" --canary {args.canary}" if args.canary else ""
            again += f" --skip {args.skip}" if skip else ""
            again += " --mooncake" if args.mooncake else ""
            print(f"  reproduce: python -m hicache.testing.sim {again}")
            sys.stdout.flush()
    took = time.monotonic() - started
    missing = report_coverage(reached) if args.coverage else []
    print(
        f"{len(seeds)} seeds, {total} operations in {took:.1f} s ({total / took:.0f} ops/s), "
        f"{failed} failed"
        + (f", {skipped} skipped (vLLM is not installed)" if skipped else "")
        + (f", canary {args.canary}" if args.canary else "")
        + (f", {len(missing)} coverage marks never reached" if missing else "")
    )
    return 1 if failed or missing else 0


def report_coverage(reached: dict[str, int]) -> list[str]:
    """Print each coverage mark's count (``name count``) and the store-read figures; the marks
    never reached."""
    for name in sorted(marks.MARKS):
        print(f"{name} {reached.get(name, 0)}")
    matches, gets = reached.get("cache.match", 0), reached.get("store.get", 0)
    asked, back = reached.get("store.get.keys", 0), reached.get("store.get.keys-back", 0)
    print(
        f"store reads: {gets} gets over {matches} matches ({gets / max(1, matches):.1%}), "
        f"{back} of {asked} objects asked came back ({back / max(1, asked):.1%})"
    )
    return [name for name in marks.MARKS if not reached.get(name)]


if __name__ == "__main__":
    sys.exit(main())
