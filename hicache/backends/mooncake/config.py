"""The Mooncake tier's YAML section (``- type: mooncake``), checked when the file is loaded."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from hicache.config import Bytes, StoreTierConfig

SHOW_NATIVE_LOG = "HICACHE_MOONCAKE_LOG"
"""Set (to anything but ``0``) to let Mooncake's own log lines through to stderr."""

_MIN_SEGMENT = 16 << 20  # Mooncake 0.3.13 fails setup (INVALID_PARAMS) below this

# -- configuration -------------------------------------------------------------------------------


class MooncakeConfig(StoreTierConfig):
    """``- type: mooncake``: a Mooncake Store below the host tier.

    The defaults reach a master on this host over TCP (``mooncake_master --rpc_port=50051``),
    and contribute no memory: the store nodes beside the master hold the objects. Across hosts
    set `master_address` to the master and `local_hostname` to this host's address that the
    other clients can reach.
    """

    type: Literal["mooncake"] = "mooncake"
    master_address: str = "127.0.0.1:50051"
    """``host:port`` of mooncake_master (or an ``etcd://...`` list for an HA master set)."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata service: ``P2PHANDSHAKE`` (none needed), ``etcd://…``,
    ``http://…``."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transfer protocol between clients."""
    device_names: str = ""
    """RDMA devices, comma separated (``mlx5_0,mlx5_1``); empty lets Mooncake choose."""
    local_hostname: str = "127.0.0.1"
    """This client's address as the other clients reach it (host or host:port)."""
    global_segment_size: Bytes = Field(default=0, ge=0)
    """Memory this process contributes to the store; otherwise at least 16 MiB (Mooncake refuses
    smaller segments). The objects put into a segment go away with the process that mounted
    it, so engines mount none (0) and store nodes hold the memory (docs/mooncake.md)."""
    local_buffer_size: Bytes = Field(default=16 << 20, ge=0)
    """Mooncake's own staging buffer; hicache's transfers are zero-copy and do not use it."""
    replicas: int = Field(default=1, ge=1, le=16)
    """Copies of each object (Mooncake ``replica_num``)."""
    call_timeout_s: float = Field(default=2.0, gt=0, le=600)
    """A call still out after this long counts as a breaker failure (the watchdog's). Mooncake's
    own master-RPC timeout (MC_RPC_TIMEOUT_MS) is set to 80 % of it, so that a stalled master's
    call ends by itself just before."""
    setup_retries: int = Field(default=1, ge=1, le=100)
    """Mooncake's attempts inside one setup (MC_STORE_CLIENT_SETUP_RETRIES); each attempt
    against an absent master takes about 4.4 s."""
    reconnect_backoff_s: float = Field(default=1.0, gt=0, le=3600)
    """Wait after the first failed setup; doubles after each failure."""
    reconnect_backoff_max_s: float = Field(default=30.0, gt=0, le=3600)
    """Upper bound of the wait between setups."""

    @field_validator("master_address")
    @classmethod
    def _check_master(cls, v: str) -> str:
        if "://" in v:
            if v.split("://", 1)[1] == "":
                raise ValueError(f"master_address {v!r} names no endpoint after the scheme")
            return v
        _split_host_port(v, "master_address", need_port=True)
        return v

    @field_validator("global_segment_size")
    @classmethod
    def _check_segment(cls, v: int) -> int:
        if 0 < v < _MIN_SEGMENT:
            raise ValueError(
                f"global_segment_size must be 0 or at least 16MiB ({_MIN_SEGMENT}), got {v}"
            )
        return v

    @field_validator("local_hostname")
    @classmethod
    def _check_local(cls, v: str) -> str:
        _split_host_port(v, "local_hostname", need_port=False)
        return v

    @field_validator("metadata_server")
    @classmethod
    def _check_metadata(cls, v: str) -> str:
        if not v or v != v.strip():
            raise ValueError(f"metadata_server must be a non-empty string without spaces: {v!r}")
        return v

    @field_validator("device_names")
    @classmethod
    def _check_devices(cls, v: str) -> str:
        if v and any(not d or d != d.strip() for d in v.split(",")):
            raise ValueError(f"device_names must be comma-separated names without spaces: {v!r}")
        return v

    @field_validator("reconnect_backoff_max_s")
    @classmethod
    def _check_backoff(cls, v: float, info: Any) -> float:
        first = info.data.get("reconnect_backoff_s")
        if first is not None and v < first:
            raise ValueError(
                f"reconnect_backoff_max_s ({v}) is below reconnect_backoff_s ({first})"
            )
        return v


def _split_host_port(v: str, field: str, need_port: bool) -> None:
    if not v or v != v.strip() or " " in v:
        raise ValueError(f"{field} must be a host or host:port without spaces: {v!r}")
    host, sep, port = v.rpartition(":") if v.count(":") == 1 else (v, "", "")
    if need_port and not sep:
        raise ValueError(f"{field} must be host:port, got {v!r}")
    if sep and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ValueError(f"{field} has no valid host:port (port 1-65535): {v!r}")
