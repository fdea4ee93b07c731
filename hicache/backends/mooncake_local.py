"""A `mooncake_master` on loopback, for single-host runs, tools and tests.

`hicache replay` starts one for its run when the `mooncake` extra is installed; the test
fixtures build on `LocalMaster`. Production deployments run their master(s) themselves.
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
from collections.abc import Sequence
from pathlib import Path


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


def master_problem(address: str, timeout_s: float = 3.0) -> str | None:
    """Why the Mooncake master at `address` (``host:port``) cannot be reached, or None when it
    accepts a connection within `timeout_s`. For tools that fail at once where the cache would
    keep reconnecting in the background."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"master_address {address!r} is not host:port"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as err:
        why = err.strerror or type(err).__name__
        return f"the Mooncake master at {address} does not answer ({why})"


def free_port() -> int:
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


class LocalMaster:
    """One `mooncake_master` process on 127.0.0.1 (clients use metadata server ``P2PHANDSHAKE``).

    Starts on free ports and waits until the master's *own* process listens on its RPC port (a
    port clash kills a master, sometimes seconds later, while another process answers there).
    """

    def __init__(self, extra_args: Sequence[str] = (), log_dir: str | None = None) -> None:
        binary = find_master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found")
        self.binary = binary
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hicache-mooncake-"))
        self._own_log_dir = log_dir is None  # made here: removed by `stop`
        self.rpc_port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        """``127.0.0.1:<rpc port>`` for `MooncakeConfig.master_address`."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0, attempts: int = 5) -> LocalMaster:
        """Start on fresh free ports (retrying on a clash) and wait until it listens."""
        last = ""
        for _ in range(attempts):
            self.rpc_port, self.metrics_port = free_port(), free_port()
            if self.rpc_port == self.metrics_port:
                continue
            try:
                return self._launch(timeout_s)
            except RuntimeError as err:
                last = str(err)
        raise RuntimeError(f"mooncake_master did not start in {attempts} attempts: {last}")

    def restart(self, timeout_s: float = 10.0) -> LocalMaster:
        """Start again on the same ports (after `kill` or `stop`)."""
        if self.running:
            raise RuntimeError("restart: the master is still running")
        return self._launch(timeout_s)

    def _launch(self, timeout_s: float) -> LocalMaster:
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)  # `stop` removes one made here
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

    def kill(self) -> None:
        """SIGKILL the master (tracked clients stay open, for failure tests)."""
        self._reap(signal.SIGKILL)

    def stop(self) -> None:
        """End the master (SIGTERM, SIGKILL after 5 s). Close its clients first. A log directory
        this object made itself is removed with its logs (one given to it is kept); a master
        that failed to start leaves its logs where the error said."""
        self._reap(signal.SIGTERM)
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
