"""What Mooncake Store answers: its per-key result codes (`StoreCode`), the client's state and
its counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.backends.breaker import BreakerStats


class StoreCode(enum.IntEnum):
    """Mooncake Store's return codes that hicache meets (0.3.13; negative = failure).

    `get_into` returns bytes read (>= 0) or one of the negative codes; `put_from` and `remove`
    return OK or a negative code. Codes not listed here are passed through as plain ints.
    """

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    NO_SPACE = -200
    """NO_AVAILABLE_HANDLE: no segment has room (the store is full, or the object is larger
    than any segment). The master evicts in the background; a later put may succeed."""
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    """Also: the buffers of a get are smaller than the object."""
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    """remove: someone read the object within the lease time (default 10 s)."""
    LEASE_EXPIRED = -707
    """get: the transfer outlasted the lease; the data must not be used."""
    TRANSFER_FAIL = -800
    """Also: the buffers of a get are larger than the object."""
    RPC_FAIL = -900
    """The master is unreachable."""
    RPC_TIMEOUT = -901
    """The master did not answer within MC_RPC_TIMEOUT_MS."""


UNREACHABLE = frozenset({StoreCode.RPC_FAIL, StoreCode.RPC_TIMEOUT})


def code_name(code: int) -> str:
    """``NAME`` of a known code, else the number (for logs and stats)."""
    try:
        return StoreCode(code).name
    except ValueError:
        return str(code)


class StoreState(str, enum.Enum):
    """Where the client stands."""

    CONNECTING = "connecting"
    READY = "ready"
    DOWN = "down"
    CLOSED = "closed"


@dataclass(frozen=True)
class StoreStats:
    """Counters of one `MooncakeStore`."""

    state: StoreState
    setups: int
    setup_failures: int
    calls: int
    timeouts: int
    unreachable: int
    refused: int
    keys_put: int
    keys_got: int
    bytes_put: int
    bytes_got: int
    breaker: BreakerStats
