"""The lossless codec of store tiers (`hicache.backends.codec`): ratio, encode/decode throughput,
and a disk tier read with and without it.

    python bench/codec.py --machine <name> [--source engine --device cuda] [--disk PATH]

KV: `--source synthetic` (normal values with a few outliers, made on the CPU) or `--source
engine`: the reference engine (`hicache.tools.refengine`, `--model` shape, RANDOM weights,
bf16 on `--device`) prefills one random prompt and its block pool is the KV; fp16 and fp8 rows
cast that bf16 KV. Objects are `--group-pages` pages of `--page-tokens` tokens (as the tier
stores them). For each dtype and thread count: the ratio, and raw GB/s of encoding and of
decoding every object (the objects split among the threads, as a tier's codec threads do).
With `--disk`: the objects are put into two disk tiers there (raw and encoded) and read back
`--rounds` times, raw and encoded interleaved, O_DIRECT where the file system takes it; the
encoded read includes decoding on `--threads`' largest count. Writes bench/results/
codec_<machine>.json unless `--out` says otherwise. Needs torch, numpy and zstandard.
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
from hicache.backends.base import Buffers
from hicache.backends.memory import HostMemory


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
            disk_rows = disk_reads(args, c, objects, outs, stored, max(args.threads))
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


def disk_reads(args, c, objects, outs, stored, threads: int) -> list[dict]:
    """Read the objects back from a disk tier raw and encoded, interleaved: GB/s of KV."""
    from hicache.backends.disk.config import DiskTierConfig
    from hicache.backends.disk.tier import DiskTier

    raw = objects[0].size
    n = len(objects)
    memory = HostMemory(2 * n * raw, pin=False)
    mem = memory.tensor.numpy()
    base = memory.tensor.data_ptr()
    tiers = {}
    for mode in ("raw", "lossless"):
        path = tempfile.mkdtemp(prefix=f"codec-{mode}-", dir=args.disk)
        tier = DiskTier(DiskTierConfig(path=path, size=4 * n * raw, sync=False))
        tier.start()
        tier.wait_ready(60)
        tier.register(memory.tensor)
        for k in range(n):
            if mode == "raw" or stored[k] is None:
                mem[k * raw : (k + 1) * raw] = objects[k]
                size = raw
            else:
                size = stored[k]
                mem[k * raw : k * raw + size] = outs[k][:size]
        sizes = [raw if mode == "raw" or s is None else s for s in stored]
        put = tier.put_from(
            [f"o{k}" for k in range(n)],
            Buffers([[base + k * raw] for k in range(n)], [[s] for s in sizes]),
        )
        assert put == [0] * n, put
        tiers[mode] = tier
    into = Buffers([[base + (n + k) * raw] for k in range(n)], [[raw] for _ in range(n)])
    keys = [f"o{k}" for k in range(n)]
    times: dict[str, list[float]] = {"raw": [], "lossless": []}
    with ThreadPoolExecutor(threads) as pool:

        def decode(k: int) -> None:
            if stored[k] is not None:
                dst = mem[(n + k) * raw : (n + k + 1) * raw]
                assert c.decode(c.ident, dst[: stored[k]], dst)

        for _ in range(args.rounds):
            for mode, tier in tiers.items():
                start = time.perf_counter()
                codes = tier.get_into(keys, into)
                if mode == "lossless":
                    list(pool.map(decode, range(n)))
                times[mode].append(time.perf_counter() - start)
                assert all(code > 0 for code in codes), codes
                for k in (0, n - 1):
                    assert np.array_equal(mem[(n + k) * raw : (n + k + 1) * raw], objects[k])
    out = []
    for mode, tier in tiers.items():
        t = statistics.median(times[mode])
        out.append(
            {
                "mode": mode,
                "objects": n,
                "object_bytes": raw,
                "decode_threads": threads,
                "io_threads": tier.config.io_threads,
                "kv_gbps": round(n * raw / t / 1e9, 3),
                "direct_calls": tier.stats().direct_calls,
                "buffered_calls": tier.stats().buffered_calls,
            }
        )
        print(json.dumps(out[-1]), flush=True)
        tier.close()
    return out


if __name__ == "__main__":
    main()
