"""`hicache replay` with a host tier alone against the same with a local Mooncake store tier
(`--store local`: a master and a store node of the run's own), the two taking turns, repeated:
what the store tier costs or buys the cache-on run, and what a second instance gets from it.

    python bench/replay_store.py --machine vm --repeats 2

Writes bench/results/replay_store_<machine>.json: per run the TTFT p50/p90 off and on, the
end-to-end times, the tokens each tier served and the second instance's figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, command, commit, cpu_model

KEYS = ("ttft_p50_off_s", "ttft_p50_on_s", "ttft_p90_off_s", "ttft_p90_on_s", "identical")


def replay(store: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        args = ["replay", "--quiet", "--store", store, "--json", str(out), *extra]
        subprocess.run([sys.executable, "-m", "hicache.cli", *args], check=True, cwd=ROOT)
        res = json.loads(out.read_text())
    row = {k: res[k] for k in KEYS}
    row.update(
        e2e_off_s=res["off"]["e2e_s"],
        e2e_on_s=res["on"]["e2e_s"],
        cached_tokens_host=res["on"]["cached_tokens_host"],
        cached_tokens_store=res["on"]["cached_tokens_store"],
        prompt_tokens=res["on"]["prompt_tokens"],
    )
    if "second_instance" in res:
        row["second_instance"] = res["second_instance"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", required=True, help="names the result file")
    ap.add_argument("--repeats", type=int, default=2)
    args, extra = ap.parse_known_args()
    runs: list[dict] = []
    for r in range(args.repeats):
        order = ("off", "local") if r % 2 == 0 else ("local", "off")
        for store in order:
            runs.append({"store": store, "round": r, **replay(store, extra)})
            print(json.dumps(runs[-1]), flush=True)
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {cpu_model()}",
        "command": command(),
        "runs": runs,
    }
    path = ROOT / "bench" / "results" / f"replay_store_{args.machine}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
