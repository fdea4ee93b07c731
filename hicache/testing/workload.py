"""What a seed makes: the world's shape (`Setup`) and the operations run in it (`operations`).

Operations are plain tuples, made in full before the run, so that a failing sequence can be cut
down (`hicache.testing.shrink`) and printed; the world skips one that no longer applies (a load
of a request that was released). Prompts share prefixes (a few base texts, a small vocabulary),
come from several tenants, run past the host tier, and are asked again, with the engine's own
prefix cache grown, or with another prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from hicache.testing.faults import CALL_FAULTS
from hicache.testing.oracle import Content

Op = tuple
"""("ask", rid, spec, computed_pages, partial) | ("load", rid, by_layer, skip) |
("store", rid, decode) | ("release", rid) | ("device", n) | ("poll",) |
("call", index, fault) | ("space", what, arg) | ("reopen",)"""

SALTS = (None, "tenant-a", "tenant-b")
STORE_FAULTS = ("down", "up", "restart", "lost", "truncated", "full")
GOOD_CODES = tuple(f for f in CALL_FAULTS if f not in ("short", "long", "wrong_type"))
"""Call faults whose answers have the right form (without `bad-codes`)."""
FAULT_SHARE = 0.2
"""The share of released store calls that answer with a fault."""


@dataclass(frozen=True)
class Setup:
    """The shape of one seed's world."""

    page_tokens: int = 4
    page_bytes: int = 64
    host_pages: int = 16
    host_states: int = 8
    state_bytes: int = 0
    history_tokens: int = 8
    layers: int = 0
    stores: tuple[tuple[str, str, int], ...] = ()
    """(memory | private | disk, write mode, group pages) of each store tier, in walk order
    (memory: shared by every instance of the world; private: this instance's alone)."""
    fetch_workers: int = 1
    reserve_pages: int = 0
    memo: int = 64
    blocks: int = 128
    decode_max: int = 6
    engine: str = "direct"
    """direct: an engine on HiCache's API; vllm: vLLM's connector pair (`vllm_world`)."""
    pin_share: float = 0.5
    in_step: bool = True
    features: frozenset[str] = frozenset()
    """The `FEATURES` this world exercises."""
    codec: bool = False
    """Store tiers with codec: lossless (objects encoded where they shrink; gets read
    prefixes)."""


FEATURES = {
    "bad-codes": "store calls answer code lists too short, too long or of the wrong type",
    "reuse-buffers": "the engine reuses a released request's token buffer",
    "on-evict": "store tiers with write: on_evict",
    "replaced": "objects replaced at rest by other bytes of the same length",
    "alias-salt": "a tenant salt spelled as hicache spells a LoRA adapter's namespace (vLLM)",
    "cache-grows": "vLLM's own prefix cache grows while a request waits for its answer",
}
"""Parts of the workload that `--skip` can leave out (each finds a class of defect)."""


def draw_setup(rng: random.Random, skip: frozenset[str] = frozenset()) -> Setup:
    """A world's shape, without the `FEATURES` in `skip`."""
    features = frozenset(FEATURES) - skip
    modes = ("behind", "behind", "on_evict", "on_evict", "off")
    if "on-evict" not in features:
        modes = ("behind", "behind", "off")
    stores = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        disk = not any(s[0] == "disk" for s in stores) and rng.random() < 0.4
        kind = "disk" if disk else rng.choice(("memory", "memory", "private"))
        write = rng.choice(modes)
        stores.append((kind, write, rng.choice((1, 2, 4))))
    if rng.random() < VLLM_SHARE and _has_vllm():
        if stores and rng.random() < 0.7:  # tiers vLLM's scheduler knows: it answers in step
            stores = [("private", "behind", G) for _, _, G in stores[:1]]
        return Setup(
            page_bytes=2 * 2 * 4 * 8 * 4,  # two layers of K and V, (4 tokens, 8) float32 each
            host_pages=rng.choice((8, 12, 24, 48)),
            stores=tuple(stores),
            fetch_workers=rng.choice((1, 2)),
            reserve_pages=rng.choice((0, 4)),
            memo=rng.choice((0, 64)),
            engine="vllm",
            pin_share=rng.choice((0.5, 0.1, 0.1)),
            in_step=rng.random() < 0.8,
            features=features,
            codec=_peek(rng) < CODEC_SHARE,
        )
    return Setup(
        host_pages=rng.choice((8, 12, 24, 48)),
        state_bytes=rng.choice((0, 0, 24)),
        layers=rng.choice((0, 0, 2)),
        stores=tuple(stores),
        fetch_workers=rng.choice((1, 2)),
        reserve_pages=rng.choice((0, 4)),
        memo=rng.choice((0, 64)),
        features=features,
        codec=_peek(rng) < CODEC_SHARE,
    )


