"""The pieces under a store client in its own process that need no store: host memory in a
shared file, and the messages between the two processes."""

from __future__ import annotations

import mmap
import os
import socket
import threading

import pytest
import torch

from hicache.backends import wire
from hicache.memory import HostMemory, shared_file


def test_a_view_of_shared_memory_names_its_file_and_offset_until_closed():
    memory = HostMemory(1 << 16, pin=False, shared=True)
    view = memory.tensor[4096:8192]
    found = shared_file(view)
    assert found is not None
    assert (found.fd, found.offset, found.nbytes) == (memory.fd, 4096, 4096)
    memory.tensor[4096] = 7
    with mmap.mmap(found.fd, 1 << 16) as other:  # what another process maps: the same bytes
        assert other[4096] == 7
        other[4097] = 9
    assert int(memory.tensor[4097]) == 9
    memory.close()
    assert memory.fd is None and shared_file(view) is None


def test_private_memory_has_no_shared_file():
    assert shared_file(HostMemory(4096, pin=False).tensor) is None
    assert shared_file(torch.zeros(16, dtype=torch.uint8)) is None


def test_a_message_and_a_descriptor_arrive_whole():
    left, right = socket.socketpair()
    r, w = os.pipe()
    with left, right:
        big = ("put_from", ["k"] * 50_000, b"\x01" * (3 << 20))  # larger than a socket buffer
        wire.send(left, ("register", 0, 0, 4096), [r])
        (message, fds) = wire.recv(right, with_fds=1)
        assert message == ("register", 0, 0, 4096) and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"  # the same pipe, through the passed descriptor
        for fd in (r, w, *fds):
            os.close(fd)
        sender = threading.Thread(target=wire.send, args=(left, big))
        sender.start()
        assert wire.recv(right)[0] == big
        sender.join()
        left.close()
        with pytest.raises(wire.ChannelClosed):
            wire.recv(right)
