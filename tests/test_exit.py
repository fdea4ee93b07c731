"""A process that embeds hicache exits cleanly, whatever its background threads are doing.

Each scenario is a short script run as its own process, five times at once: it builds a
`HiCache` and exits at a given moment (at once, after `close`, while a large host pool is still
being zeroed, after `wait_ready`). A thread still inside torch, CUDA or Mooncake when the
interpreter finalizes aborts the process ("terminate called without an active exception",
SIGABRT); every run must exit 0 with nothing on stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys, torch
from hicache import HiCache, PagedBuffer, load_config
size, l3, moment = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
layout = {"model": "m", "kv_dtype": "float32", "page_tokens": 16, "page_bytes": 4096}
tiers = [{"type": "host", "size": size}, *([l3] if l3 else [])]
cache = HiCache(load_config({"layout": layout, "tiers": tiers}, env={}),
                PagedBuffer.page_first(torch.zeros(64, 4096, dtype=torch.uint8)))
if moment == "ready":
    assert cache.wait_ready(60)
if moment in ("close", "ready"):
    cache.close()
"""

RUNS = 5


def run_all(size: str, l3: dict | None, moment: str) -> list[tuple[int, str]]:
    """Start RUNS processes of the scenario at once; their exit codes and stderr."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, size, json.dumps(l3), moment],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(RUNS)
    ]
    return [(p.wait(120), p.stderr.read() if p.stderr else "") for p in procs]


@pytest.mark.parametrize(
    ("size", "moment"),
    [
        ("64MiB", "now"),  # small pool: its thread is in torch as the interpreter exits
        ("64MiB", "close"),
        ("1GiB", "now"),  # large pool: still being zeroed at exit
        ("1GiB", "ready"),
    ],
)
def test_host_only_process_exits_cleanly(size, moment):
    assert run_all(size, None, moment) == [(0, "")] * RUNS


@pytest.mark.mooncake
def test_process_with_l3_exits_cleanly_without_close(mooncake_master):
    # its L3 threads are connecting, registering the pools or idle as the interpreter exits
    l3 = {**mooncake_master.tier_config, "type": "mooncake", "global_segment_size": "16MiB"}
    results = run_all("64MiB", l3, "now")
    assert [rc for rc, _ in results] == [0] * RUNS, results
    assert not any("terminate called" in err for _, err in results)
