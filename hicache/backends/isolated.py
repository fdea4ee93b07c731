"""A store tier whose client runs in a process of its own (``own_process: true``).

Why: isolation. Mooncake's client, its transfer threads, its segment and its process-wide
`MC_*` settings live in a child process (`hicache.backends.store_server`); a client that crashes
or leaks takes the child down, not the engine, and the child is started again. The engine's
process keeps L3's worker threads, which wait on a socket instead of a transfer. It was built to
test whether the client's traffic inside the engine's process slows the engine thread; on H200
hosts it did not make the engine thread faster, and each call pays a round trip between the
processes (README, "The store client in a process of its own").

How: the host pools are anonymous memory files (`HostMemory(shared=True)`), which the child maps
and registers with its client, so transfers stay zero-copy; a call names its pieces as offsets
into those files. Each calling thread gets a channel of its own (a socket pair, the child's end
passed over the control socket), so calls from different workers run at once as before. The
child says whether its store is available whenever that changes; `available` reads that flag
and never blocks.

Failures: a call that cannot reach the child (it exited, or gave no answer within
`reply_timeout_s`) raises `StoreUnavailable`, like a store that is down. A child that exits is
started again after a backoff (1 s, doubling to 30 s) with every memory file registered again;
the store's own breaker and reconnects run inside it. Errors the child's store raises come back
as the same class (`StoreUnavailable`, `ValueError`, `TypeError`; anything else as
RuntimeError) with the same message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hicache import threads
from hicache.backends import wire
from hicache.backends.base import Buffers, StoreTier, StoreUnavailable
from hicache.backends.regions import Region, Regions, check_keys, checked_tensor
from hicache.backends.registry import tier_class
from hicache.config import StoreTierConfig
from hicache.memory import SharedFile, shared_file

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[Exception]] = {
    "StoreUnavailable": StoreUnavailable,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


class IsolatedStore(StoreTier):
    """The store tier of `config` (any registered type), run in a child process.

    Its capabilities are the inner tier's. Calls come from L3's worker threads as with any store
    tier; `available` is read by the engine thread and takes no lock.
    """

    reply_timeout_s = 60.0
    """A call whose answer has not come after this long gives up (StoreUnavailable) and drops
    its channel. The store's own calls end sooner (Mooncake's within its RPC timeout, ~4.3 s
    against a master that is gone): only a child that hangs as a whole reaches it."""
    restart_backoff_s = (1.0, 30.0)
    """Wait before starting a child again after it exited: first, and at most (doubling)."""

    def __init__(self, config: StoreTierConfig) -> None:
        inner = tier_class(config.type)
        self.type = config.type  # type: ignore[misc]
        self.shared = inner.shared  # type: ignore[misc]
        self.persistent = inner.persistent  # type: ignore[misc]
        self.missing_code = inner.missing_code
        self.config = config
        self._cpus = threads.check_cpus(config.worker_cpus)
        self._lock = threading.Lock()  # the control socket
        self._changed = threading.Condition(threading.Lock())  # availability or life changed
        self._memory: Regions[SharedFile] = Regions()  # each with its file (our own descriptor)
        self._control: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._generation = 0  # one per child started; channels of an older one are dropped
        self._local = threading.local()
        self._available = False
        self._closing = False
        self._started = False
        self.restarts = 0  # children started again after one exited

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child, and keep one running, on a background thread; return at once."""
        with self._lock:
            if self._closing:
                raise RuntimeError("IsolatedStore.start after close")
            if self._started:
                return
            self._started = True
        threads.start(self._supervise, "hicache-l3-process", self._cpus)

    @property
    def available(self) -> bool:
        """The child runs and says its store is available. Takes no lock."""
        return self._available and not self._closing

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the store is available or `timeout_s` passed (for tools and tests)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self.available and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return self.available

    def close(self, timeout_s: float = 30.0) -> bool:
        """Close the child's store and let it exit; True if it did within about `timeout_s`
        (otherwise it is killed)."""
        with self._lock:
            if self._closing:
                return True
            self._closing = True
            control, process = self._control, self._process
            self._control = None
        self._set_available(False)
        done = process is None
        if control is not None:
            control.settimeout(timeout_s)
            try:
                wire.send(control, ("close",))
                wire.recv(control)
                done = True
            except (OSError, wire.ChannelClosed):
                pass
            control.close()
        if process is not None:
            try:
                process.wait(timeout_s if done else 1.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                done = False
        for region in self._memory.clear():
            os.close(region.info.fd)
        return done

    def _supervise(self) -> None:
        """Background thread: start the child, follow its status until it exits, start it
        again after a backoff, until close."""
        delay, longest = self.restart_backoff_s
        while True:
            status = self._spawn()
            if status is not None:
                if self._generation > 1:
                    self.restarts += 1
                if self._follow(status):  # it served: a later exit starts the backoff afresh
                    delay = self.restart_backoff_s[0]
                status.close()
            with self._lock:
                if self._closing:
                    return
                process, self._control = self._process, None
            if process is not None:
                code = process.poll()
                log.warning("hicache: the store process exited (%s); starting it again", code)
            time.sleep(delay)
            delay = min(delay * 2, longest)

    def _spawn(self) -> socket.socket | None:
        """Start a child, send it the config and every file; its status socket, or None."""
        control, theirs = socket.socketpair()
        status, their_status = socket.socketpair()
        fds = (theirs.fileno(), their_status.fileno())
        cmd = [sys.executable, "-m", "hicache.backends.store_server", *map(str, fds)]
        try:
            process = subprocess.Popen(cmd, pass_fds=fds, env=_child_env())
        except OSError as err:
            log.error("hicache: starting the store process failed: %r", err)
            for s in (control, theirs, status, their_status):
                s.close()
            return None
        theirs.close()
        their_status.close()
        if self._cpus:
            os.sched_setaffinity(process.pid, self._cpus)
        with self._lock:
            if self._closing:
                process.kill()
                control.close()
                status.close()
                return None
            self._process = process
            self._generation += 1
            try:
                wire.send(control, ("config", self.config.type, self.config.model_dump()))
                for region in self._memory.all():
                    self._send_file(control, region)
            except Exception as err:  # the child is of no use: it goes, a new one is tried later
                log.error("hicache: the store process failed at its start: %r", err)
                process.kill()
                control.close()
                return status
            self._control = control
        return status

    def _follow(self, status: socket.socket) -> bool:
        """Track the child's availability until it exits (its status socket closes); whether
        its store was ever available."""
        served = False
        while True:
            try:
                (_, available), _ = wire.recv(status)
            except (wire.ChannelClosed, OSError):
                self._set_available(False)
                return served
            served = served or available
            self._set_available(available)

    def _set_available(self, available: bool) -> None:
        with self._changed:
            self._available = available
            self._changed.notify_all()

    # -- memory -------------------------------------------------------------------------------

    def register(self, memory: object) -> None:
        """Register a tensor that lies in a shared host memory file (`HostMemory(shared=True)`;
        the cache allocates its pools so where the store tier has ``own_process``). Registering
        the same tensor twice is a no-op; overlapping ones are refused."""
        checked_tensor(memory)
        found = shared_file(memory)  # type: ignore[arg-type]
        if found is None:
            raise ValueError(
                "register: a store in its own process needs the tensor in shared host memory "
                "(HostMemory(shared=True)); this one is private to the process"
            )
        own = SharedFile(os.dup(found.fd), found.offset, found.nbytes)  # for every child to come
        try:
            region = self._memory.add(memory, own)
        except BaseException:
            os.close(own.fd)
            raise
        if region is None:
            os.close(own.fd)
            return
        with self._lock:
            if self._control is not None:
                with contextlib.suppress(OSError, wire.ChannelClosed):
                    self._send_file(self._control, region)
                # (a child gone meanwhile: the next one gets every file at its start)

    @staticmethod
    def _send_file(control: socket.socket, region: Region[SharedFile]) -> None:
        """Register one file with the child (under the control lock); raises its error."""
        f = region.info
        wire.send(control, ("register", region.index, f.offset, f.nbytes), [f.fd])
        (status, *rest), _ = wire.recv(control)
        if status != "ok":
            raise _ERRORS.get(rest[0], RuntimeError)(f"store process: {rest[1]}")

    def _pieces(self, keys: list[str], buffers: Buffers) -> wire.Pieces:
        """The pieces of `buffers` as offsets into the registered files (checked)."""
        at = self._memory.locate(keys, buffers)
        return wire.Pieces(
            at.counts,
            at.region.astype(np.int32).tobytes(),
            at.offset.tobytes(),
            at.size.tobytes(),
            at.span,
        )

    # -- calls --------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call("exists", check_keys(keys))

    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        keys = check_keys(keys)
        return self._call("get_into", keys, self._pieces(keys, buffers))

    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        keys = check_keys(keys)
        return self._call("put_from", keys, self._pieces(keys, buffers))

    def remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """The inner store's `remove`, where it has one."""
        return self._call("remove", check_keys(keys), force)

    def stats(self) -> Any:
        """The inner store's `stats()`, where it has one."""
        return self._call("stats")

    def _call(self, op: str, *args: Any) -> Any:
        """One call on this thread's channel; the child's answer, or its error raised here."""
        sock = self._channel()
        try:
            wire.send(sock, (op, *args))
            (status, *rest), _ = wire.recv(sock)
        except (OSError, wire.ChannelClosed) as err:
            self._local.channel = None
            sock.close()  # a late answer must not be read as the next call's
            raise StoreUnavailable(f"{self.type} store process: no answer to {op} ({err})") from err
        if status == "ok":
            return rest[0]
        kind, message = rest
        raise _ERRORS.get(kind, RuntimeError)(message)

    def _channel(self) -> socket.socket:
        """This thread's socket to the current child (made on first use)."""
        mine = getattr(self._local, "channel", None)
        if mine is not None and mine[0] == self._generation:
            return mine[1]
        if mine is not None:
            mine[1].close()
            self._local.channel = None
        with self._lock:
            control, generation = self._control, self._generation
            if control is None or self._closing:
                raise StoreUnavailable(f"{self.type} store process: not running")
            sock, theirs = socket.socketpair()
            try:
                wire.send(control, ("channel",), [theirs.fileno()])
            except OSError as err:
                sock.close()
                raise StoreUnavailable(f"{self.type} store process: {err}") from err
            finally:
                theirs.close()
        sock.settimeout(self.reply_timeout_s)
        self._local.channel = (generation, sock)
        return sock


def _child_env() -> dict[str, str]:
    """This environment, with the folder that holds this hicache first on the child's path: the
    child imports the same hicache however the engine found it."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
