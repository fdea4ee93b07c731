"""SGLang's host pool to and from hicache's store tiers, against SGLang's own backends on the
same disk and the same Mooncake store, in one run, interleaved:

    python bench/sglang.py --machine NAME --dir /path/on/the/disk

Pages are SGLang's: its real host pool (`MHATokenToKVPoolHost`, ``page_first``, an 8B model's
shape by default: 32 layers, 8 KV heads of 128, bf16, 64 tokens a page: 8 MiB), filled with
synthetic bf16 KV (bench/codec.py's). Each backend is driven through SGLang's own controller
functions, as its cache controller drives it: hicache's backend and SGLang's `mooncake` through
the zero-copy calls (`_page_set_zero_copy`, `_page_get_zero_copy`), the `file` backend through
the generic ones (`_generic_page_set`, `_generic_page_get`: a flat copy of each page).
Backends:

- ``hicache``: hicache's disk tier (`codec: none`, `sync: false`: SGLang's `file` backend does
  not sync either; O_DIRECT where aligned, its default);
- ``hicache_buffered``: the same with `direct_io: off` (writes and reads through the page
  cache, as `file`'s);
- ``hicache_codec``: the disk tier with `codec: lossless` (bf16 KV as byte planes, zstd);
- ``sglang_file``: SGLang's `HiCacheFile`;
- ``hicache_mooncake`` and ``sglang_mooncake``: hicache's Mooncake tier and SGLang's own
  `MooncakeStore`, on one real master and store node on loopback (TCP), started here; left out
  (and the result says why) where Mooncake is not installed.

For each repetition (`--rounds`, 3), batch size (64 and 128 pages) and backend, the backends in
an order rotated each repetition: `--pages` pages are set in batches into a fresh directory
(namespace), timed to the last call's return (what SGLang's backup thread waits for) and, for
the disk backends, also until their files are on disk (``fsync`` of each: `set_durable`); the
page cache is dropped for the files (``posix_fadvise(DONTNEED)``, and ``drop_caches`` where
writable); they are got back in batches into other host pages and compared byte for byte. Then,
in each repetition, a prefetch of `--prefetch-pages` pages through ``hicache`` and
``sglang_file`` as SGLang's prefetch threads make it (``batch_exists`` in batches of 128, then
the gets in batches of 128), timed from the first call to the last page. Ratios are taken
within a repetition and summarised as their median with the spread (least, most) over the
repetitions. Writes ``bench/results/sglang_<machine>.json`` (commit, machine, command at its top
level; `summary` with the ratios and `targets` with whether each was met).

The GPU is not used (``CUDA_VISIBLE_DEVICES`` is emptied here); where torchvision does not load,
hicache stands in for it (`hicache.integrations.sglang.cpu_imports`). Nothing is fetched.
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

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the bench needs no GPU; SGLang then looks for none

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from codec import synthetic_kv  # noqa: E402
from common import ROOT, command, commit, cpu_model  # noqa: E402

# this file is named as SGLang's package is: its folder leaves the path, so `sglang` is SGLang
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # hicache from this tree, run from anywhere

DISK = ("hicache", "hicache_buffered", "hicache_codec", "sglang_file")
MOONCAKE = ("hicache_mooncake", "sglang_mooncake")
BACKENDS = DISK + MOONCAKE
PREFETCH = ("hicache", "sglang_file")
BATCHES = (64, 128)
STORAGE_BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
DISTINCT = 97
"""Pages of KV drawn (the rest repeat them: a prime, so that no two neighbours are equal)."""


def sglang() -> SimpleNamespace:
    """SGLang's modules the bench drives."""
    from hicache.integrations.sglang.cpu_imports import without_torchvision

    without_torchvision()
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    return SimpleNamespace(
        Controller=HiCacheController, Config=HiCacheStorageConfig, Device=MHATokenToKVPool,
        Host=MHATokenToKVPoolHost, Factory=StorageBackendFactory, master=None,
        budget=host_memory_budget_scope,
    )  # fmt: skip


def mooncake_master(segment_bytes: int) -> tuple[Any, str]:
    """A Mooncake master and store node on loopback holding `segment_bytes`, and None; or None
    and why not."""
    from hicache.tools.mooncake_local import LocalMaster, mooncake_missing

    missing = mooncake_missing()
    if missing:
        return None, missing
    try:
        return LocalMaster(segment_bytes=segment_bytes).start(), ""
    except (RuntimeError, OSError) as err:
        return None, f"the master did not start: {err}"


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
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * 2  # K and V, bf16
    # booked against its own size, not the machine's free memory less SGLang's 10 GiB reserve
    with sg.budget((pages + 2) * P * per_token + (1 << 30)):
        return sg.Host(
            device.get_device_pool_infos()[0].buffer_info, ratio, 0, P, "page_first",
            pin_memory=torch.cuda.is_available(), device="cpu",
            device_capacity_tokens=device_pages * P, start_layer=0, end_layer=args.layers,
        )  # fmt: skip


