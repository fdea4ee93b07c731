"""`hicache trace import DIR OUT`: turn a folder of kv-cache-tester sessions into one trace.

The kv-cache-tester session format is one JSON file per session::

    {"id": "trace_0001", "block_size": 64, "requests": [
        {"t": 0.0, "model": "m", "in": 20064, "out": 797, "hash_ids": [1, 2, ...], "stop": ""},
        {"type": "subagent", "t": 2.0, "agent_id": "sa-1", "requests": [...]},
        ...]}

`hash_ids` name the prompt's 64-token blocks (`block_size`), scoped to the session. The
conversion (the one `/work/shared/traces/README.md` describes for the shared agentic trace):

- each session starts at a seeded uniform random time within the first `spread_s` seconds; a
  request keeps its offset `t` from its session's start; a sub-agent's requests are placed at the
  sub-agent's own start `t` plus their offset (nested sub-agents likewise); requests later than
  `horizon_s` are dropped;
- one hash id per `block_tokens`-token block: the id of the block's last small block, renumbered
  per (session, model), so equal ids mean equal prefixes of the same model; a partial last block
  gets an id of its own that never repeats;
- `session` is the session's id (a sub-agent's requests: ``session/agent_id``) and `stop` the
  request's own stop reason.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.tools.trace.workload import BLOCK_TOKENS, open_trace

SPREAD_S = 2 * 3600.0
"""Sessions start at uniform random times within this many seconds."""
HORIZON_S = 6 * 3600.0
"""Requests later than this are dropped."""


@dataclass
class ImportSummary:
    """What an import wrote."""

    sessions: int = 0
    requests: int = 0
    dropped: int = 0
    """Requests later than the horizon."""
    prompt_tokens: int = 0


def _requests(
    entries: list[Any], start: float, session: str, where: str
) -> Iterator[tuple[float, str, dict[str, Any]]]:
    """(arrival in seconds, session name, request) of a session's entries, sub-agents included."""
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: request {i} is not an object")
        try:
            t = start + float(entry.get("t", 0.0))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: request {i} has no usable 't'") from None
        if entry.get("type") == "subagent":
            agent = str(entry.get("agent_id") or i)
            yield from _requests(
                entry.get("requests") or [], t, f"{session}/{agent}", f"{where} subagent {agent}"
            )
        else:
            yield t, session, entry


def _session_lines(
    path: Path, start: float, block_tokens: int, ids: dict[tuple[str, str, int], int]
) -> Iterator[tuple[float, dict[str, Any]]]:
    """(arrival in seconds, trace line) for every request of one session file."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        small = int(doc.get("block_size", 64))
        name = str(doc.get("id") or path.stem)
        entries = doc["requests"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a kv-cache-tester session ({err})") from None
    if small <= 0 or block_tokens % small:
        raise ValueError(
            f"{path}: block_size {small} does not divide --block-tokens {block_tokens}"
        )
    per = block_tokens // small
    for t, session, req in _requests(entries, start, name, str(path)):
        try:
            tokens = int(req["in"])
            small_ids = [int(h) for h in req["hash_ids"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: a request without usable 'in'/'hash_ids' ({err})") from None
        if tokens <= 0:
            continue
        full = tokens // block_tokens
        if len(small_ids) < full * per:
            raise ValueError(
                f"{path}: a request of {tokens} tokens has {len(small_ids)} hash ids of "
                f"{small} tokens, fewer than its {full} full blocks need"
            )
        model = str(req.get("model", ""))
        hash_ids = [
            ids.setdefault((name, model, small_ids[(b + 1) * per - 1]), len(ids))
            for b in range(full)
        ]
        if tokens % block_tokens:  # a partial last block: an id no other block gets
            hash_ids.append(ids.setdefault((name, model, -1 - len(ids)), len(ids)))
        yield (
            t,
            {
                "timestamp": round(t * 1000),
                "input_length": tokens,
                "output_length": int(req.get("out", 0) or 0),
                "hash_ids": hash_ids,
                "session": session,
                "stop": str(req.get("stop") or ""),
            },
        )


def import_sessions(
    folder: str | Path,
    out: str | Path,
    seed: int = 0,
    spread_s: float = SPREAD_S,
    horizon_s: float = HORIZON_S,
    block_tokens: int = BLOCK_TOKENS,
) -> ImportSummary:
    """Convert every ``*.json`` session of `folder` (sorted by name) into the trace `out` (JSON
    Lines, gzip when it ends in ``.gz``), ordered by timestamp. Raises ValueError naming the
    file of any malformed session, before `out` is written."""
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise ValueError(f"{folder}: no *.json session files")
    if block_tokens <= 0 or spread_s < 0 or horizon_s <= 0:
        raise ValueError("block_tokens and horizon must be positive, spread non-negative")
    rng = random.Random(seed)
    ids: dict[tuple[str, str, int], int] = {}
    summary = ImportSummary(sessions=len(files))
    lines: list[tuple[float, dict[str, Any]]] = []
    for path in files:
        start = rng.uniform(0.0, spread_s)
        for t, line in _session_lines(path, start, block_tokens, ids):
            if t > horizon_s:
                summary.dropped += 1
                continue
            lines.append((t, line))
            summary.prompt_tokens += line["input_length"]
    lines.sort(key=lambda item: item[0])
    summary.requests = len(lines)
    with open_trace(out, "wt") as f:
        for _, line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """`hicache trace import DIR OUT`; exit 0, or 2 with one line on bad input."""
    p = argparse.ArgumentParser(
        prog="hicache trace import",
        description="Convert a folder of kv-cache-tester session files (one JSON per session, "
        "64-token hash_ids, nested sub-agents) into one trace for `hicache trace`.",
    )
    p.add_argument("folder", type=Path, help="the folder of *.json session files")
    p.add_argument("out", type=Path, help="the trace to write (.jsonl or .jsonl.gz)")
    p.add_argument("--seed", type=int, default=0, help="seed of the session start times")
    p.add_argument(
        "--spread", type=float, default=SPREAD_S, help="sessions start within this many seconds"
    )
    p.add_argument(
        "--horizon", type=float, default=HORIZON_S, help="drop requests later than this (s)"
    )
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="tokens per hash id")
    args = p.parse_args(argv)
    try:
        if not args.folder.is_dir():
            raise ValueError(f"{args.folder}: not a folder")
        if not args.out.parent.is_dir():
            raise ValueError(f"{args.out.parent}: no such folder for the output")
        s = import_sessions(
            args.folder, args.out, args.seed, args.spread, args.horizon, args.block_tokens
        )
    except (ValueError, OSError) as err:
        print(f"hicache trace import: {err}", file=sys.stderr)
        return 2
    print(
        f"{s.sessions} sessions, {s.requests} requests ({s.dropped} after the horizon dropped), "
        f"{s.prompt_tokens:,} prompt tokens -> {args.out}"
    )
    return 0
