"""The Redis tier's store and load GB/s against redis-py's plain pipelined SET and GET of the same values, on the
same real redis-server (a loopback port, an ACL user), in the same run.

Ours: ``RedisTier.put`` (seal each record with its xxh3 checksum, one ``SET NX PX`` per record, a pipeline per batch)
and ``RedisTier.get`` (a pipeline of ``GET``, each value checked and its payload copied into the caller's buffer).
The baseline: the same records' bytes, ``SET`` and ``GET`` in a pipeline per batch, no format, no check, no copy.
Best of ``--repeat`` rounds, ours and the baseline alternating, the server emptied between rounds.

Last line: ``redis_store_vs_raw=… redis_load_vs_raw=…``, the smallest over the record sizes (goal: ≥ 0.9 from
256 KiB to 4 MiB).
"""

from __future__ import annotations

import argparse
import os
import time

from kvoffload.impl.testing.redis_server import PASSWORD, USER, RedisServer, missing
from kvoffload.impl.tiers.redis import RedisSettings, RedisTier
from kvoffload.spec.records import Namespace, seal

NS = Namespace(model="bench", weights="none", kv_dtype="bfloat16", kv_layout="kv_first", block_size=16,
               hash_block_size=16, hash_algorithm="sha256", hash_seed="0")


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def raw_round(server: RedisServer, payloads: list[bytes], batch: int) -> tuple[float, float]:
    client = server.client()
    values = [b"".join(seal(NS, i, payload)) for i, payload in enumerate(payloads)]  # the same bytes as ours
    names = [f"raw:{i}" for i in range(len(values))]
    start = time.perf_counter()
    for part in batches(list(zip(names, values)), batch):
        with client.pipeline(transaction=False) as pipe:
            for name, value in part:
                pipe.set(name, value)
            pipe.execute()
    stored = time.perf_counter() - start
    start = time.perf_counter()
    got = []
    for part in batches(names, batch):
        with client.pipeline(transaction=False) as pipe:
            for name in part:
                pipe.get(name)
            got += pipe.execute()
    loaded = time.perf_counter() - start
    assert got == values
    return stored, loaded


def tier_round(server: RedisServer, payloads: list[bytes], batch: int) -> tuple[float, float]:
    tier = RedisTier(RedisSettings(url=server.url, username=USER, password=PASSWORD, timeout=30), NS,
                     len(payloads[0]))
    records = list(enumerate(payloads))
    start = time.perf_counter()
    outcomes = [outcome for part in batches(records, batch) for outcome in tier.put(part)]
    stored = time.perf_counter() - start
    assert outcomes == ["stored"] * len(payloads), outcomes
    buffers = [memoryview(bytearray(len(payload))) for payload in payloads]  # host slots, touched beforehand
    start = time.perf_counter()
    hits = [hit for part in batches(list(range(len(payloads))), batch)
            for hit in tier.get(part, buffers[part[0]:part[-1] + 1])]
    loaded = time.perf_counter() - start
    assert all(hits) and all(bytes(b) == p for b, p in zip(buffers, payloads))
    return stored, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--total-mib", type=int, default=64, help="bytes per round")
    parser.add_argument("--batch", type=int, default=16, help="records per pipeline (a transfer's blocks)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    why = missing()
    if why:
        raise SystemExit(why)
    ratios = []
    with RedisServer() as server:
        for size in args.sizes_kib:
            payloads = [os.urandom(size << 10) for _ in range(max(args.total_mib * 1024 // size, 1))]
            nbytes = sum(map(len, payloads))
            best = {"raw": [float("inf")] * 2, "tier": [float("inf")] * 2}
            for _ in range(args.repeat):
                for name, run in (("raw", raw_round), ("tier", tier_round)):
                    seconds = run(server, payloads, args.batch)
                    best[name] = [min(b, s) for b, s in zip(best[name], seconds)]
                    server.client().flushall()
            gbps = {name: [nbytes / s / 1e9 for s in seconds] for name, seconds in best.items()}
            ratios.append((gbps["tier"][0] / gbps["raw"][0], gbps["tier"][1] / gbps["raw"][1]))
            print(f"{size:>5} KiB records x {len(payloads)}: store {gbps['tier'][0]:.2f} GB/s (raw "
                  f"{gbps['raw'][0]:.2f}), load {gbps['tier'][1]:.2f} GB/s (raw {gbps['raw'][1]:.2f})", flush=True)
    print(f"redis_store_vs_raw={min(r[0] for r in ratios):.2f} redis_load_vs_raw={min(r[1] for r in ratios):.2f}")


if __name__ == "__main__":
    main()