def _peek(rng: random.Random) -> float:
    """The generator's next `random()`, leaving it where it was: a draw that keeps every seed's
    world and operations as they were before it."""
    state = rng.getstate()
    value = rng.random()
    rng.setstate(state)
    return value


CODEC_SHARE = 0.3
"""The share of seeds whose store tiers have a codec."""
VLLM_SHARE = 0.35
"""The share of seeds whose engine is vLLM's connector pair (where vLLM is installed)."""


@lru_cache(maxsize=1)
def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@lru_cache(maxsize=64)
def _base(base: int) -> tuple[int, ...]:
    rng = random.Random(base * 7919 + 1)
    return tuple(rng.randrange(1, 9) for _ in range(256))


def content_of(spec: tuple) -> Content:
    """A prompt: `shared` tokens of base text `base`, then its own tail, `n` tokens in all."""
    salt, base, shared, tail_seed, n = spec
    rng = random.Random(tail_seed)
    head = _base(base)[: min(shared, n)]
    tail = tuple(rng.randrange(1, 9) for _ in range(n - len(head)))
    return Content(head + tail, SALTS[salt])


def operations(rng: random.Random, setup: Setup, count: int) -> list[Op]:
    """`count` operations for a world of `setup`."""
    if setup.engine == "vllm":
        return vllm_operations(rng, setup, count)
    ops: list[Op] = []
    live: list[str] = []
    specs: list[tuple] = []
    made = 0
    P = setup.page_tokens
    kinds = ("ask", "again", "load", "store", "release", "device", "call", "poll", "fault")
    weights = (3, 1.5, 4, 2.5, 2, 4, 4, 3, 0.4)
    last: dict[str, tuple] = {}  # each live request's prompt
    released: tuple | None = None  # the prompt of the request released last
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        if kind == "ask" or (kind in ("again", "load", "store", "release") and not live):
            if specs and rng.random() < 0.6:
                # a follow-up: the same prefix, more or other text; often the next turn of the
                # conversation that just ended (in the token buffer it leaves behind)
                next_turn = released is not None and rng.random() < 0.5
                old = released if next_turn else rng.choice(specs)
                n = max(2, old[4] + rng.randrange(-8, 24))
                shared = old[4] if rng.random() < 0.7 else old[2]
                spec = (old[0], old[1], shared, rng.randrange(99), n)
            else:
                n = rng.randrange(2, 100)
                shared = rng.randrange(0, n + 1)
                spec = (rng.randrange(len(SALTS)), rng.randrange(4), shared, rng.randrange(99), n)
            specs.append(spec)
            rid = f"r{made}"
            made += 1
            live.append(rid)
            computed = rng.choice((0, 0, 0, 1, 2))
            ops.append(("ask", rid, spec, computed, rng.random() < 0.3))
            last[rid] = spec
        elif kind == "again":
            rid = rng.choice(live)
            asked = next(op for op in reversed(ops) if op[0] == "ask" and op[1] == rid)
            spec = asked[2]
            if rng.random() < 0.2:  # asked again with another prompt
                spec = (*spec[:3], rng.randrange(99), spec[4])
            ops.append(("ask", rid, spec, asked[3] + (rng.random() < 0.2), asked[4]))
            last[rid] = spec
        elif kind == "load":
            skip = rng.choice((0.0, 0.0, 0.0, 0.5))
            ops.append(("load", rng.choice(live), rng.random() < 0.5, skip))
        elif kind == "store":
            ops.append(("store", rng.choice(live), rng.choice((0, 0, 1, P, setup.decode_max))))
        elif kind == "release":
            rid = rng.choice(live)
            live.remove(rid)
            released = last.pop(rid)
            ops.append(("release", rid))
        elif kind == "poll":
            ops.append(("poll",))
        else:
            ops.append(_common(rng, setup, kind))
    return ops


