"""vLLM's own benchmark client (`vllm bench serve`) against vLLM's OpenAI server: vLLM alone,
vLLM + hicache and vLLM + LMCache, interleaved. Run through bench/vllm.py, in an environment
with vLLM's CPU build, Mooncake and LMCache (installed as bench/vllm.py says), hicache from this
tree:

    python bench/vllm.py serve --out bench/results/vllm_serve_cpu.json     # 5 repetitions

The way docs/vllm.md's "Measure it yourself" measures, with every way of the comparison:

- ``vllm``: vLLM alone;
- ``hicache_host``, ``hicache_disk``, ``hicache_mooncake``: vLLM + `HiCacheConnector` with a host
  tier alone, a host tier and a disk tier, a host tier and a Mooncake tier on the store node
  that `hicache.tools.mooncake_local` starts for the run;
- ``lmcache<chunk>`` (``lmcache128``, ``lmcache256``; 64 and 512 too): vLLM + LMCache's
  `LMCacheMPConnector` with an `lmcache server` of that chunk size (an L1 the size of hicache's
  host tier, a file-system L2); the targets are taken against the one with the lower reuse
  TTFT p50.

Each way, each repetition: a fresh server (vLLM's CPU build, a random 4-layer Llama, prefix
caching on, a KV pool below the working set, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` on every
server so that each runs its model on the same cores: vLLM's CPU build otherwise reserves one
more core where a KV connector is configured), every store empty; then two `vllm bench serve`
runs, one request at a time: **reuse** (`prefix_repetition`: `--prefixes` prefixes, each
followed by its own suffixes, shuffled) and **no reuse** (the same lengths, every prefix new).
Every repetition runs every way once, in an order rotated by one from the repetition before.
Before each way the bench waits (at most `--load-wait-s`) for the 1-minute load average to fall
to `--max-load` (its own last way's load decays in a minute or two); the load average before
and after each way is recorded, and a repetition in which a way still started above
`--max-load` (other work on the machine) is run again (at most `--reruns` times; the discarded
ones are kept in the JSON). vLLM's counters of prompt tokens by source and hicache's hit
tokens by tier are read from the server's /metrics around each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import ROOT, command, commit, cpu_model
from lmcache_peer import LMCacheServer, connector_config

from hicache.tools.mooncake_local import LocalMaster, free_port

KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # the small model: 4 layers, K and V, 2 heads of 64, fp32
COUNTERS = (  # vLLM's /metrics families read around each run, by their one distinguishing label
    ("vllm:prompt_tokens_by_source_total", "source"),
    ("vllm:prompt_tokens_cached_by_source_total", "source"),
    ("vllm:hicache_hit_tokens_total", "tier"),
)
RUNNER = ("-m", "hicache.tools.vllm_run")  # makes the model
FIGURES = ("median_ttft_ms", "p90_ttft_ms", "request_throughput", "median_tpot_ms")


def env(**extra: str) -> dict[str, str]:
    """This environment for a child, with this tree's hicache first on its path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


Setup = Callable[[Path, Namespace], tuple[dict | None, list[Callable[[], None]]]]
"""A way's setup: vLLM's `--kv-transfer-config` for it (None: vLLM alone) and what stops what
it started beside vLLM."""


def hicache(tiers: list[dict]) -> dict:
    return {
        "kv_connector": "HiCacheConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_connector_extra_config": {"hicache": {"tiers": tiers}},
    }  # fmt: skip


def host_tier(args: Namespace) -> dict:
    return {"type": "host", "size": args.host_bytes}


def hicache_host(work: Path, args: Namespace) -> tuple[dict | None, list]:
    return hicache([host_tier(args)]), []


def hicache_disk(work: Path, args: Namespace) -> tuple[dict | None, list]:
    disk = {"type": "disk", "path": str(work / "disk"), "size": args.disk_bytes}
    return hicache([host_tier(args), disk]), []


def hicache_mooncake(work: Path, args: Namespace) -> tuple[dict | None, list]:
    store = LocalMaster(log_dir=str(work / "mooncake"), segment_bytes=args.disk_bytes).start()
    return hicache([host_tier(args), store.engine_tier()]), [store.stop]


def lmcache(chunk: int) -> Setup:
    def setup(work: Path, args: Namespace) -> tuple[dict | None, list]:
        server = LMCacheServer(chunk, args.host_bytes, work / "l2", work / "lmcache.log")
        return connector_config(server.port), [server.close]

    return setup


SETUPS: dict[str, Setup] = {
    "vllm": lambda work, args: (None, []),
    "hicache_host": hicache_host,
    "hicache_disk": hicache_disk,
    "hicache_mooncake": hicache_mooncake,
    **{f"lmcache{chunk}": lmcache(chunk) for chunk in (64, 128, 256, 512)},
}


