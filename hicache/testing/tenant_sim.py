"""A seeded simulation of tenants on a shared disk tier attached and detached at runtime
(issue 60), with its own coverage marks and canaries; self-contained beside `hicache.testing.sim`.

One real `HiCache` (a small host tier over a small disk tier, three tenants: acme and globex
encrypted, acme with a share of each tier, globex with a quota of each; and requests of no
tenant) runs a seeded sequence of
steps: a request of one of them (a prompt from a small pool, so prefixes recur), a flood of
unique prompts, a disk tier attached, or detached right after a request (its puts in flight; not
waited for). Every step ends with the tiers settled, so that which slots are pinned when one is
evicted does not depend on timing. After every step it checks:

- every loaded byte is the page's own (the page's KV is a function of its tenant and tokens);
- a request asked after a detach is never answered from the detached tier;
- once a detach has finished, the tier left no thread and no open file;
- an encrypted tenant's KV never rests in plaintext in the disk tier's files;
- globex never holds more host pages than its quota once its pages are idle, nor more bytes of
  disk records (counted from the files) than its disk quota; a step of another tenant never
  takes acme below its share of either tier.

`MARKS` are the coverage marks (`hicache.core.marks`) a run must reach, `CANARIES` the defects
it must catch (each a patch of the real code and the violation it must cause, `EXPECT`).
``python -m hicache.testing.tenant_sim --seeds 0-2 [--canary NAME]`` runs it from a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from hicache import HiCache, PagedBuffer, load_config
from hicache.core import marks
from hicache.testing.canaries import Install, _patch

PAGE_TOKENS, PAGE_BYTES, HOST_PAGES, BLOCKS = 4, 256, 48, 32
SHARE, QUOTA = 20, 10  # acme's host share, globex's host quota (pages)
RECORD = 4096 + 2 * PAGE_BYTES + 16  # a disk record of a group at most (an encrypted one's tag)
DISK, DISK_SHARE, DISK_QUOTA = 24 * RECORD, 12 * RECORD, 8 * RECORD  # bytes
TENANTS = ("acme", "globex", None)
ENCRYPTED = ("acme", "globex")
KEYS = {"acme": "11" * 32, "globex": "22" * 32}

CATCHERS = {
    "tenant-plaintext-written": 0,
    "detached-tier-still-read": 0,
    "quota-not-kept": 0,
    "share-not-kept": 0,
    "disk-quota-not-kept": 1,
    "disk-share-not-kept": 0,
}
"""A seed of each canary's run that catches it."""

MARKS = (
    "crypt.sealed", "crypt.opened", "host.evict.tenant", "host.evict.quota", "tier.attached",
    "tier.detached", "disk.evict.tenant", "disk.evict.quota",
)  # fmt: skip
"""The coverage marks a run of the CI seeds reaches."""


class Violation(AssertionError):
    """An invariant of the simulation broke."""