def make_backend(sg: SimpleNamespace, name: str, path: Path, size: int) -> tuple[Any, Any, Any]:
    """The backend `name` on directory `path` (a disk backend) or on the bench's Mooncake
    master (`sg.master`), with the controller functions that drive it (set, get)."""
    kind, extra = "dynamic", {}
    if name == "sglang_file":
        kind, extra = "file", {"file_storage_path": str(path)}
    elif name == "sglang_mooncake":
        kind, extra = "mooncake", {
            "master_server_address": sg.master.address, "protocol": "tcp",
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 0, "check_server": False,
        }  # fmt: skip
    else:
        tier: dict[str, Any] = {"type": "disk", "path": str(path), "size": size, "sync": False}
        if name == "hicache_mooncake":
            tier = {**sg.master.engine_tier(), "protocol": "tcp", "key_prefix": path.name}
        tier.update({"hicache_codec": {"codec": "lossless"},
                     "hicache_buffered": {"direct_io": "off"}}.get(name, {}))  # fmt: skip
        extra = {
            "backend_name": "hicache", "module_path": "hicache.integrations.sglang",
            "class_name": "HiCacheBackend", "interface_v1": 1, "hicache": {"tiers": [tier]},
        }  # fmt: skip
    config = sg.Config(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=f"bench-{path.name}", extra_config=extra,
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
    synced(path)
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


def synced(path: Path) -> float:
    """Put every file under `path` on disk (fsync each); the seconds it took."""
    start = time.perf_counter()
    for f in path.rglob("*"):
        if f.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    return time.perf_counter() - start


def slots(P: int, first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * P, (first_page + n) * P, dtype=torch.int64)


def page_bytes(host: Any, P: int, page: int) -> torch.Tensor:
    return host.get_data_page(page * P).view(torch.uint8)


@contextlib.contextmanager
def opened(
    sg: SimpleNamespace, args: argparse.Namespace, host: Any, name: str, tag: str, n: int
) -> Iterator[tuple[Path, Any, Any, Any]]:
    """Backend `name` on a fresh directory (namespace) for `n` pages: the directory, the
    backend, and its set (keys, host slots) and get (keys, host slots: pages arrived) as
    SGLang's controller makes them. The backend is cleared (Mooncake) and closed, and the
    directory removed, after."""
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
        if name in MOONCAKE:
            backend.clear()  # the store node's segment holds one phase at a time
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
        durable_s = set_s + synced(path)
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
    sets = {**row, "op": "set", "seconds": set_s, "stored_bytes": stored}
    if name not in MOONCAKE:
        sets["durable_seconds"] = durable_s
    return sets, {**row, "op": "get", "seconds": get_s}, dropped


def prefetch(
    sg: SimpleNamespace, args: argparse.Namespace, host: Any, name: str, tag: str
) -> dict[str, Any]:
    """Store `args.prefetch_pages` pages, drop the cache, then prefetch them as SGLang's threads
    do: the hit query in batches of 128, then the gets in batches of 128."""
    P, n = args.page, args.prefetch_pages
    names = keys(tag, n)
    with opened(sg, args, host, name, tag, n) as (path, backend, put, get):
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
    ap.add_argument("--rounds", type=int, default=3, help="repetitions, interleaved")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="a comma-separated subset")
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
    backends = [b for b in BACKENDS if b in args.backends.split(",")]
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
        "mooncake": "not asked for",
        "rows": [],
        "prefetch": [],
    }  # fmt: skip
    if set(MOONCAKE) & set(backends):
        # room for two phases: a phase's objects go while the next one's come
        sg.master, why = mooncake_master(4 * args.pages * page + (256 << 20))
        if sg.master is None:
            backends = [b for b in backends if b not in MOONCAKE]
            result["mooncake"] = f"left out: {why}"
        else:
            result["mooncake"] = "one master and one store node on loopback (TCP), started here"
    rows, prefetches = result["rows"], result["prefetch"]

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        out.write_text(json.dumps(result, indent=1) + "\n")

    try:
        for r in range(args.rounds):
            order = backends[r % len(backends) :] + backends[: r % len(backends)]
            for batch in BATCHES:
                for name in order:
                    set_row, get_row, dropped = phase(
                        sg, args, host, name, batch, f"{name}-{batch}-{r}"
                    )
                    if not dropped and name not in MOONCAKE:
                        result["page_cache"] = (
                            "the phase's files advised away (posix_fadvise DONTNEED after "
                            "fsync): not root"
                        )
                    for row in (set_row, get_row):
                        row.update(round=r, pages_per_s=round(row["pages"] / row["seconds"], 1))
                        row["gbps"] = round(row["pages"] * page / row["seconds"] / 1e9, 3)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    save()
            for name in [b for b in order if b in PREFETCH]:
                prefetches.append({**prefetch(sg, args, host, name, f"pf-{name}-{r}"), "round": r})
                print(json.dumps(prefetches[-1]), flush=True)
                save()
    finally:
        if sg.master is not None:
            sg.master.stop()
    result["summary"] = summary(rows, prefetches)
    result["targets"] = targets(result["summary"])
    save()
    print(json.dumps({"summary": result["summary"], "targets": result["targets"]}, indent=1))
    print(f"wrote {out}")