class Server:
    """One vLLM OpenAI server (`vllm serve`) for one way's run, with what runs beside it (an
    `lmcache server`, a Mooncake store); `close` stops them all."""

    def __init__(self, way: str, work: Path, args: Namespace) -> None:
        self.port, self.log = free_port(), work / "server.log"
        transfer, self._beside = SETUPS[way](work, args)
        cmd = [
            sys.executable, "-m", "hicache.tools.vllm_cli", "serve", args.model,
            "--dtype", "float32", "--enforce-eager", "--seed", "0", "--port", str(self.port),
            "--host", "127.0.0.1", "--max-model-len", str(args.max_model_len),
            "--kv-cache-memory-bytes", str(args.kv_tokens * KV_BYTES_PER_TOKEN),
        ]  # fmt: skip
        if transfer:
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        self.proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            env=env(VLLM_CPU_NUM_OF_RESERVED_CPU=str(args.reserved_cpus)),
            cwd=work, start_new_session=True,
        )  # fmt: skip
        try:
            self._wait_ready(args.start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"vLLM's server did not start:\n{self.tail()}")
            time.sleep(1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def omp_cores(self) -> str:
        """The cores vLLM bound its model's OpenMP threads to, as it logged them."""
        found = re.findall(r"local_rank=0, core ids=(\[[^\]]*\])", self.log.read_text("latin-1"))
        return found[-1] if found else "unknown"

    def counters(self) -> dict[str, float]:
        """`COUNTERS` from the server's /metrics, as ``family{label}: value``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for family, label in COUNTERS:
            for m in re.finditer(rf'^{re.escape(family)}{{[^}}]*{label}="([^"]+)"[^}}]*}} (\S+)$',
                                 text, flags=re.M):  # fmt: skip
                out[f"{family}{{{m.group(1)}}}"] = float(m.group(2))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # vLLM and its engine process
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for stop in reversed(self._beside):
            stop()
        self._beside = []


def bench_serve(server: Server, prefixes: int, seed: int, out: Path, args: Namespace) -> dict:
    """One `vllm bench serve` run of `prefix_repetition` (vLLM's own client, through
    `hicache.tools.vllm_cli` so that it starts with vLLM's CPU build); its result JSON with the
    server's counters gained during the run (``counters``)."""
    before = server.counters()
    cmd = [
        sys.executable, "-m", "hicache.tools.vllm_cli", "bench", "serve", "--backend", "vllm",
        "--base-url", server.url, "--model", args.model, "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.prompts), "--max-concurrency", "1", "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    log = out.with_suffix(".log")
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), cwd=out.parent)
    if done.returncode:
        raise SystemExit(f"vllm bench serve failed:\n{log.read_text()[-4000:]}")
    result = json.loads(out.read_text())
    after = server.counters()
    result["counters"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k)}
    return result


def run_way(way: str, rep: int, args: Namespace) -> dict:
    """One way's server through both workloads; the row of figures."""
    work = Path(tempfile.mkdtemp(prefix=f"{way}-{rep}-", dir=args.work))
    started = time.monotonic()
    server = Server(way, work, args)
    row: dict = {"way": way, "rep": rep, "omp_cores": server.omp_cores()}
    try:
        row["start_s"] = time.monotonic() - started
        for name, prefixes, seed in (
            ("reuse", args.prefixes, rep),
            ("no_reuse", args.prompts, 1000 + rep),
        ):
            result = bench_serve(server, prefixes, seed, work / f"{name}.json", args)
            if result["completed"] != args.prompts:
                raise SystemExit(f"{way}: {result['completed']} of {args.prompts} completed")
            row[name] = {k: result[k] for k in FIGURES} | {"counters": result["counters"]}
    finally:
        server.close()
    row["elapsed_s"] = time.monotonic() - started
    return row


def quiet(limit: float, timeout_s: float) -> float:
    """Wait until the 1-minute load average is at most `limit` (the last way's own load decays
    in a minute or two on an otherwise quiet machine), at most `timeout_s`; the seconds waited."""
    started = time.monotonic()
    while os.getloadavg()[0] > limit and time.monotonic() - started < timeout_s:
        time.sleep(5)
    return time.monotonic() - started


