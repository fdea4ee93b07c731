"""Page keys: deterministic everywhere, chained, namespaced by layout and tenant."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from hicache import Layout
from hicache.core import native
from hicache.core.keys import (
    KeyChain,
    _page_keys_python,
    as_tokens,
    chain_seed,
    fingerprint,
    page_keys,
    store_key,
)

LAYOUT = Layout(model="m", kv_dtype="bfloat16", page_tokens=4, page_bytes=64)
SEED = chain_seed(fingerprint(LAYOUT))
TOKENS = np.arange(1000, 1018, dtype=np.int32)  # 4 full pages and 2 tokens


def count_hashed(monkeypatch) -> list[int]:
    """Record how many pages each call of the compiled chain hashes."""
    hashed: list[int] = []
    real = native.chain_keys

    def counting(seed, pages, *args):
        hashed.append(pages.shape[0])
        return real(seed, pages, *args)

    monkeypatch.setattr(native, "chain_keys", counting)
    return hashed


def test_keys_follow_the_documented_chain():
    keys = page_keys(SEED, TOKENS, 4)
    prev, expected = SEED, []
    for i in range(4):
        page = TOKENS[4 * i : 4 * i + 4].astype("<i4").tobytes()
        prev = hashlib.sha256(prev + hashlib.sha256(page).digest()).digest()[:16]
        expected.append(prev)
    assert keys == expected
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)


@pytest.mark.native
def test_known_answer():
    # key[i] = SHA-256(key[i-1] || SHA-256(page i))[:16], pages as int32 little-endian
    seed = bytes(range(16))
    pages = np.array([[1, 2, 3, 4], [-1, 0, 2**31 - 1, -(2**31)]], dtype=np.int32)
    d0 = hashlib.sha256(b"\x01\0\0\0\x02\0\0\0\x03\0\0\0\x04\0\0\0").digest()
    d1 = hashlib.sha256(b"\xff\xff\xff\xff\0\0\0\0\xff\xff\xff\x7f\0\0\0\x80").digest()
    k0 = hashlib.sha256(seed + d0).digest()[:16]
    k1 = hashlib.sha256(k0 + d1).digest()[:16]
    # pinned, so that a change of format in both the code and this test still fails here
    assert k0.hex() == "68d44b3bd65703953693bd45715de276"
    assert k1.hex() == "36e26b1a84d2a8c43ff028c85a372410"
    assert page_keys(seed, pages.reshape(-1), 4) == [k0, k1]
    assert _page_keys_python(seed, pages) == [k0, k1]
    assert native.chain_keys(seed, pages) == k0 + k1


@pytest.fixture
def sha_ni_restored():
    yield
    native.force_portable(False)


@pytest.mark.native
def test_compiled_and_python_chains_agree(sha_ni_restored):
    assert native.available(), "the C key chain should build here (gcc and OpenSSL are present)"
    tokens = np.random.default_rng(1).integers(0, 2**31 - 1, 4096, dtype=np.int32)
    assert page_keys(SEED, tokens, 128) == _page_keys_python(SEED, tokens.reshape(32, 128))
    rng = np.random.default_rng(2)
    for portable in (False, True):
        native.force_portable(portable)
        for page_bytes in (4, 64, 400, 512, 2048):  # 400: a partial last block; 4: only one
            for n in (0, 1, 2, 3, 7, 64):
                pages = rng.integers(-(2**31), 2**31 - 1, (n, page_bytes // 4), dtype=np.int32)
                expected = b"".join(_page_keys_python(SEED, pages))
                assert native.chain_keys(SEED, pages) == expected, (portable, page_bytes, n)


def test_sha_ni_and_openssl_paths_agree(sha_ni_restored):
    if not native.force_portable(False):
        pytest.skip("this CPU has no SHA extensions: only the OpenSSL path runs")
    rng = np.random.default_rng(3)
    # 52..60 bytes: the padding's length fits the last block, or needs one more (56 and 60)
    for page_bytes in (4, 52, 56, 60, 64, 120, 400, 512, 2048):
        for n in (1, 2, 3, 7, 64):
            pages = rng.integers(-(2**31), 2**31 - 1, (n, page_bytes // 4), dtype=np.int32)
            assert native.force_portable(False)
            fast = native.chain_keys(SEED, pages)
            assert not native.force_portable(True)
            assert native.chain_keys(SEED, pages) == fast, (page_bytes, n)


def test_keys_are_the_same_in_other_interpreters():
    code = (
        "import numpy as np;from hicache import Layout;from hicache.core.keys import *;"
        "L=Layout(model='m',kv_dtype='bfloat16',page_tokens=4,page_bytes=64);"
        "print(page_keys(chain_seed(fingerprint(L),'t'),np.arange(1000,1018,dtype=np.int32),4)[-1].hex())"
    )
    outs = set()
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        outs.add(done.stdout.strip())
    assert outs == {page_keys(chain_seed(fingerprint(LAYOUT), "t"), TOKENS, 4)[-1].hex()}


def test_a_key_names_its_whole_prefix():
    other = TOKENS.copy()
    other[0] += 1  # change only the first page
    a, b = page_keys(SEED, TOKENS, 4), page_keys(SEED, other, 4)
    assert all(x != y for x, y in zip(a, b))


def test_a_chain_hashes_each_page_once_and_only_when_asked(monkeypatch):
    want = page_keys(SEED, TOKENS, 4)
    hashed = count_hashed(monkeypatch)
    chain = KeyChain(SEED, 4, TOKENS[:6])
    assert hashed == [] and chain.pages == 1
    assert chain.hash_to(1) == want[:1]
    assert chain.try_extend(TOKENS)
    assert chain.pages == 4 and len(chain.hashed) == 1  # extending hashes nothing yet
    held = chain.tokens
    assert held is not TOKENS and np.array_equal(held, TOKENS)  # a copy, never the caller's
    hashed.clear()
    assert chain.hash_to(3) == want[:3]
    assert chain.hash_to(9) == want  # never past the full pages held
    assert hashed == [2, 1]  # pages 1..2 from key 0, then page 3; none twice
    assert not chain.try_extend(TOKENS[::-1].copy())
    assert chain.tokens is held and chain.pages == 4  # unchanged


def test_salt_and_every_layout_field_change_the_namespace():
    base = fingerprint(LAYOUT)
    for change in (
        {"model": "m2"},
        {"kv_dtype": "float8_e4m3fn"},
        {"page_tokens": 8},
        {"page_bytes": 128},
        {"state_bytes": 16},
        {"tp_size": 2},
        {"segments": (32, 32)},
    ):
        assert fingerprint(LAYOUT.model_copy(update=change)) != base, change
    # TP rank matters only where KV is sharded by head
    assert fingerprint(LAYOUT.model_copy(update={"tp_size": 2, "tp_rank": 1})) != fingerprint(
        LAYOUT.model_copy(update={"tp_size": 2})
    )
    replicated = {"tp_size": 2, "kv_head_sharded": False}
    assert fingerprint(LAYOUT.model_copy(update={**replicated, "tp_rank": 1})) == fingerprint(
        LAYOUT.model_copy(update=replicated)
    )
    assert len({chain_seed(base), chain_seed(base, "a"), chain_seed(base, "b")}) == 3
    assert chain_seed(base, "a") == chain_seed(base, b"a")


def test_token_validation_names_the_problem():
    assert as_tokens([1, 2, 3]).dtype == np.int32
    with pytest.raises(ValueError, match="token id 2147483648 is outside int32"):
        as_tokens(np.array([1, 2**31], dtype=np.int64))
    with pytest.raises(ValueError, match="token id -2147483649 is outside int32"):
        as_tokens([-(2**31) - 1])
    with pytest.raises(ValueError, match="must be integers"):
        as_tokens([1.5, 2.0])
    with pytest.raises(ValueError, match="1-D"):
        as_tokens([[1, 2]])
    with pytest.raises(ValueError, match="token id 2147483648 is outside int32"):
        as_tokens([1, 2**31])
    with pytest.raises(ValueError, match="token ids must be integers, got str"):
        as_tokens([1, "2"])
    assert as_tokens((5, 6)).tolist() == [5, 6] and as_tokens([]).shape == (0,)


def test_store_key_format():
    fp = fingerprint(LAYOUT)
    key = page_keys(SEED, TOKENS, 4)[3]
    assert store_key("hicache", fp, key, 4) == f"hicache/{fp.hex()}/g4/{key.hex()}"
    assert store_key("hicache", fp, key, None) == f"hicache/{fp.hex()}/s/{key.hex()}"


def test_prefix_memo_reuses_exactly_the_keys_hashing_gives(monkeypatch):
    from hicache.core.keys import PrefixMemo

    memo = PrefixMemo(page_tokens=4)
    rng = np.random.default_rng(5)
    base = rng.integers(0, 1000, 40, dtype=np.int32)  # 10 pages
    first = KeyChain(SEED, 4, base, memo)
    first.hash_to(first.pages)
    memo.remember(first)
    hashed = count_hashed(monkeypatch)
    longer = np.concatenate([base, rng.integers(0, 1000, 9, dtype=np.int32)])
    chain = KeyChain(SEED, 4, longer, memo)
    assert chain.hash_to(chain.pages) == _page_keys_python(SEED, longer[:48].reshape(12, 4))
    assert hashed == [2]  # only the two new pages
    diverged = base.copy()
    diverged[22] += 1  # inside page 5: pages 0..4 are shared
    hashed.clear()
    assert KeyChain(SEED, 4, diverged, memo).hash_to(10) == page_keys(SEED, diverged, 4)
    assert hashed == [5, 10]  # 5 pages from the divergence on; then the check hashes all 10
    other_tenant = chain_seed(fingerprint(LAYOUT), "t")
    hashed.clear()
    KeyChain(other_tenant, 4, longer, memo).hash_to(12)
    assert hashed == [12]  # another namespace never reuses keys
    assert memo.reused_pages == 10 + 5


def test_prefix_memo_is_bounded():
    from hicache.core.keys import PrefixMemo

    def hashed(tokens: np.ndarray) -> KeyChain:
        chain = KeyChain(SEED, 4, tokens)
        chain.hash_to(chain.pages)
        return chain

    memo = PrefixMemo(page_tokens=4, max_sequences=3, per_head=2)
    for i in range(10):
        memo.remember(hashed(np.arange(i, i + 8, dtype=np.int32)))
    assert sum(len(c) for c in memo._heads.values()) == 3
    same_head = [
        np.concatenate([np.arange(4, dtype=np.int32), np.full(4, i, np.int32)]) for i in range(5)
    ]
    for t in same_head:
        memo.remember(hashed(t))
    assert len(memo._heads[SEED + same_head[0][:4].tobytes()]) == 2


def test_the_memo_takes_the_longest_shared_run_not_the_most_recent_sequence(monkeypatch):
    from hicache.core.keys import PrefixMemo

    memo = PrefixMemo(page_tokens=4)
    rng = np.random.default_rng(11)
    a = rng.integers(0, 1000, 40, dtype=np.int32)  # 10 pages
    b = a.copy()
    b[13] += 1  # shares pages 0..2 with a; remembered after a, so tried first
    for tokens in (a, b):
        chain = KeyChain(SEED, 4, tokens, memo)
        chain.hash_to(chain.pages)
        memo.remember(chain)
    prompt = np.concatenate([a, rng.integers(0, 1000, 8, dtype=np.int32)])  # a's next turn
    hashed = count_hashed(monkeypatch)
    chain = KeyChain(SEED, 4, prompt, memo)
    assert len(chain.hashed) == 10  # all of a's pages, found behind b's 3
    assert chain.hash_to(12) == _page_keys_python(SEED, prompt.reshape(12, 4))
    assert hashed[0] == 2  # only the two new pages were hashed by the chain
