"""hicache's configuration: pydantic models loaded from YAML.

A file has three sections::

    layout:            # what a page is (an engine may instead pass its Layout in code)
      model: llama-3.1-8b@main
      kv_dtype: bfloat16
      page_tokens: 128
      page_bytes: 16777216
    tiers:             # fastest first, below the engine's own GPU pool
      - type: host
        size: 64GiB
    policy:
      min_recompute_tokens: 1

Every field is validated; an unknown key or a bad value is a `ConfigError` whose message names the
file and the field (``configs/x.yaml: tiers.0.size: ...``). Tier sections are validated by the model
their backend registered for its ``type`` (see `hicache.registry`).

Environment overrides have one form: ``HICACHE__<SECTION>__<FIELD>=value``, a double underscore
between path parts, list items by index, the value parsed as a YAML scalar. For example
``HICACHE__POLICY__MIN_RECOMPUTE_TOKENS=64`` or ``HICACHE__TIERS__0__SIZE=8GiB``.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from hicache.errors import ConfigError
from hicache.registry import tier_class, tier_config_model
from hicache.threads import check_cpus

ENV_PREFIX = "HICACHE__"

_BYTES = TypeAdapter(ByteSize)


def _to_bytes(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a byte size such as 4096, '512MiB' or '64GiB'")
    if (isinstance(value, int | float) and value < 0) or str(value).strip().startswith("-"):
        raise ValueError(f"a size cannot be negative, got {value}")
    return int(_BYTES.validate_python(value))


Bytes = Annotated[int, BeforeValidator(_to_bytes), PlainSerializer(int)]
"""A size in bytes, written as an integer or with a unit: ``4096``, ``512MiB``, ``64GiB``."""


class _Strict(BaseModel):
    # the docstring under a field is its description (docs/configuration.md is made from them)
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Layout(_Strict):
    """What one page (and one state) of this engine is. Everything here goes into the fingerprint.

    `page_bytes` is the size of one page of all KV layers; an engine that keeps one tensor per
    layer (or per layer and K/V) gives `segments` instead, the bytes of a page in each, in the
    order of its pool tensors. `state_bytes` is non-zero for hybrid models (sliding-window or
    linear attention) whose sequences also need a state to resume at a page boundary.
    """

    model: str = Field(min_length=1)
    """Names everything that decides a page's bytes beyond this layout's other fields: the
    `name` of a `hicache.core.identity.Identity` (the weights by name, content and version,
    the model's config, compute dtype, KV format, quantization, attention, shard, arithmetic,
    ...). Pages of instances whose identities differ in any field never mix. The reference
    engine, vLLM's connector and SGLang's backend fill theirs (docs/identity.md)."""
    kv_dtype: str = Field(min_length=1)
    """The KV cache's dtype (``bfloat16``, ``float8_e4m3fn``): bf16 and fp8 pages never mix."""
    page_tokens: int = Field(default=128, gt=0)
    """Tokens per page: one block of the engine's paged KV pool."""
    page_bytes: int = Field(default=0, ge=0)
    """Bytes of one page of all KV layers, for page-first pools (0: give `segments`)."""
    segments: tuple[int, ...] = ()
    """Layer-first pools: the bytes of one page in each pool tensor, in the pools' order."""
    state_bytes: int = Field(default=0, ge=0)
    """Bytes of the state needed to resume a sequence at a page boundary (hybrid models with
    sliding-window or linear attention); 0 for models without one."""
    tp_rank: int = Field(default=0, ge=0)
    """This engine's tensor-parallel rank."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel ranks of the engine."""
    kv_head_sharded: bool = True
    """KV heads are split across the TP ranks, so each rank's pages are its own (the rank goes
    into the fingerprint); false where every rank holds the same KV."""

    @field_validator("segments")
    @classmethod
    def _positive_segments(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(s <= 0 for s in v):
            raise ValueError("every segment must be a positive number of bytes")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Layout:
        if self.segments and self.page_bytes and sum(self.segments) != self.page_bytes:
            raise ValueError(
                f"segments add up to {sum(self.segments)} bytes but page_bytes is {self.page_bytes}"
            )
        if not self.segments and not self.page_bytes:
            raise ValueError("give page_bytes (page-first pools) or segments (layer-first pools)")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")
        return self

    @cached_property
    def page_size(self) -> int:
        """Bytes of one page, whichever way it was given (worked out at the first read and kept:
        the tiers read it on the engine thread)."""
        return self.page_bytes or sum(self.segments)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Layout:
        """pydantic's copy (`update` applied unvalidated), with `page_size` worked out again."""
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("page_size", None)
        return copy

    @property
    def segment_bytes(self) -> tuple[int, ...]:
        """Bytes of a page in each segment (one segment for page-first pools)."""
        return self.segments or (self.page_bytes,)


class TierConfig(_Strict):
    """Base of every tier section. Backends subclass it with ``type: Literal["name"]``."""

    type: str
    """The backend that serves this tier (its registered name)."""

    def check_layout(self, layout: Layout) -> None:
        """Raise ValueError (naming the field) if this tier cannot hold pages of `layout`."""

    def check_machine(self) -> None:
        """Raise ValueError (naming the field) if this tier cannot run on this machine as
        configured. Run by ``hicache config check`` and when the tier is built."""


class StoreTierConfig(TierConfig):
    """Base of the sections of keyed stores below the host tier (see `hicache.chain.walk`)."""

    name: str | None = Field(default=None, max_length=32, pattern=r"^[a-z][a-z0-9_]*$")
    """The tier's name in stats keys (``hit_tokens_<name>``), metrics and events (``tier=<name>``);
    default: its type. Two tiers of one chain need different names."""
    write: Literal["behind", "on_evict", "off"] = "behind"
    """behind: every page group stored in the host tier is put to this tier soon after;
    on_evict: a group is put when the host tier is about to evict it (write-back: once the host
    runs short of free slots, its groups not yet written are put, oldest first, and pinned until
    the put returns); off: this tier is only read."""
    read_gbps: float | None = Field(default=None, gt=0)
    """Read throughput (GB/s) the cost model starts from; then it learns the tier's own from its
    completed fetches. None: the backend's default (`StoreTier.read_gbps`)."""
    breaker_failures: int = Field(default=3, ge=1, le=1000)
    """Consecutive failed calls (unreachable, timed out) that open the tier's breaker."""
    breaker_reprobe_s: float = Field(default=5.0, gt=0, le=3600)
    """How long an open breaker refuses calls before one probe is let through."""
    close_timeout_s: float = Field(default=10.0, ge=0, le=3600)
    """A persistent tier (its contents outlive the process): how long `HiCache.close` waits at
    most for its writes (and write-backs) to finish, so that a clean shutdown loses nothing."""

    group_pages: int = Field(default=4, ge=1)
    """G: consecutive pages written to the store as one object; a stored prompt's pages past its
    last whole group go as one shorter object, its tail (not for layouts with states)."""
    key_prefix: str = Field(default="hicache", min_length=1, max_length=64, pattern=r"^[\w.\-]+$")
    """First part of every object name (separates hicache from other users of the store)."""
    write_queue_depth: int = Field(default=256, ge=1)
    """Put batches waiting for the write-behind worker; beyond this, work is dropped and counted."""
    fetch_queue_depth: int = Field(default=64, ge=1)
    """Fetch calls queued or running at most; beyond this a request takes its host hit at once
    (counted): behind that many calls a new fetch would not land within fetch_max_wait_ms anyway,
    and a store that stopped answering would otherwise collect one job per request."""
    fetch_workers: int | None = Field(default=None, ge=1, le=16)
    """Threads that run fetch calls. A fetch goes to the least busy, the first of equals: one
    fetch at a time always runs on the first; with several out, one request's call runs while
    another's is prepared or answered, and their transfers overlap. None: 2 where the tier's threads
    may use 4 CPUs or more, else 1 (on fewer cores, transfers at once compete for them)."""
    fetch_reserve: Bytes = 64 << 20
    """Host memory kept free for fetches from the store (at most an eighth of the host tier). A
    fetch that fits in it is one call on the worker thread (a get into these slots, no exists
    before it) and reaches the host tier one engine step sooner; larger ones (and layouts with
    states) ask exists first. 0: always ask first."""
    worker_cpus: tuple[Annotated[int, Field(ge=0)], ...] = ()
    """CPUs for this tier's threads (its workers, and the store client's threads, which inherit
    them): give CPUs other than the engine thread's, so that a tier never takes its core. Empty:
    wherever the process may run."""

    codec: Literal["none", "lossless"] = "none"
    """How objects are stored: none (as they are) or lossless (``hicache.backends.codec``: 16-bit
    KV as byte planes, the high plane compressed with zstd; 8-bit KV compressed whole; an object
    that does not shrink stored as it is). Needs the ``codec`` extra (zstandard) and a backend
    that reads objects shorter than their buffers (`StoreTier.reads_prefix`, or
    `prefix_with_codec`); whatever the setting, a tier that reads prefixes reads every object it
    knows how to decode. A tier that reads prefixes only with a codec (`prefix_with_codec`:
    Mooncake) puts the codec into its objects' names: instances with and without it keep their
    own objects."""
    codec_threads: int = Field(default=2, ge=1, le=64)
    """With codec: lossless, threads that encode and decode one call's objects in parallel."""

    @field_validator("codec")
    @classmethod
    def _codec_here(cls, v: str) -> str:
        # the package looked for here, not through hicache.backends.codec: the configuration
        # sits below the backends and never imports them
        if v == "lossless" and importlib.util.find_spec("zstandard") is None:
            raise ValueError(
                "lossless needs the zstandard package: pip install zstandard "
                "(hicache is not on the package index: in its clone, pip install -e '.[codec]')"
            )
        return v

    @model_validator(mode="after")
    def _codec_backend(self) -> StoreTierConfig:
        if self.codec != "none":
            from hicache.registry import tier_class

            tier = tier_class(self.type)
            if not (
                getattr(tier, "reads_prefix", False) or getattr(tier, "prefix_with_codec", False)
            ):
                raise ValueError(
                    f"codec: the {self.type} tier cannot hold encoded objects (its gets need "
                    "an object's exact size); use codec: none"
                )
        return self

    def check_machine(self) -> None:
        check_cpus(self.worker_cpus, "worker_cpus")


class Policy(_Strict):
    """How hits are taken and what gets stored."""

    min_recompute_tokens: int = Field(default=1, ge=1)
    """At least this many prompt tokens are always recomputed (the engine needs logits)."""
    state_boundaries: int = Field(default=2, ge=1)
    """States are stored at this many trailing page boundaries of every stored sequence."""
    write_policy: Literal["write_through", "read_only"] = "write_through"
    """write_through: `store` copies new pages to the host tier; read_only: `store` does nothing."""
    fetch_pending: Literal["wait", "host_only"] = "wait"
    """While a fetch from the tiers below the host runs, `match` answers pending (wait) or takes
    the host hit now and lets the fetch finish for later requests (host_only)."""
    fetch_max_wait_ms: float = Field(default=200.0, gt=0)
    """A request waits at most this long for the tiers below the host (the whole walk), then
    goes on with its host hit."""
    prefill_tokens_per_s: float = Field(default=20000.0, gt=0)
    """The engine's prefill throughput the cost model starts from, until the engine reports its
    own (`HiCache.report_prefill`): a tier's page is fetched only where reading it is faster
    than recomputing its tokens."""
    prefix_memo: int = Field(default=256, ge=0)
    """Finished sequences whose tokens and keys are kept so that a prompt that starts like one of
    them is hashed only past the shared part (0: hash every prompt in full)."""


class MetricsConfig(_Strict):
    """Prometheus metrics over HTTP. Off unless a port is given; stats() works regardless."""

    port: int | None = Field(default=None, ge=0, le=65535)
    """Serve http://addr:port/metrics (0: any free port)."""
    addr: str = "127.0.0.1"
    """Address the metrics endpoint listens on."""


class TenantConfig(_Strict):
    """A tenant: the requests whose salt is `salt` (docs/tenants.md), with a key of its own for
    encryption at rest on the store tiers (at most one of `key_env`, `key_file` and `key_hook`;
    none: its objects are stored plain), and its shares and quotas of the tiers that keep them
    (the host tier, the disk tier)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[\w.\-]+$")
    """The tenant's name (what a `key_hook` is asked for)."""
    salt: str | None = Field(default=None, min_length=1)
    """The salt its requests carry (given to `match` and `store`; vLLM: the request's
    ``cache_salt``). Default: the name."""
    key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """An environment variable holding the key: 32, 48 or 64 hex digits (AES-128/192/256)."""
    key_file: Path | None = None
    """A file holding the key: its 16, 24 or 32 raw bytes, or its hex digits."""
    key_hook: str | None = Field(default=None, pattern=r"^[\w.]+:[\w]+$")
    """``module:function`` returning the key's bytes for the tenant's name (a KMS client;
    `hicache.backends.crypt.KeyHook`)."""
    share: dict[str, Bytes] = {}
    """Bytes of a tier the tenant keeps however hard the others push, by tier name (``host``,
    or a disk tier's name): eviction takes from the tenant furthest over its share first."""
    quota: dict[str, Bytes] = {}
    """Bytes of a tier the tenant may hold at most, by tier name (as `share`): past it, its
    own least recent pages are evicted."""

    @model_validator(mode="after")
    def _one_key(self) -> TenantConfig:
        given = [f for f in ("key_env", "key_file", "key_hook") if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of key_env, key_file, key_hook, not {' and '.join(given)}")
        for tier, share in self.share.items():
            quota = self.quota.get(tier)
            if quota is not None and share > quota:
                raise ValueError(f"share.{tier}: {share} bytes, more than quota.{tier} ({quota})")
        if self.name == "none":
            raise ValueError("name: 'none' names the requests of no tenant (in the metrics)")
        if given and importlib.util.find_spec("cryptography") is None:
            raise ValueError(
                f"{given[0]}: encryption needs the cryptography package: "
                "pip install 'hicache[crypto]'"
            )
        return self

    def check_machine(self) -> None:
        """ValueError naming the field where this process cannot have the key (a variable not
        set, a file it cannot read); the key itself is read and checked when the cache starts."""
        if self.key_env is not None and self.key_env not in os.environ:
            raise ValueError(f"key_env: {self.key_env} is not set")
        if self.key_file is not None and not os.access(self.key_file, os.R_OK):
            raise ValueError(f"key_file: {self.key_file} cannot be read here")

    @property
    def encrypted(self) -> bool:
        """Whether its objects are stored encrypted."""
        return any(v is not None for v in (self.key_env, self.key_file, self.key_hook))


class HiCacheConfig(_Strict):
    """The whole configuration."""

    layout: Layout | None = None
    """What a page is; optional here, as engines usually pass their `Layout` in code."""
    tiers: tuple[SerializeAsAny[TierConfig], ...] = Field(min_length=1)
    """The tiers below the engine's GPU pool, fastest first; the first is always ``host``."""
    policy: Policy = Policy()
    """How hits are taken and what gets stored."""
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus metrics over HTTP (off by default)."""
    tenants: tuple[TenantConfig, ...] = ()
    """The tenants, by salt (docs/tenants.md): each with its key for encryption at rest and its
    shares and quotas of the host and disk tiers, if any. A request whose salt names no tenant
    is stored plain, under no share or quota."""
    _source: str = PrivateAttr(default="")

    @property
    def source(self) -> str:
        """The file the configuration was read from by `load_config` ('' for a mapping); kept by
        ``model_copy``. Errors raised when it starts name it."""
        return self._source

    @field_validator("tiers", mode="before")
    @classmethod
    def _tier_models(cls, items: Any) -> Any:
        if not isinstance(items, list | tuple):
            return items
        out = []
        for i, item in enumerate(items):
            if isinstance(item, TierConfig):
                out.append(item)
                continue
            if not isinstance(item, Mapping) or "type" not in item:
                raise ValueError(f"tiers.{i} needs a 'type'")
            model = tier_config_model(str(item["type"]), where=f"tiers.{i}.type")
            if ":" in str(item["type"]):  # a module path: the section is the class's own type
                item = {**item, "type": model.model_fields["type"].default}
            try:
                out.append(model.model_validate(item))
            except ValidationError as err:
                first = _first(err)
                path = first["loc"][:-1] if first["type"] == "extra_forbidden" else first["loc"]
                loc = ".".join(str(p) for p in ("tiers", i, *path))
                raise ValueError(f"{loc}: {_message(first, model)}") from None
        return out

    @model_validator(mode="after")
    def _tier_order(self) -> HiCacheConfig:
        types = [t.type for t in self.tiers]
        if types[0] != "host" or "host" in types[1:]:
            raise ValueError(
                "the first tier must be 'host', and only the first: every other tier "
                "moves through it"
            )
        names = [tier_name(t) for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"each tier needs its own name (give 'name:'), got {names}")
        seen: dict[str, int] = {}
        for i, tenant in enumerate(self.tenants):
            for what, value in (("name", tenant.name), ("salt", tenant.salt or tenant.name)):
                j = seen.setdefault(f"{what}:{value}", i)
                if j != i:
                    raise ValueError(f"tenants.{i}.{what}: {value!r} is tenants.{j}'s already")
            for what in ("share", "quota"):
                for tier in getattr(tenant, what):
                    _check_terms_tier(f"tenants.{i}.{what}.{tier}", tier, self.tiers)
        for i, tier in enumerate(self.tiers):
            name = tier_name(tier)
            shares = sum(t.share.get(name, 0) for t in self.tenants)
            if shares > getattr(tier, "size", shares):
                raise ValueError(
                    f"tenants: the {name} shares add up to {shares} bytes, more than tiers.{i}.size"
                )
        policy = getattr(self.tiers[0], "policy", "lru")
        on_host = any("host" in t.share or "host" in t.quota for t in self.tenants)
        if on_host and policy != "lru":
            raise ValueError(
                "tenants: shares and quotas evict by lru within each tenant; tiers.0.policy is "
                f"{policy}"
            )
        if self.layout is not None:
            for i, tier in enumerate(self.tiers):
                _at(f"tiers.{i}", tier.check_layout, self.layout)
        return self

    def machine_problems(self, where: str = "") -> list[str]:
        """What cannot run on this machine as configured (CPUs or memory it does not have, a
        disk directory it cannot write), one line each, naming `where` (the file) and the
        field. A valid configuration may have some: it may be meant for another machine."""
        problems = []
        checks = [(f"tiers.{i}", tier.check_machine) for i, tier in enumerate(self.tiers)]
        checks += [(f"tenants.{i}", t.check_machine) for i, t in enumerate(self.tenants)]
        for at, check in checks:
            try:
                _at(at, check)
            except ValueError as err:
                problems.append(f"{where}: {err}" if where else str(err))
        return problems

    def check_machine(self, where: str = "") -> None:
        """Raise ConfigError with the first of `machine_problems`, if any: for tools about to
        run the configuration here."""
        problems = self.machine_problems(where)
        if problems:
            raise ConfigError(problems[0])

    def tier(self, name: str) -> TierConfig | None:
        """The section of the tier of this name (by default its type), or None."""
        return next((t for t in self.tiers if tier_name(t) == name), None)


def tier_section(item: Mapping[str, Any], where: str) -> TierConfig:
    """One tier section, validated as `tiers:` validates its items; ConfigError naming `where`
    and the field (``attach: size: ...``)."""
    try:
        return HiCacheConfig._tier_models([item])[0]  # type: ignore[no-any-return]
    except ValueError as err:
        reason = str(err).removeprefix("tiers.0.").removeprefix("tiers.0")
        raise ConfigError(f"{where}: {reason.lstrip(': ')}") from None


def _check_terms_tier(where: str, name: str, tiers: Sequence[TierConfig]) -> None:
    """ValueError naming `where` unless `name` is a tier of `tiers` that keeps tenants' shares
    and quotas (the host tier; a store tier whose class `keeps_terms`)."""
    named = {tier_name(t): t for t in tiers}
    if name not in named:
        close = difflib.get_close_matches(name, named, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: no tier is named {name!r} (tiers: {', '.join(named)}){hint}")
    tier = named[name]
    if tier.type != "host" and not getattr(tier_class(tier.type), "keeps_terms", False):
        raise ValueError(
            f"{where}: the {tier.type} tier keeps no shares or quotas (it evicts by its own "
            "policy); the host and disk tiers do"
        )


def tier_name(tier: TierConfig) -> str:
    """A tier's name: its `name:` where it has one, else its type."""
    return getattr(tier, "name", None) or tier.type


# -- loading -------------------------------------------------------------------------------------

C = TypeVar("C", bound=HiCacheConfig)


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    model: type[C] = HiCacheConfig,  # type: ignore[assignment]
) -> C:
    """Load and validate a configuration from a YAML file or a mapping, with env overrides.

    `env` defaults to ``os.environ``; pass ``{}`` to ignore the environment. `model`: the
    configuration's model (an integration's subclass of `HiCacheConfig`, with rules of its own).
    Raises ConfigError with one line naming the file and the field.
    """
    where = ""
    if isinstance(source, Mapping):
        data: Any = dict(source)
    else:
        where = str(source)
        try:
            text = Path(source).read_text()
        except OSError as err:
            raise ConfigError(f"{where}: cannot read: {err.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}: not valid YAML: {_one_line(str(err))}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of sections")
    data = apply_env_overrides(data, os.environ if env is None else env, where)
    try:
        config = model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, where)) from None
    config._source = where
    return config


