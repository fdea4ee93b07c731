"""Encryption at rest per tenant (issue 60): a tenant's objects rest on the disk tier and in a
real Mooncake store as AES-GCM ciphertext under its own key (compressed first where the tier has
a codec), never as plaintext; the same key reads them back byte-exact; a wrong key, no key, a
changed byte or a plaintext object where a key is expected is a counted miss, never a hit; the
configuration's errors name their field."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine, config, kv_bytes, settle
from test_codec import stored_object
from test_integrity import PAGE, Writer, flip_middle, prompt, rewrite

from hicache.backends import crypt
from hicache.backends.disk.records import HEADER as DISK_HEADER
from hicache.backends.envelope import _FIELDS, HEADER, RAW
from hicache.config import load_config
from hicache.core.keys import chain_seed, fingerprint, namespace
from hicache.errors import ConfigError

pytest.importorskip("cryptography")

KINDS = ["disk", "mooncake"]
KEY = "11" * 32
OTHER_KEY = "22" * 32


def tenant_config(
    kind, tmp_path: Path, master=None, key: str | None = KEY, codec="none", page: int = PAGE
) -> dict:
    """A host tier and one store tier (groups of 2 pages of `PAGE` bytes), with tenant "acme"
    (salt "acme", its key `key` in $ACME_KEY; None: no key) and tenant "plain" (no key)."""
    cfg = config(page_bytes=page, host_pages=64)
    if kind == "disk":
        tier: dict = {"type": "disk", "path": str(tmp_path / "d"), "size": "64MiB"}
    else:
        tier = {"type": "mooncake", **master.tier_config, "key_prefix": "t" + str(tmp_path.name)}
    cfg["tiers"].append({**tier, "group_pages": 2, "codec": codec})
    acme: dict = {"name": "acme"}
    if key is not None:
        acme["key_env"] = "ACME_KEY"
    cfg["tenants"] = [acme, {"name": "plain"}]
    return cfg


@pytest.fixture
def keys(monkeypatch):
    """Sets $ACME_KEY (None: unsets it) before an engine or a writer is made."""

    def use(key: str | None) -> None:
        if key is None:
            monkeypatch.delenv("ACME_KEY", raising=False)
        else:
            monkeypatch.setenv("ACME_KEY", key)

    return use


def engine(cfg: dict, keys, key: str | None = KEY) -> FakeEngine:
    keys(key)
    return FakeEngine(load_config(cfg, env={}), num_blocks=64)


def make_writer(cfg: dict, keys, key: str | None = KEY) -> Writer:
    keys(key)
    return Writer(load_config(cfg, env={}))


def store(writer: Writer, tokens: np.ndarray, salt: str) -> list[str]:
    """Store `tokens` under `salt`; the names of the objects put."""
    before = len(writer.names)
    writer.engine.run(f"w{before}", tokens, salt=salt)
    settle(writer.engine)
    return writer.names[before:]


def pages_plain(tokens: np.ndarray) -> list[bytes]:
    """The plaintext KV of each full page of `tokens` (FakeEngine's)."""
    return [kv_bytes(tokens, (i + 1) * 4, PAGE).tobytes() for i in range(len(tokens) // 4)]


def header(data: bytes) -> tuple:
    return _FIELDS.unpack_from(data)


@pytest.fixture(params=KINDS)
def kind_master(request):
    if request.param == "mooncake":
        return request.param, request.getfixturevalue("mooncake_master")
    return request.param, None


def test_encrypt_a_tenants_objects_rest_as_ciphertext_and_read_back_byte_exact(
    kind_master, tmp_path, keys
):
    """Tenant acme's 5 objects rest encrypted (its key's id, a nonce of their own, not one of
    its pages' plaintext bytes anywhere in the store); tenant plain's rest plain (key id 0). A
    fresh engine with the key hits acme's prompt whole, byte-exact (FakeEngine checks every
    byte), and so does vLLM's form of the salt (`namespace(salt=...)`)."""
    kind, master = kind_master
    cfg = tenant_config(kind, tmp_path, master)
    p, q = prompt(1), prompt(2)
    writer = make_writer(cfg, keys)
    try:
        secret = store(writer, p, "acme")
        public = store(writer, q, "plain")
        assert len(secret) == len(public) == 5
        kid = crypt.key_id(bytes.fromhex(KEY))
        nonces = set()
        for name in secret:
            data = stored_object(kind, writer, name)
            _, _, codec, flags, raw, stored, _, key_id, nonce, tag = header(data)
            assert (codec, flags, raw, stored, key_id) == (0, 0, 2 * PAGE, 2 * PAGE, kid)
            assert len(data) == HEADER + stored and tag != bytes(16)
            nonces.add(nonce)
        assert len(nonces) == 5
        for name in public:
            assert header(stored_object(kind, writer, name))[7] == 0
        at_rest = everything_at_rest(kind, writer, secret + public)
        for page in pages_plain(p):
            assert page[:64] not in at_rest  # no 64 bytes of acme's plaintext anywhere
        assert any(page[:64] in at_rest for page in pages_plain(q))  # plain's rests as it is
    finally:
        writer.engine.cache.close()
    reader = engine(cfg, keys)
    try:
        m = reader.run("r", p, salt="acme")
        assert (m.hit_tokens, reader.cache.stats()[f"key_misses_{kind}"]) == (40, 0)
        assert reader.run("r2", q, salt="plain").hit_tokens == 40
    finally:
        reader.cache.close()


def everything_at_rest(kind: str, writer: Writer, names: list[str]) -> bytes:
    """Every byte the store holds: the disk tier's files whole, or each of `names`' objects
    read raw from the Mooncake store."""
    if kind == "disk":
        root = Path(writer.store.root)
        return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())
    return b"".join(stored_object(kind, writer, name) for name in names)


@pytest.mark.parametrize("reader_key", ["wrong", "none"])
def test_encrypt_wrong_or_missing_key_is_a_counted_miss(kind_master, tmp_path, reader_key, keys):
    """Objects sealed under acme's key are misses, counted (`key_misses_<tier>`), for an
    engine with another key and for one without a key for acme; the prompt is then computed
    and stored again under the reader's own terms, and read back."""
    kind, master = kind_master
    cfg = tenant_config(kind, tmp_path, master)
    p = prompt(3)
    writer = make_writer(cfg, keys)
    try:
        assert len(store(writer, p, "acme")) == 5
    finally:
        writer.engine.cache.close()
    key = OTHER_KEY if reader_key == "wrong" else None
    reader = engine(tenant_config(kind, tmp_path, master, key=key), keys, key)
    try:
        m = reader.run("r", p, salt="acme")
        settle(reader)
        stats = reader.cache.stats()
        assert (m.hit_tokens, stats[f"key_misses_{kind}"], stats[f"corrupt_{kind}"]) == (0, 5, 0)
    finally:
        reader.cache.close()


def test_encrypt_changed_ciphertext_and_plaintext_where_a_key_is_expected_are_misses(
    kind_master, tmp_path, keys
):
    """A byte changed in an encrypted object fails its tag (a key miss, never wrong bytes);
    objects a keyless instance stored plain for acme's salt are misses for an instance that
    holds acme's key (a plaintext object is never taken for one of an encrypted tenant)."""
    kind, master = kind_master
    cfg = tenant_config(kind, tmp_path, master)
    p, q = prompt(4), prompt(5)
    writer = make_writer(cfg, keys)
    try:
        for name in store(writer, p, "acme"):
            rewrite(kind, writer, name, flip_middle)
    finally:
        writer.engine.cache.close()
    keyless = make_writer(tenant_config(kind, tmp_path, master, key=None), keys, None)
    try:
        assert len(store(keyless, q, "acme")) == 5
    finally:
        keyless.engine.cache.close()
    reader = engine(cfg, keys)
    try:
        assert reader.run("r", p, salt="acme").hit_tokens == 0
        assert reader.run("r2", q, salt="acme").hit_tokens == 0
        settle(reader)
        assert reader.cache.stats()[f"key_misses_{kind}"] == 10
    finally:
        reader.cache.close()


def test_encrypt_composes_with_the_codec_compressed_then_encrypted(kind_master, tmp_path, keys):
    """With codec: lossless, acme's KV-like groups rest compressed (fewer bytes than raw, the
    codec's id in the header) and encrypted: ciphertext does not compress, so they were
    compressed first. Read back byte-exact; a group that does not shrink rests raw (flag RAW),
    encrypted all the same."""
    pytest.importorskip("zstandard")
    kind, master = kind_master
    # groups of 16 KiB shrink; of 2 KiB (PAGE) they don't
    cfg = tenant_config(kind, tmp_path, master, codec="lossless", page=8192)
    p = prompt(6)
    writer = make_writer(cfg, keys)
    try:
        names = store(writer, p, "acme")
        for name in names:
            data = stored_object(kind, writer, name)
            _, _, codec, flags, raw, stored, _, key_id, _, _ = header(data)
            assert (codec, flags, raw, key_id) == (1, 0, 16384, crypt.key_id(bytes.fromhex(KEY)))
            assert stored < raw and len(data) == HEADER + stored
    finally:
        writer.engine.cache.close()
    reader = engine(cfg, keys)
    try:
        assert reader.run("r", p, salt="acme").hit_tokens == 40
    finally:
        reader.cache.close()
    small = tenant_config(kind, tmp_path, master, codec="lossless")
    small["tiers"][1]["key_prefix" if kind == "mooncake" else "path"] = (
        "s" + uuid.uuid4().hex[:8] if kind == "mooncake" else str(tmp_path / "small")
    )
    writer = make_writer(small, keys)
    try:
        for name in store(writer, prompt(7), "acme"):
            _, _, _, flags, raw, stored, _, key_id, _, _ = header(stored_object(kind, writer, name))
            assert (flags, stored, key_id > 0) == (RAW, raw, True)
    finally:
        writer.engine.cache.close()


def test_encrypt_keyring_maps_a_tenants_salt_and_vllms_form_of_it():
    cfg = load_config(tenant_config("disk", Path("/nonexistent")), env={})
    fp = b"f" * 16
    ring = crypt.keyring(cfg.tenants, fp, env={"ACME_KEY": KEY})
    key = ring.key_for(chain_seed(fp, "acme"))
    assert key is not None and key is ring.key_for(chain_seed(fp, namespace(salt="acme")))
    assert ring.key_for(chain_seed(fp, "plain")) is None and ring.key_for(chain_seed(fp)) is None
    assert key.id == crypt.key_id(bytes.fromhex(KEY)) and fingerprint  # a 32-bit digest


def _cfg(**acme) -> dict:
    cfg = config()
    cfg["tenants"] = [{"name": "acme", **acme}]
    return cfg


@pytest.mark.parametrize(
    ("acme", "env", "error"),
    [
        ({"key_env": "ACME_KEY"}, {}, "tenants.0.key_env: ACME_KEY is not set"),
        (
            {"key_env": "ACME_KEY"},
            {"ACME_KEY": "zz"},
            "tenants.0.key_env: ACME_KEY: not a key in hex digits",
        ),
        (
            {"key_env": "ACME_KEY"},
            {"ACME_KEY": "ab" * 10},
            "tenants.0.key_env: ACME_KEY: a key of 10 bytes (AES takes 16, 24 or 32)",
        ),
        (
            {"key_hook": "no_such_module_x:key"},
            {},
            "tenants.0.key_hook: no_such_module_x:key: cannot import it (No module named "
            "'no_such_module_x')",
        ),
    ],
)
def test_encrypt_a_key_that_cannot_be_had_is_a_one_line_error_naming_the_field(
    acme, env, error, monkeypatch
):
    monkeypatch.delenv("ACME_KEY", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    cfg = load_config(_cfg(**acme), env={})
    with pytest.raises(ConfigError) as err:
        FakeEngine(cfg, layout=cfg.layout)
    assert str(err.value) == error


def test_encrypt_key_file_and_key_hook_give_the_key(tmp_path, monkeypatch):
    raw = bytes(range(32))
    (tmp_path / "acme.key").write_bytes(raw)
    (tmp_path / "acme.hex").write_text(raw.hex() + "\n")
    (tmp_path / "kms_stub.py").write_text(
        "def key(tenant):\n    return bytes(range(32)) if tenant == 'acme' else b''\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fp = b"f" * 16
    for acme in (
        {"key_file": str(tmp_path / "acme.key")},
        {"key_file": str(tmp_path / "acme.hex")},
        {"key_hook": "kms_stub:key"},
    ):
        cfg = load_config(_cfg(**acme), env={})
        ring = crypt.keyring(cfg.tenants, fp, env={})
        assert ring.key_for(chain_seed(fp, "acme")).id == crypt.key_id(raw)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("tenants", "error"),
    [
        (
            [{"name": "acme", "key_env": "A", "key_file": "/k"}],
            "give one of key_env, key_file, key_hook, not key_env and key_file",
        ),
        ([{"name": "a"}, {"name": "b", "salt": "a"}], "tenants.1.salt: 'a' is tenants.0's already"),
        ([{"name": "a"}, {"name": "a", "salt": "x"}], "tenants.1.name: 'a' is tenants.0's already"),
        ([{"name": "a b"}], "tenants.0.name"),
    ],
)
def test_encrypt_tenant_config_errors_name_the_field(tenants, error):
    cfg = config()
    cfg["tenants"] = tenants
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    assert error in str(err.value)


def test_encrypt_objects_of_disk_rest_after_the_record_header(tmp_path, keys):
    """The disk tier keeps an encrypted object's 64-byte header inline in its record header
    block and the ciphertext after it (the payload still starts aligned)."""
    cfg = tenant_config("disk", tmp_path)
    writer = make_writer(cfg, keys)
    try:
        names = store(writer, prompt(8), "acme")
        data = stored_object("disk", writer, names[0])
        from hicache.backends.disk.records import file_name

        path = Path(writer.store.root) / "objects" / file_name(names[0])
        assert path.stat().st_size == DISK_HEADER + 2 * PAGE and len(data) == HEADER + 2 * PAGE
    finally:
        writer.engine.cache.close()
