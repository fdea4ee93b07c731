"""vLLM alone, vLLM + hicache and vLLM + LMCache on agentic sessions and on distinct prompts.

    pip install lmcache==0.5.6          # once, beside torch==2.13.0 (CPU) and '.[vllm]'
    python bench/vllm.py --out bench/results/vllm_cpu.json

LMCache is not in hicache's extras (it caps numpy, protobuf and prometheus-client below what
the other extras install, and pulls CUDA packages): install it into the environment that runs
the benchmark, then uninstall torchvision, torchaudio and torchcodec as `scripts/test.sh` does.

Ways, each in a fresh vLLM process (vLLM's CPU build, a random 4-layer Llama, prefix caching
on, a KV budget far below the working set), interleaved: every repetition runs every way once,
in an order rotated by one from the repetition before, so load from other work on the machine
falls on all ways alike:

- ``vllm``: vLLM alone;
- ``vllm_floor``: vLLM alone with a KV budget that holds every prompt and answer of the run
  (`floor_kv_tokens` in the JSON), so its own prefix cache keeps every prefix: nothing loaded,
  no reused token computed again. The physical best for this workload on this engine;
- ``hicache``: vLLM + `HiCacheConnector`, a host tier and a disk tier;
- ``lmcache256``, ``lmcache32``: vLLM + LMCache's `LMCacheMPConnector` with an `lmcache server`
  started for the run (an L1 of the host tier's size, a file-system L2 of the disk's), chunks of
  256 and 32 tokens (LMCache's only CPU path: its in-process connector has none);
- ``hicache_host`` (an extra row, named in `--ways`): hicache with its host tier alone;
- ``hicache_mooncake`` (an extra row, named in `--ways`): hicache with its host tier and a
  Mooncake store tier on the store node that `hicache.tools.mooncake_local` starts for the run
  (a node of `--disk-bytes`, pages kept in memory across engines: the second instance reads
  them there), one page an object, so that a prompt's pages past its last whole group of 4
  are shared too;
- ``example`` (with `--example`): vLLM's `ExampleConnector` on a directory, an extra row.

Every way pins the same OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`, `--omp-bind`): vLLM's CPU
build otherwise reserves one more core when any KV connector is configured. Each process runs
two workloads: **reuse**, then **no reuse**. Reuse: the first `--turns` requests of
`--sessions` agentic coding sessions from the trace, each hash id made `--scale` tokens (as
`hicache trace` makes 512), sent a round at a time (every session's next request at once).
No reuse: prompts of the same lengths whose every block is new. Then, for the connectors with
a shared tier, a **second instance** (a fresh vLLM beside the same disk or LMCache server,
after the first has exited) sends the sessions' first requests again.

On the 2-core VM a run of the four ways before ``vllm_floor`` took about 27 minutes (the floor
adds about a fifth; longer while other work shares the machine). Rows: each way's TTFT p50 and
p90 per workload, median [min-max] over the repetitions, the prompt tokens each source served,
whether greedy answers equal vLLM alone's; then the targets, as ratios of the medians and
within each repetition.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, command, commit, cpu_model
from lmcache_peer import LMCacheServer

from hicache.tools.mooncake_local import LocalMaster
from hicache.tools.trace.workload import BLOCK_TOKENS, block_tokens_of

RUNNER = ["-m", "hicache.tools.vllm_run"]  # one vLLM process (the tests run it too)
TRACE = ROOT / "examples" / "traces" / "agentic_sample.jsonl.gz"  # its first sessions: the same
VOCAB = 512  # the model's vocabulary (hicache.tools.vllm_run.VOCAB)
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # 4 layers, K and V, 2 KV heads of 64, fp32
NEW_IDS = 1 << 40  # hash ids above every id of the trace: blocks no other prompt has


def session_prompts(args: argparse.Namespace) -> list[list[list[int]]]:
    """The first `turns` prompts of the first `sessions` top-level sessions (by start time)
    whose prompts all fit in `max_tokens`, each as token ids below VOCAB."""
    by_session: dict[str, list[dict]] = defaultdict(list)
    with gzip.open(args.trace, "rt") as f:
        for line in f:
            req = json.loads(line)
            if "/" not in req["session"]:  # sub-agents have sessions of their own
                by_session[req["session"]].append(req)
    chosen = []
    for reqs in sorted(by_session.values(), key=lambda rs: min(r["timestamp"] for r in rs)):
        reqs = sorted(reqs, key=lambda r: r["timestamp"])[: args.turns]
        prompts = [
            tokens(r["hash_ids"], -(-r["input_length"] * args.scale // BLOCK_TOKENS), args.scale)
            for r in reqs
        ]
        if len(prompts) == args.turns and max(map(len, prompts)) <= args.max_tokens:
            chosen.append(prompts)
        if len(chosen) == args.sessions:
            return chosen
    raise SystemExit(f"the trace has fewer than {args.sessions} sessions that fit")


def tokens(hash_ids: list[int] | range, n: int, scale: int) -> list[int]:
    """`n` token ids below VOCAB for a prompt of trace hash ids, `scale` tokens an id: equal
    ids give equal tokens."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    return (block_tokens_of(ids, scale).reshape(-1)[:n] % VOCAB).tolist()


