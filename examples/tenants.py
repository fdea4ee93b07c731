"""Tenants on a shared disk tier: encryption at rest per tenant, and what a wrong key does.

Runs on the CPU in seconds:  python examples/tenants.py

It runs the `tenants:` section of configs/tenants.yaml (acme's key from $HICACHE_KEY_ACME,
globex's from a key file, here one written into a temporary directory) on a small layout, with a
host tier and a disk tier (without the file's codec) in that directory:

1. an engine stores one prompt for each of acme, globex and a request of no tenant;
2. every file of the disk tier is searched for the KV of those prompts: acme's and globex's
   pages are nowhere in plaintext, the untenanted request's are;
3. a fresh engine with the same keys loads acme's prompt from the disk, byte-exact;
4. one whose acme key is another misses it: counted in ``key_misses_disk``, never a hit.

Exits 1 where any of these does not hold.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from hicache import HiCache, PagedBuffer, load_config

PAGE_TOKENS, PAGE_BYTES, BLOCKS = 16, 4096, 32
SALTS = {"acme": "acme", "globex": "globex-prod", "none": None}


def config(root: Path) -> dict:
    """configs/tenants.yaml's tenants on a small layout, in `root`."""
    tenants = yaml.safe_load(Path("configs/tenants.yaml").read_text())["tenants"]
    tenants[0]["share"] = {"host": "16MiB", "disk": "64MiB"}  # a quarter, as in the file
    tenants[1]["quota"] = {"host": "8MiB", "disk": "32MiB"}
    tenants[1]["key_file"] = str(root / "globex.key")
    return {
        "layout": {"model": "example", "kv_dtype": "bfloat16", "page_tokens": PAGE_TOKENS,
                   "page_bytes": PAGE_BYTES},
        "tiers": [
            {"type": "host", "size": "64MiB"},
            # codec: none (the file has lossless), so that the untenanted request's pages show
            # on the disk as they are: compressed, no page would be found in plaintext
            {"type": "disk", "path": str(root / "disk"), "size": "256MiB"},
        ],
        "tenants": tenants,
    }  # fmt: skip


def kv(tokens: np.ndarray, page: int) -> np.ndarray:
    """The stand-in model's KV of one page: bf16-like values that depend on the prefix."""
    rng = np.random.default_rng(int(tokens[: (page + 1) * PAGE_TOKENS].sum()) + page)
    values = torch.from_numpy(rng.normal(0, 0.5, PAGE_BYTES // 2).astype(np.float32))
    return values.to(torch.bfloat16).view(torch.uint8).numpy()


def run(cfg: dict, prompts: dict[str, np.ndarray], store: bool) -> tuple[dict, dict[str, int]]:
    """One engine: each prompt matched (and loaded, each loaded byte checked), and, with
    `store`, computed and stored. Its stats, and the hit tokens per tenant."""
    pool = torch.zeros(BLOCKS, PAGE_BYTES, dtype=torch.uint8)
    cache = HiCache(load_config(cfg), PagedBuffer.page_first(pool))
    cache.wait_ready(60)
    hits = {}
    try:
        for name, tokens in prompts.items():
            m = cache.match(name, tokens, salt=SALTS[name])
            while m.pending:
                cache.poll()
                m = cache.match(name, tokens, salt=SALTS[name])
            blocks = list(range(len(tokens) // PAGE_TOKENS))
            cache.load(m, blocks)
            cache.poll()
            for page in range(m.load_pages):
                if not np.array_equal(pool[page].numpy(), kv(tokens, page)):
                    raise SystemExit(f"{name}: page {page} loaded wrong bytes")
            hits[name] = m.hit_tokens
            if store:
                for page in range(len(blocks)):
                    pool[page] = torch.from_numpy(kv(tokens, page))
                cache.store(name, tokens, blocks)
            cache.release(name)
        while not cache.tiers_idle:
            cache.poll()
        return cache.stats(), hits
    finally:
        cache.close()


def main() -> int:
    if "HICACHE_KEY_ACME" not in os.environ:
        print("set HICACHE_KEY_ACME first (docs/tenants.md)", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="hicache-tenants-"))
    (root / "globex.key").write_bytes(os.urandom(32))
    cfg = config(root)
    rng = np.random.default_rng(0)
    prompts = {name: rng.integers(0, 50_000, 8 * PAGE_TOKENS).astype(np.int32) for name in SALTS}
    run(cfg, prompts, store=True)
    files = b"".join(p.read_bytes() for p in (root / "disk").rglob("*") if p.is_file())
    ok = True
    for name, tokens in prompts.items():
        plain = sum(kv(tokens, p)[:256].tobytes() in files for p in range(8))
        print(f"{name}: {plain} of 8 pages in plaintext on the disk")
        ok &= plain == (8 if name == "none" else 0)
    _, hits = run(cfg, {"acme": prompts["acme"]}, store=False)
    print(f"acme, same key: {hits['acme']} of {len(prompts['acme'])} tokens from the disk")
    ok &= hits["acme"] == len(prompts["acme"]) - PAGE_TOKENS  # the last page is recomputed
    real = os.environ["HICACHE_KEY_ACME"]
    os.environ["HICACHE_KEY_ACME"] = os.urandom(32).hex()
    try:
        stats, hits = run(cfg, {"acme": prompts["acme"]}, store=False)
    finally:
        os.environ["HICACHE_KEY_ACME"] = real
    print(f"acme, another key: {hits['acme']} tokens, key_misses_disk={stats['key_misses_disk']}")
    ok &= hits["acme"] == 0 and stats["key_misses_disk"] == 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
