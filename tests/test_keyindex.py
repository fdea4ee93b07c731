"""The key index: the compiled table and the dict fallback answer exactly like a dict."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hicache.core.native.index import _DictIndex, _TableIndex, key_index


def _kinds() -> list:
    return [pytest.param("compiled", marks=pytest.mark.native), "dict"]


def _new(kind: str, capacity: int):
    index = key_index(capacity, compiled=kind == "compiled")
    expected = _TableIndex if kind == "compiled" else _DictIndex
    assert isinstance(index, expected), "the C compiler is present here: the table must build"
    return index


def _key(rng: random.Random, clash_bits: int = 0) -> bytes:
    """A random key; with clash_bits, its low 64-bit word keeps only that many random bits, so
    that keys crowd into a few buckets (long probe runs, removals that must shift entries)."""
    k = bytearray(rng.randbytes(16))
    if clash_bits:
        low = rng.getrandbits(clash_bits)
        k[:8] = low.to_bytes(8, "little")
    return bytes(k)


@pytest.mark.parametrize("kind", _kinds())
def test_prefix_stops_at_the_first_missing_key(kind: str) -> None:
    rng = random.Random(1)
    index = _new(kind, 16)
    keys = [_key(rng) for _ in range(5)]
    assert index.insert(keys[:3], [7, 8, 9]) == [True, True, True]
    index.insert([keys[4]], [11])
    assert index.prefix(keys) == [7, 8, 9]
    assert index.lookup(keys) == [7, 8, 9, None, 11]
    assert index.prefix([]) == [] and index.lookup([]) == []
    assert len(index) == 4


@pytest.mark.parametrize("kind", _kinds())
def test_insert_keeps_the_first_slot_of_a_key(kind: str) -> None:
    rng = random.Random(2)
    index = _new(kind, 8)
    a, b = _key(rng), _key(rng)
    assert index.insert([a, b, a], [1, 2, 3]) == [True, True, False]
    assert index.get(a) == 1 and len(index) == 2
    index.remove([a, a, _key(rng)])  # absent keys and repeats are ignored
    assert a not in index and index.get(b) == 2 and len(index) == 1


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize("clash_bits", [0, 3])
def test_random_operations_agree_with_a_dict(kind: str, clash_bits: int) -> None:
    rng = random.Random(3 + clash_bits)
    capacity = 200
    index, model = _new(kind, capacity), {}
    pool = [_key(rng, clash_bits) for _ in range(400)]
    for _ in range(3000):
        op = rng.random()
        batch = rng.sample(pool, rng.randint(1, 12))
        if op < 0.45 and len(model) + len(batch) <= capacity:
            slots = [rng.randrange(1000) for _ in batch]
            fresh = index.insert(batch, slots)
            want = []
            for k, s in zip(batch, slots):
                want.append(k not in model)
                model.setdefault(k, s)
            assert fresh == want
        elif op < 0.75:
            index.remove(batch)
            for k in batch:
                model.pop(k, None)
        else:
            assert index.lookup(batch) == [model.get(k) for k in batch]
        assert len(index) == len(model)
    assert dict(index.items()) == model
    assert index.lookup(pool) == [model.get(k) for k in pool]


@pytest.mark.native
def test_keys_of_the_wrong_size_are_refused() -> None:
    index = _new("compiled", 4)
    with pytest.raises(ValueError, match="16 bytes"):
        index.lookup([b"short"])
    with pytest.raises(ValueError, match="2 keys but 1 slots"):
        index.insert([b"a" * 16, b"b" * 16], [1])


@pytest.mark.native
def test_the_table_refuses_to_fill_up() -> None:
    rng = random.Random(5)
    index = _new("compiled", 4)  # 16 buckets
    index.insert([_key(rng) for _ in range(15)], list(range(15)))
    with pytest.raises(RuntimeError, match="key index full"):
        index.insert([_key(rng)], [15])


@pytest.mark.native
def test_the_walk_hashes_pairs_until_the_first_missing_key():
    from hicache.core.keys import page_keys

    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 50_000, 10 * 4, dtype=np.int32)
    seed = bytes(16)
    keys = page_keys(seed, tokens, 4)
    pages = tokens.reshape(10, 4)
    index = _new("compiled", 64)
    index.insert(keys[:3] + keys[5:], [10, 11, 12, 15, 16, 17, 18, 19])  # page 3 missing
    hashed, slots = index.walk(seed, pages)
    assert hashed == keys[:4] and slots == [10, 11, 12]  # stops after the pair (2, 3)
    index.insert([keys[3]], [13])
    index.remove([keys[4]])
    hashed, slots = index.walk(seed, pages)
    assert hashed == keys[:6] and slots == [10, 11, 12, 13]  # pair (4, 5) holds the miss
    index.insert([keys[4]], [14])
    hashed, slots = index.walk(seed, pages[:9])  # an odd count: the last page alone
    assert hashed == keys[:9] and slots == list(range(10, 19))
    hashed, slots = index.walk(keys[1], pages[2:5])  # from a known key, mid-chain
    assert hashed == keys[2:5] and slots == [12, 13, 14]
    assert _new("dict", 8).walk(seed, pages) is None  # the caller hashes in steps instead