def workloads(args: argparse.Namespace) -> dict[str, list[list[list[int]]]]:
    """Rounds of prompts: ``reuse`` (round t: every session's t-th request), ``no_reuse``
    (the same lengths as its first rounds, every block new) and ``second`` (the sessions'
    first requests)."""
    sessions = session_prompts(args)
    reuse = [[s[t] for s in sessions] for t in range(args.turns)]
    no_reuse = []
    start = NEW_IDS
    for prompts in reuse[: args.no_reuse_rounds]:
        no_reuse.append([])
        for p in prompts:
            blocks = -(-len(p) // args.scale)
            no_reuse[-1].append(tokens(range(start, start + blocks), len(p), args.scale))
            start += blocks
    return {"reuse": reuse, "no_reuse": no_reuse, "second": reuse[:1]}


def run_vllm(way: str, config: dict, workload: Path, out: Path, args: argparse.Namespace) -> dict:
    """One vLLM process through one workload file; its result (`hicache.tools.vllm_run`'s JSON)."""
    kind = next((k for k in ("hicache", "lmcache", "vllm") if way.startswith(k)), way)
    kv_tokens = args.floor_kv_tokens if way == "vllm_floor" else args.kv_tokens
    cmd = [
        sys.executable, *RUNNER, "--model", args.model, "--workload", workload, "--out", out,
        "--way", kind, "--config", json.dumps(config), "--block", str(args.block),
        "--kv-bytes", str(kv_tokens * KV_BYTES_PER_TOKEN), "--output", str(args.output),
        "--max-model-len", str(args.max_tokens + args.output), "--max-num-seqs", "16",
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log = out.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.run(
            [str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    if proc.returncode:
        raise SystemExit(f"{way}: vLLM failed:\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def run_way(way: str, rep: int, files: dict[str, Path], args: argparse.Namespace) -> dict:
    """One way's first instance (both workloads), then its second instance where it has a
    tier that outlives the process. Every store starts empty."""
    work = Path(tempfile.mkdtemp(prefix=f"{way}-{rep}-", dir=args.work))
    server = store = None
    try:
        if way.startswith("hicache"):
            tiers = [{"type": "host", "size": args.host_bytes}]
            if way == "hicache":
                tiers.append({"type": "disk", "path": str(work / "disk"), "size": args.disk_bytes})
            elif way == "hicache_mooncake":
                store = LocalMaster(log_dir=str(work / "mooncake"), segment_bytes=args.disk_bytes)
                tiers.append({**store.start().engine_tier(), "group_pages": 1})
            config = {"tiers": tiers}
        elif way.startswith("lmcache"):
            chunk = int(way.removeprefix("lmcache"))
            server = LMCacheServer(chunk, args.host_bytes, work / "l2", work / "server.log")
            config = {"port": server.port}
        elif way == "example":
            config = {"path": str(work / "example")}
        else:
            config = {}
        first = run_vllm(way, config, files["first"], work / "first.json", args)
        second = None
        if way != "vllm" and way in args.second:
            second = run_vllm(way, config, files["second"], work / "second.json", args)
        return {"first": first, "second": second}
    finally:
        if server:
            server.close()
        if store:
            store.stop()
        shutil.rmtree(work, ignore_errors=True)


def sources(metrics: dict) -> dict[str, float]:
    """Prompt tokens by where vLLM got them (its own prefix cache, a connector, compute)."""
    return {
        k.split("source=")[1].rstrip("}"): v
        for k, v in metrics.items()
        if k.startswith("vllm:prompt_tokens_by_source") and v
    }


def measure(run: dict, phases: dict[str, range], base: dict | None) -> dict:
    """One process's figures: TTFT p50/p90 per workload phase, answers against vLLM alone's."""
    first = run["first"]
    row: dict = {"omp_threads": first["omp_threads"], "elapsed_s": first["elapsed_s"]}
    for phase, rounds in phases.items():
        ttft = np.concatenate([first["ttft_s"][i] for i in rounds]) * 1e3
        row[f"{phase}_ttft_p50_ms"] = float(np.percentile(ttft, 50))
        row[f"{phase}_ttft_p90_ms"] = float(np.percentile(ttft, 90))
    later = np.concatenate([first["ttft_s"][i] for i in list(phases["reuse"])[1:]]) * 1e3
    row["reuse_later_turns_ttft_p50_ms"] = float(np.percentile(later, 50))
    row["prompt_tokens_by_source"] = sources(first["vllm_metrics"])
    base_answers = base["first"]["answers"] if base else None  # None: vLLM alone not run
    row["answers_identical_to_vllm"] = base_answers and first["answers"] == base_answers
    if run["second"]:
        second = run["second"]
        row["second_first_turns_ttft_p50_ms"] = float(np.median(second["ttft_s"][0]) * 1e3)
        row["second_prompt_tokens_by_source"] = sources(second["vllm_metrics"])
        row["second_answers_identical_to_vllm"] = (
            base_answers and second["answers"][0] == base_answers[0]
        )
        row["second_omp_threads"] = second["omp_threads"]
    return row


def spread(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def summarize(rows: list[dict], ways: list[str]) -> tuple[dict, dict]:
    """Per way: median [min, max] over repetitions of every timing; then the targets."""
    keys = [k for k in rows[0] if k.endswith("_ms")] + ["second_first_turns_ttft_p50_ms"]
    summary = {}
    for way in ways:
        mine = [r for r in rows if r["way"] == way]
        summary[way] = {
            k: spread([r[k] for r in mine]) for k in dict.fromkeys(keys) if k in mine[0]
        }
        summary[way]["answers_identical_to_vllm"] = all(
            r["answers_identical_to_vllm"] and r.get("second_answers_identical_to_vllm", True)
            for r in mine
        )
        summary[way]["omp_threads"] = sorted({r["omp_threads"] for r in mine})

    def compare(way: str, other: str, key: str, limit: float) -> dict:
        """The ratio of the medians against its target, and the ratio within each repetition."""
        value = summary[way][key]["median"] / summary[other][key]["median"]
        mine = {r["rep"]: r[key] for r in rows if r["way"] == way}
        paired = [mine[r["rep"]] / r[key] for r in rows if r["way"] == other and r["rep"] in mine]
        return {"value": value, "per_rep": spread(paired), "target": limit, "met": value <= limit}

    lmcaches = [w for w in ways if w.startswith("lmcache")]
    targets: dict = {}
    if "hicache" in ways and "vllm" in ways:
        targets["reuse_p50_vs_vllm"] = compare("hicache", "vllm", "reuse_ttft_p50_ms", 0.3)
        targets["no_reuse_p50_vs_vllm"] = compare("hicache", "vllm", "no_reuse_ttft_p50_ms", 1.05)
    if "hicache" in ways and "vllm_floor" in ways:
        targets["reuse_p50_vs_floor"] = compare("hicache", "vllm_floor", "reuse_ttft_p50_ms", 1.2)
    if "hicache" in ways and lmcaches:
        best = min(lmcaches, key=lambda w: summary[w]["reuse_ttft_p50_ms"]["median"])
        targets["lmcache_best"] = best
        targets["reuse_p50_vs_lmcache"] = compare("hicache", best, "reuse_ttft_p50_ms", 0.8)
        targets["reuse_p90_vs_lmcache"] = compare("hicache", best, "reuse_ttft_p90_ms", 0.9)
    key = "second_first_turns_ttft_p50_ms"
    seconds = [w for w in lmcaches if key in summary[w]]
    for way, name in (("hicache", "second_instance"), ("hicache_mooncake", "second_mooncake")):
        if seconds and way in ways and key in summary[way]:
            other = min(seconds, key=lambda w: summary[w][key]["median"])
            targets[f"{name}_p50_vs_lmcache"] = {**compare(way, other, key, 1.0), "lmcache": other}
    return summary, targets


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--trace", default=str(TRACE), help="agentic_sessions.jsonl.gz")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ways", default="vllm,vllm_floor,hicache,lmcache256,lmcache32")
    p.add_argument("--example", action="store_true", help="add vLLM's ExampleConnector as a row")
    p.add_argument("--second", default="hicache,hicache_mooncake,lmcache256,lmcache32",
                   help="ways that also run a second instance")  # fmt: skip
    p.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for every way")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--scale", type=int, default=16, help="tokens a trace hash id stands for")
    p.add_argument("--max-tokens", type=int, default=3072, help="longest prompt of a session")
    p.add_argument("--no-reuse-rounds", type=int, default=2)
    p.add_argument("--output", type=int, default=16, help="tokens of a greedy answer")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=4096, help="vLLM's own KV budget")
    p.add_argument("--host-bytes", type=int, default=256 << 20, help="host tier / LMCache L1")
    p.add_argument("--disk-bytes", type=int, default=1 << 30, help="disk tier / LMCache L2")
    args = p.parse_args()
    args.ways = args.ways.split(",") + (["example"] if args.example else [])
    args.second = set(args.second.split(","))
    return args


def main() -> None:
    if sys.argv[1:2] == ["serve"]:  # vLLM's own client against its server: bench/vllm_serve.py
        from vllm_serve import main as serve

        serve(sys.argv[2:])
        return
    args = parse_args()
    loads = workloads(args)
    every = [p for r in loads["reuse"] + loads["no_reuse"] for p in r]  # each prompt + answer
    blocks = sum(-(-(len(p) + args.output) // args.block) for p in every)
    args.floor_kv_tokens = (blocks + 1) * args.block  # and vLLM's null block
    phases = {
        "reuse": range(len(loads["reuse"])),
        "no_reuse": range(len(loads["reuse"]), len(loads["reuse"]) + len(loads["no_reuse"])),
    }
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        args.work = Path(tmp)
        args.model = args.work / "model"
        make = ["--model", args.model, "--make-model", "llama", "--size", "small"]
        subprocess.run([sys.executable, *RUNNER, *make], check=True, cwd=ROOT)
        files = {"first": args.work / "first.json", "second": args.work / "second.json"}
        files["first"].write_text(json.dumps({"rounds": loads["reuse"] + loads["no_reuse"]}))
        files["second"].write_text(json.dumps({"rounds": loads["second"]}))
        for rep in range(args.reps):
            order = args.ways[rep % len(args.ways) :] + args.ways[: rep % len(args.ways)]
            results, load = {}, {}
            for way in order:  # the 1-minute load average around each run: how busy it ran
                before = os.getloadavg()[0]
                results[way] = run_way(way, rep, files, args)
                load[way] = {"before": before, "after": os.getloadavg()[0]}
            for way in order:
                measured = measure(results[way], phases, results.get("vllm"))
                row = {"way": way, "rep": rep, "load_average": load[way], **measured}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if "source" not in k}), flush=True)
    summary, targets = summarize(rows, args.ways)
    working_set = sum(len(s) for s in loads["reuse"][-1])
    out = {
        "commit": commit(),
        "machine": f"{platform.node()} ({cpu_model()}, {platform.machine()})",
        "command": command(),
        "elapsed_s": time.monotonic() - started,
        "workload": {
            **{k: v for k, v in vars(args).items() if k not in ("work", "model", "out")},
            "second": sorted(args.second),
            "reuse_requests": sum(map(len, loads["reuse"])),
            "reuse_prompt_tokens": sum(len(p) for r in loads["reuse"] for p in r),
            "working_set_tokens": working_set,
            "no_reuse_requests": sum(map(len, loads["no_reuse"])),
            "engine": "vLLM's CPU build (vllm-cpu), its default engine-core process",
        },
        "targets": targets,
        "summary": summary,
        "rows": rows,
    }
    text = json.dumps(out, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({"targets": targets}, indent=1))
    for way, s in summary.items():
        print(way, {k: round(v["median"]) for k, v in s.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