def kv(tenant: str | None, tokens: np.ndarray, end: int) -> np.ndarray:
    """The KV of the page ending at token `end` of `tenant`'s prompt `tokens`."""
    seed = hashlib.sha256((tenant or "").encode() + tokens[:end].tobytes()).digest()
    return np.frombuffer(seed * (PAGE_BYTES // 32), dtype=np.uint8)


class World:
    """The cache, its disk tier's directory, and what the checks compare against."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.disk = {"type": "disk", "path": str(root / "disk"), "size": DISK, "group_pages": 2,
                     "sync": False}  # fmt: skip
        tenants = [
            {"name": "acme", "key_env": "HICACHE_SIM_KEY_ACME",
             "share": {"host": SHARE * PAGE_BYTES, "disk": DISK_SHARE}},
            {"name": "globex", "key_env": "HICACHE_SIM_KEY_GLOBEX",
             "quota": {"host": QUOTA * PAGE_BYTES, "disk": DISK_QUOTA}},
        ]  # fmt: skip
        cfg = {
            "layout": {"model": "tenant-sim", "kv_dtype": "bfloat16", "page_tokens": PAGE_TOKENS,
                       "page_bytes": PAGE_BYTES},
            "tiers": [{"type": "host", "size": HOST_PAGES * PAGE_BYTES, "pin": "no"}, self.disk],
            "policy": {"fetch_max_wait_ms": 600_000.0},
            "tenants": tenants,
        }  # fmt: skip
        os.environ["HICACHE_SIM_KEY_ACME"] = KEYS["acme"]
        os.environ["HICACHE_SIM_KEY_GLOBEX"] = KEYS["globex"]
        self.pool = torch.zeros(BLOCKS, PAGE_BYTES, dtype=torch.uint8)
        self.cache = HiCache(load_config(cfg, env={}), PagedBuffer.page_first(self.pool))
        if not self.cache.wait_ready(120):
            raise RuntimeError("the cache did not start")
        self.attached = True
        self.detaching = False
        self.stored: dict[str | None, list[np.ndarray]] = {t: [] for t in TENANTS}
        self.n = 0

    def request(self, tenant: str | None, tokens: np.ndarray) -> None:
        """One request: match (waiting for the store), load and check every byte, compute the
        rest, store, release."""
        cache, rid = self.cache, f"r{self.n}"
        self.n += 1
        m = cache.match(rid, tokens, salt=tenant)
        while m.pending:
            cache.poll()
            m = cache.match(rid, tokens, salt=tenant)
        if not self.attached and any(name == "disk" for name, _ in m.tier_tokens):
            raise Violation(f"{rid}: answered from the detached disk tier: {m.tier_tokens}")
        pages = len(tokens) // PAGE_TOKENS
        blocks = list(range(pages))
        cache.load(m, blocks)
        cache.poll()
        for i in range(m.load_pages):
            if not np.array_equal(self.pool[i].numpy(), kv(tenant, tokens, (i + 1) * PAGE_TOKENS)):
                raise Violation(f"{rid} ({tenant}): page {i} loaded wrong bytes")
        for i in range(pages):
            self.pool[i] = torch.from_numpy(kv(tenant, tokens, (i + 1) * PAGE_TOKENS).copy())
        cache.store(rid, tokens, blocks)
        cache.poll()
        cache.release(rid)
        self.stored[tenant].append(tokens)

    def attach(self) -> None:
        self.cache.attach(self.disk)
        if not self.cache.wait_ready(120):
            raise Violation("the attached disk tier did not answer")
        self.attached, self.detaching = True, False

    def detach(self) -> None:
        self.cache.detach("disk", timeout_s=0)  # not waited for: the steps go on
        self.attached, self.detaching = False, True

    def settle(self) -> None:
        for _ in range(60_000):
            self.cache.poll()
            if self.cache.tiers_idle:
                break
            threading.Event().wait(0.002)
        else:
            raise Violation("the tiers did not settle")
        if self.detaching:
            self.detaching = False
            self.check_released()

    def check_released(self) -> None:
        left = [t.name for t in threading.enumerate() if t.name.startswith("hicache-disk-")]
        if left:
            raise Violation(f"a detached tier left threads: {left}")
        files = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(str(self.root)):
                    files.append(fd)
        if files:
            raise Violation(f"a detached tier left {len(files)} open file(s)")

    def check_at_rest(self) -> None:
        """No page of an encrypted tenant in plaintext in any file of the disk tier."""
        files = b"".join(p.read_bytes() for p in (self.root / "disk").rglob("*") if p.is_file())
        for tenant in ENCRYPTED:
            for tokens in self.stored[tenant]:
                for end in range(PAGE_TOKENS, len(tokens) + 1, PAGE_TOKENS):
                    if kv(tenant, tokens, end)[:64].tobytes() in files:
                        raise Violation(f"plaintext of tenant {tenant} at rest on the disk")

    def pages(self, tenant: str) -> int:
        return self.cache.stats().get(f"tenant_host_pages_{tenant}", 0)

    def disk_bytes(self, tenant: str) -> int:
        """The bytes of `tenant`'s records in the disk tier's files (their names carry it)."""
        files = (self.root / "disk" / "objects").rglob(f"*~{tenant}")
        return sum(p.stat().st_size for p in files if p.is_file())


def run(seed: int, steps: int = 60, canary: str | None = None) -> str | None:
    """One seeded run; the first violation (one line), or None."""
    rng = np.random.default_rng(seed)
    prompts = {t: [rng.integers(0, 50_000, 4 * PAGE_TOKENS).astype(np.int32) for _ in range(3)]
               for t in TENANTS}  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="hicache-tenant-sim-"))
    with applied(canary):
        world = World(root)
        try:
            for _ in range(steps):
                op = rng.choice(["request", "request", "request", "flood", "tier"])
                tenant = TENANTS[rng.integers(len(TENANTS))]
                before = world.pages("acme"), world.disk_bytes("acme")
                if op == "tier" and not world.attached:
                    world.attach()
                elif op == "flood":
                    for _ in range(3):  # each settled: which slots are pinned is not timing's
                        world.request(tenant, rng.integers(0, 50_000, 8 * PAGE_TOKENS,
                                                           dtype=np.int32))  # fmt: skip
                        world.settle()
                else:
                    base = prompts[tenant][rng.integers(3)]
                    tail = rng.integers(0, 50_000, rng.integers(0, 3) * PAGE_TOKENS)
                    world.request(tenant, np.concatenate([base, tail]).astype(np.int32))
                    if op == "tier":  # detached with the request's puts in flight
                        world.detach()
                world.settle()  # every put returned: no page is pinned
                if tenant != "acme" and world.pages("acme") < min(before[0], SHARE):
                    raise Violation(f"a step of {tenant} took acme below its share")
                if tenant != "acme" and world.disk_bytes("acme") < min(before[1], DISK_SHARE):
                    raise Violation(f"a step of {tenant} took acme below its disk share")
                if world.pages("globex") > QUOTA:
                    raise Violation(f"globex holds {world.pages('globex')} pages, over its quota")
                if world.disk_bytes("globex") > DISK_QUOTA:
                    raise Violation(f"globex holds {world.disk_bytes('globex')} disk bytes, over")
                world.check_at_rest()
        except Violation as err:
            return str(err)
        finally:
            world.cache.close()
    return None


# -- canaries -------------------------------------------------------------------------------------

CANARIES: dict[str, Install] = {}
"""This simulation's canaries (`hicache.testing.canaries`' are the main simulation's)."""
EXPECT: dict[str, str] = {}


def canary(name: str, expect: str) -> Callable[[Install], Install]:
    """Register a canary of this simulation and the violation it must cause."""

    def add(install: Install) -> Install:
        CANARIES[name], EXPECT[name] = install, expect
        return install

    return add


@contextlib.contextmanager
def applied(name: str | None) -> Iterator[None]:
    """The canary `name` in place for the block (None: none)."""
    undo = None if name is None else CANARIES[name]()
    try:
        yield
    finally:
        if undo is not None:
            undo()


@canary("tenant-plaintext-written", r"plaintext of tenant \w+ at rest")
def _plaintext_written() -> Callable[[], None]:
    """A put never looks up its tenant's key: every object is stored plain."""
    from hicache.chain.jobs import JobRunner

    return _patch(JobRunner, "_key", lambda self, job: None)


@canary(
    "detached-tier-still-read",
    r"answered from the detached disk tier|a detached tier left threads",
)
def _detached_still_read() -> Callable[[], None]:
    """`detach` leaves the tier in the walk (still asked, still running: whichever the steps
    meet first)."""
    from hicache.chain.walk import TierChain

    def detach(self, name):  # type: ignore[no-untyped-def]
        return next(link for link in self.links if link.name == name)

    return _patch(TierChain, "detach", detach)


@canary("quota-not-kept", r"globex holds \d+ pages, over its quota")
def _quota_not_kept() -> Callable[[], None]:
    """A publish past a tenant's quota evicts nothing."""
    from hicache.core.shares import TenantBooks

    return _patch(TenantBooks, "_trim", lambda self, t, n: None)


@canary("share-not-kept", r"took acme below its share")
def _share_not_kept() -> Callable[[], None]:
    """Eviction picks the tenant with the most pages, whatever its share."""
    from hicache.core.shares import TenantBooks

    def victim(self, stuck):  # type: ignore[no-untyped-def]
        held = [(self.used[t], t) for t, own in enumerate(self._lrus) if own and t not in stuck]
        return max(held)[1] if held else None

    return _patch(TenantBooks, "_victim", victim)


@canary("disk-quota-not-kept", r"globex holds \d+ disk bytes, over")
def _disk_quota_not_kept() -> Callable[[], None]:
    """The disk tier's book knows no quota."""
    from hicache.backends.disk.lru import LruBook

    return _patch(LruBook, "_quota", lambda self, tenant: self.size)


@canary("disk-share-not-kept", r"took acme below its disk share")
def _disk_share_not_kept() -> Callable[[], None]:
    """The disk tier's book evicts from the tenant holding the most bytes, whatever its
    share."""
    from hicache.backends.disk.lru import LruBook

    def victim(self, used, tenant, done):  # type: ignore[no-untyped-def]
        held = [(n, t) for t, n in used.items() if t not in done and n > 0]
        return max(held)[1] if held else None

    return _patch(LruBook, "_victim", victim)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-2", help="a range, as 0-2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--canary", choices=sorted(CANARIES))
    args = ap.parse_args()
    lo, _, hi = args.seeds.partition("-")
    failed = 0
    with marks.counting() as counts:
        for seed in range(int(lo), int(hi or lo) + 1):
            error = run(seed, args.steps, args.canary)
            print(f"seed {seed}: {error or 'ok'}")
            failed += error is not None
    for name in MARKS:
        print(name, counts.get(name, 0))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
