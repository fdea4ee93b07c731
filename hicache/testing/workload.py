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

from hicache.testing.faults import CALL_FAULTS, KILL_POINTS
from hicache.testing.oracle import Content

Op = tuple
"""("ask", rid, spec, computed_pages, partial, instance) | ("load", rid, by_layer, skip) |
("store", rid, decode) | ("release", rid) | ("device", n, instance) | ("poll", instance) |
("call", index, fault) | ("space", what, arg, target) | ("reopen", instance, codec) |
("kill", instance, point); vLLM's side: ("step", instance), ("decode", rid, n),
("preempt", rid), ("grow", rid, pages) too."""

SALTS = (None, "tenant-a", "tenant-b")
STORE_FAULTS = (
    "down", "up", "restart", "lost", "truncated", "full", "payload", "stray", "raising",
)  # fmt: skip
GOOD_CODES = tuple(f for f in CALL_FAULTS if f not in ("short", "long", "wrong_type"))
"""Call faults whose answers have the right form (without `bad-codes`)."""
FAULT_SHARE = 0.12
"""The share of released store calls that answer with a fault."""
RECENT = 16
"""A follow-up mostly goes on with one of the conversations stored last (these many)."""
MAX_PROMPT = 120
"""Tokens past which a conversation has no next turn (the host tier holds a few prompts)."""
POLICIES = ("lru", "arc", "s3fifo", "prefix")
"""The host tier's eviction policies (`hicache.core.eviction`), one drawn per world."""
FP8_FORMATS = ("fp8", "fp8_e4m3", "fp8_e5m2")
IMAGE_COUNT = 4
"""vLLM: the images a request may hold (`vllm_world.IMAGES`), in pairs (0 and 1, 2 and 3)."""
"""vLLM's fp8 KV cache formats (`--kv-cache-dtype`): one byte a value, different bytes."""


@dataclass(frozen=True)
class Setup:
    """The shape of one seed's world."""

    page_tokens: int = 4
    page_bytes: int = 64
    host_pages: int = 16
    host_states: int = 8
    state_bytes: int = 0
    history_tokens: int = 8
    state_boundaries: int = 2
    """The policy's: states are stored at this many trailing page boundaries."""
    layers: int = 0
    stores: tuple[tuple[str, str, int], ...] = ()
    """(memory | private | disk, write mode, group pages) of each store tier, in walk order
    (memory: shared by every instance of the world; private: each instance's own; disk: each
    instance's own directory)."""
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
    codecs: tuple[bool, ...] = (False,)
    """One per instance of the engine on the world's stores at the same time: whether its
    store tiers have codec: lossless (objects encoded where they shrink; gets read prefixes)."""
    compressible: bool = False
    """The pages' and states' bytes compress as KV does (`Oracle`), and are large enough that
    an encoded object is smaller than a raw one."""
    policy: str = "lru"
    """The host tier's eviction policy."""
    disk_objects: int = 128
    """A disk tier's size, in objects of its group size (small: it evicts what the link put)."""
    tp: int = 1
    """vLLM: tensor-parallel ranks of each instance (each its own cache over its shard)."""
    kv_formats: tuple[str, ...] = ("auto",)
    """vLLM: each instance's KV cache dtype (``auto``: the model's, float32 here)."""
    heads: int = 8
    """vLLM: floats of one token's K (or V) in one layer of a rank's shard."""
    prefix_reads: bool = False
    """The shared store reads objects shorter than their buffers whatever an instance's codec
    (as a disk tier does: instances with and without a codec read each other's objects), not
    only with one (as Mooncake does)."""

    @property
    def instances(self) -> int:
        return len(self.codecs)


FEATURES = {
    "bad-codes": "store calls answer code lists too short, too long or of the wrong type",
    "reuse-buffers": "the engine reuses a released request's token buffer",
    "on-evict": "store tiers with write: on_evict",
    "replaced": "objects replaced at rest by other bytes of the same length",
    "alias-salt": "a tenant salt spelled as hicache spells a LoRA adapter's namespace (vLLM)",
    "cache-grows": "vLLM's own prefix cache grows while a request waits for its answer",
}
"""Parts of the workload that `--skip` can leave out (each finds a class of defect)."""

