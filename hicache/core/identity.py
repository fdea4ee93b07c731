"""The identity of a page's bytes: one record of every input that decides them, declared once.

A page is served only where a recompute would write the same bytes. What decides those bytes
is listed here, as the fields of `Identity`, and nowhere else: the reference engine
(`hicache.tools.refengine.build`), vLLM's connector (`hicache.integrations.vllm.worker`),
SGLang's backend (`hicache.integrations.sglang.backend`) and a program that embeds hicache
(`Layout`) each fill one `Identity` through one function of theirs, and its `name` goes into
`Layout.model`, from which `hicache.core.keys.fingerprint` makes the 16 bytes every page key of
the instance is rooted in (``key[-1] = SHA-256(fingerprint, salt)``). So two instances share a
page only where every field below is equal (and the layout's own fields: the KV tensors'
dtype, the page's tokens and bytes, the TP rank where KV is sharded by head).

A name the user gives (``model_id``) names the weights (`weights`) and replaces nothing else.
The weights are named by their content too (`weights_digest`: every byte of every weight
file, `hicache.core.weights`) and by an explicit `weights_version` that a user or an RL loop
bumps when it changes weights in place.

docs/identity.md has the table of what makes two pages the same, generated from `FIELDS` and
`NEUTRAL` (`hicache.tools.docgen`), and tests/test_identity_table.py runs it on every engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

IDENTITY_VERSION = 1
"""The record's own version: bump it when a field's meaning changes (names then never mix)."""


@dataclass(frozen=True)
class Identity:
    """Every input that decides the bytes of a KV page (each field's docstring is in `FIELDS`).

    Strings, or mappings (canonical JSON) where an engine has structured settings; '' where an
    input does not apply to the engine (none is ever left out silently: an engine that cannot
    tell an input refuses to start, `unknown_setting`)."""

    weights: str
    weights_digest: str = ""
    weights_version: str = ""
    config: Any = ""
    compute_dtype: str = ""
    kv_format: str = ""
    quantization: str = ""
    attention: Any = ""
    position: Any = ""
    shard: str = ""
    arithmetic: str = ""
    adapters: str = ""
    multimodal: str = ""
    salt: str = ""
    engine: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, str) or not self.weights:
            raise ValueError(f"identity: weights must name the model, got {self.weights!r}")

    def canonical(self) -> bytes:
        """The record as canonical JSON (sorted keys, no spaces): what `name` digests."""
        doc = {"identity": IDENTITY_VERSION, **asdict(self)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()

    def digest(self) -> str:
        """16 hex digits of SHA-256 over `canonical`: equal only where every field is."""
        return hashlib.sha256(self.canonical()).hexdigest()[:16]

    def name(self) -> str:
        """What goes into `Layout.model`: ``<weights>[@<version>]:<digest>`` (the weights'
        name and version, readable in logs, and the digest of every field)."""
        version = f"@{self.weights_version}" if self.weights_version else ""
        return f"{self.weights}{version}:{self.digest()}"

    def differences(self, other: Identity) -> list[str]:
        """The fields in which `other` differs from this record, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


FIELDS: dict[str, str] = {
    "weights": "The weights' name: the user's `model_id`, else the engine's model name or "
    "path. It names the weights only: every other field is kept.",
    "weights_digest": "Every byte of every weight file (SHA-256, streamed; remembered by each "
    "file's path, size, mtime, ctime and inode, so an unchanged checkpoint is read once): weights "
    "re-saved under one name (a fine-tune over its base) are other weights.",
    "weights_version": "An explicit version (`weights_version` in the engine's settings, or "
    "the API): bump it when weights change in place in a running engine (an RL step, an "
    "update-weights call), where no file tells.",
    "config": "The model's config as the engine loaded it, overrides applied (layers, heads, "
    "norms, sliding window, RoPE, ...), and the engine's code revision.",
    "compute_dtype": "The dtype the model computes in.",
    "kv_format": "The KV cache format as the engine interprets its bytes (bf16, fp8_e4m3, "
    "fp8_e5m2, scales, layers left unquantized), never the storage dtype alone: every fp8 "
    "format lies in uint8 tensors.",
    "quantization": "The weights' quantization method.",
    "attention": "The attention kind (MHA, GQA, MLA, sliding) and geometry (heads, KV heads, "
    "head size, layers) and how a page's bytes lie in the KV tensors.",
    "position": "Position-encoding settings (RoPE base, scaling) where the engine sets them "
    "apart from the config.",
    "shard": "The part of the model's KV this rank holds: TP rank where KV heads are split, "
    "pipeline stage, context-parallel slice.",
    "arithmetic": "How K/V are computed: an exact (batch-invariant) mode, and the device "
    "class (CPU, a GPU's architecture) where results differ by device.",
    "adapters": "LoRA adapters applied to every request of the instance (per-request adapters "
    "go into the request's namespace instead, `hicache.core.keys.namespace`).",
    "multimodal": "Multimodal settings of the instance (per-request images fold into the "
    "page keys, `hicache.core.keys.fold_features`).",
    "salt": "The instance's tenant salt (per-request salts go into the request's namespace).",
    "engine": "What else of the engine's settings changes bytes and has no field above (a "
    "speculative drafter that keeps KV in the same blocks, ...).",
}
"""Each field of `Identity` and what it names (the generated docs' table)."""

NEUTRAL: dict[str, str] = {
    "codec": "How a tier encodes the pages it stores (the bytes served are the page's own).",
    "tier order": "Which tiers there are and in what order.",
    "metrics port": "Where hicache's metrics are served.",
    "threads": "hicache's worker threads.",
    "worker CPUs": "Which CPUs hicache's workers run on.",
}
"""Settings that must not matter: instances differing only there share every page."""

NAMING: dict[str, str] = {
    "page group size": "How many pages a store object holds (`group_pages`): an object of G "
    "pages is named by G and its last page's key, and a tier reads the objects of its own G "
    "only, so instances share a store tier's pages only where their G is equal (SGLang's is "
    "always 1).",
}
"""Settings that name the store objects, not their bytes: instances differing only there
share no page of a store tier (their host tiers are their own anyway)."""


def check_fields() -> None:
    """ValueError where `FIELDS` and `Identity` disagree (a field added without its meaning)."""
    declared = [f.name for f in fields(Identity)]
    if declared != list(FIELDS):
        raise ValueError(f"identity: FIELDS {list(FIELDS)} do not match Identity's {declared}")


check_fields()


def device_class(device: Any) -> str:
    """The class of devices whose K/V agree bit for bit for one computation: ``cpu``, or a
    CUDA device's name and compute capability (``cuda:NVIDIA H100 80GB HBM3:sm90``)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    major, minor = torch.cuda.get_device_capability(dev)
    return f"cuda:{torch.cuda.get_device_name(dev)}:sm{major}{minor}"


def current_device_class() -> str:
    """`device_class` of the GPU this process computes on (CUDA's current device), or ``cpu``
    where it has none."""
    import torch

    if torch.cuda.is_available():
        return device_class(torch.device("cuda", torch.cuda.current_device()))
    return "cpu"


def unknown_setting(engine: str, setting: str, value: Any, why: str) -> ValueError:
    """The one-line refusal of an engine setting hicache cannot key: `setting` is `value`."""
    return ValueError(
        f"hicache: {engine}'s {setting}={value!r} may change the KV bytes and hicache cannot "
        f"key it: {why}"
    )
