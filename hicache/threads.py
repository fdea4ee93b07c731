"""hicache's background threads, and the CPUs they may run on.

Every thread that a store tier starts (its fetch and put workers, and the store client's connect,
watchdog and close threads) goes through `start`: a daemon thread that first restricts itself to
the configured CPUs (`worker_cpus` of the store tier). Threads that a library starts from one of
them inherit the restriction — Mooncake's transfer threads are made while its client is set up on
the connect thread — so one setting keeps all of a tier off the cores the engine thread runs on.
Sharing a core with them slows the engine thread's own calls by tens of percent (see
docs/decisions/l3-engine-thread.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["check_cpus", "irq_cpus", "start"]


def check_cpus(cpus: Iterable[int], what: str = "worker_cpus") -> frozenset[int]:
    """`cpus` as a set, checked against the CPUs this process may run on now.

    Empty means no restriction. ValueError naming the problem for a CPU the process may not use,
    or on a platform without thread affinity (only Linux has it)."""
    wanted = frozenset(cpus)
    if not wanted:
        return wanted
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{what}: this platform cannot set a thread's CPUs (Linux only)")
    allowed = os.sched_getaffinity(0)
    outside = sorted(wanted - allowed)
    if outside:
        raise ValueError(
            f"{what}: CPU {outside[0]} is not one this process may run on "
            f"(allowed: {_ranges(sorted(allowed))})"
        )
    return wanted


def fetch_workers(cpus: frozenset[int]) -> int:
    """The default count of a tier's fetch workers for threads confined to `cpus` (empty: the CPUs
    this process may run on): 2 with at least 4 CPUs, else 1. Two calls at once overlap one's
    Python with the other's transfer (four fills of 512 KiB objects at once: 93-96 % -> 102 % of
    raw gets on an H200 host, 16 vCPUs), but on 2 cores their transfers compete (four fills of
    4 MiB objects at once: 90-96 -> 81 % of raw gets on the 2-core VM)."""
    if not cpus and hasattr(os, "sched_getaffinity"):
        cpus = frozenset(os.sched_getaffinity(0))
    return 2 if (len(cpus) or os.cpu_count() or 1) >= 4 else 1


def start(
    target: Callable[..., Any],
    name: str,
    cpus: frozenset[int] = frozenset(),
    args: tuple[Any, ...] = (),
) -> threading.Thread:
    """Start a daemon thread that runs ``target(*args)`` on `cpus` (all allowed if empty)."""

    def run() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def irq_cpus(device: str = "nvidia", proc: Path = Path("/proc")) -> frozenset[int]:
    """The CPUs that take the interrupts of the devices whose line in ``/proc/interrupts``
    names `device` (case-insensitive), from each interrupt's effective affinity (its allowed
    CPUs where the kernel does not say). Empty where there is none, or no ``/proc``.

    A GPU raises an interrupt as each of hicache's copies completes; an engine thread on one
    of these CPUs runs its calls slower (see docs/engine-contract.md, "The GIL, garbage collection
    and CPUs")."""
    try:
        lines = (proc / "interrupts").read_text().splitlines()[1:]
    except OSError:
        return frozenset()
    cpus: set[int] = set()
    for line in lines:
        irq, _, rest = line.partition(":")
        if not irq.strip().isdigit() or device.lower() not in rest.lower():
            continue
        for name in ("effective_affinity_list", "smp_affinity_list"):
            try:
                cpus |= _parse_ranges((proc / "irq" / irq.strip() / name).read_text())
                break
            except (OSError, ValueError):
                continue
    return frozenset(cpus)


def _parse_ranges(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    start_ = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start_) if start_ == prev else f"{start_}-{prev}")
        if c is not None:
            start_ = prev = c
    return ",".join(parts)