VLLM_SHARE = 0.35
"""The share of seeds whose engine is vLLM's connector pair (skipped where vLLM is not
installed: the draw does not depend on it)."""
CODEC_SHARE = 0.3
"""The share of seeds whose bytes compress (and whose instances mostly have a codec)."""
FP8_SHARE = 0.4
"""vLLM: the share of seeds whose instances keep fp8 KV (each its own format)."""


def draw_setup(rng: random.Random, skip: frozenset[str] = frozenset()) -> Setup:
    """A world's shape (a swarm: every seed draws its own configuration), without the
    `FEATURES` in `skip`. The draws do not depend on what is installed, nor on `skip`: a seed
    is the same world everywhere (vLLM's worlds are skipped where vLLM is missing)."""
    features = frozenset(FEATURES) - skip
    vllm = rng.random() < VLLM_SHARE
    P = rng.choice((1, 4, 4, 8) if vllm else (1, 2, 4, 4, 4, 8))
    compressible = rng.random() < CODEC_SHARE
    instances = rng.choice((1, 1, 2) if vllm else (1, 1, 2, 2, 3))
    codecs = tuple(compressible and (i == 0 or rng.random() < 0.5) for i in range(instances))
    prefix_reads = rng.random() < 0.5
    policy = rng.choice(POLICIES)
    stores = []
    for _ in range(rng.choice((0, 1, 1, 1, 2, 2, 2))):
        disk = not any(s[0] == "disk" for s in stores) and rng.random() < 0.4
        kind = "disk" if disk else rng.choice(("memory", "memory", "private"))
        write = rng.choice(("behind", "behind", "on_evict", "on_evict", "off"))
        if write == "on_evict" and "on-evict" not in features:
            write = "behind"
        G = rng.choice((4, 8) if compressible else (1, 2, 4, 8))
        stores.append((kind, write, G))
    if stores and all(write == "off" for _, write, _ in stores):  # some tier is written
        stores[0] = (stores[0][0], "behind", stores[0][2])
    widest = max((G for _, _, G in stores), default=1)
    host_pages = max(4 * widest, rng.choice((48, 64, 96, 128)) // P)
    disk_objects = rng.choice((8, 128, 512))
    common = dict(
        page_tokens=P,
        host_pages=host_pages,
        blocks=1024 // P,
        fetch_workers=rng.choice((1, 2)),
        reserve_pages=rng.choice((0, 4)),
        memo=rng.choice((0, 64)),
        features=features,
        codecs=codecs,
        compressible=compressible,
        policy=policy,
        disk_objects=disk_objects,
        prefix_reads=prefix_reads,
    )
    if vllm:
        fp8 = rng.random() < FP8_SHARE
        formats = tuple(rng.choice(FP8_FORMATS) if fp8 else "auto" for _ in range(instances))
        tp = rng.choice((1, 1, 2, 4) if instances == 1 else (1, 2))
        one = rng.random()  # one tier whose contents the scheduler knows, or can ask itself
        if stores and one < 0.35:  # its own books (`TierView`) answer
            stores = [("private", "behind", G) for _, _, G in stores[:1]]
        elif stores and one < 0.7:  # it asks the store (`StoreProbe`), as with Mooncake
            stores = [("memory", "behind", G) for _, _, G in stores[:1]]
        width = 1 if fp8 else 4  # bytes a value
        heads = max(8, 2048 // (P * width)) if compressible else 32 // width  # rows of 16n B
        return Setup(
            **common,
            page_bytes=2 * 2 * P * heads * width,  # two layers of K and V, (P, heads) each
            stores=tuple(stores),
            engine="vllm",
            pin_share=rng.choice((0.5, 0.1, 0.1)),
            in_step=rng.random() < 0.8,
            tp=tp,
            kv_formats=formats,
            heads=heads,
        )
    states = (0, 0, 24, 16384, 16385) if compressible else (0, 0, 24)
    return Setup(
        **common,
        page_bytes=4096 if compressible else 64,
        state_bytes=rng.choice(states),
        history_tokens=8 * P,
        state_boundaries=rng.choice((4, 8)),
        layers=rng.choice((0, 0, 2)),
        stores=tuple(stores),
    )


@lru_cache(maxsize=1)
def _has_vllm() -> bool:
    """Whether vLLM can be imported here (its worlds run only then)."""
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
    kinds = ("ask", "again", "load", "store", "release", "device", "call", "poll", "fault", "drain")
    weights = (3, 0.3, 4, 2.5, 3.2, 4, 8, 3, 1, 3)
    last: dict[str, tuple] = {}  # each live request's prompt
    stage: dict[str, int] = {}  # each live request's progress: 0 asked, 1 loaded, 2 stored
    released: tuple | None = None  # the prompt of the request released last
    stored: list[tuple] = []  # the prompts of requests that were loaded, then stored
    ran_on: dict[tuple, int] = {}  # the instance each prompt was asked of
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        if kind == "ask" or (kind in ("again", "load", "store", "release") and not live):
            if specs and rng.random() < 0.9:
                # a follow-up: often the next turn of the conversation that just ended (in the
                # token buffer it leaves behind), or of an older one, mostly one stored
                just_ended = released is not None and rng.random() < 0.15
                older = (stored[-RECENT:] if rng.random() < 0.2 else stored) if stored else specs
                old = released if just_ended else rng.choice(older)
                spec = _follow_up(rng, old)
            else:
                old = None
                n = rng.randrange(2, 100)
                shared = rng.randrange(0, n + 1)
                spec = (rng.randrange(len(SALTS)), rng.randrange(4), shared, rng.randrange(99), n)
            specs.append(spec)
            rid = f"r{made}"
            made += 1
            live.append(rid)
            computed = rng.choice((0, 0, 0, 1, 2))
            inst = rng.randrange(setup.instances)
            if old in ran_on and setup.instances > 1 and rng.random() < 0.6:
                inst = (ran_on[old] + 1 + inst % (setup.instances - 1)) % setup.instances
            ran_on[spec] = inst  # a conversation goes on elsewhere: another instance's store
            ops.append(("ask", rid, spec, computed, rng.random() < 0.3, inst))
            last[rid], stage[rid] = spec, 0
        elif kind == "again":
            rid = rng.choice(live)
            asked = next(op for op in reversed(ops) if op[0] == "ask" and op[1] == rid)
            spec = asked[2]
            if rng.random() < 0.2:  # asked again with another prompt
                spec = (*spec[:3], rng.randrange(99), spec[4])
            ops.append(("ask", rid, spec, asked[3] + (rng.random() < 0.2), asked[4], asked[5]))
            last[rid] = spec
        elif kind == "load":  # mostly a request's next step: loaded, then stored, then released
            skip = rng.choice((0.0, 0.0, 0.0, 0.5))
            rid = _at(rng, live, stage, 0)
            stage[rid] = max(stage[rid], 1)
            ops.append(("load", rid, rng.random() < 0.5, skip))
        elif kind == "store":
            rid = _at(rng, live, stage, 1)
            if stage[rid] == 1:
                stored.append(last[rid])
            stage[rid] = max(stage[rid], 2)
            ops.append(("store", rid, rng.choice((0, 0, 1, P, setup.decode_max))))
        elif kind == "release":
            rid = _at(rng, live, stage, 2)
            live.remove(rid)
            released = last.pop(rid)
            del stage[rid]
            ops.append(("release", rid))
        elif kind == "poll":
            ops.append(("poll", rng.randrange(setup.instances)))
        elif kind == "drain":
            ops.append(("drain",))
        else:
            ops.append(_common(rng, setup, kind))
    return ops


def _follow_up(rng: random.Random, old: tuple) -> tuple:
    """A prompt after `old` (`content_of`'s spec): its next turn (the same tokens and more: the
    tail's generator goes on), or another question on the same text (the old prompt's text, or
    its base text's, then text of its own)."""
    salt, base, shared, tail_seed, n = old
    if rng.random() < 0.8 and n < MAX_PROMPT:
        return (salt, base, shared, tail_seed, n + rng.randrange(1, 24))
    n = max(2, n + rng.randrange(-8, 24))
    shared = old[4] if rng.random() < 0.7 else shared
    return (salt, base, shared, rng.randrange(99), n)


def _at(rng: random.Random, live: list[str], stage: dict[str, int], at: int) -> str:
    """A live request, mostly (85 %) one at `stage` `at` where there is one (an abort, a load or
    a store out of turn otherwise)."""
    ready = [rid for rid in live if stage[rid] == at]
    return rng.choice(ready if ready and rng.random() < 0.85 else live)


def call_fault(rng: random.Random, setup: Setup, op: str = "") -> str | None:
    """The fault a released store call answers with, or None (`FAULT_SHARE` of them faulty);
    a get's (`op`), where the simulation knows it, mostly loses objects of its run."""
    if op == "get" and rng.random() < FAULT_SHARE:
        return rng.choice(("per_key", "per_key_odd", "per_key_odd"))
    faults = CALL_FAULTS if "bad-codes" in setup.features else GOOD_CODES
    return rng.choice(faults) if rng.random() < FAULT_SHARE else None


def _common(rng: random.Random, setup: Setup, kind: str) -> Op:
    """An operation on a device, the store calls or the stores."""
    inst = rng.randrange(setup.instances * setup.tp)
    if kind == "device":
        return ("device", rng.choice((1, 2, 3, -1, -1)), inst)
    if kind == "call":
        return ("call", rng.randrange(4), call_fault(rng, setup))
    what = rng.random()
    if what < 0.1:
        return ("reopen", inst, rng.random() < 0.3)
    if what < 0.25 and any(kind == "disk" for kind, _, _ in setup.stores):
        return ("kill", inst, rng.choice(KILL_POINTS))
    replaced = ("replaced",) if "replaced" in setup.features else ()
    faults = STORE_FAULTS + replaced
    what = rng.choices(faults, [0.3 if f == "restart" else 1 for f in faults])[0]
    return ("space", what, rng.randrange(64) if what != "full" else 8, rng.randrange(8))


def vllm_operations(rng: random.Random, setup: Setup, count: int) -> list[Op]:
    """Operations for vLLM's side: requests (tenants, LoRA adapters, images) arrive, engine
    steps run, requests decode, are preempted and finish (or abort)."""
    ops: list[Op] = []
    live: list[str] = []
    specs: list[tuple] = []
    kinds = ("ask", "step", "decode", "preempt", "grow", "release", "device", "call", "fault")
    weights = (2, 6, 1.5, 0.5, 2.5 if "cache-grows" in setup.features else 0, 1.5, 4, 4, 0.8)
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        if kind == "ask" or (kind in ("decode", "preempt", "grow", "release") and not live):
            if specs and rng.random() < 0.8:
                old = rng.choice(specs)
                spec = (*_follow_up(rng, old[:5]), *old[5:])
                if rng.random() < 0.3:  # the same text under another namespace
                    spec = (*spec[:5], rng.randrange(3), rng.randrange(3), spec[7])
                elif spec[7] is not None and rng.random() < 0.3:  # the other of its pair, there
                    spec = (*spec[:7], (spec[7][0] ^ 1, *spec[7][1:]))
            else:
                n = rng.randrange(2, 100)
                image = None
                if rng.random() < 0.3:
                    image = (rng.randrange(IMAGE_COUNT), rng.randrange(n), rng.randrange(1, 12))
                spec = (0, rng.randrange(4), rng.randrange(0, n + 1), rng.randrange(99), n,
                        rng.randrange(3), rng.randrange(3), image)  # fmt: skip
            specs.append(spec)
            rid = f"v{i}"
            live.append(rid)
            inst = rng.randrange(setup.instances)
            ops.append(("ask", rid, spec, rng.choice((0, 0, 0, 1, 2)), False, inst))
            if spec[7] is not None and rng.random() < 0.3:  # the same text, the other image
                twin = (*spec[:7], (spec[7][0] ^ 1, *spec[7][1:]))
                specs.append(twin)
                live.append(f"{rid}b")
                ops.append(("ask", f"{rid}b", twin, 0, False, inst))
        elif kind == "step":
            ops.append(("step", rng.randrange(setup.instances)))
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
