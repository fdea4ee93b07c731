"""One process that runs a test module's vLLM workloads one after another
(`hicache.tools.vllm_run --runs`): torch and vLLM are imported once for all of them, where a
process a run imported them each time (half a minute of a loaded 2-core machine's time a run).
Each run still builds its own `LLM`, with its own configuration, and shuts it down."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

RUNNER = ["-m", "hicache.tools.vllm_run"]


class RunFailed(Exception):
    """A run raised, or the process died or outlived its time: the message has vLLM's log."""


class Runner:
    """Runs `hicache.tools.vllm_run` command lines in one process, started at the first run
    and again after a failed one (a failed run ends its process). `env`: the process's
    environment, the same for every run it takes. `close` ends it."""

    def __init__(self, env: dict[str, str], timeout_s: float = 900.0) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._reply: IO[str] | None = None
        self._log: Path | None = None

    def run(self, args: list[str]) -> None:
        """One run of `args` (the command line after ``-m hicache.tools.vllm_run``), which
        writes its result to its ``--out``. Raises `RunFailed` with the run's log."""
        if self._proc is None:
            self._start()
        assert self._proc and self._proc.stdin and self._log
        start = self._log.stat().st_size
        self._proc.stdin.write(json.dumps([str(a) for a in args]) + "\n")
        self._proc.stdin.flush()
        line = self._read_reply()
        if line is None or "error" in json.loads(line):
            cause = json.loads(line)["error"] if line else "no answer in time, or the process died"
            log = self._tail(start)
            self.close()
            raise RunFailed(f"vLLM run failed: {cause[-2000:]}\nlog:\n{log}")

    def _start(self) -> None:
        fd, name = tempfile.mkstemp(prefix="vllm-runs-", suffix=".log")
        os.close(fd)
        self._log = Path(name)
        reply, write = os.pipe()
        try:
            with self._log.open("ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, *RUNNER, "--runs", "--reply-fd", str(write)],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env, text=True, pass_fds=(write,),
                )  # fmt: skip
        finally:
            os.close(write)
        self._reply = os.fdopen(reply, "r")

    def _read_reply(self) -> str | None:
        """The run's answer, or None if the process ended or the run outlived `timeout_s`."""
        assert self._reply
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self._reply], [], [], left)
            if ready:
                return self._reply.readline() or None
        return None

    def _tail(self, start: int) -> str:
        """What the process logged since `start` (the run's part), its last 4,000 characters."""
        if self._log is None:
            return ""
        with self._log.open("rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        """End the process (its runs have shut their engines down) and remove its log."""
        if self._proc is not None:
            if self._proc.stdin:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._reply is not None:
            self._reply.close()
            self._reply = None
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None
