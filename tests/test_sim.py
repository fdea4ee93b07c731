"""The simulation (`hicache.testing`): the CI seed set passes, each canary fails it, a failing
seed reproduces exactly and shrinks, and the documented commands run."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from extras import require

from hicache.backends import envelope
from hicache.core import marks
from hicache.core.checksum import checksum_bytes
from hicache.core.keys import fold_features
from hicache.testing import canaries, faults
from hicache.testing.device import SimDevice
from hicache.testing.oracle import Content, Oracle, Violation
from hicache.testing.sim import plan, replay, run_seed
from hicache.testing.workload import FEATURES, IMAGE_COUNT, Setup, _has_vllm

ROOT = Path(__file__).resolve().parent.parent

CI_OPS = 300
CATCHERS = {
    "available-raises-into-match": 74, "checksum-verdict-ignored": 29,
    "codec-left-out-of-names": 0, "drop-superseded-question": 43,
    "dropped-group-kept-as-held": 0, "failed-load-stored": 49, "forgotten-get-loses-slots": 29,
    "fp8-formats-share-keys": 3, "images-fold-31-bits": 71, "keep-caller-array": 81,
    "lora-not-in-key": 71, "odd-size-header-names-planes": 19,
    "partial-get-publishes-failed-group": 74, "pin-not-released": 81,
    "publish-before-copy": 81, "raw-salt-namespace": 14, "s3fifo-evicts-pinned-main": 232,
    "short-codes-accepted": 3, "state-of-a-shorter-run": 81,
    "stored-over-another-ranks-failed-load": 73, "stray-entry-disables-disk": 81,
    "worker-dies-on-base-exception": 81,
}  # fmt: skip
"""The seed that catches each canary, for its own reason, in its first `CI_OPS` operations
(measured over seeds 0-99, s3fifo's main queue over 0-299: of seeds 0-99 only seed 2 reaches
it, and there a put finds the reused slot first; a seed that does, chosen so that few seeds
catch every canary). The
four of issue 56 (the checksum's verdict, a partial get, s3fifo's main queue, a forgotten get)
passed the CI set before a failed transfer left poison and the world checked the slots a get
writes into and a reserve takes."""
MARKERS = (8, 22)
"""Seeds that reach the coverage marks no catcher reaches: an encoded object read by an
instance without a codec (8), a write: off tier (22)."""
CI_SEEDS = sorted(set(CATCHERS.values()) | set(MARKERS))
STORE_READS = re.compile(r"store reads: (\d+) gets over (\d+) matches .*, (\d+) of (\d+) objects")


def _documented() -> list[str]:
    """The commands docs/simulation.md gives."""
    text = (ROOT / "docs" / "simulation.md").read_text()
    return [line for line in text.splitlines() if line.startswith("python -m hicache.testing")]


def test_the_ci_seeds_pass_and_reach_every_coverage_mark():
    """The coverage command of docs/simulation.md, over the CI set, in a fresh process as a
    user runs it: every seed passes, every coverage mark is reached by the real code, and the
    store tiers are read (a get on one match in 25 or more, half the objects asked or more
    coming back: 7.2 % and 62 % measured)."""
    require("vllm", None if _has_vllm() else "vLLM is not installed: its worlds' marks are unmet")
    (command,) = [c for c in _documented() if "--coverage" in c]
    assert f" --seed-list {','.join(map(str, CI_SEEDS))} --ops {CI_OPS} " in command
    done = _run(command)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    counts = dict(line.split(" ") for line in lines if line.split(" ")[0] in marks.MARKS)
    assert set(counts) == set(marks.MARKS) and "0" not in counts.values(), done.stdout
    gets, matches, back, asked = map(int, STORE_READS.search(done.stdout).groups())
    assert gets >= matches / 25 and back >= asked / 2, done.stdout


@pytest.mark.parametrize("canary", sorted(canaries.CANARIES))
def test_each_canary_fails_the_ci_seeds_for_its_own_reason(canary):
    if plan(CATCHERS[canary], CI_OPS)[0].engine == "vllm":
        require("vllm", None if _has_vllm() else "vLLM is not installed: its catcher is skipped")
    error = run_seed(CATCHERS[canary], CI_OPS, canary, 0).error
    assert error is not None and re.search(canaries.EXPECT[canary], error), error


@pytest.mark.parametrize("canary", sorted(canaries.CANARIES))
def test_each_canary_puts_back_exactly_what_it_patched(canary):
    """A canary's undo leaves every attribute it patched as it found it: the checksum canary's
    patch of a staticmethod once came back as a plain function, so that every get of every
    later seed in the process raised, and four canaries run after it went uncaught."""
    canaries.PATCHED.clear()
    try:
        with canaries.applied(canary):
            pass
    except ImportError:  # a canary of vLLM's side
        require("vllm", "vLLM is not installed")
    assert canaries.PATCHED
    for owner, attr, old in canaries.PATCHED:
        assert vars(owner).get(attr, canaries.ABSENT) is old, (owner, attr)


def test_a_canary_whose_patch_raises_is_not_caught(monkeypatch):
    """A canary counts only where the violation is its own: the publish-before-copy canary's
    patch once took no `tail` argument, so every store raised a TypeError, which a test that
    took any error for a catch passed."""

    def broken() -> Callable[[], None]:
        from hicache.chain.walk import TierChain
        from hicache.kernels.completions import DONE

        stored = TierChain.stored

        def eager(self, keys, ready, slots=None):  # type: ignore[no-untyped-def]
            return stored(self, keys, DONE, slots)

        TierChain.stored = eager
        return lambda: setattr(TierChain, "stored", stored)

    monkeypatch.setitem(canaries.CANARIES, "broken", broken)
    error = run_seed(CATCHERS["publish-before-copy"], CI_OPS, "broken", 0).error
    assert error is not None and error.startswith("TypeError"), error
    assert not re.search(canaries.EXPECT["publish-before-copy"], error)


def test_a_seed_draws_the_same_world_with_or_without_vllm():
    """Where vLLM is not installed a seed draws the same world and operations (a vLLM world is
    skipped, not replaced by another): in a process that cannot import vLLM."""
    seeds = list(range(40))
    script = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "sys.path.insert(0, 'tests')\n"
        "from hicache.testing.sim import run_seed\n"
        "from hicache.testing.workload import _has_vllm\n"
        "from tests.test_sim import drawn\n"
        "assert not _has_vllm()\n"
        f"print(drawn({seeds!r}))\n"
        f"print([s for s in {seeds!r} if run_seed(s, 50).skipped])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert done.returncode == 0, done.stderr
    plans, skipped = done.stdout.splitlines()[-2:]
    assert plans == drawn(seeds)
    vllm = [s for s in seeds if plan(s, 50)[0].engine == "vllm"]
    assert vllm and skipped == repr(vllm)


def drawn(seeds: list[int]) -> str:
    """The worlds and operations `seeds` draw (50 operations each), as one comparable string
    (a set's order differs between processes: sorted here)."""
    out = []
    for seed in seeds:
        setup, ops = plan(seed, 50)
        fields = {**dataclasses.asdict(setup), "features": sorted(setup.features)}
        out.append((sorted(fields.items()), ops))
    return repr(out)


def test_two_of_the_images_fold_to_one_word_on_a_page_of_one_token():
    """The premise of the images-fold-31-bits canary: the last two images give their page the
    same folded word (only the rest of their hashes tells them apart)."""
    require("vllm", None if _has_vllm() else "vLLM is not installed")
    from hicache.testing import vllm_world

    assert len(vllm_world.IMAGES) == IMAGE_COUNT
    (a, _), (b, _) = vllm_world.IMAGES[-2:]
    page = [vllm_world.PLACEHOLDER]
    words = [fold_features(page, 0, 1, [(0, 1, f"image:{x}")]) for x in (a, b)]
    assert words[0] == words[1]


def test_a_thread_whose_awaited_work_has_run_is_not_counted_as_blocked():
    """A step settles when every worker is blocked; a waiter whose work ran but which has not
    woken yet is about to go on (counting it blocked let the next step race it)."""
    device = SimDevice()
    device.run_later(lambda: None)
    waiter = threading.Thread(target=device.wait_for, args=(1,), name="hicache-waiter", daemon=True)
    waiter.start()
    deadline = time.monotonic() + 60
    while device.waiting != {"hicache-waiter"}:
        assert time.monotonic() < deadline, "the waiter never blocked"
        time.sleep(0.001)
    with device._cond:  # the waiter cannot wake while this is held
        device.advance()
        assert device.waiting == set()
    waiter.join(60)
    assert not waiter.is_alive()


DETERMINISM_SEED = 22
"""A world of the CI set with several instances on one store and a disk tier each."""


def test_a_seed_releases_the_same_store_calls_in_the_same_order_every_time(monkeypatch):
    """The store calls a seed lets through, and in which order, do not depend on where memory
    was allocated or on how fast the worker threads woke (a world earlier in the process)."""
    traces: list[list[tuple]] = []
    release, release_call = faults.Gate.release, faults.Gate.release_call

    def recorded(gate: faults.Gate, index: int, fault: str | None) -> faults.Call | None:
        call = release(gate, index, fault)
        traces[-1].append(None if call is None else (call.op, call.names, call.order, fault))
        return call

    def recorded_call(gate: faults.Gate, call: faults.Call, fault: str | None) -> None:
        traces[-1].append((call.op, call.names, call.order, fault))
        release_call(gate, call, fault)

    monkeypatch.setattr(faults.Gate, "release", recorded)
    monkeypatch.setattr(faults.Gate, "release_call", recorded_call)
    keep = []
    setup, ops = plan(DETERMINISM_SEED, CI_OPS)
    assert setup.instances > 1 and any(kind == "disk" for kind, _, _ in setup.stores)
    for _ in range(2):
        traces.append([])
        assert replay(DETERMINISM_SEED, setup, ops) == (CI_OPS, None)
        keep.append(bytearray(1 << 20))  # the next world's memory lies elsewhere
    assert traces[0] and traces[0] == traces[1]


def test_a_failing_seed_fails_the_same_way_again_and_its_shrunk_sequence_fails_too():
    seed = CATCHERS["publish-before-copy"]
    first = run_seed(seed, CI_OPS, "publish-before-copy", 20)
    again = run_seed(seed, CI_OPS, "publish-before-copy", 0)
    assert (first.at, first.error) == (again.at, again.error)
    assert first.shrunk is not None and len(first.shrunk) <= first.at + 1
    with canaries.applied("publish-before-copy"):
        setup, _ = plan(seed, CI_OPS)
        shrunk_error = replay(seed, setup, first.shrunk)[1]
    assert shrunk_error is not None
    # replayed in a fresh process, as a user would: the same violation
    script = (
        "from hicache.testing import canaries\n"
        "from hicache.testing.sim import plan, replay\n"
        "with canaries.applied('publish-before-copy'):\n"
        f"    setup, _ = plan({seed}, {CI_OPS})\n"
        f"    print(replay({seed}, setup, {first.shrunk!r})[1])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert done.stdout.splitlines()[-1:] == [shrunk_error], done.stdout + done.stderr


def _run(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *command.split()[1:]], capture_output=True, text=True, cwd=ROOT,
        timeout=600,
    )  # fmt: skip


def test_the_documented_commands_run():
    """Those of docs/simulation.md but the coverage command (see above)."""
    commands = [c for c in _documented() if "--coverage" not in c]
    assert len(commands) == 2
    for command in commands:
        done = _run(command)
        assert done.returncode == 0, done.stdout + done.stderr
        assert " operations in " in done.stdout.splitlines()[-1]


def test_the_docs_list_every_coverage_mark_and_every_canary():
    text = (ROOT / "docs" / "simulation.md").read_text()
    rows = set(re.findall(r"^\| `([\w.-]+)` \|", text, re.M))
    assert rows == set(marks.MARKS) | set(canaries.CANARIES)


def test_the_shared_store_can_be_a_real_mooncake_master():
    """`--mooncake`: the worlds' shared store is a real Mooncake master and store node of the
    process; seed 0's world (three instances on one shared store) runs clean on it."""
    from mooncake_master import require_mooncake

    require_mooncake()
    setup, _ = plan(0, CI_OPS)
    assert setup.instances == 3 and setup.stores[0][0] == "memory"
    code = subprocess.run(
        [sys.executable, "-m", "hicache.testing.sim", "--seed-list", "0", "--ops", str(CI_OPS),
         "--mooncake", "--coverage", "--shrink-s", "0"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    # exit 1: one seed leaves most coverage marks unreached; none may fail
    last = code.stdout.splitlines()[-1] if code.stdout else ""
    assert ", 0 failed" in last, code.stdout + code.stderr
    counts = dict(line.split(" ") for line in code.stdout.splitlines() if line.count(" ") == 1)
    assert int(counts["store.get"]) > 0 and int(counts["sim.two-writers"]) > 0, code.stdout


def test_a_failure_exits_non_zero_with_the_command_that_reproduces_it():
    seed = CATCHERS["pin-not-released"]
    done = _run(
        f"python -m hicache.testing.sim --seed {seed} --seeds 1 --ops {CI_OPS} --shrink-s 5 "
        "--canary pin-not-released"
    )
    assert done.returncode == 1
    assert f"reproduce: python -m hicache.testing.sim --seed {seed} --seeds 1" in done.stdout


def test_a_bad_argument_is_one_line():
    done = _run("python -m hicache.testing.sim --skip nothing")
    assert done.returncode == 2
    assert "--skip: unknown 'nothing'" in done.stderr


def _object(name: str, payload: np.ndarray) -> bytes:
    """An object as a store tier's worker puts it: its header (`envelope`), then `payload`."""
    headers = envelope.Envelopes(1, 0)
    at = headers.page_header(0)
    headers.seal(name, [at, payload.ctypes.data], [envelope.HEADER, payload.size])
    return headers.memory.numpy()[: envelope.HEADER].tobytes() + payload.tobytes()


def test_the_oracle_checks_what_a_put_holds_behind_its_header():
    """A put's object is a header, then the payload: the oracle compares the payload (it once
    compared the whole object, so a right state failed and no group was checked at all)."""
    oracle = Oracle(page_bytes=64, state_bytes=24, page_tokens=4)
    content = Content(tuple(range(1, 9)))
    keys = [bytes([1]) * 16, bytes([2]) * 16]
    oracle.learn(keys, content, "a store")
    group = f"sim/g2/{keys[1].hex()}"
    pages = np.concatenate([oracle.page(content, 4), oracle.page(content, 8)])
    oracle.check_put(group, _object(group, pages))
    state = f"sim/s/{keys[1].hex()}"
    oracle.check_put(state, _object(state, oracle.state(content, 8)))
    wrong = pages.copy()
    wrong[64 + 5] ^= 1
    with pytest.raises(Violation, match="page 1 of 2 has wrong bytes"):
        oracle.check_put(group, _object(group, wrong))
    with pytest.raises(Violation, match="wrong bytes"):
        oracle.check_put(state, _object(state, oracle.state(content, 4)))
    with pytest.raises(Violation, match="checksum"):
        oracle.check_put(state, _object(group, oracle.state(content, 8)))


def _released(space: faults.Space, call: Callable[[], object], fault: str | None) -> object:
    """What `call` (a store call of a tier on `space`, run on a thread of its own, as a
    worker's) returns or raises once the gate lets it through with `fault`."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as err:  # the call's own failure, returned to the test
            out.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while not space.gate.parked:
        assert time.monotonic() < deadline, "the call never reached the gate"
        time.sleep(0.001)
    space.gate.release(0, fault)
    worker.join(60)
    return out[0]


def test_a_failed_transfer_leaves_poison_where_it_failed():
    """A get made to fail for an object leaves poison in that object's buffers, where its right
    bytes lay before (a failed transfer taken as a hit then went unseen by the byte oracle); a
    get that raises, in all of them. A put made to fail leaves the object it wrote torn: its
    header whole, its payload poison (only the payload's checksum can tell)."""
    from hicache.backends.base import Buffers

    space = faults.SPACES["sim-poison"] = faults.Space()
    try:
        tier = faults.SimTier(faults.SimTierConfig(space="sim-poison"))
        memory = torch.zeros(4 * 96, dtype=torch.uint8)  # objects of 96 bytes: a header, a payload
        tier.register(memory)
        memory[:192] = torch.arange(1, 193, dtype=torch.uint8)
        at = [[memory.data_ptr() + 96 * i] for i in range(4)]
        put, into = Buffers(at[:2], [[96], [96]]), Buffers(at[2:], [[96], [96]])
        assert _released(space, lambda: tier.put_from(["a", "b"], put), None) == [0, 0]
        with marks.counting() as reached:
            codes = _released(space, lambda: tier.get_into(["a", "b"], into), "per_key")
            assert codes == [-5, 96]
            assert (memory[192:288] == faults.POISON).all()
            assert torch.equal(memory[288:], memory[96:192])
            err = _released(space, lambda: tier.get_into(["a", "b"], into), "cancelled")
            assert isinstance(err, asyncio.CancelledError)
            assert (memory[192:] == faults.POISON).all()
            codes = _released(space, lambda: tier.put_from(["c", "d"], put), "per_key")
            assert codes == [-28, 0]
            whole = bytes(memory[:192].numpy())
            assert space.objects["c"] == whole[: faults.HEADER] + bytes([faults.POISON]) * (
                96 - faults.HEADER
            )
            assert space.objects["d"] == whole[96:]
            err = _released(space, lambda: tier.put_from(["a", "e"], put), "exception")
            assert isinstance(err, RuntimeError)
            assert space.objects["a"] == whole[:96]  # held before: the put wrote nothing
            assert space.objects["e"] == whole[96 : 96 + faults.HEADER] + bytes([faults.POISON]) * (
                96 - faults.HEADER
            )
        assert (reached["sim.poisoned-get"], reached["sim.poisoned-put"]) == (3, 2)
    finally:
        del faults.SPACES["sim-poison"]


STEP_WAIT_OPS = [
    ("step",),
    ("ask", "v176", (0, 2, 38, 10, 55, 2, 1, None), 2, False),
    ("step",),
    ("ask", "v181", (0, 1, 19, 52, 37, 1, 2, None), 1, False),
    ("ask", "v199", (0, 0, 43, 15, 48, 0, 2, (1, 21, 7)), 0, False),
    ("device", 2),
    ("device", 3),
    ("call", 3, None),
    ("step",),
    ("device", -1),
    ("preempt", "v176"),
    ("call", 1, None),
    ("call", 1, None),
    ("step",),
    ("ask", "v231", (0, 2, 73, 54, 66, 1, 2, None), 1, False),
    ("call", 1, None),
    ("step",),
    ("call", 1, None),
    ("ask", "v237", (0, 1, 26, 42, 19, 1, 1, (0, 20, 4)), 0, False),
    ("step",),
    ("step",),
]
"""Operations (shrunk from a seed's) in which vLLM's worker waits in its step for a granted
load's fetch, whose store calls are parked at the gate."""
STEP_WAIT_WORLD = Setup(
    page_bytes=512, host_pages=24, stores=(("private", "behind", 4),), fetch_workers=2, memo=0,
    engine="vllm", pin_share=0.1, features=frozenset(FEATURES),
)  # fmt: skip


def test_the_store_answers_while_the_vllm_worker_waits_in_step_for_a_fetch(monkeypatch):
    """The simulation serves parked store calls while the engine thread waits for them (it
    once waited for the next operation to release them: a stall of fetch_max_wait_ms)."""
    require("vllm", None if _has_vllm() else "vLLM is not installed")
    from hicache.testing import vllm_world

    waits = []
    wait = vllm_world.StoreWhileWaiting.wait
    monkeypatch.setattr(
        vllm_world.StoreWhileWaiting, "wait", lambda self, t: waits.append(t) or wait(self, t)
    )
    outcome: list[tuple[int, str | None]] = []
    runner = threading.Thread(
        target=lambda: outcome.append(replay(12, STEP_WAIT_WORLD, STEP_WAIT_OPS)), daemon=True
    )
    runner.start()
    runner.join(240)
    assert outcome == [(len(STEP_WAIT_OPS), None)], "the world stalled in a step"
    assert waits, "the worker never waited for a fetch in its step"


def test_a_vllm_world_of_two_ranks_on_disk_tiers_opens():
    """Each rank's disk tier has its directory, and the scheduler asks no disk tier itself (it
    is no store any process can ask): the scheduler's probe once opened rank 0's directory a
    second time, so that the world did not open (seed 127 of the long run)."""
    require("vllm", None if _has_vllm() else "vLLM is not installed")
    world = Setup(
        page_bytes=512, host_pages=24, stores=(("disk", "behind", 2),), engine="vllm", tp=2,
        features=frozenset(FEATURES),
    )  # fmt: skip
    assert replay(127, world, [("step",)] * 3) == (3, None)


SHARED_FIRST_PAGE_OPS = [
    ("space", "down", 15),
    ("ask", "r32", (1, 1, 7, 3, 21), 0, False),
    ("load", "r32", False, 0.0),
    ("store", "r32", 1),
    ("ask", "r35", (1, 1, 21, 85, 23), 2, True),
    ("load", "r35", True, 0.5),
    ("store", "r35", 0),
    ("space", "up", 26),
]
"""Operations (shrunk from a seed's): two prompts share their first page, not their second;
with groups of two pages, both first groups start in the same host slot, and their puts wait at
the store (down) at the same time."""
SHARED_FIRST_PAGE_WORLD = Setup(
    host_pages=8, state_bytes=24, layers=2, stores=(("memory", "on_evict", 2),), reserve_pages=4,
    features=frozenset(FEATURES),
)  # fmt: skip


def test_two_puts_of_groups_that_start_in_the_same_host_slot_keep_their_own_headers():
    """Each object a store tier keeps verifies (its header's checksum is its payload's): the
    header of a page group lay in the header memory of its first host slot, which a concurrent
    put of another group beginning with the same page overwrote."""
    setup = SHARED_FIRST_PAGE_WORLD
    seen: dict[str, bytes] = {}
    put = faults.SimTier.put_from

    def kept(tier, keys, buffers):  # type: ignore[no-untyped-def]
        out = put(tier, keys, buffers)
        seen.update((k, tier.space.objects[k]) for k in keys if k in tier.space.objects)
        return out

    faults.SimTier.put_from = kept
    try:
        assert replay(167, setup, SHARED_FIRST_PAGE_OPS) == (len(SHARED_FIRST_PAGE_OPS), None)
    finally:
        faults.SimTier.put_from = put
    groups = [name for name in seen if "/g2/" in name]
    assert len(groups) >= 2
    for name in groups:
        data = seen[name]
        value = int.from_bytes(data[24:32], "little")
        assert checksum_bytes(data[envelope.HEADER :], envelope.seed(name)) == value, name
