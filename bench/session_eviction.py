"""Eviction that knows sessions and stop reasons, against LRU and the offline reference.

    python bench/session_eviction.py ../shared/traces/agentic_sessions.jsonl.gz --offline
    python bench/session_eviction.py ../shared/traces/agentic_sessions.jsonl.gz --half 0 \
        --variants "lru;end_turn -120 s;end_turn -300 s;cold -30 s, end_turn -120 s"

With `session` and `stop` on every request, an engine knows, when it stores a request's pages,
whether the context now waits on a tool (`tool_use`: back in seconds) or on a person
(`end_turn`: minutes, or never). Every policy here is an LRU over classes: each page belongs to
the class its last request gave it, and the victim is the page whose last use plus its class's
bonus (seconds) is smallest, so a bonus of B s makes a class look B s fresher than it is (an
O(1) policy: one LRU queue per class, the queues' heads compared). Classes:

- `tool_use`, `end_turn`, `other` (no stop reason): the stop reason of the request's answer;
- `cold`: the request found none of its prompt held (a context seen for the first time, or
  one lost already); with a negative bonus its pages go first, so that a cold context does not
  push out resident ones (a stable subset, as the offline reference keeps).

All run under hicache's placement rules (`hicache.tools.trace.simulate.PolicySim`) at the sweep's
capacities (fractions of the trace's distinct pages). Writes
bench/results/session_eviction_<machine>.json (with --half H: ..._half<H>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command, commit, cpu_model

from hicache.core.eviction import EvictionPolicy
from hicache.tools.trace.replay import DEFAULT_FRACTIONS, Workload
from hicache.tools.trace.simulate import PolicySim
from hicache.tools.trace.workload import read_trace

CLASSES = ("tool_use", "end_turn", "other", "cold")


class ClassBonusLRU(EvictionPolicy):
    """LRU within each class; across classes, the smallest (last use + bonus) goes first.
    `begin` names the class and time of the request whose pages come next."""

    def __init__(self, capacity: int, bonus: dict[str, float]) -> None:
        super().__init__(capacity)
        self.bonus = {c: bonus.get(c, 0.0) for c in CLASSES}
        self._q: dict[str, OrderedDict[int, float]] = {c: OrderedDict() for c in CLASSES}
        self._of: dict[int, str] = {}
        self._cls, self._now = "other", 0.0

    def begin(self, cls: str, now: float) -> None:
        self._cls, self._now = cls, now

    def insert(self, key: int, weight: float = 1.0) -> None:  # type: ignore[override]
        self._q[self._cls][key] = self._now
        self._of[key] = self._cls

    def touch(self, key: int) -> None:  # type: ignore[override]
        old = self._of[key]
        if old == self._cls:
            q = self._q[old]
            q.move_to_end(key)
            q[key] = self._now
        else:
            del self._q[old][key]
            self.insert(key)

    def remove(self, key: int) -> None:  # type: ignore[override]
        del self._q[self._of.pop(key)][key]

    def victim(self, busy=lambda _k: False):  # type: ignore[no-untyped-def]
        best, best_at = None, 0.0
        for cls, q in self._q.items():
            for _ in range(len(q)):
                key = next(iter(q))
                if not busy(key):
                    at = q[key] + self.bonus[cls]
                    if best is None or at < best_at:
                        best, best_at = key, at
                    break
                q.move_to_end(key)
        return best

    def __contains__(self, key: object) -> bool:
        return key in self._of

    def __len__(self) -> int:
        return len(self._of)

    def order(self) -> list[int]:  # type: ignore[override]
        return sorted(self._of, key=lambda k: self._q[self._of[k]][k] + self.bonus[self._of[k]])


def run(w: Workload, capacity: int, bonus: dict[str, float], cold: bool) -> float:
    """Hit share of ClassBonusLRU(bonus) at `capacity` pages; `cold`: use the cold class."""
    policy = ClassBonusLRU(capacity, bonus)
    sim = PolicySim(capacity, w.page_tokens, 1, policy)
    for req, pages in zip(w.requests, w.pages):
        cls = req.stop if req.stop in ("tool_use", "end_turn") else "other"
        if cold and pages and pages[0] not in policy:
            cls = "cold"
        policy.begin(cls, req.timestamp / 1000)
        sim.request(pages, req.input_length)
    return sim.result.share


VARIANTS: dict[str, tuple[dict[str, float], bool]] = {
    "lru": ({}, False),
    "tool +15 s": ({"tool_use": 15}, False),
    "tool +60 s": ({"tool_use": 60}, False),
    "tool +300 s": ({"tool_use": 300}, False),
    "end_turn -60 s": ({"end_turn": -60}, False),
    "end_turn -300 s": ({"end_turn": -300}, False),
    "tool +60 s, end_turn -300 s": ({"tool_use": 60, "end_turn": -300}, False),
    "cold -30 s": ({"cold": -30}, True),
    "cold -120 s": ({"cold": -120}, True),
    "cold -600 s": ({"cold": -600}, True),
    "cold -120 s, tool +60 s": ({"cold": -120, "tool_use": 60}, True),
    "cold -120 s, end_turn -300 s": ({"cold": -120, "end_turn": -300}, True),
    "end_turn -120 s": ({"end_turn": -120}, False),
    "end_turn -600 s": ({"end_turn": -600}, False),
    "end_turn -1800 s": ({"end_turn": -1800}, False),
    "end_turn first": ({"end_turn": -1e9}, False),
    "cold -15 s": ({"cold": -15}, True),
    "cold -15 s, end_turn -300 s": ({"cold": -15, "end_turn": -300}, True),
    "cold -30 s, end_turn -300 s": ({"cold": -30, "end_turn": -300}, True),
    "cold -30 s, end_turn -600 s": ({"cold": -30, "end_turn": -600}, True),
    "cold -15 s, end_turn -120 s": ({"cold": -15, "end_turn": -120}, True),
    "cold -30 s, end_turn -120 s": ({"cold": -30, "end_turn": -120}, True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--variants", help="names of VARIANTS separated by semicolons (default: all)")
    ap.add_argument("--offline", action="store_true", help="also the offline reference")
    ap.add_argument(
        "--half",
        type=int,
        choices=(0, 1),
        help="only the sessions whose crc32 of the top-level session name has this parity "
        "(a check on traffic the bonuses were not chosen on)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    requests = read_trace(args.trace)
    if args.half is not None:
        requests = [
            r for r in requests if zlib.crc32(r.session.split("/")[0].encode()) % 2 == args.half
        ]
    w = Workload(requests, 512, 512)
    unique = w.unique_pages
    names = args.variants.split(";") if args.variants else list(VARIANTS)
    rows = []
    for frac in DEFAULT_FRACTIONS:
        cap = max(1, round(frac * unique))
        for name in names:
            t = time.time()
            share = run(w, cap, *VARIANTS[name])
            rows.append({"policy": name, "fraction": frac, "capacity_pages": cap, "share": share})
            print(f"{frac:5.0%} {name:<32} {share:7.2%}  {time.time() - t:5.1f} s", flush=True)
        if args.offline:
            t = time.time()
            share = w.offline(cap).share
            row = {"policy": "offline", "fraction": frac, "capacity_pages": cap, "share": share}
            rows.append(row)
            print(f"{frac:5.0%} {'offline':<32} {share:7.2%}  {time.time() - t:5.1f} s", flush=True)
    name = f"session_eviction_{args.machine}" + ("" if args.half is None else f"_half{args.half}")
    out = args.out or Path(__file__).parent / "results" / f"{name}.json"
    meta = {"commit": commit(), "machine": cpu_model(), "command": command()}
    info = {"trace": str(args.trace), "half": args.half, "unique_pages": unique, "rows": rows}
    out.write_text(json.dumps({**meta, **info}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
