"""Mooncake laid out as hicache runs it: a master, a store node holding the memory, and engines
that mount none. What survives what: an engine's exit keeps every object; a store node's restart
loses the objects in its segment; a master's restart loses every object, and the node mounts its
segment on the new master by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache.backends.mooncake.tier import SHOW_NATIVE_LOG
from hicache.tools.mooncake_local import LocalMaster

pytestmark = pytest.mark.mooncake

HERE = Path(__file__).resolve().parent
PROMPTS = 6
PATIENT = {"fetch_max_wait_ms": 600_000.0, "prefill_tokens_per_s": 1.0}
"""A policy that waits for the store however slow the machine (this file is not about
deadlines) and never finds recomputing cheaper."""
HOST_PAGES = 80
"""Room for every prompt's 10 pages (60) beside the fetch reserve (an eighth), however long the
puts that pin them take: with 64, a slow machine's puts still held the first five prompts'
pages when the sixth was stored, and the host dropped 4 of its pages (2 groups never put)."""

_ENGINE = """
import json, sys
sys.path.insert(0, {here!r})
import numpy as np
from test_mooncake_tier import mooncake_config, prompt, settled
from fake_engine import FakeEngine
class M: tier_config = json.loads(sys.argv[1])
e = FakeEngine(mooncake_config(M, **json.loads(sys.argv[2])))
hits = [e.run(f"r{{i}}", prompt(100 + i)) for i in range({n})]  # each loaded byte is checked
settled(e)
print(json.dumps({{"hit": [m.hit_tokens for m in hits], "fetched": [m.fetched_tokens for m in hits],
                  **e.cache.stats()}}))
e.cache.close()
"""


def run_engine(master: LocalMaster, **env: str) -> tuple[dict, str]:
    """A fresh engine process that runs the same prompts through the store and exits: its
    stats and its stderr."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _ENGINE.format(here=str(HERE), n=PROMPTS),
            json.dumps(master.tier_config),
            json.dumps({**PATIENT, "host_pages": HOST_PAGES}),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_process_started_after_the_writer_exited_hits_every_group_it_stored(
    start_mooncake_master,
):
    master = start_mooncake_master()
    first, log = run_engine(master, **{SHOW_NATIVE_LOG: "1"})
    assert "Logging before InitGoogleLogging" in log  # Mooncake's own lines, when asked for
    assert first["hit"] == [0] * PROMPTS
    # 42 tokens of 4 a page: 10 pages, 5 groups of 2 a prompt
    assert (first["pages_dropped"], first["puts_dropped_mooncake"]) == (0, 0)
    assert (first["objects_put_mooncake"], first["put_failed_mooncake"]) == (5 * PROMPTS, 0)

    second, log = run_engine(master)  # the first has exited: only the store node holds them
    assert log == ""  # by default no Mooncake log line reaches an embedder's stderr
    assert second["hit"] == [40] * PROMPTS and second["fetched"] == [40] * PROMPTS
    assert second["pages_fetched_mooncake"] == 10 * PROMPTS
    assert (second["objects_put_mooncake"], second["hit_tokens_host"]) == (0, 0)


# -- what survives what, at the level of objects -------------------------------------------------

_CLIENT = """
import sys
from mooncake.store import MooncakeDistributedStore
client = MooncakeDistributedStore()
assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[1]) == 0
for line in sys.stdin:
    op, key = line.split()
    if op == "put":
        print(client.put(key, key.encode() * 1000), flush=True)
    else:
        print(int(client.get(key) == key.encode() * 1000), flush=True)
client.close()
"""


class Engine:
    """An engine-like Mooncake client in a process of its own, with no segment: put and get
    objects whose bytes are their key, repeated."""

    def __init__(self, master: LocalMaster) -> None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_STORE_CLIENT_SETUP_RETRIES="5")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, master.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def _ask(self, op: str, key: str) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{op} {key}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def put(self, key: str) -> bool:
        return self._ask("put", key) == 0

    def held(self, keys: list[str]) -> list[str]:
        return [k for k in keys if self._ask("get", k)]

    def exit(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(60)


@pytest.fixture
def engines() -> Iterator[Callable[[LocalMaster], Engine]]:
    made: list[Engine] = []

    def make(master: LocalMaster) -> Engine:
        made.append(Engine(master))
        return made[-1]

    yield make
    for e in made:
        if e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()


def put_until_stored(engine: Engine, key: str, timeout_s: float = 120.0) -> float:
    """Put `key` again until the store takes it (a put may land in the segment of a node the
    master has not yet noticed is gone); the seconds that took."""
    start = time.monotonic()
    while not engine.put(key):
        assert time.monotonic() - start < timeout_s, f"{key}: no put succeeded in {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - start


KEYS = [f"k{i}" for i in range(8)]


@pytest.fixture
def stored(start_mooncake_master, engines) -> tuple[LocalMaster, Engine]:
    """A master with a store node, and an engine that has put `KEYS`."""
    master = start_mooncake_master()
    master.add_node(64 << 20)
    writer = engines(master)
    assert all(writer.put(k) for k in KEYS)
    return master, writer


def test_an_engine_restart_keeps_every_object_and_a_node_restart_loses_its_own(stored, engines):
    master, writer = stored
    keys = KEYS
    writer.exit()
    assert engines(master).held(keys) == keys  # engine restart: everything

    assert master.node is not None
    master.node.kill()
    master.node.restart()
    reader = engines(master)
    assert reader.held(keys) == []  # the node's objects went with it
    put_until_stored(reader, "after")  # once the master dropped the dead segment
    assert reader.held(["after"]) == ["after"]


def test_a_master_restart_loses_every_object_and_the_node_serves_the_new_master(stored, engines):
    master, writer = stored
    keys = KEYS
    master.kill()
    master.restart()
    put_until_stored(writer, "after")  # the node mounted its segment on the new master
    assert writer.held([*keys, "after"]) == ["after"]
    writer.exit()
    assert engines(master).held(["after"]) == ["after"]  # and it outlives its writer