def call_fault(rng: random.Random, setup: Setup) -> str | None:
    """The fault a released store call answers with, or None (`FAULT_SHARE` of them faulty)."""
    faults = CALL_FAULTS if "bad-codes" in setup.features else GOOD_CODES
    return rng.choice(faults) if rng.random() < FAULT_SHARE else None


def _common(rng: random.Random, setup: Setup, kind: str) -> Op:
    """An operation on the device, the store calls or the store."""
    if kind == "device":
        return ("device", rng.choice((1, 1, 2, 3, -1)))
    if kind == "call":
        return ("call", rng.randrange(4), call_fault(rng, setup))
    if rng.random() < 0.1:
        return ("reopen",)
    replaced = ("replaced",) if "replaced" in setup.features else ()
    what = rng.choice(STORE_FAULTS + replaced)
    return ("space", what, rng.randrange(64) if what != "full" else 8)


def vllm_operations(rng: random.Random, setup: Setup, count: int) -> list[Op]:
    """Operations for vLLM's side: requests (tenants, LoRA adapters, images) arrive, engine
    steps run, requests decode, are preempted and finish (or abort)."""
    ops: list[Op] = []
    live: list[str] = []
    specs: list[tuple] = []
    kinds = ("ask", "step", "decode", "preempt", "grow", "release", "device", "call", "fault")
    weights = (2, 6, 1.5, 0.5, 2.5 if "cache-grows" in setup.features else 0, 1.5, 4, 4, 0.4)
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        if kind == "ask" or (kind in ("decode", "preempt", "grow", "release") and not live):
            if specs and rng.random() < 0.6:
                old = rng.choice(specs)
                n = max(2, old[4] + rng.randrange(-8, 24))
                spec = (*old[:2], old[4], rng.randrange(99), n, *old[5:])
                if rng.random() < 0.3:  # the same text under another namespace
                    spec = (*spec[:5], rng.randrange(3), rng.randrange(3), spec[7])
            else:
                n = rng.randrange(2, 100)
                image = None
                if rng.random() < 0.3:
                    image = (rng.randrange(2), rng.randrange(n), rng.randrange(1, 12))
                spec = (0, rng.randrange(4), rng.randrange(0, n + 1), rng.randrange(99), n,
                        rng.randrange(3), rng.randrange(3), image)  # fmt: skip
            specs.append(spec)
            rid = f"v{i}"
            live.append(rid)
            ops.append(("ask", rid, spec, rng.choice((0, 0, 0, 1, 2)), False))
        elif kind == "step":
            ops.append(("step",))
        elif kind == "decode":
            ops.append(("decode", rng.choice(live), rng.choice((1, 4, setup.decode_max))))
        elif kind == "preempt":
            ops.append(("preempt", rng.choice(live)))
        elif kind == "grow":
            ops.append(("grow", rng.choice(live), rng.choice((1, 2, 4, 8))))
        elif kind == "release":
            rid = rng.choice(live)
            live.remove(rid)
            ops.append(("release", rid))
        else:
            ops.append(_common(rng, setup, kind))
    return ops
