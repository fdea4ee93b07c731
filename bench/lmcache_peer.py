"""The peer in the vLLM benchmarks: an `lmcache server` beside vLLM, which loads LMCache's
`LMCacheMPConnector` (docs/decisions/vllm-peer.md says why this mode, configured so)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from hicache.tools.mooncake_local import free_port


def connector_config(port: int) -> dict:
    """vLLM's `kv_transfer_config` for LMCache's connector on the server at `port`."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
        },
    }


class LMCacheServer:
    """An `lmcache server` for one way's run (and its second instance): an L1 in memory and a
    file-system L2, `chunk` tokens a chunk. Stopped (SIGINT, then SIGKILL) by `close`."""

    def __init__(self, chunk: int, l1_bytes: int, disk: Path, log: Path) -> None:
        self.port = free_port()
        cmd = [
            str(Path(sys.executable).with_name("lmcache")), "server",
            "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", str(chunk),
            "--l1-size-gb", f"{l1_bytes / 2**30:.4f}", "--eviction-policy", "LRU",
            "--no-l1-use-lazy", "--supported-transfer-mode", "auto",
            "--http-port", str(free_port()),
            "--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)}),
        ]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while "cache server is running" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"lmcache server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
