"""SGLang's host pool to and from hicache's disk tier, against SGLang's own `file` backend on the
same disk, in one run:

    python bench/sglang.py --machine NAME --dir /path/on/the/disk [--pages 256 --rounds 2]

Pages are SGLang's: its real host pool (`MHATokenToKVPoolHost`, ``page_first``, an 8B model's
shape by default: 32 layers, 8 KV heads of 128, bf16, 64 tokens a page: 8 MiB), filled with
synthetic bf16 KV (bench/codec.py's). Each backend is driven through SGLang's own controller
functions, as its cache controller drives it: hicache's backend through the zero-copy calls
(`_page_set_zero_copy`, `_page_get_zero_copy`: ``interface_v1``), the `file` backend through
the generic ones (`_generic_page_set`, `_generic_page_get`: a flat copy of each page). Backends:

- ``hicache``: hicache's disk tier (`codec: none`, `sync: false`: SGLang's `file` backend does
  not sync either);
- ``hicache_codec``: the same with `codec: lossless` (bf16 KV as byte planes, zstd);
- ``sglang_file``: SGLang's `HiCacheFile`.

For each round, batch size (64 and 128 pages) and backend, in turn: `--pages` pages are set in
batches into a fresh directory, the page cache is dropped for its files (``os.sync`` and
``posix_fadvise(DONTNEED)``; ``/proc/sys/vm/drop_caches`` too where it is writable), and they
are got back in batches into other host pages and compared byte for byte. Then a prefetch of
`--prefetch-pages` pages per backend, as SGLang's prefetch threads make it (``batch_exists`` in
batches of 128, then the gets in batches of 128), timed from the first call to the last page.
Writes ``bench/results/sglang_<machine>.json`` (commit, machine, command at its top level).

SGLang's import path needs torchvision, which a CPU torch or a GPU image may lack: run with
``PYTHONPATH=tests/standins`` there (tests/sglang_standins.py). The GPU is not used: set
``CUDA_VISIBLE_DEVICES=`` so that SGLang does not look for its CUDA kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from codec import synthetic_kv  # noqa: E402
from common import ROOT, command, commit, cpu_model  # noqa: E402

# this file is named as SGLang's package is: its folder leaves the path, so `sglang` is SGLang
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

BACKENDS = ("hicache", "hicache_codec", "sglang_file")
BATCHES = (64, 128)
STORAGE_BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
DISTINCT = 97
"""Pages of KV drawn (the rest repeat them: a prime, so that no two neighbours are equal)."""


def sglang() -> SimpleNamespace:
    """SGLang's modules the bench drives."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    return SimpleNamespace(
        Controller=HiCacheController, Config=HiCacheStorageConfig, Device=MHATokenToKVPool,
        Host=MHATokenToKVPoolHost, Factory=StorageBackendFactory,
    )  # fmt: skip


def host_pool(sg: SimpleNamespace, args: argparse.Namespace, pages: int) -> Any:
    """SGLang's host pool of at least `pages` pages (its device pool a small CPU one)."""
    P = args.page
    device_pages = 8
    device = sg.Device(
        size=device_pages * P, page_size=P, dtype=torch.bfloat16, head_num=args.kv_heads,
        head_dim=args.head_dim, layer_num=args.layers, device="cpu", enable_memory_saver=False,
        enable_alt_stream=False,
    )  # fmt: skip
    ratio = (pages + 2) / device_pages
    return sg.Host(
        device.get_device_pool_infos()[0].buffer_info, ratio, 0, P, "page_first",
        pin_memory=torch.cuda.is_available(), device="cpu",
        device_capacity_tokens=device_pages * P, start_layer=0, end_layer=args.layers,
    )  # fmt: skip


