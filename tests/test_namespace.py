"""What besides token ids names a page: namespace fields, multimodal features, the weights."""

from __future__ import annotations

import pytest

from hicache.core.keys import fold_features, namespace
from hicache.core.weights import weights_digest


def test_a_namespace_is_one_injective_encoding_of_its_fields():
    assert namespace(salt=None, lora=None) is None
    cases = [
        namespace(salt=""),
        namespace(salt="ab"),
        namespace(salt="a", lora="b"),
        namespace(salt="ab", lora=""),
        namespace(lora="ab"),
        namespace(salt=namespace(lora="x").decode("latin-1")),  # a salt spelling a namespace
        namespace(lora="x"),
    ]
    assert len(set(cases)) == len(cases)
    assert namespace(lora="b", salt="a") == namespace(salt="a", lora="b")  # field order: none
    with pytest.raises(TypeError, match="'salt' must be str or None"):
        namespace(salt=3)  # type: ignore[arg-type]


def test_features_fold_into_every_full_page_they_touch_and_nowhere_else():
    tokens = list(range(100, 114))  # pages of 4: [0..3] [4..7] [8..11] and 2 tokens
    image = (5, 5, "image:" + "ab" * 32)  # tokens 5..9: pages 1 and 2
    out = fold_features(tokens, 0, 4, [image])
    assert out[:4] == tokens[:4] and out[12:] == tokens[12:]
    assert all(w < 0 for w in out[4:12]) and out[4:8] != out[8:12]
    flipped = (5, 5, "image:" + "ab" * 31 + "ac")  # one bit of the last hex digit
    moved = (6, 4, image[2])
    for other in (flipped, moved):
        again = fold_features(tokens, 0, 4, [other])
        assert again[4:8] != out[4:8]
    # a run from page 2 on (the scheduler's later stores) gives the same words
    assert fold_features(tokens[8:], 8, 4, [image]) == out[8:]
    with pytest.raises(ValueError, match="not a page boundary"):
        fold_features(tokens[1:], 1, 4, [image])


def test_the_weights_digest_changes_with_their_bytes_not_with_their_place(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40_000)
    assert weights_digest(a) == weights_digest(b) != ""
    data = bytearray((b / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1  # re-saved weights: the same name, size and config
    (b / "model.safetensors").write_bytes(bytes(data))
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(tmp_path / "missing") == weights_digest(tmp_path) == ""


def test_the_weights_digest_is_remembered_by_file_and_read_again_when_it_changes(
    tmp_path, monkeypatch
):
    """A digest is kept in the cache directory by each file's identity: a second digest of the
    unchanged folder takes the remembered one (here: one planted in the memo), a file written
    in place is read again, and every byte counts (one flipped far from any sample point)."""
    import json

    from hicache.core import weights

    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    data = bytearray(bytes(range(256)) * 40_000)  # 10 MB
    (folder / "model.safetensors").write_bytes(bytes(data))
    first = weights_digest(folder)
    memo_file = tmp_path / "cache" / weights.MEMO_FILE
    memo = json.loads(memo_file.read_text())
    assert list(memo.values()) == [weights.file_digest(folder / "model.safetensors")]
    (ident,) = memo
    memo_file.write_text(json.dumps({ident: "00" * 32}))
    planted = weights_digest(folder)
    assert planted != first  # taken from the memo, not read
    assert weights_digest(folder, memo=False) == first
    data[3 * len(data) // 4 + 12345] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))  # in place: same name and size
    again = weights_digest(folder)
    assert again not in (first, planted)
    assert again == weights_digest(folder, memo=False)


def test_the_weights_digest_covers_every_piece_of_a_file_of_several(monkeypatch, tmp_path):
    """Files longer than a piece (`CHUNK`) are hashed piece by piece, side by side: the digest
    is the same on 1 and 4 threads, and a byte of the last piece changes it."""
    from hicache.core import weights

    monkeypatch.setattr(weights, "CHUNK", 1 << 16)
    path = tmp_path / "w.bin"
    data = bytearray(bytes(range(256)) * 1000)  # 256,000 bytes: 4 pieces, the last short
    path.write_bytes(bytes(data))
    one = weights.file_digest(path, workers=1)
    assert weights.file_digest(path, workers=4) == one
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert weights.file_digest(path, workers=4) != one
