"""A real `mooncake_master` on loopback for tests and benchmarks.

`MooncakeMaster` starts the master on free ports, waits until the master's *own* process listens
on its RPC port (a port clash kills a master, sometimes seconds later, while another process
answers on the port), and can stop, kill, pause, resume and restart it on the same ports. Clients
handed to `track` are closed before the master stops (Mooncake's close needs the master).

Fixtures (loaded through ``pytest_plugins`` in conftest.py):

- `mooncake_master` (session): one shared master; tests must leave it running.
- `start_mooncake_master` (function): starts masters of the test's own, for tests that kill
  them or need other master flags.

Both skip when Mooncake is not installed, or fail under ``HICACHE_REQUIRE_MOONCAKE=1`` (CI).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import pytest
from extras import require

from hicache.tools.mooncake_local import LocalMaster, mooncake_missing


class _Closable(Protocol):
    def close(self, timeout_s: float = ...) -> object: ...


def require_mooncake() -> None:
    """Skip the calling test (fail it under HICACHE_REQUIRE_MOONCAKE=1) without Mooncake."""
    require("mooncake", mooncake_missing())


class MooncakeMaster(LocalMaster):
    """A `LocalMaster` for tests: also pauses, resumes, and closes tracked clients first."""

    def __init__(self, extra_args: Sequence[str] = (), log_dir: str | None = None) -> None:
        super().__init__(extra_args, log_dir)
        self._clients: list[_Closable] = []

    @property
    def tier_config(self) -> dict[str, object]:
        """Fields of a ``type: mooncake`` tier section for engines under test: this master, quick
        reconnects, calls given time (tests about deadlines set their own), and no segment of
        their own (``global_segment_size: 0``).

        The first access starts a store node that holds a 128 MiB segment for as long as the
        master runs, so that objects outlive the engine that put them (a client's segment, and
        every object in it, goes away when the client closes). A test that fills a store starts
        a master of its own: a full shared segment fails later tests' puts."""
        if self.node is None:
            self.add_node(128 << 20)
        return {
            **{k: v for k, v in self.engine_tier().items() if k != "type"},
            "local_buffer_size": "16MiB",
            "call_timeout_s": 30.0,  # a loaded machine's calls are not failures
            "reconnect_backoff_s": 0.2,
            "breaker_reprobe_s": 0.5,
        }

    def track(self, client: _Closable) -> _Closable:
        """Remember a client so that `stop` closes it before the master goes."""
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        while self._clients:
            self._clients.pop().close()

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: the master keeps its sockets but answers nothing. Returns once every thread
        of it has stopped (a busy machine can let it answer one more call after the signal)."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + timeout_s
        while not all(_stopped(task) for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master {self.proc.pid} did not stop on SIGSTOP")
            time.sleep(0.001)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Close tracked clients, then end the store node and the master."""
        self.close_clients()
        super().stop()


def _stopped(task: Path) -> bool:
    """Whether the thread `task` (/proc/PID/task/TID) is stopped by a signal (state T), or gone."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "T"


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A master shared by the session. Leave it running; use `start_mooncake_master` to kill."""
    require_mooncake()
    master = MooncakeMaster().start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def start_mooncake_master() -> Iterator[Callable[..., MooncakeMaster]]:
    """A factory of masters of this test's own (it may kill, pause or restart them):
    ``start_mooncake_master("--default_kv_lease_ttl=100")``. All are stopped after the test."""
    require_mooncake()
    masters: list[MooncakeMaster] = []

    def start(*extra_args: str) -> MooncakeMaster:
        master = MooncakeMaster(extra_args)
        masters.append(master)
        return master.start()

    try:
        yield start
    finally:
        for master in reversed(masters):
            master.stop()
