"""The filesystem tier's store and load GB/s against plain file I/O of the same bytes, in the same directory, in
the same run.

Ours: ``FileTier.put`` (seal the record with its xxh3 checksum, write, fsync, link; the directory fsynced once)
and ``FileTier.get`` (one ``preadv`` into the caller's buffer, then every check of the record), a batch at a time
on the tier's I/O threads. The baseline: each record's bytes written to a file of its own and fsynced, and read
back with ``readinto``, one after the other (no format, no checks).
Reads come from the page cache on both sides. Best of ``--repeat`` rounds, ours and the baseline alternating.

Last line: ``shared_tier_store_vs_raw=… shared_tier_load_vs_raw=…`` at the largest record size (goal: ≥ 0.9 at
2 MiB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvoffload.impl.tiers import FileTier
from kvoffload.spec.records import Namespace

NS = Namespace(model="bench", weights="none", kv_dtype="bfloat16", kv_layout="kv_first", block_size=16,
               hash_block_size=16, hash_algorithm="sha256", hash_seed="0")


def scrub(buffers: list[memoryview]) -> None:
    """Overwrite what the last round read, so that a read that copies nothing shows (and the pages stay touched)."""
    for buffer in buffers:
        buffer[:] = b"\xff" * len(buffer)


def raw_round(directory: Path, payloads: list[bytes], buffers: list[memoryview]) -> tuple[float, float]:
    directory.mkdir()
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        fd = os.open(directory / f"{i}.raw", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, payload)
        os.fsync(fd)
        os.close(fd)
    stored = time.perf_counter() - start
    scrub(buffers)
    start = time.perf_counter()
    for i, buffer in enumerate(buffers):
        with open(directory / f"{i}.raw", "rb", buffering=0) as f:
            f.readinto(buffer)
    return stored, time.perf_counter() - start


def tier_round(directory: Path, payloads: list[bytes], buffers: list[memoryview]) -> tuple[float, float]:
    tier = FileTier(directory, NS, len(payloads[0]))
    start = time.perf_counter()
    outcomes = tier.put([(i, payload) for i, payload in enumerate(payloads)])
    stored = time.perf_counter() - start
    assert outcomes == ["stored"] * len(payloads), outcomes
    scrub(buffers)
    start = time.perf_counter()
    hits = tier.get(list(range(len(payloads))), buffers)
    loaded = time.perf_counter() - start
    assert all(hits) and all(bytes(b) == p for b, p in zip(buffers, payloads))
    return stored, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--total-mib", type=int, default=128, help="bytes per round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvoffload-bench-", dir=args.dir))
    try:
        for size in args.sizes_kib:
            payloads = [os.urandom(size << 10) for _ in range(max(args.total_mib * 1024 // size, 1))]
            nbytes = sum(map(len, payloads))
            # both sides read into the same buffers, touched once beforehand: the host slots a tier loads into
            buffers = [memoryview(bytearray(len(payload))) for payload in payloads]
            best = {"raw": [float("inf")] * 2, "tier": [float("inf")] * 2}
            for r in range(args.repeat):
                for name, run in (("raw", raw_round), ("tier", tier_round)):
                    seconds = run(root / f"{name}-{size}-{r}", payloads, buffers)
                    best[name] = [min(b, s) for b, s in zip(best[name], seconds)]
                    shutil.rmtree(root / f"{name}-{size}-{r}")
            gbps = {name: [nbytes / s / 1e9 for s in seconds] for name, seconds in best.items()}
            store, load = gbps["tier"][0] / gbps["raw"][0], gbps["tier"][1] / gbps["raw"][1]
            print(f"{size:>5} KiB records x {len(payloads)}: store {gbps['tier'][0]:.2f} GB/s (raw "
                  f"{gbps['raw'][0]:.2f}), load {gbps['tier'][1]:.2f} GB/s (raw {gbps['raw'][1]:.2f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"shared_tier_store_vs_raw={store:.2f} shared_tier_load_vs_raw={load:.2f}")


if __name__ == "__main__":
    main()
