"""The tier interface.

Every tier states what it can do as class attributes, read by the cache instead of checking names:

- `shared`: other processes and instances see what this tier holds (Mooncake: yes; host: no).
  The tier chain trusts its own books of a tier that is neither shared nor persistent: a group
  it never put there is a miss without asking the tier.
- `persistent`: its contents outlive this process. `HiCache.close` waits (bounded) for the
  write-behind of a persistent tier to drain, so that a clean shutdown loses nothing.
- `exists_from_any_process` (store tiers): another process, with a client of its own made
  from the same config, can ask in about a millisecond which objects the tier holds (Mooncake:
  yes; a disk directory: no). vLLM's scheduler then answers store-tier hits in the step.

Two families share that header:

- `PoolTier`: memory that hicache addresses by page id through a `PagedBuffer` — the engine's GPU
  pool (block ids) and the pinned host pools (slots). Copies between pool tiers go through
  `hicache.kernels.copy_pages` on the engine's stream.
- `StoreTier`: a keyed object store below the host tier (Mooncake Store, a local disk, a tier from
  another package). Objects move between it and host slots in batches: which keys exist, get into
  host memory, put from host memory. The tier chain (`hicache.chain.walk`) calls a store tier only
  from its own worker threads, never from the engine thread, except for `available` (a read
  that never blocks) and `start` (returns at once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from hicache.backends.breaker import CircuitBreaker
from hicache.core.shares import Terms
from hicache.kernels import PagedBuffer

Piece = tuple[int, int]
"""(address, size) of a run of bytes inside memory the store has registered."""


@dataclass(frozen=True)
class Buffers:
    """Where the objects of one store call lie in registered memory: object ``i`` is the bytes of
    its pieces, ``sizes[i][j]`` bytes at address ``ptrs[i][j]``, in order.

    This is the form Mooncake's batch calls take, so a call passes the lists as they are. The
    lists are not copied: the caller must not change them while a call uses them.
    """

    ptrs: list[list[int]]
    sizes: list[list[int]]
    span: tuple[int, int] | None = None
    """[low, high): addresses that hold every piece, when the builder knows them (the tier chain
    does: its pieces are slots of one pool). A store then checks the span against its registered
    memory instead of every piece; a builder that gives one promises that it is right."""

    @classmethod
    def of(cls, pieces: Sequence[Sequence[Piece]]) -> Buffers:
        """From (address, size) pairs, object by object."""
        return cls(
            [[int(ptr) for ptr, _ in obj] for obj in pieces],
            [[int(size) for _, size in obj] for obj in pieces],
        )

    def __len__(self) -> int:
        return len(self.ptrs)

    def nbytes(self, i: int) -> int:
        """The size of object `i`."""
        return sum(self.sizes[i])


class Tier(ABC):
    """Capabilities every tier declares. `type` is set by the registry (or by the class)."""

    type: ClassVar[str]
    shared: ClassVar[bool]
    persistent: ClassVar[bool]


class PoolTier(Tier):
    """Addressable memory made of pages (and, where the layout has them, state slots)."""

    @property
    @abstractmethod
    def pages(self) -> PagedBuffer:
        """The page memory, page `i` being block/slot id `i`."""


class StoreTier(Tier):
    """A keyed object store. Every call may block: call it from worker threads only.

    Keys are strings built by `hicache.core.keys.store_key`. Objects are written from and read into
    host memory that the store has registered (`register`). A failed call raises
    `StoreUnavailable`; a per-key failure is a negative code in the returned list. The buffers
    of a call are the store's until the call returns (raised or not): the caller keeps them
    unchanged and pinned until then.
    """

    missing_code: int | None = None
    """The per-key code `get_into` gives for an object the store does not hold, if it has one:
    then a get may be asked without an exists first, and a miss is not counted as a failure."""
    read_gbps: ClassVar[float] = 4.0
    """Read throughput (GB/s) the cost model starts from until it has measured this tier's own
    fetches (a tier's `read_gbps:` setting overrides it)."""
    exists_from_any_process: ClassVar[bool] = False
    """Whether a client of this tier made in another process (from the same config, never
    registering memory) answers `exists` for the objects every process wrote, cheaply."""
    reads_prefix: bool = False
    """A get into buffers larger than the object reads it into their front and answers its
    length (not a failure). Only such a tier can store encoded objects (`codec: lossless`),
    whose size its reader does not know in advance. An instance may set it (see
    `prefix_with_codec`)."""
    prefix_with_codec: ClassVar[bool] = False
    """The tier reads prefixes (`reads_prefix`) where its config's codec is not none, at a cost
    it pays only then (Mooncake looks the objects' sizes up first)."""
    keeps_terms: ClassVar[bool] = False
    """The tier keeps tenants' shares and quotas (`set_terms`): it evicts by tenant, reading
    each object's tenant from its name (`hicache.core.keys.object_tenant`). The configuration
    refuses terms on a tier that does not."""
    breaker: CircuitBreaker | None = None
    """The store's own circuit breaker, if it keeps one (and counts its failures itself);
    otherwise the tier chain keeps one for it, fed by the outcomes of its calls."""

    def object_prefix(self, key_prefix: str, codec: str) -> str:
        """The prefix of the names of this tier's objects under a config whose `key_prefix` and
        `codec` are these: the key prefix, and the codec too where the tier reads prefixes only
        with a codec (`prefix_with_codec`: Mooncake). An instance of such a tier without a codec
        could not read an encoded object, and its put of the same name would write nothing;
        with the format in the name, instances with and without a codec keep their own objects.
        A tier that reads prefixes whatever its codec (the disk tier) reads either format: its
        names leave the codec out."""
        if codec != "none" and self.prefix_with_codec:
            return f"{key_prefix}/{codec}"
        return key_prefix

    def set_terms(self, terms: Mapping[str, Terms]) -> None:
        """Keep the tenants' `terms` (by tenant name; the others have none); called before
        `start`. Only a tier that `keeps_terms`."""
        raise NotImplementedError(f"a {type(self).__name__} keeps no tenants' terms")

    def tenant_bytes(self) -> dict[str, tuple[int, int]]:
        """Per tenant with terms here: (bytes it holds, bytes of it evicted so far). Empty for
        a tier that does not keep terms."""
        return {}

    def empty_at_start(self) -> bool:
        """Whether the tier held nothing when it became ready, and no other process writes it:
        then this process knows all it holds from what it put (vLLM's scheduler answers
        questions about such tiers without asking the workers). False unless a tier knows."""
        return False

    @abstractmethod
    def start(self) -> None:
        """Begin connecting in the background and return at once."""

    @property
    @abstractmethod
    def available(self) -> bool:
        """Whether calls are expected to be answered now (connected; not failing repeatedly).
        Never blocks: the engine thread reads it to decide whether to start a fetch. A
        store that is down re-probes itself in the background and becomes available again."""

    @abstractmethod
    def register(self, memory: object) -> None:
        """Make a host tensor available as the source and target of transfers."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` the store holds, in one batched call."""

    @abstractmethod
    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """Read each object into its pieces; per key the bytes read or a negative code (for an
        object of another size than its buffers, unless `reads_prefix` and it is shorter)."""

    @abstractmethod
    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """Write each object from its pieces; per key 0 or a negative code."""

    def discard(self, keys: Sequence[str]) -> None:
        """Remove these objects, which a reader found unreadable (bytes changed at rest, or
        sealed under a key it does not hold), so that a put of the same name writes them again
        (a put of a name the store holds writes nothing). Best effort: a good object put
        meanwhile under one of the names may go too (a miss, recomputed). The default keeps
        them (a tier that cannot remove by name)."""

    def drop_prefix(self, prefix: str) -> int:
        """Drop every object whose name starts with `prefix` (the clear of one namespace, for
        every process that reads the tier): how many were dropped. An object put while it runs
        may stay; the caller holds its own puts meanwhile. NotImplementedError where the tier
        cannot find its objects by name."""
        raise NotImplementedError(f"a {type(self).__name__} cannot drop objects by name")

    @abstractmethod
    def close(self) -> None:
        """Release the connection. Blocks; call at shutdown."""


class StoreUnavailable(RuntimeError):
    """The store could not be reached (not connected yet, master down, breaker open)."""
