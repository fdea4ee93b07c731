"""Raw Mooncake Store throughput on this machine: batched put/get of registered host memory.

Measures Mooncake's own batch calls (``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers``), no hicache code in the path, for two placements:

- ``same_process``: the measuring client owns the only segment, so objects land in its own memory;
- ``other_process``: another process owns the only segment (the measuring client contributes none),
  so every byte crosses the transport (loopback TCP here).

Usage::

    python bench/l3_raw.py --out bench/results/l3_raw_loopback.json [--master HOST:PORT]
    python bench/l3_raw.py --split --rounds 30 --out ...   # one get against concurrent shares

``--split`` asks instead whether a fetch would finish sooner split into concurrent calls
(`split_gets`): one batched get of 32 objects against 2 and 4 concurrent gets of a share each.

Without ``--master`` a master is started on loopback (tests/mooncake_master.py) and stopped after.
Importable: `measure` runs one (object size, batch) point on a raw client that the caller set up,
so another bench can put hicache's own L3 path next to the raw calls in the same run, and
`store_load` keeps the store busy from another process while a block runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from mooncake_master import MooncakeMaster, SegmentHolder  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")


def report(result: dict, out: str | None) -> None:
    """Print a bench's JSON, and write it to `out` too when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def raw_client(master: str, segment_bytes: int, local_hostname: str = "127.0.0.1") -> Any:
    """A Mooncake client on TCP with `segment_bytes` contributed (0: none)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(local_hostname, "P2PHANDSHAKE", segment_bytes, 16 * MiB, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup with master {master} failed: {rc}")
    return client


def measure(
    client: Any,
    base_ptr: int,
    obj_bytes: int,
    batch: int,
    rounds: int,
    warmup: int = 1,
    reader: Any = None,
    reader_ptr: int = 0,
) -> dict[str, Any]:
    """Batched put then get of `batch` objects of `obj_bytes`, `rounds` times (after `warmup`).

    `base_ptr` must point at ``2 * batch * obj_bytes`` bytes registered with `client`: objects are
    put from the first half and read into the second. With `reader`, another client reads them
    instead, into ``batch * obj_bytes`` bytes at `reader_ptr` registered with it (a client reads
    objects it put itself about twice as fast as others do, on loopback TCP). Every round uses
    fresh keys and removes them afterwards (force), so the store never fills. Returns GB/s (1e9
    bytes per second) of the aggregate and of the median round, for put and get.
    """
    from mooncake.store import ReplicateConfig

    rep = ReplicateConfig()
    rep.replica_num = 1
    src = [[base_ptr + i * obj_bytes] for i in range(batch)]
    getter = reader if reader is not None else client
    dst_ptr = reader_ptr if reader is not None else base_ptr + batch * obj_bytes
    dst = [[dst_ptr + i * obj_bytes] for i in range(batch)]
    sizes = [[obj_bytes] for _ in range(batch)]
    times: dict[str, list[float]] = {"put": [], "get": []}
    run = uuid.uuid4().hex[:8]
    for r in range(warmup + rounds):
        keys = [f"bench/{run}/{r}/{i}" for i in range(batch)]
        t0 = time.perf_counter()
        put = client.batch_put_from_multi_buffers(keys, src, sizes, rep)
        t1 = time.perf_counter()
        got = getter.batch_get_into_multi_buffers(keys, dst, sizes)
        t2 = time.perf_counter()
        client.batch_remove(keys, True)
        if any(c != 0 for c in put) or any(c != obj_bytes for c in got):
            raise RuntimeError(f"round {r}: put codes {set(put)}, get codes {set(got)}")
        if r >= warmup:
            times["put"].append(t1 - t0)
            times["get"].append(t2 - t1)
    nbytes = batch * obj_bytes
    out: dict[str, Any] = {"object_bytes": obj_bytes, "batch": batch, "rounds": rounds}
    for op, ts in times.items():
        out[f"{op}_gbps"] = round(nbytes * len(ts) / sum(ts) / 1e9, 3)
        out[f"{op}_gbps_median_round"] = round(nbytes / statistics.median(ts) / 1e9, 3)
        out[f"{op}_ms_median_round"] = round(statistics.median(ts) * 1e3, 2)
    return out


@contextlib.contextmanager
def segment_server(master: str, segment_bytes: int) -> Iterator[None]:
    """Another process contributes the store's only segment while the block runs (the tests'
    segment holder)."""
    holder = SegmentHolder(master, segment_bytes)
    try:
        yield
    finally:
        holder.close()


@contextlib.contextmanager
def store_load(
    master: str, obj_bytes: int, batch: int = 16, gbps: float | None = None
) -> Iterator[dict[str, float]]:
    """Another process puts batches of `batch` objects into the store and removes them again
    while the block runs, without pause or paced to `gbps`: the store's traffic of a saturated
    write-behind, from outside the measuring process. The dict yielded gets the loader's `gbps`
    (bytes put per second) and `seconds` once the block has ended."""
    result: dict[str, float] = {}
    args = ("--load-store", master, str(obj_bytes), str(batch), str(gbps or 0))
    child = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        if not child.stdout or child.stdout.readline().strip() != "ready":
            raise RuntimeError("the store loader did not start")
        yield result
    finally:
        if child.stdin:
            child.stdin.close()  # its signal to finish; then it prints its rate
        said = child.stdout.read().strip() if child.stdout else ""
        child.wait(60)
        if said:
            result.update(json.loads(said))


def put_loop(
    master: str,
    obj_bytes: int,
    batch: int,
    gbps: float,
    stop: threading.Event,
    on_ready: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Put and remove batches of `batch` objects of `obj_bytes`, with a client of its own, until
    `stop` is set (no faster than `gbps` when it is not 0). `on_ready` is called once the client
    is set up. Returns the rate put (`gbps`, 1e9 bytes per second) and how long it ran
    (`seconds`): the store's traffic of a saturated write-behind, from anywhere."""
    import torch
    from mooncake.store import ReplicateConfig

    client = raw_client(master, 0)
    try:
        buf = torch.full((obj_bytes * batch,), 7, dtype=torch.uint8)
        if client.register_buffer(buf.data_ptr(), buf.numel()) != 0:
            raise RuntimeError("register_buffer failed")
        rep = ReplicateConfig()
        rep.replica_num = 1
        ptrs = [[buf.data_ptr() + i * obj_bytes] for i in range(batch)]
        sizes = [[obj_bytes]] * batch
        run, n, moved = uuid.uuid4().hex[:8], 0, 0
        on_ready()
        t0 = time.perf_counter()
        while not stop.is_set():
            keys = [f"load/{run}/{n}/{i}" for i in range(batch)]
            n += 1
            codes = client.batch_put_from_multi_buffers(keys, ptrs, sizes, rep)
            moved += obj_bytes * sum(c == 0 for c in codes)
            client.batch_remove(keys, True)
            if gbps:
                time.sleep(max(0.0, t0 + moved / (gbps * 1e9) - time.perf_counter()))
        seconds = time.perf_counter() - t0
        return {"gbps": round(moved / seconds / 1e9, 3), "seconds": round(seconds, 2)}
    finally:
        client.close()


