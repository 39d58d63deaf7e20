"""The Redis tier's store and load GB/s against redis-py's plain pipelined SET and GET of the same values, on the
same real redis-server (a loopback port, an ACL user), in the same run.

Ours: ``RedisTier.put`` (seal each record with its xxh3 checksum, one ``SET NX PX`` per record, a pipeline per
batch) and ``RedisTier.get`` (a pipeline of ``GETRANGE``, each reply received straight into the caller's buffer,
then checked). The baseline: the same records' bytes, ``SET`` and ``GET`` in a pipeline per batch, no format, no
check (redis-py as it comes: hiredis packs each command and parses each reply into a bytes object). Side by side a
batch at a time, the ratio of each round's sums, the median over ``--repeat`` rounds; the server is emptied between
rounds.

Last line: ``redis_store_vs_raw=… redis_load_vs_raw=…``, the smallest over the record sizes (goal: ≥ 0.9 from
256 KiB to 4 MiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

from kvoffload.impl.testing.redis_server import PASSWORD, USER, RedisServer, missing
from kvoffload.impl.tiers.redis import RedisSettings, RedisTier
from kvoffload.spec.records import Namespace, seal

NS = Namespace(model="bench", weights="none", kv_dtype="bfloat16", kv_layout="kv_first", block_size=16,
               hash_block_size=16, hash_algorithm="sha256", hash_seed="0")


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def timed(run, *args) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def raw_set(client, names: list[str], values: list[bytes]) -> None:
    with client.pipeline(transaction=False) as pipe:
        for name, value in zip(names, values):
            pipe.set(name, value)
        pipe.execute()


def raw_get(client, names: list[str], got: list) -> None:
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.get(name)
        got += pipe.execute()


def one_round(server: RedisServer, tier: RedisTier, payloads: list[bytes], batch: int) -> dict[str, float]:
    """Every batch stored raw then by us, then loaded raw then by us, side by side: seconds of each, summed."""
    client, seconds = server.client(), dict.fromkeys(("raw_store", "store", "raw_load", "load"), 0.0)
    values = [b"".join(seal(NS, i, payload)) for i, payload in enumerate(payloads)]  # the same bytes as ours
    buffers = [memoryview(bytearray(b"\xff" * len(payload))) for payload in payloads]  # host slots, already touched
    got: list[bytes] = []
    for part in batches(list(range(len(payloads))), batch):
        names = [f"raw:{i}" for i in part]
        seconds["raw_store"] += timed(raw_set, client, names, [values[i] for i in part])
        seconds["store"] += timed(lambda part=part: outcomes.extend(tier.put([(i, payloads[i]) for i in part])))
    for part in batches(list(range(len(payloads))), batch):
        seconds["raw_load"] += timed(raw_get, client, [f"raw:{i}" for i in part], got)
        seconds["load"] += timed(lambda part=part: hits.extend(tier.get(part, buffers[part[0]:part[-1] + 1])))
    assert outcomes == ["stored"] * len(payloads), outcomes
    assert got == values and all(hits) and all(bytes(b) == p for b, p in zip(buffers, payloads))
    outcomes.clear()
    hits.clear()
    client.flushall()
    return seconds


outcomes: list[str] = []
hits: list[bool] = []


def arguments(doc: str, missing: Callable[[], str | None]) -> argparse.Namespace:
    """A tier benchmark's arguments (its docstring's first paragraph is its help); it exits if its server cannot
    run here, saying why."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--total-mib", type=int, default=64, help="bytes per round")
    parser.add_argument("--batch", type=int, default=16, help="records per batch (a transfer's blocks)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    why = missing()
    if why:
        raise SystemExit(why)
    return args


def main() -> None:
    args = arguments(__doc__, missing)
    ratios = []
    with RedisServer() as server:
        for size in args.sizes_kib:
            payloads = [os.urandom(size << 10) for _ in range(max(args.total_mib * 1024 // size, 1))]
            nbytes = sum(map(len, payloads))
            tier = RedisTier(RedisSettings(url=server.url, username=USER, password=PASSWORD, timeout=30), NS,
                             size << 10)
            rounds = [one_round(server, tier, payloads, args.batch) for _ in range(args.repeat)]
            gbps = {kind: nbytes / statistics.median(r[kind] for r in rounds) / 1e9 for kind in rounds[0]}
            ratios.append((statistics.median(r["raw_store"] / r["store"] for r in rounds),
                           statistics.median(r["raw_load"] / r["load"] for r in rounds)))
            print(f"{size:>5} KiB records x {len(payloads)}: store {gbps['store']:.2f} GB/s (raw "
                  f"{gbps['raw_store']:.2f}), load {gbps['load']:.2f} GB/s (raw {gbps['raw_load']:.2f}); "
                  f"ours/raw {ratios[-1][0]:.2f}, {ratios[-1][1]:.2f}", flush=True)
    print(f"redis_store_vs_raw={min(r[0] for r in ratios):.2f} redis_load_vs_raw={min(r[1] for r in ratios):.2f}")


if __name__ == "__main__":
    main()
