"""The lossless codec of store tiers (`hicache.backends.codec`): ratio, encode/decode throughput,
and a disk tier read with and without it.

    python bench/codec.py --machine <name> [--source engine --device cuda] [--disk PATH]

KV: `--source synthetic` (normal values with a few outliers, made on the CPU) or `--source
engine`: the reference engine (`hicache.tools.refengine`, `--model` shape, RANDOM weights,
bf16 on `--device`) prefills one random prompt and its block pool is the KV; fp16 and fp8 rows
cast that bf16 KV. Objects are `--group-pages` pages of `--page-tokens` tokens (as the tier
stores them). For each dtype and thread count: the ratio, and raw GB/s of encoding and of
decoding every object (the objects split among the threads, as a tier's codec threads do).
With `--disk`: the bf16 KV is put through a store tier's worker (`hicache.chain.jobs`, as
the cache puts it: headers, checksums, encoding) into two disk tiers there (codec: none and
codec: lossless, `--threads`' largest count of codec threads) and fetched back through it
`--rounds` times, the modes interleaved, O_DIRECT where the file system takes it: raw, lossless
(reads overlapped with decoding, as the tier does) and lossless_serial (every object read, then
every object decoded: the tier before the overlap); `vs_raw` is each mode's rate over raw's.
Writes bench/results/codec_<machine>.json unless `--out` says otherwise. Needs torch, numpy
and zstandard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, command, commit, cpu_model
from hicache.backends import codec


def engine_kv(model: str, device: str, page_tokens: int, pages: int) -> torch.Tensor:
    """`pages` pages of bf16 KV (one row of bytes each) from the reference engine's prefill of
    a random prompt (random weights)."""
    from hicache.tools.refengine.build import EngineSpec, build_engine
    from hicache.tools.refengine.engine import Request

    spec = EngineSpec(
        model=model, device=device, dtype="bfloat16", page_tokens=page_tokens,
        num_blocks=pages + 2, num_slots=1, prefix_share=0.0,
    )  # fmt: skip
    engine = build_engine(spec)
    prompt = torch.randint(0, engine.model.cfg.vocab_size, (pages * page_tokens,)).tolist()
    engine.run([Request("kv", prompt, max_new_tokens=1)])
    pool = engine.memory.pool  # (blocks, layers, 2, page_tokens, heads, dim)
    used = pool.view(pool.shape[0], -1)[:pages]
    return used.view(torch.uint16).cpu()


def synthetic_kv(page_bytes: int, pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(pages * page_bytes // 2, generator=g) * 0.5
    x[torch.rand(x.numel(), generator=g) < 0.001] *= 20
    return x.to(torch.bfloat16).view(torch.uint16).view(pages, -1)


def as_dtype(bf16: torch.Tensor, dtype: str) -> np.ndarray:
    """The bf16 KV (uint16 rows) cast to `dtype`, as bytes per page."""
    values = bf16.view(torch.bfloat16)
    if dtype != "bfloat16":
        values = values.to(getattr(torch, dtype))
    return values.contiguous().view(torch.uint8).numpy().reshape(bf16.shape[0], -1)


def timed(pool: ThreadPoolExecutor, fn, items: list) -> float:
    start = time.perf_counter()
    list(pool.map(fn, items))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--source", choices=["synthetic", "engine"], default="synthetic")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--group-pages", type=int, default=4)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk", help="a directory on the drive to read from (omit: no disk rows)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.source == "engine":
        kv = engine_kv(args.model, args.device, args.page_tokens, args.pages)
    else:
        kv = synthetic_kv(128 * 1024 * args.page_tokens, args.pages)  # llama-8b: 128 KiB/token
    G = args.group_pages
    rows, disk_rows = [], []
    for dtype in ("bfloat16", "float16", "float8_e4m3fn"):
        pages = as_dtype(kv, dtype)
        objects = [pages[i : i + G].reshape(-1).copy() for i in range(0, len(pages) - G + 1, G)]
        raw = objects[0].size
        c = codec.for_dtype(dtype)
        outs = [np.zeros(raw, dtype=np.uint8) for _ in objects]
        stored = [c.encode(o, out) for o, out in zip(objects, outs)]
        nbytes = sum(s if s is not None else raw for s in stored)
        back = [np.zeros(raw, dtype=np.uint8) for _ in objects]
        for k, s in enumerate(stored):
            if s is not None:
                assert c.decode(c.ident, outs[k][:s], back[k]) and np.array_equal(
                    back[k], objects[k]
                )
        total = raw * len(objects)
        for threads in args.threads:
            with ThreadPoolExecutor(threads) as pool:
                enc = [
                    timed(
                        pool,
                        lambda k, c=c, o=objects, x=outs: c.encode(o[k], x[k]),
                        range(len(objects)),
                    )
                    for _ in range(args.repeats)
                ]
                dec = [
                    timed(
                        pool,
                        lambda k, c=c, s=stored, x=outs, b=back: (
                            s[k] and c.decode(c.ident, x[k][: s[k]], b[k])
                        ),
                        range(len(objects)),
                    )
                    for _ in range(args.repeats)
                ]
            rows.append(
                {
                    "dtype": dtype,
                    "codec": codec.NAMES[c.ident],
                    "object_bytes": raw,
                    "objects": len(objects),
                    "objects_raw": sum(s is None for s in stored),
                    "ratio": round(total / nbytes, 4),
                    "threads": threads,
                    "encode_gbps": round(total / statistics.median(enc) / 1e9, 3),
                    "decode_gbps": round(total / statistics.median(dec) / 1e9, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        if args.disk and dtype == "bfloat16":
            disk_rows = disk_reads(args, dtype, pages, max(args.threads))
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {cpu_model()}, {os.cpu_count()} CPUs",
        "command": command(),
        "kv": (
            f"reference engine, {args.model} shape, RANDOM weights, bf16 on {args.device}; "
            "fp16/fp8 rows cast it"
            if args.source == "engine"
            else "synthetic: normal(0, 0.5) with 0.1% outliers x20, bf16; fp16/fp8 cast it"
        ),
        "zstd_level": codec.LEVEL,
        "rows": rows,
        "disk": disk_rows,
    }
    default = ROOT / "bench" / "results" / f"codec_{args.machine}.json"
    out = Path(args.out) if args.out else default
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def disk_reads(args, dtype: str, pages: np.ndarray, threads: int) -> list[dict]:
    """Read the KV back from disk tiers through a store tier's worker (`hicache.chain.jobs`,
    as a fetch does: headers checked, checksums, decoding on the codec threads), raw and
    encoded, interleaved: GB/s of KV. Modes: raw (codec: none), lossless (reads overlapped with
    decoding), lossless_serial (every object read, then every object decoded)."""
    from hicache.backends.disk.config import DiskTierConfig
    from hicache.backends.disk.tier import DiskTier
    from hicache.backends.host import HostTier, HostTierConfig
    from hicache.chain.jobs import READ_CHUNK_BYTES, Job, JobRunner
    from hicache.config import Layout

    G, n_pages, page = args.group_pages, pages.shape[0], pages.shape[1]
    n_pages -= n_pages % G
    layout = Layout(model="bench", kv_dtype=dtype, page_tokens=args.page_tokens, page_bytes=page)
    host = HostTier(HostTierConfig(size=2 * n_pages * page, pin="no"), layout)
    host.wait_ready(600)
    rows = host.pages.segments[0].numpy()
    rows[:n_pages] = pages[:n_pages]
    keys = [os.urandom(16) for _ in range(n_pages // G)]
    written, into = list(range(n_pages)), list(range(n_pages, 2 * n_pages))
    modes = {
        "raw": (None, READ_CHUNK_BYTES),
        "lossless": (codec.for_dtype(dtype), READ_CHUNK_BYTES),
    }
    modes["lossless_serial"] = (modes["lossless"][0], 1 << 62)
    workers, tiers = {}, {}
    for mode, (c, chunk) in modes.items():
        if mode == "lossless_serial":  # the same tier and objects, read the old way
            tier = tiers["lossless"]
        else:
            path = tempfile.mkdtemp(prefix=f"codec-{mode}-", dir=args.disk)
            tier = tiers[mode] = DiskTier(
                DiskTierConfig(path=path, size=4 * n_pages * page, sync=False)
            )
            tier.start()
            tier.wait_ready(60)
            for memory in host.memory():
                tier.register(memory)
        worker = JobRunner(tier, host, "b", b"f", G, args.page_tokens, False, c, threads, chunk)
        for memory in worker.memory():
            tier.register(memory)
        if mode != "lossless_serial":
            put = worker.run(Job("put", ends=keys, page_slots=written))
            assert put == [0] * len(keys), put
        workers[mode] = worker
    times: dict[str, list[float]] = {mode: [] for mode in workers}
    for _ in range(args.rounds):
        for mode, worker in workers.items():
            rows[n_pages:] = 0
            start = time.perf_counter()
            codes = worker.run(Job("get", ends=keys, page_slots=into))
            times[mode].append(time.perf_counter() - start)
            assert codes == [G * page] * len(keys), codes
            assert np.array_equal(rows[n_pages:], rows[:n_pages])
    out = []
    for mode, worker in workers.items():
        t = statistics.median(times[mode])
        stats = worker.store.stats()
        out.append(
            {
                "mode": mode,
                "objects": len(keys),
                "object_bytes": G * page,
                "codec_threads": threads,
                "read_chunk_bytes": worker.read_chunk_bytes if worker.codec else None,
                "io_threads": worker.store.config.io_threads,
                "kv_gbps": round(n_pages * page / t / 1e9, 3),
                "kv_gbps_rounds": [round(n_pages * page / r / 1e9, 3) for r in times[mode]],
                "stored_bytes": stats.bytes_used,
                "direct_calls": stats.direct_calls,
                "buffered_calls": stats.buffered_calls,
            }
        )
        print(json.dumps(out[-1]), flush=True)
        worker.close()
    raw = next(r["kv_gbps"] for r in out if r["mode"] == "raw")
    for r in out:
        r["vs_raw"] = round(r["kv_gbps"] / raw, 3)
        # the same round's raw read: both ran back to back, under the same load
        r["vs_raw_rounds"] = [round(times["raw"][i] / t, 3) for i, t in enumerate(times[r["mode"]])]
    for tier in tiers.values():
        tier.close()
    host.close()
    return out


if __name__ == "__main__":
    main()