def _load_store(master: str, obj_bytes: int, batch: int, gbps: float) -> None:
    """Child process of `store_load`: `put_loop` until stdin closes, then print its rate as
    one JSON line."""
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    rate = put_loop(master, obj_bytes, batch, gbps, closed, lambda: print("ready", flush=True))
    print(json.dumps(rate), flush=True)


def split_gets(
    master: str,
    sizes: tuple[int, ...] = (512 * KiB, 4 * MiB),
    batch: int = 32,
    rounds: int = 30,
    ways: tuple[int, ...] = (1, 2, 4),
) -> list[dict[str, Any]]:
    """Would a fetch finish sooner split into concurrent calls? For each object size: `batch`
    objects (in another process's segment) read by one batched get, or by 2 or 4 concurrent
    gets of an equal share each, from as many threads (one client: hicache's fetch workers
    share their cache's). The ways take turns within each round, in alternating order, and
    every way goes through the same thread pool, so hand-off costs are alike. Median ms."""
    import torch
    from mooncake.store import ReplicateConfig

    rep = ReplicateConfig()
    rep.replica_num = 1
    span = batch * max(sizes)
    src = torch.full((span,), 7, dtype=torch.uint8)
    dst = torch.zeros(span, dtype=torch.uint8)
    out = []
    with segment_server(master, 2 * span), ThreadPoolExecutor(max(ways)) as pool:
        writer, reader = raw_client(master, 0), raw_client(master, 0)
        try:
            if writer.register_buffer(src.data_ptr(), span) or reader.register_buffer(
                dst.data_ptr(), span
            ):
                raise RuntimeError("register_buffer failed")
            for obj in sizes:
                keys = [f"split/{uuid.uuid4().hex[:8]}/{i}" for i in range(batch)]
                put = writer.batch_put_from_multi_buffers(
                    keys, [[src.data_ptr() + i * obj] for i in range(batch)], [[obj]] * batch, rep
                )
                if any(c != 0 for c in put):
                    raise RuntimeError(f"split: put codes {set(put)}")

                def get(lo: int, hi: int, obj: int = obj, keys: list[str] = keys) -> None:
                    ptrs = [[dst.data_ptr() + i * obj] for i in range(lo, hi)]
                    got = reader.batch_get_into_multi_buffers(
                        keys[lo:hi], ptrs, [[obj]] * (hi - lo)
                    )
                    if any(g != obj for g in got):
                        raise RuntimeError(f"split: get codes {set(got)}")

                times: dict[int, list[float]] = {w: [] for w in ways}
                for r in range(rounds + 1):
                    for w in ways if r % 2 else ways[::-1]:
                        share = batch // w
                        t0 = time.perf_counter()
                        for f in [pool.submit(get, k * share, (k + 1) * share) for k in range(w)]:
                            f.result()
                        if r:  # round 0 warms up
                            times[w].append(time.perf_counter() - t0)
                writer.batch_remove(keys, True)
                one = statistics.median(times[ways[0]])
                out.append(
                    {
                        "object_bytes": obj,
                        "batch": batch,
                        "rounds": rounds,
                        "median_ms": {
                            str(w): round(statistics.median(t) * 1e3, 3) for w, t in times.items()
                        },
                        "speedup_vs_one_call": {
                            str(w): round(one / statistics.median(t), 3) for w, t in times.items()
                        },
                    }
                )
        finally:
            writer.close()
            reader.close()
    return out