def spread(values: list[float]) -> dict[str, float]:
    """The median of `values`, with the least and the most (the spread over repetitions)."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def summary(rows: list[dict], prefetches: list[dict]) -> dict[str, Any]:
    """GB/s per backend, op and batch, and the ratios the targets are about, each taken within
    a repetition (hicache's over SGLang's backend's, as the two ran side by side) and given as
    its median over the repetitions, with the spread under ``spread``."""
    rate: dict[tuple, float] = {}
    for row in rows:
        key = (row["backend"], row["op"], row["batch"], row["round"])
        rate[key] = row["pages"] * row["page_bytes"] / row["seconds"] / 1e9
        if "durable_seconds" in row:
            durable = row["pages"] * row["page_bytes"] / row["durable_seconds"] / 1e9
            rate[(row["backend"], "set_durable", row["batch"], row["round"])] = durable
    rounds = sorted({k[3] for k in rate})
    names = sorted({k[0] for k in rate})
    out: dict[str, Any] = {}
    spreads: dict[str, dict[str, float]] = {}
    for name in names:
        for op in ("set", "set_durable", "get"):
            for batch in BATCHES:
                got = [rate[k] for r in rounds if (k := (name, op, batch, r)) in rate]
                if got:
                    spreads[f"{name}_{op}_{batch}_gbps"] = spread(got)
    pairs = (
        ("hicache_vs_file", "hicache", "sglang_file", ("set", "set_durable", "get")),
        ("hicache_buffered_vs_file", "hicache_buffered", "sglang_file",
         ("set", "set_durable", "get")),
        ("codec_vs_raw", "hicache_codec", "hicache", ("set", "get")),
        ("hicache_mooncake_vs_sglang_mooncake", "hicache_mooncake", "sglang_mooncake",
         ("set", "get")),
    )  # fmt: skip
    for label, mine, theirs, ops in pairs:
        for op in ops:
            for batch in BATCHES:
                ratios = [
                    rate[(mine, op, batch, r)] / rate[(theirs, op, batch, r)]
                    for r in rounds
                    if (mine, op, batch, r) in rate and (theirs, op, batch, r) in rate
                ]
                if ratios:
                    spreads[f"{label}_{op}_{batch}"] = spread(ratios)
    seconds = {(p["backend"], p["round"]): p["seconds"] for p in prefetches}
    times = [
        seconds[("hicache", r)] / seconds[("sglang_file", r)]
        for r in sorted({p["round"] for p in prefetches})
        if ("hicache", r) in seconds and ("sglang_file", r) in seconds
    ]
    if times:
        spreads["prefetch_hicache_vs_file_time"] = spread(times)
    out.update({k: v["median"] for k, v in spreads.items()})
    out["spread"] = {k: [v["min"], v["max"]] for k, v in spreads.items()}
    return out


TARGETS = {
    "hicache_vs_file_set_": (">=", 1.0),
    "hicache_vs_file_get_": (">=", 1.5),
    "prefetch_hicache_vs_file_time": ("<=", 0.6),
    "hicache_mooncake_vs_sglang_mooncake_set_": (">=", 1.0),
    "hicache_mooncake_vs_sglang_mooncake_get_": (">=", 1.0),
    "codec_vs_raw_get_": (">=", 1.2),
}
"""docs/sglang.md's targets: a ratio key (or the start of the keys, one per batch size), how it
compares and with what."""


def targets(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target's ratios (medians over the repetitions) and whether they meet it."""
    out = {}
    for start, (how, bound) in TARGETS.items():
        for key, value in summary.items():
            if key == start or (start.endswith("_") and key.startswith(start) and
                                key[len(start):].isdigit()):  # fmt: skip
                met = value >= bound if how == ">=" else value <= bound
                out[key] = {"median": value, "target": f"{how} {bound}", "met": met}
    return out


if __name__ == "__main__":
    main()
