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

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import pytest

REQUIRE_ENV = "HICACHE_REQUIRE_MOONCAKE"


class _Closable(Protocol):
    def close(self, timeout_s: float = ...) -> object: ...


def find_master_binary() -> str | None:
    """Path of the `mooncake_master` that the installed wheel ships, or None."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = Path(sys.executable).with_name("mooncake_master")
    if beside.is_file():
        return str(beside)
    try:
        import mooncake
    except ImportError:
        return None
    packaged = Path(mooncake.__file__).with_name("mooncake_master")
    return str(packaged) if packaged.is_file() else None


def mooncake_missing() -> str | None:
    """Why Mooncake cannot be used here, or None when it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as err:  # ImportError, or OSError from a missing libibverbs
        return (
            f"mooncake.store does not import ({type(err).__name__}: {err}); install the "
            "'mooncake' extra and Debian's libibverbs1"
        )
    if find_master_binary() is None:
        return "the mooncake_master binary was not found"
    return None


def require_mooncake() -> None:
    """Skip the calling test (fail it under HICACHE_REQUIRE_MOONCAKE=1) without Mooncake."""
    why = mooncake_missing()
    if why is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}", pytrace=False)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the IPv4/IPv6 sockets in LISTEN state on `port` (from /proc/net)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                local, state, inode = parts[1], parts[3], parts[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def _pid_listens(pid: int, port: int) -> bool:
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


class MooncakeMaster:
    """One `mooncake_master` process on 127.0.0.1; the clients use metadata `P2PHANDSHAKE`."""

    def __init__(self, extra_args: Sequence[str] = (), log_dir: str | None = None) -> None:
        binary = find_master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found")
        self.binary = binary
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hicache-mooncake-"))
        self.rpc_port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._clients: list[_Closable] = []
        self._segment: _SegmentHolder | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:<rpc port>`` for `MooncakeConfig.master_address`."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def tier_config(self) -> dict[str, object]:
        """Fields of a ``type: mooncake`` tier section for engines under test: this master, small
        quick settings, and no segment of their own (``global_segment_size: 0``).

        The first access starts a helper process that holds a 128 MiB segment for as long as
        the master runs, so that objects outlive the engine that put them (a client's segment,
        and every object in it, goes away when the client closes)."""
        if self._segment is None:
            self._segment = _SegmentHolder(self.address, 128 << 20)
        return {
            "master_address": self.address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,
            "local_buffer_size": "16MiB",
            "call_timeout_s": 2.0,
            "reconnect_backoff_s": 0.2,
            "breaker_reprobe_s": 0.5,
        }

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0, attempts: int = 5) -> MooncakeMaster:
        """Start on fresh free ports (retrying on a clash) and wait until it listens."""
        last = ""
        for _ in range(attempts):
            self.rpc_port, self.metrics_port = _free_port(), _free_port()
            if self.rpc_port == self.metrics_port:
                continue
            try:
                return self._launch(timeout_s)
            except RuntimeError as err:
                last = str(err)
        raise RuntimeError(f"mooncake_master did not start in {attempts} attempts: {last}")

    def restart(self, timeout_s: float = 10.0) -> MooncakeMaster:
        """Start again on the same ports (after `kill` or `stop`)."""
        if self.running:
            raise RuntimeError("restart: the master is still running")
        return self._launch(timeout_s)

    def _launch(self, timeout_s: float) -> MooncakeMaster:
        self.starts += 1
        log = open(self.log_dir / f"master-{self.rpc_port}-{self.starts}.log", "wb")  # noqa: SIM115
        args = [
            self.binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _pid_listens(self.proc.pid, self.rpc_port):
                # A clash on the metrics port kills the master a little later: look again.
                time.sleep(0.2)
                if self.proc.poll() is None and _pid_listens(self.proc.pid, self.rpc_port):
                    return self
                break
            time.sleep(0.05)
        self._reap(signal.SIGKILL)
        raise RuntimeError(
            f"mooncake_master on port {self.rpc_port} did not listen (log in {self.log_dir})"
        )

    def track(self, client: _Closable) -> _Closable:
        """Remember a client so that `stop` closes it before the master goes."""
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        while self._clients:
            self._clients.pop().close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def kill(self) -> None:
        """SIGKILL the master (tracked clients stay open, for failure tests)."""
        self._reap(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the master keeps its sockets but answers nothing."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Close tracked clients, then end the master (SIGTERM, SIGKILL after 5 s)."""
        self.close_clients()
        self._reap(signal.SIGTERM)

    def _reap(self, sig: int) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(sig)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_HOLD_SEGMENT = """
import sys
from mooncake.store import MooncakeDistributedStore
client = MooncakeDistributedStore()
rc = client.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
sys.stdin.read()
if rc == 0:
    client.close()
"""


class _SegmentHolder:
    """A process that contributes one segment to the store until `close`."""

    def __init__(self, master_address: str, nbytes: int) -> None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR")
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD_SEGMENT, master_address, str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if line != "ready":
            self.close()
            raise RuntimeError(f"segment holder did not start: {line!r}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