def repetition(rep: int, args: Namespace) -> list[dict]:
    """Every way once, in an order rotated by `rep`, with the load average around each."""
    order = args.ways[rep % len(args.ways) :] + args.ways[: rep % len(args.ways)]
    rows = []
    for way in order:
        waited = quiet(args.max_load, args.load_wait_s)
        before = os.getloadavg()[0]
        row = run_way(way, rep, args)
        row["load_average"] = {"before": before, "after": os.getloadavg()[0], "waited_s": waited}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def spread(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def summarize(rows: list[dict], ways: list[str]) -> tuple[dict, dict]:
    """Per way and workload: median [min, max] over the repetitions; then the targets as
    ratios of the medians, with the ratio within each repetition."""
    summary = {
        way: {
            f"{load}_{k}": spread([r[load][k] for r in rows if r["way"] == way])
            for load in ("reuse", "no_reuse")
            for k in FIGURES
        }
        for way in ways
    }

    def ratio(way: str, other: str, load: str, figure: str, target: float, least=False) -> dict:
        """`way`'s median of a figure over `other`'s against its target (an upper bound; a
        lower one where `least`), and the ratio within each repetition."""
        key = f"{load}_{figure}"
        value = summary[way][key]["median"] / summary[other][key]["median"]
        mine = {r["rep"]: r[load][figure] for r in rows if r["way"] == way}
        per_rep = [mine[r["rep"]] / r[load][figure] for r in rows if r["way"] == other]
        met = value >= target if least else value <= target
        return {"value": value, "per_rep": spread(per_rep), "target": target, "met": met}

    targets: dict = {}
    lmcaches = [w for w in ways if w.startswith("lmcache")]
    best = min(lmcaches, key=lambda w: summary[w]["reuse_median_ttft_ms"]["median"], default=None)
    for way in (w for w in ways if w.startswith("hicache")):
        t: dict = {}
        if "vllm" in ways:
            t["reuse_ttft_p50_vs_vllm"] = ratio(way, "vllm", "reuse", "median_ttft_ms", 0.5)
            t["reuse_req_per_s_vs_vllm"] = ratio(
                way, "vllm", "reuse", "request_throughput", 1.3, least=True
            )
            t["no_reuse_ttft_p50_vs_vllm"] = ratio(way, "vllm", "no_reuse", "median_ttft_ms", 1.05)
        if best:
            t["reuse_ttft_p50_vs_lmcache"] = {
                **ratio(way, best, "reuse", "median_ttft_ms", 0.9), "lmcache": best
            }  # fmt: skip
        targets[way] = t
    return summary, targets


def parse_args(argv: list[str]) -> Namespace:
    p = argparse.ArgumentParser(prog="bench/vllm.py serve", description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ways", default="vllm,hicache_host,hicache_disk,hicache_mooncake,"
                   "lmcache128,lmcache256")  # fmt: skip
    p.add_argument("--prompts", type=int, default=20, help="requests of each workload")
    p.add_argument("--prefixes", type=int, default=4, help="distinct prefixes of the reuse run")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=2560, help="vLLM's KV pool, in tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--host-bytes", type=int, default=1 << 30, help="host tier / LMCache L1")
    p.add_argument("--disk-bytes", type=int, default=1 << 30, help="disk, store node, LMCache L2")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server")  # fmt: skip
    p.add_argument(
        "--max-load",
        type=float,
        default=2.5,
        help="run a repetition again where the 1-minute load average passed this",
    )
    p.add_argument("--reruns", type=int, default=3, help="at most this many times a repetition")
    p.add_argument("--load-wait-s", type=float, default=240,
                   help="before each way: wait at most this long for --max-load")  # fmt: skip
    p.add_argument("--start-timeout-s", type=float, default=900)
    args = p.parse_args(argv)
    args.ways = args.ways.split(",")
    unknown = [w for w in args.ways if w not in SETUPS]
    if unknown:
        p.error(f"unknown ways {unknown}: the ways are {', '.join(SETUPS)}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    rows: list[dict] = []
    discarded: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        args.work = Path(tmp)
        args.model = str(args.work / "model")
        make = ["--model", args.model, "--make-model", "llama", "--size", "small"]
        subprocess.run([sys.executable, *RUNNER, *make], check=True, cwd=ROOT)
        for rep in range(args.reps):
            for attempt in range(args.reruns + 1):
                got = repetition(rep, args)
                peak = max(r["load_average"]["before"] for r in got)
                if peak <= args.max_load or attempt == args.reruns:
                    rows += got
                    break
                print(f"repetition {rep}: load average {peak:.2f} > {args.max_load}: again")
                discarded += [{**r, "attempt": attempt} for r in got]
    summary, targets = summarize(rows, args.ways)
    working_set = args.prefixes * args.prefix_len + args.prompts * args.suffix_len
    out = {
        "commit": commit(),
        "machine": f"{platform.node()} ({cpu_model()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs)",
        "command": command(),
        "elapsed_s": time.monotonic() - started,
        "workload": {
            **{k: v for k, v in vars(args).items() if k not in ("work", "model", "out")},
            "client": "vllm bench serve (python -m hicache.tools.vllm_cli bench serve)",
            "reuse_working_set_tokens": working_set,
            "kv_pool_tokens": args.kv_tokens,
            "engine": "vLLM's CPU build (vllm-cpu), its OpenAI server",
        },
        "targets": targets,
        "summary": summary,
        "rows": rows,
        "discarded_for_load": discarded,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    for way, figures in summary.items():
        print(way, {k: round(v["median"], 2) for k, v in figures.items()})
    print(json.dumps({"targets": targets}, indent=1))
