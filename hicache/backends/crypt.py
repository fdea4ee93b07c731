"""Encryption at rest of store tiers, per tenant: AES-GCM with a key of the tenant's own.

A tenant (`hicache.config.TenantConfig`) is the namespace of a salt: the requests that
`match` and `store` are given its salt (vLLM: its ``cache_salt``) name their pages under the
chain seed of that salt (`hicache.core.keys.chain_seed`), so a job's seed says whose objects it
moves. A tenant with a key (`key_env`, `key_file` or `key_hook`) has every object a store tier
holds for it encrypted: the payload as stored (after the codec, if any) is AES-GCM's ciphertext
under a random 96-bit nonce, with the object's name and header as associated data, so that an
object moved under another name, or a header changed, does not open. The key's id (a digest
of the key, never the key), the nonce and the tag lie in the object's header
(`hicache.backends.envelope`). A read opens an object only with the tenant's own key: an
object of an encrypted tenant stored in plain, one under another key (a rotated one, another
instance's) or one whose tag does not verify is a miss (`KEY_MISS`, counted), and so is an
encrypted object read by an instance without the key.

The ``cryptography`` package (the ``crypto`` extra) does the work; `problem()` says why it
cannot be used here. The plaintext of an encrypted object never lies in memory a store tier
reads: a put encrypts into the link's staging memory, and a get decrypts out of the host
slots into a thread's scratch before writing the plaintext back.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hicache.core.shares import tenant_seeds
from hicache.errors import ConfigError

KEY_MISS = -errno.EKEYREJECTED
"""The per-key code a get gives for an object that did not open under the tenant's key (or
that should have been encrypted and was not, or that was and no key is here)."""
NONCE = 12
TAG = 16
KEY_SIZES = (16, 24, 32)
"""Key lengths AES takes (bytes): AES-128, -192, -256."""


class KeyHook(Protocol):
    """A key source of one's own (a KMS client): the key of tenant `tenant` (16, 24 or 32
    bytes), called once per tenant when the cache starts. Name it in ``key_hook:`` as
    ``module:function``."""

    def __call__(self, tenant: str) -> bytes: ...


def problem() -> str | None:
    """Why encryption cannot be used in this process (one line), or None."""
    try:
        import cryptography.hazmat.primitives.ciphers  # noqa: F401
    except ImportError:
        return "needs the cryptography package: pip install 'hicache[crypto]'"
    return None


def key_id(key: bytes) -> int:
    """The 32-bit id of `key` that headers carry: a digest, from which the key cannot be had;
    0 is kept for plain objects."""
    digest = hashlib.blake2b(key, digest_size=4, person=b"hicache-keyid").digest()
    return int.from_bytes(digest, "little") or 1


class TenantKey:
    """One tenant's key: seals payloads (encrypt, tag) and opens them (decrypt, verify).
    Thread-safe: every call makes its own cipher context."""

    def __init__(self, tenant: str, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers import algorithms

        if len(key) not in KEY_SIZES:
            raise ValueError(f"tenant {tenant}: a key of {len(key)} bytes (AES takes 16, 24 or 32)")
        self.tenant = tenant
        self.id = key_id(key)
        self._algorithm = algorithms.AES(key)
        self._local = threading.local()

    def scratch(self, nbytes: int) -> np.ndarray:
        """This thread's buffer of at least `nbytes` + 15 bytes (what a cipher's update_into
        asks for), its first `nbytes` + 15 returned."""
        want = nbytes + 15
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < want:
            buf = self._local.buf = np.empty(want, dtype=np.uint8)
        return buf[:want]

    def seal(self, src: np.ndarray, out: np.ndarray, aad: bytes) -> tuple[bytes, bytes]:
        """Encrypt `src` into `out` (at least ``src.size + 15`` bytes, not overlapping `src`;
        the ciphertext is its first ``src.size``) under a fresh random nonce, authenticating
        `aad` too; (nonce, tag)."""
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        nonce = os.urandom(NONCE)
        enc = Cipher(self._algorithm, modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        enc.update_into(src, out)
        enc.finalize()
        return nonce, enc.tag

    def open(self, src: np.ndarray, out: np.ndarray, aad: bytes, nonce: bytes, tag: bytes) -> bool:
        """Decrypt `src` into `out` (as `seal`'s); False, and `out` not to be used, where the
        tag does not verify (another key, changed bytes, another name or header)."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        dec = Cipher(self._algorithm, modes.GCM(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        dec.update_into(src, out)
        try:
            dec.finalize()
        except InvalidTag:
            return False
        return True


@dataclass(frozen=True)
class Keyring:
    """The keys of the encrypted tenants, by the chain seed of their namespace (a seed that is
    not here is a plain tenant's, or no tenant's)."""

    by_seed: Mapping[bytes, TenantKey]

    def key_for(self, seed: bytes) -> TenantKey | None:
        """The key of the tenant whose pages are named from `seed`, or None (stored plain)."""
        return self.by_seed.get(seed)

    def __bool__(self) -> bool:
        return bool(self.by_seed)


def keyring(
    tenants: Iterable[Any], fingerprint: bytes, env: Mapping[str, str] | None = None
) -> Keyring:
    """The keys of `tenants` (`TenantConfig`s) that have one, loaded now; ConfigError naming the
    field (``tenants.0.key_env: ...``) where a key cannot be had."""
    env = os.environ if env is None else env
    out: dict[bytes, TenantKey] = {}
    for i, tenant in enumerate(tenants):
        field, load = _source(tenant, env)
        if load is None:
            continue
        where = f"tenants.{i}.{field}"
        reason = problem()
        if reason is not None:
            raise ConfigError(f"{where}: encryption {reason}")
        try:
            key = TenantKey(tenant.name, load())
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"{where}: {err}") from None
        for seed in tenant_seeds(fingerprint, tenant.salt or tenant.name):
            out[seed] = key
    return Keyring(out)


def _source(tenant: Any, env: Mapping[str, str]) -> tuple[str, Callable[[], bytes] | None]:
    """The field that gives `tenant`'s key and a loader of it (None: no key)."""
    if tenant.key_env is not None:
        return "key_env", lambda: _from_env(tenant.key_env, env)
    if tenant.key_file is not None:
        return "key_file", lambda: _from_file(Path(tenant.key_file))
    if tenant.key_hook is not None:
        return "key_hook", lambda: _from_hook(tenant.key_hook, tenant.name)
    return "", None


def _from_env(var: str, env: Mapping[str, str]) -> bytes:
    value = env.get(var)
    if value is None:
        raise ValueError(f"{var} is not set")
    return _hex(value.strip(), var)


def _from_file(path: Path) -> bytes:
    """A key file: the key's raw bytes, or its hex digits (one line)."""
    data = path.read_bytes()
    if len(data) in KEY_SIZES:
        return data
    return _hex(data.decode("ascii", "replace").strip(), str(path))


def _hex(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{where}: not a key in hex digits") from None
    if len(key) not in KEY_SIZES:
        raise ValueError(f"{where}: a key of {len(key)} bytes (AES takes 16, 24 or 32)")
    return key


def _from_hook(path: str, tenant: str) -> bytes:
    module, _, name = path.partition(":")
    try:
        hook: KeyHook = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{path}: cannot import it ({err})") from None
    key = hook(tenant)
    if not isinstance(key, bytes | bytearray):
        raise TypeError(f"{path} returned {type(key).__name__}, not bytes")
    return bytes(key)