def make_backend(sg: SimpleNamespace, name: str, path: Path, size: int) -> tuple[Any, Any, Any]:
    """The backend `name` on directory `path`, with the controller functions that drive it
    (set, get)."""
    tier = {"type": "disk", "path": str(path), "size": size, "sync": False}
    if name == "hicache_codec":
        tier["codec"] = "lossless"
    extra: dict[str, Any] = {"file_storage_path": str(path)}
    kind = "file"
    if name != "sglang_file":
        kind = "dynamic"
        extra = {
            "backend_name": "hicache", "module_path": "hicache.integrations.sglang",
            "class_name": "HiCacheBackend", "interface_v1": 1, "hicache": {"tiers": [tier]},
        }  # fmt: skip
    config = sg.Config(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench-model", extra_config=extra,
    )  # fmt: skip
    backend = sg.Factory.create_backend(kind, config, None)
    C = sg.Controller
    if kind == "file":
        return backend, C._generic_page_set, C._generic_page_get
    return backend, C._page_set_zero_copy, C._page_get_zero_copy


def keys(tag: str, n: int) -> list[str]:
    """`n` page keys as SGLang names pages (hex SHA-256 digests, chained)."""
    out, prev = [], tag.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def drop_cache(path: Path) -> bool:
    """Drop the page cache of the files under `path`; True where the whole cache was dropped
    (root), False where only these files' clean pages were advised away."""
    os.sync()
    for f in path.rglob("*"):
        if f.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def slots(P: int, first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * P, (first_page + n) * P, dtype=torch.int64)


def page_bytes(host: Any, P: int, page: int) -> torch.Tensor:
    return host.get_data_page(page * P).view(torch.uint8)


@contextlib.contextmanager
def opened(
    sg: SimpleNamespace, args: argparse.Namespace, host: Any, name: str, tag: str, n: int
) -> Iterator[tuple[Path, Any, Any, Any]]:
    """Backend `name` on a fresh directory for `n` pages: the directory, the backend, and its
    set (keys, host slots) and get (keys, host slots: pages arrived) as SGLang's controller
    makes them. The backend is closed and the directory removed after."""
    P = args.page
    path = Path(args.dir) / f"sglang-bench-{tag}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    size = 2 * n * host.get_size_per_token() * P + (64 << 20)
    backend, put, get = make_backend(sg, name, path, size)
    try:
        backend.register_mem_pool_host(host)
        me = SimpleNamespace(storage_backend=backend, storage_host_pool=host, page_size=P)
        op = SimpleNamespace(request_id=tag, is_terminated=lambda: False)
        yield path, backend, (lambda k, at: put(me, k, at)), (lambda k, at: get(me, op, k, at))
    finally:
        if hasattr(backend, "close"):
            backend.close()
        shutil.rmtree(path, ignore_errors=True)


def phase(
    sg: SimpleNamespace, args: argparse.Namespace, host: Any, name: str, batch: int, tag: str
) -> tuple[dict, dict, bool]:
    """Set `args.pages` pages in batches of `batch`, drop the cache, get them back, check."""
    P, n = args.page, args.pages
    names = keys(tag, n)
    with opened(sg, args, host, name, tag, n) as (path, _, put, get):
        start = time.perf_counter()
        for at in range(0, n, batch):
            ok = put(names[at : at + batch], slots(P, at, min(batch, n - at)))
            assert ok, f"{name}: a set failed"
        set_s = time.perf_counter() - start
        dropped = drop_cache(path)
        host.kv_buffer[:, n * P : 2 * n * P].zero_()
        start = time.perf_counter()
        for at in range(0, n, batch):
            k = min(batch, n - at)
            got = get(names[at : at + k], slots(P, n + at, k))
            assert got == k, f"{name}: a get brought {got} of {k} pages"
        get_s = time.perf_counter() - start
        for i in range(n):
            assert torch.equal(page_bytes(host, P, n + i), page_bytes(host, P, i)), name
        stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    page = host.get_size_per_token() * P
    row = {"backend": name, "batch": batch, "pages": n, "page_bytes": page}
    return (
        {**row, "op": "set", "seconds": set_s, "stored_bytes": stored},
        {**row, "op": "get", "seconds": get_s},
        dropped,
    )


