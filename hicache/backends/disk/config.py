"""The disk tier's YAML section (``- type: disk``) and the check of its directory."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from hicache.config import Bytes, StoreTierConfig


class DiskTierConfig(StoreTierConfig):
    """``- type: disk``: objects as files in a directory of a local file system."""

    type: Literal["disk"] = "disk"
    path: str = Field(min_length=1)
    """The directory (made if absent; its parent must exist). One process uses it at a time."""
    size: Bytes = Field(gt=0)
    """Bytes the records may take (``200GiB``); beyond, the least recently used are removed."""
    io_threads: int = Field(default=8, ge=1, le=128)
    """Threads that read and write objects in parallel (enough requests in flight to keep an
    NVMe drive busy; each waits in the kernel without the GIL)."""
    direct_io: Literal["auto", "off"] = "auto"
    """auto: O_DIRECT (no page cache) where the file system takes it and an object's memory and
    sizes are aligned; off: always through the page cache."""
    sync: bool = True
    """Sync each record to the device before publishing it, so that a power loss cannot leave a
    named record with unwritten blocks. Off, a killed process still never leaves a wrong record
    (the rename comes after every write), but a host crash might."""

    def check_machine(self) -> None:
        super().check_machine()
        problem = directory_problem(Path(self.path))
        if problem:
            raise ValueError(f"path: {problem}")


def directory_problem(root: Path) -> str | None:
    """Why `root` cannot serve as a disk tier's directory here, or None: it (or, where it is
    absent, its parent) must be a directory in which this process can create and remove a
    file. Leaves nothing behind: a directory made for the test is removed again."""
    made = False
    try:
        if not root.exists():
            if not root.parent.is_dir():
                return f"{root}: its parent {root.parent} is not a directory"
            root.mkdir()
            made = True
        elif not root.is_dir():
            return f"{root} is not a directory"
        fd, probe = tempfile.mkstemp(dir=root, prefix=".hicache-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"{root}: cannot create files there: {os_reason(err)}"
    finally:
        if made:
            with contextlib.suppress(OSError):
                root.rmdir()
    return None


def os_reason(err: OSError) -> str:
    """What an OSError says, without its errno and path."""
    return err.strerror or str(err)