def apply_env_overrides(data: dict[str, Any], env: Mapping[str, str], where: str = "") -> dict:
    """Return a copy of `data` with every ``HICACHE__A__B=value`` variable applied."""
    import copy

    out = copy.deepcopy(data)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not path:
            continue
        value = yaml.safe_load(env[name]) if env[name] != "" else None
        node: Any = out
        for depth, part in enumerate(path[:-1]):
            nxt = path[depth + 1]
            node = _child(node, part, list if nxt.isdigit() else dict, name)
        _assign(node, path[-1], value, name)
    return out


def _child(node: Any, part: str, kind: type, var: str) -> Any:
    if isinstance(node, list):
        index = _index(part, node, var)
        if node[index] is None:
            node[index] = kind()
        return node[index]
    if not isinstance(node, dict):
        raise ConfigError(f"environment {var}: '{part}' is not inside a section")
    if node.get(part) is None:
        node[part] = kind()
    return node[part]


def _assign(node: Any, part: str, value: Any, var: str) -> None:
    if isinstance(node, list):
        node[_index(part, node, var)] = value
    elif isinstance(node, dict):
        node[part] = value
    else:
        raise ConfigError(f"environment {var}: '{part}' is not inside a section")


def _index(part: str, node: list, var: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"environment {var}: no list item '{part}' (the list has {len(node)})")
    return int(part)


