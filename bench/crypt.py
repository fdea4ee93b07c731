"""Encryption at rest (`hicache.backends.crypt`): what AES-GCM costs a store tier's worker, in
GB/s of raw KV, beside the lossless codec's.

    python bench/crypt.py --machine <name> [--disk PATH]

Objects are `--group-pages` pages of `--page-tokens` tokens of synthetic bf16 KV (bench/codec.py's:
normal values, a few outliers; llama-8b's 128 KiB a token). Two tables:

- `primitives`: one thread, GB/s of raw bytes for AES-GCM sealing and opening an object
  (`TenantKey.seal`/`open`) and for the codec's encoding and decoding it, the four
  interleaved over `--rounds` rounds (median, min and max).
- `worker`: a store tier's worker (`hicache.chain.jobs.JobRunner`, as the cache runs it:
  headers, checksums, codec, cipher) putting every object into a disk tier at `--disk` (default:
  /dev/shm, so that the drive is not what is measured) and getting it back, for four
  configurations: plain, codec (lossless), encrypted, codec + encrypted; the configurations
  interleaved each round; `vs_plain` is each one's median rate over plain's.

Writes bench/results/crypt_<machine>.json unless `--out` says otherwise. Needs torch, numpy,
zstandard and cryptography.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.codec import as_dtype, synthetic_kv
from bench.common import command, commit, cpu_model, write_result
from hicache.backends import codec
from hicache.backends.crypt import Keyring, TenantKey

KEY = bytes(range(32))


def spread(times: list[float], nbytes: int) -> dict[str, float]:
    """GB/s of `nbytes` at the median, slowest and fastest of `times`."""
    return {
        "gbps": round(nbytes / statistics.median(times) / 1e9, 3),
        "min_gbps": round(nbytes / max(times) / 1e9, 3),
        "max_gbps": round(nbytes / min(times) / 1e9, 3),
    }


def primitives(objects: list[np.ndarray], rounds: int) -> dict[str, dict[str, float]]:
    key, c = TenantKey("bench", KEY), codec.for_dtype("bfloat16")
    raw = objects[0].size
    sealed = [np.empty(raw + 15, np.uint8) for _ in objects]
    tags = [key.seal(o, s, b"aad") for o, s in zip(objects, sealed)]
    encoded = [np.empty(raw, np.uint8) for _ in objects]
    sizes = [c.encode(o, e) or raw for o, e in zip(objects, encoded)]
    out = np.empty(raw + 15, np.uint8)

    def seal() -> None:  # into `out`: `sealed` keeps what `tags` open
        for o in objects:
            key.seal(o, out, b"aad")

    def open_() -> None:
        for s, (nonce, tag) in zip(sealed, tags):
            if not key.open(s[:raw], out, b"aad", nonce, tag):
                raise AssertionError("a sealed object did not open")

    def encode() -> None:
        for o, e in zip(objects, encoded):
            c.encode(o, e)

    def decode() -> None:
        for e, n in zip(encoded, sizes):
            c.decode(c.ident, e[:n], out[:raw])

    ops = {"aes_gcm_seal": seal, "aes_gcm_open": open_, "codec_encode": encode,
           "codec_decode": decode}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, fn in ops.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    total = raw * len(objects)
    return {name: spread(t, total) for name, t in times.items()}


def worker(args, pages: np.ndarray) -> list[dict]:
    """Put and get every object through a `JobRunner` into a disk tier, per configuration."""
    from hicache.backends.disk.config import DiskTierConfig
    from hicache.backends.disk.tier import DiskTier
    from hicache.backends.host import HostTier, HostTierConfig
    from hicache.chain.jobs import Job, JobRunner
    from hicache.config import Layout
    from hicache.core.keys import chain_seed

    G, n_pages, page = args.group_pages, pages.shape[0], pages.shape[1]
    n_pages -= n_pages % G
    layout = Layout(model="bench", kv_dtype="bfloat16", page_tokens=args.page_tokens,
                    page_bytes=page)  # fmt: skip
    host = HostTier(HostTierConfig(size=2 * n_pages * page, pin="no"), layout)
    host.wait_ready(600)
    rows = host.pages.segments[0].numpy()
    rows[:n_pages] = pages[:n_pages]
    seed = chain_seed(b"f" * 16, "bench")
    ring = Keyring({seed: TenantKey("bench", KEY)})
    configs = {
        "plain": (None, None),
        "codec": (codec.for_dtype("bfloat16"), None),
        "encrypted": (None, ring),
        "codec+encrypted": (codec.for_dtype("bfloat16"), ring),
    }
    written, into = list(range(n_pages)), list(range(n_pages, 2 * n_pages))
    runners = {}
    for name, (c, keys) in configs.items():
        path = tempfile.mkdtemp(prefix=f"crypt-{name}-", dir=args.disk)
        tier = DiskTier(DiskTierConfig(path=path, size=4 * n_pages * page, sync=False))
        tier.start()
        tier.wait_ready(60)
        runner = JobRunner(tier, host, "b", b"f", G, args.page_tokens, False, c, 1, keyring=keys)
        for memory in [*host.memory(), *runner.memory()]:
            tier.register(memory)
        runners[name] = runner
    puts: dict[str, list[float]] = {name: [] for name in runners}
    gets: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            ends = [os.urandom(16) for _k in range(n_pages // G)]  # new objects each round
            start = time.perf_counter()
            codes = runner.run(Job("put", ends=ends, page_slots=written, seed=seed))
            puts[name].append(time.perf_counter() - start)
            assert codes == [0] * len(ends), codes
            rows[n_pages:] = 0
            start = time.perf_counter()
            got = runner.run(Job("get", ends=ends, page_slots=into, seed=seed))
            gets[name].append(time.perf_counter() - start)
            assert got == [G * page] * len(ends), got
            assert np.array_equal(rows[n_pages:], rows[:n_pages])
    total = n_pages * page
    out = []
    for name in runners:
        out.append({"config": name, "put": spread(puts[name], total),
                    "get": spread(gets[name], total)})  # fmt: skip
    for row in out:
        base = out[0]
        row["put_vs_plain"] = round(row["put"]["gbps"] / base["put"]["gbps"], 3)
        row["get_vs_plain"] = round(row["get"]["gbps"] / base["get"]["gbps"], 3)
        print(json.dumps(row), flush=True)
    for runner in runners.values():
        runner.close()
        runner.store.close()
    host.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--group-pages", type=int, default=4)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--disk", default="/dev/shm")
    ap.add_argument("--out")
    args = ap.parse_args()
    kv = synthetic_kv(128 * 1024 * args.page_tokens, args.pages)
    pages = as_dtype(kv, "bfloat16")
    G = args.group_pages
    objects = [pages[i : i + G].reshape(-1).copy() for i in range(0, len(pages) - G + 1, G)]
    prim = primitives(objects, args.rounds)
    print(json.dumps(prim), flush=True)
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {cpu_model()}, {os.cpu_count()} CPUs",
        "command": command(),
        "kv": "synthetic: normal(0, 0.5) with 0.1% outliers x20, bf16 (bench/codec.py's)",
        "object_bytes": objects[0].size,
        "objects": len(objects),
        "rounds": args.rounds,
        "primitives": prim,
        "worker": worker(args, pages),
    }
    write_result(result, "crypt", args.machine, args.out)


if __name__ == "__main__":
    main()
