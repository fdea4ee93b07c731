"""Without the CUDA copy extension (not buildable, or HICACHE_NO_NATIVE=1) the cache on a GPU
copies with torch: the same bytes, one warning, no crash.

Run on a machine with CUDA (skipped elsewhere): ``pytest -m cuda tests/test_fallback_cuda.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = """
import torch
from hicache import HiCache, Layout, PagedBuffer, load_config
from hicache.kernels.cuda import TorchEvent, event_class, extension

assert extension() is None and event_class() is TorchEvent
layout = Layout(model="m", kv_dtype="uint8", page_tokens=16, segments=(2048, 2048))
pool = torch.randint(0, 255, (32, 2, 2048), dtype=torch.uint8, device="cuda")
gpu = PagedBuffer.layer_first([pool[:, 0], pool[:, 1]])  # two segments: rows of 2 KiB
cache = HiCache(load_config({"tiers": [{"type": "host", "size": "1MiB"}]}, env={}), gpu,
                layout=layout)
assert cache.wait_ready(60)
tokens = list(range(16 * 5))
cache.match("a", tokens)
cache.store("a", tokens, [3, 9, 4, 20, 7])
cache.release("a")
m = cache.match("b", tokens)
assert (m.hit_tokens, m.load_pages) == (64, 4), m
done = cache.load(m, [30, 29, 28, 27])
done.wait()
cache.poll()
cache.release("b")
assert torch.equal(pool[[30, 29, 28, 27]], pool[[3, 9, 4, 20]])
cache.close()
print("ok")
"""


def test_the_cache_copies_with_torch_without_the_extension():
    env = {**os.environ, "HICACHE_NO_NATIVE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
