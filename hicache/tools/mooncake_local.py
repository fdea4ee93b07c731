"""A Mooncake Store on loopback, for single-host runs, tools and tests: a `mooncake_master`
and a store node (the wheel's `mooncake_client`, a process that only contributes memory).

In Mooncake the bytes of an object live in a segment that some client mounted; when that client
exits, its objects go with it. So the engines mount no segment (``global_segment_size: 0``) and
the store node holds the memory: objects outlive the engine that put them. `hicache replay
--store local` starts one `LocalMaster` with a node for its run; the test fixtures build on it.
Production deployments run their master(s) and store nodes themselves (docs/mooncake.md).
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
    return _find_binary("mooncake_master")


def _find_binary(name: str) -> str | None:
    """The wheel's compiled `name` (in the package folder; the one on PATH may be a Python
    launcher that execs it), else one on PATH or beside this interpreter, or None."""
    try:
        import mooncake

        packaged = Path(mooncake.__file__).with_name(name)
        if packaged.is_file():
            return str(packaged)
    except ImportError:
        pass
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.is_file() else None


def mooncake_missing() -> str | None:
    """Why Mooncake cannot be used here, or None when it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as err:  # ImportError, or OSError from a missing libibverbs
        return (
            f"mooncake.store does not import ({type(err).__name__}: {err}); install the "
            "'mooncake' extra and Debian's libibverbs1"
        )
    for name in ("mooncake_master", "mooncake_client"):
        if _find_binary(name) is None:
            return f"the {name} binary was not found"
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


class _LocalProcess:
    """One Mooncake process on 127.0.0.1 that listens on a port of its own once it is ready.

    Started on a free port, ready once its *own* process listens there (a port clash kills a
    master, sometimes seconds later, while another process answers on the port). Its output
    goes to a log file in `log_dir`.
    """

    binary_name = ""
    log_name = ""

    def __init__(self, log_dir: str | Path | None = None) -> None:
        binary = _find_binary(self.binary_name)
        if binary is None:
            raise RuntimeError(f"{self.binary_name} not found")
        self.binary = binary
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hicache-mooncake-"))
        self._own_log_dir = log_dir is None  # made here: removed by `stop`
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _args(self) -> list[str]:
        raise NotImplementedError

    def _pick_ports(self) -> bool:
        """Choose fresh free ports; False if the choice clashes with itself."""
        self.port = free_port()
        return True

    def start(self, timeout_s: float = 10.0, attempts: int = 5) -> _LocalProcess:
        """Start on fresh free ports (retrying on a clash) and wait until it listens."""
        last = ""
        for _ in range(attempts):
            if not self._pick_ports():
                continue
            try:
                return self._launch(timeout_s)
            except RuntimeError as err:
                last = str(err)
        raise RuntimeError(f"{self.binary_name} did not start in {attempts} attempts: {last}")

    def restart(self, timeout_s: float = 10.0) -> _LocalProcess:
        """Start again on the same ports (after `kill` or `stop`)."""
        if self.running:
            raise RuntimeError(f"restart: the {self.binary_name} is still running")
        return self._launch(timeout_s)

    def _launch(self, timeout_s: float) -> _LocalProcess:
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)  # `stop` removes one made here
        name = f"{self.log_name}-{self.port}-{self.starts}.log"
        log = open(self.log_dir / name, "wb")  # noqa: SIM115
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        self.proc = subprocess.Popen(
            [self.binary, *self._args()], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _pid_listens(self.proc.pid, self.port):
                # A clash on another port kills a master a little later: look again.
                time.sleep(0.2)
                if self.proc.poll() is None and _pid_listens(self.proc.pid, self.port):
                    return self
                break
            time.sleep(0.05)
        self._reap(signal.SIGKILL)
        raise RuntimeError(
            f"{self.binary_name} on port {self.port} did not listen (log in {self.log_dir})"
        )

    def kill(self) -> None:
        """SIGKILL the process (for failure tests)."""
        self._reap(signal.SIGKILL)

    def stop(self) -> None:
        """End the process (SIGTERM, SIGKILL after 5 s). A log directory this object made
        itself is removed with its logs (one given to it is kept); a process that failed to
        start leaves its logs where the error said."""
        self._reap(signal.SIGTERM)
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

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


class StoreNode(_LocalProcess):
    """A store node: the wheel's `mooncake_client`, which mounts `segment_bytes` of its memory
    in the store of the master at `master_address` and does nothing else. The objects put into
    its segment live as long as it does (and its master: a restarted master knows none)."""

    binary_name = "mooncake_client"
    log_name = "node"

    def __init__(
        self, master_address: str, segment_bytes: int, log_dir: str | Path | None = None
    ) -> None:
        super().__init__(log_dir)
        self.master_address = master_address
        self.segment_bytes = segment_bytes

    def _args(self) -> list[str]:
        return [
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={self.segment_bytes}",
        ]

    def start(self, timeout_s: float = 10.0, attempts: int = 5) -> StoreNode:
        super().start(timeout_s, attempts)
        return self


class LocalMaster(_LocalProcess):
    """One `mooncake_master` on 127.0.0.1 (clients use metadata server ``P2PHANDSHAKE``), and,
    with `segment_bytes`, a `StoreNode` of that size beside it: started after the master,
    stopped before it (a node unmounts through its master)."""

    binary_name = "mooncake_master"
    log_name = "master"

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        log_dir: str | None = None,
        segment_bytes: int = 0,
    ) -> None:
        super().__init__(log_dir)
        self.extra_args = list(extra_args)
        self.segment_bytes = segment_bytes
        self.metrics_port = 0
        self.node: StoreNode | None = None

    @property
    def rpc_port(self) -> int:
        return self.port

    @property
    def address(self) -> str:
        """``127.0.0.1:<rpc port>`` for `MooncakeConfig.master_address`."""
        return f"127.0.0.1:{self.port}"

    def engine_tier(self) -> dict[str, object]:
        """A ``type: mooncake`` tier section for an engine on this store: this master, and no
        segment of the engine's own (the store node holds the memory)."""
        return {
            "type": "mooncake",
            "master_address": self.address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,
        }

    def _pick_ports(self) -> bool:
        self.port, self.metrics_port = free_port(), free_port()
        return self.port != self.metrics_port

    def _args(self) -> list[str]:
        return [
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 10.0, attempts: int = 5) -> LocalMaster:
        super().start(timeout_s, attempts)
        if self.segment_bytes:
            self.add_node(self.segment_bytes, timeout_s)
        return self

    def add_node(self, segment_bytes: int, timeout_s: float = 10.0) -> StoreNode:
        """Start a store node of `segment_bytes` on this master (kept in `node`; one only)."""
        if self.node is not None:
            raise RuntimeError("this master has a store node already")
        self.node = StoreNode(self.address, segment_bytes, self.log_dir / "node")
        try:
            self.node.start(timeout_s)
        except RuntimeError:
            self.node = None
            raise
        return self.node

    def restart(self, timeout_s: float = 10.0) -> LocalMaster:
        """Start the master again on the same ports (after `kill`); a store node left running
        mounts its segment on it again by itself."""
        super().restart(timeout_s)
        return self

    def stop(self) -> None:
        """End the store node, then the master (SIGTERM, SIGKILL after 5 s). Close the engines'
        clients first. A log directory this object made itself is removed with its logs."""
        node, self.node = self.node, None
        if node is not None:
            node.stop()
        super().stop()

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