def prefetch(
    sg: SimpleNamespace, args: argparse.Namespace, host: Any, name: str
) -> dict[str, float]:
    """Store `args.prefetch_pages` pages, drop the cache, then prefetch them as SGLang's threads
    do: the hit query in batches of 128, then the gets in batches of 128."""
    P, n = args.page, args.prefetch_pages
    names = keys(f"prefetch-{name}", n)
    with opened(sg, args, host, name, f"prefetch-{name}", n) as (path, backend, put, get):
        for at in range(0, n, STORAGE_BATCH):
            assert put(names[at : at + STORAGE_BATCH], slots(P, at, min(STORAGE_BATCH, n - at)))
        drop_cache(path)
        start = time.perf_counter()
        found = 0
        for at in range(0, n, STORAGE_BATCH):
            found += backend.batch_exists(names[at : at + STORAGE_BATCH])
        query_s = time.perf_counter() - start
        got = 0
        for at in range(0, found, STORAGE_BATCH):
            k = min(STORAGE_BATCH, found - at)
            got += get(names[at : at + k], slots(P, n + at, k))
        total_s = time.perf_counter() - start
        assert got == n, f"{name}: the prefetch brought {got} of {n} pages"
    return {"backend": name, "pages": n, "query_s": query_s, "seconds": total_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64, help="tokens a page (SGLang's --page-size)")
    ap.add_argument("--pages", type=int, default=256, help="pages each phase sets and gets")
    ap.add_argument("--prefetch-pages", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    sg = sglang()
    host = host_pool(sg, args, 2 * max(args.pages, args.prefetch_pages))
    P, n = args.page, max(args.pages, args.prefetch_pages)
    page = host.get_size_per_token() * P
    kv = synthetic_kv(page, min(n, DISTINCT))  # uint16 rows of bf16 KV
    for i in range(n):
        page_bytes(host, P, i).copy_(kv[i % len(kv)].view(torch.uint8))
    out = Path(args.out or ROOT / "bench" / "results" / f"sglang_{args.machine}.json")
    result: dict[str, Any] = {
        "commit": commit(),
        "machine": f"{args.machine}: {cpu_model()}, {os.cpu_count()} CPUs",
        "command": command(),
        "sglang": __import__("sglang").__version__,
        "torch": torch.__version__,
        "page": {"tokens": P, "bytes": page, "layout": "page_first", "layers": args.layers,
                 "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16"},
        "kv": "synthetic: normal(0, 0.5) with 0.1% outliers x20, bf16 (bench/codec.py)",
        "page_cache": "dropped whole (drop_caches)",
        "rows": [],
        "prefetch": [],
    }  # fmt: skip
    rows, prefetches = result["rows"], result["prefetch"]

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=1) + "\n")

    for r in range(args.rounds):
        for batch in BATCHES:
            for name in BACKENDS:
                tag = f"{name}-{batch}-{r}"
                set_row, get_row, dropped = phase(sg, args, host, name, batch, tag)
                if not dropped:
                    result["page_cache"] = (
                        "the phase's files advised away (posix_fadvise DONTNEED after os.sync): "
                        "not root"
                    )
                for row in (set_row, get_row):
                    row.update(round=r, pages_per_s=round(row["pages"] / row["seconds"], 1))
                    row["gbps"] = round(row["pages"] * page / row["seconds"] / 1e9, 3)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                save()
    result["summary"] = summary(rows)
    for name in BACKENDS:
        prefetches.append(prefetch(sg, args, host, name))
        print(json.dumps(prefetches[-1]), flush=True)
        save()
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")


def summary(rows: list[dict]) -> dict[str, Any]:
    """Median GB/s per backend, op and batch; hicache's against SGLang's `file` backend's and
    the codec tier's against the raw tier's, per op and batch."""
    med: dict[str, float] = {}
    for name in BACKENDS:
        for op in ("set", "get"):
            for batch in BATCHES:
                key = (name, op, batch)
                got = [
                    r["pages"] * r["page_bytes"] / r["seconds"] / 1e9
                    for r in rows
                    if (r["backend"], r["op"], r["batch"]) == key
                ]
                med[f"{name}_{op}_{batch}_gbps"] = statistics.median(got)
    ratios = {}
    for op in ("set", "get"):
        for batch in BATCHES:
            raw, codec_, file_ = (med[f"{b}_{op}_{batch}_gbps"] for b in BACKENDS)
            ratios[f"hicache_vs_file_{op}_{batch}"] = round(raw / file_, 3)
            ratios[f"codec_vs_raw_{op}_{batch}"] = round(codec_ / raw, 3)
    return {**{k: round(v, 3) for k, v in med.items()}, **ratios}


if __name__ == "__main__":
    main()
