"""Messages between an `IsolatedStore` and its store process, over Unix stream sockets.

A message is an 8-byte little-endian length and a pickle of a tuple. File descriptors (the host
pools' memory files, the sockets of new channels) travel beside a message with SCM_RIGHTS. Both
ends are hicache of the same installation, started by the parent: pickle carries nothing from
anywhere else.

Pieces travel as offsets into registered memory files rather than addresses, since the two
processes map the files at different addresses: `Pieces` is what a get or a put sends.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

_LEN = struct.Struct("<Q")


class ChannelClosed(ConnectionError):
    """The other end closed the socket (its process exited, or it closed the channel)."""


@dataclass(frozen=True)
class Pieces:
    """The pieces of a call's objects, file by file: piece ``j`` is ``sizes[j]`` bytes at
    ``offsets[j]`` in memory file ``files[j]`` (the index the parent gave it when it registered
    the file); object ``i`` has ``counts[i]`` consecutive pieces. Arrays travel as bytes of
    int64 (offsets, sizes) and int32 (files). `span`, when given, is (file, low, high): every
    piece lies in [low, high) of that one file."""

    counts: list[int]
    files: bytes
    offsets: bytes
    sizes: bytes
    span: tuple[int, int, int] | None = None


def send(sock: socket.socket, message: tuple[Any, ...], fds: list[int] | None = None) -> None:
    """Send one message (and `fds` with it). Raises OSError if the other end is gone."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv(sock: socket.socket, with_fds: int = 0) -> tuple[tuple[Any, ...], list[int]]:
    """Receive one message and up to `with_fds` descriptors sent with it. Raises
    `ChannelClosed` when the other end closed before a whole message came."""
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, with_fds)
        head = head + _exactly(sock, _LEN.size - len(head)) if head else b""
    else:
        head = _exactly(sock, _LEN.size)
    if len(head) < _LEN.size:
        raise ChannelClosed("the other end closed the channel")
    (n,) = _LEN.unpack(head)
    return pickle.loads(_exactly(sock, n)), fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ChannelClosed("the other end closed the channel")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
