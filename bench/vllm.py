"""vLLM with and without hicache on one multi-turn workload, three ways in one run.

    python bench/vllm.py --out bench/results/vllm_cpu.json

The same conversations go through vLLM (the CPU build, a random 4-layer model) three ways,
each in a fresh process (`tests/vllm_run.py`), all with vLLM's prefix caching on and a KV
budget (`--kv-tokens`) far below the workload's working set, so vLLM's own cache drops a
conversation before its next turn comes:

- ``vllm``: vLLM alone;
- ``hicache``: vLLM + `HiCacheConnector` with a host tier that holds the working set;
- ``example_disk``: vLLM + its `ExampleConnector` (a directory on local disk), the peer
  connector that runs on the CPU.

Each turn of every conversation is sent as one round (all conversations at once). Rows give
the time to first token (p50, p90) over every request and over the later turns alone, the
throughput (prompt and answer tokens a second) and the prompt tokens served by each source.
Target: hicache's TTFT p50 at most half of vLLM alone's.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, command, commit, cpu_model

RUNNER = ROOT / "tests" / "vllm_run.py"
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4  # the "small" model: 4 layers, K and V, 2 heads, fp32


def run_way(name: str, args: argparse.Namespace, model: Path, work: Path) -> dict:
    out = work / f"{name}.json"
    cmd = [
        sys.executable, RUNNER, "--model", model, "--out", out, "--prefix-caching",
        "--block", str(args.block), "--max-model-len", "4096", "--max-num-seqs", "16",
        "--kv-bytes", str(args.kv_tokens * KV_BYTES_PER_TOKEN),
        "--conversations", str(args.conversations), "--turns", str(args.turns),
        "--first", str(args.first), "--user", str(args.user), "--output", str(args.output),
    ]  # fmt: skip
    if name == "hicache":
        port = 18900
        config = {"tiers": [{"type": "host", "size": args.host_size}], "metrics": {"port": port}}
        cmd += ["--hicache", json.dumps(config), "--metrics-port", str(port)]
    elif name == "example_disk":
        cmd += ["--disk-connector", str(work / "example_disk")]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: vLLM failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarize(name: str, r: dict, conversations: int) -> dict:
    ttft = np.array(r["ttft_s"]) * 1e3
    later = ttft[conversations:]  # the first round is cold for every way
    m = r["vllm_metrics"]
    sources = {
        k.split("source=")[1].rstrip("}"): v
        for k, v in m.items()
        if k.startswith("vllm:prompt_tokens_by_source") and v
    }
    tokens = m.get("vllm:prompt_tokens", 0) + m.get("vllm:generation_tokens", 0)
    return {
        "way": name,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "later_turns_ttft_p50_ms": float(np.percentile(later, 50)),
        "later_turns_ttft_p90_ms": float(np.percentile(later, 90)),
        "elapsed_s": r["elapsed_s"],
        "tokens_per_s": tokens / r["elapsed_s"],
        "prompt_tokens_by_source": sources,
        "preemptions": r["preemptions"],
        "hicache_hit_tokens": {
            k: v for k, v in r.get("hicache", {}).items() if k.startswith("hicache_hit_tokens")
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=1024, help="tokens of a first message")
    p.add_argument("--user", type=int, default=64, help="tokens of a later user message")
    p.add_argument("--output", type=int, default=32, help="tokens of an answer")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=6144, help="vLLM's KV budget, in tokens")
    p.add_argument("--host-size", default="256MiB")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run(
            [sys.executable, RUNNER, "--model", model, "--make-model", "llama", "--size", "small"],
            check=True, capture_output=True,
        )  # fmt: skip
        results = {
            name: run_way(name, args, model, work) for name in ("vllm", "hicache", "example_disk")
        }
    base = results["vllm"]["answers"]
    rows = [summarize(name, r, args.conversations) for name, r in results.items()]
    alone = rows[0]["ttft_p50_ms"]
    for row, r in zip(rows, results.values(), strict=True):
        row["ttft_p50_vs_vllm"] = row["ttft_p50_ms"] / alone
        row["answers_identical_to_vllm"] = r["answers"] == base
    working_set = args.conversations * (
        args.first + (args.turns - 1) * (args.user + args.output) + args.output
    )
    out = {
        "commit": commit(),
        "machine": f"{platform.node()} ({cpu_model()}, {platform.machine()})",
        "command": command(),
        "workload": {**vars(args), "working_set_tokens": working_set},
        "target": "hicache ttft_p50 <= 0.5 x vllm alone",
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for row in rows:
        print(
            f"{row['way']:>13}  TTFT p50 {row['ttft_p50_ms']:8.1f} ms"
            f" p90 {row['ttft_p90_ms']:8.1f} ({row['ttft_p50_vs_vllm']:.2f}x)"
            f"  later turns p50 {row['later_turns_ttft_p50_ms']:8.1f}"
            f"  {row['tokens_per_s']:7.0f} tok/s  identical {row['answers_identical_to_vllm']}"
            f"  sources {row['prompt_tokens_by_source']}"
        )


if __name__ == "__main__":
    main()