def run(
    master: str,
    sizes: tuple[int, ...] = (512 * KiB, 4 * MiB),
    batch: int = 32,
    rounds: int = 8,
) -> dict[str, Any]:
    """Both placements for every object size; returns the JSON-ready result."""
    import torch

    span = 2 * batch * max(sizes)
    segment = max(256 * MiB, 2 * batch * max(sizes))
    mem = torch.empty(span, dtype=torch.uint8)
    mem.random_(0, 256)
    results: dict[str, Any] = {}

    client = raw_client(master, segment)
    try:
        if client.register_buffer(mem.data_ptr(), span) != 0:
            raise RuntimeError("register_buffer failed")
        results["same_process"] = [measure(client, mem.data_ptr(), s, batch, rounds) for s in sizes]
    finally:
        client.close()

    with segment_server(master, segment):
        client = raw_client(master, 0)
        try:
            if client.register_buffer(mem.data_ptr(), span) != 0:
                raise RuntimeError("register_buffer failed")
            results["other_process"] = [
                measure(client, mem.data_ptr(), s, batch, rounds) for s in sizes
            ]
        finally:
            client.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master", help="host:port of a running mooncake_master (default: start one)")
    ap.add_argument("--out", help="write the JSON here as well as to stdout")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--machine", default="2-core CPU VM, loopback TCP")
    ap.add_argument(
        "--split", action="store_true", help="one batched get against 2 and 4 concurrent shares"
    )
    ap.add_argument(
        "--load-store",
        nargs=4,
        metavar=("MASTER", "BYTES", "BATCH", "GBPS"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.load_store:
        master, obj, batch, gbps = args.load_store
        _load_store(master, int(obj), int(batch), float(gbps))
        return

    master_proc = None
    address = args.master
    if address is None:
        master_proc = MooncakeMaster().start()
        address = master_proc.address
    try:
        if args.split:
            results = {"split_gets": split_gets(address, batch=args.batch, rounds=args.rounds)}
        else:
            results = run(address, batch=args.batch, rounds=args.rounds)
    finally:
        if master_proc is not None:
            master_proc.stop()

    from importlib.metadata import version

    doc = {
        "bench": "l3_raw",
        "what": "raw Mooncake Store batch put/get (batch_put_from_multi_buffers / "
        "batch_get_into_multi_buffers) of registered host memory, 1 replica, protocol tcp",
        "machine": args.machine,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mooncake": version("mooncake-transfer-engine-non-cuda"),
        "units": "GB/s = 1e9 bytes/s; *_gbps is bytes of all rounds over their summed time",
        "results": results,
    }
    report(doc, args.out)


if __name__ == "__main__":
    main()