def _at(where: str, check: Any, *args: Any) -> None:
    """Run `check(*args)`; a ValueError it raises gets `where` (a field path) put in front."""
    try:
        check(*args)
    except ValueError as err:
        raise ValueError(f"{where}.{err}") from None


def _first(err: ValidationError) -> Any:
    """The error to report: an unknown key before anything else (a misspelt key also makes
    the key it was meant to be missing, and that is not the mistake)."""
    errors = err.errors()
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


def _describe(err: ValidationError, where: str) -> str:
    first = _first(err)
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = _message(first, HiCacheConfig)
    if first["type"] == "extra_forbidden":  # name the section, and the key in the message
        loc = ".".join(str(p) for p in first["loc"][:-1]) or "(top level)"
    head, sep, rest = msg.partition(": ")
    if sep and " " not in head and (head.startswith(loc + ".") or not first["loc"]):
        loc, msg = head, rest  # a nested error already names its full path
    text = f"{loc}: {_one_line(msg)}"
    return f"{where}: {text}" if where else text


def _message(error: Any, model: type[BaseModel]) -> str:
    if error["type"] == "extra_forbidden":
        key = str(error["loc"][-1])
        known = _fields_at(model, error["loc"][:-1])
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown key '{key}'{hint}"
    msg = str(error["msg"])
    return msg[len("Value error, ") :] if msg.startswith("Value error, ") else msg


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section at `loc` under `model` (empty where it is not a model)."""
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        inner = [t for t in (field.annotation, *get_args(field.annotation)) if _is_model(t)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _one_line(text: str) -> str:
    return " ".join(text.split())
