"""The Mooncake tier's store and load GB/s against the raw client's batch put and get of the same bytes, on the same
real pool (a ``mooncake_master`` and a store node on loopback ports, over TCP), in the same run.

Ours: ``MooncakeTier.put`` of payloads staged where the engine stages them (``MooncakeTier.staging``: which of the
batch's records are there, then seal each in the room before its payload and put it as one piece) and
``MooncakeTier.get`` into the same (each record lands whole, checked in place). The baseline: the same sealed bytes,
``batch_put_from`` and ``batch_get_into`` from and into one registered buffer, no format, no check (the client's
zero-copy calls). Side by side a batch at a time, who goes first taking turns; the ratio is the median over every
batch of ``--repeat`` rounds of the raw call's time over ours (GB/s: the median round's); every object is removed
between rounds.

Last line: ``mooncake_store_vs_raw=… mooncake_load_vs_raw=…``, the smallest over the record sizes (goal: ≥ 0.9 from
256 KiB to 4 MiB).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time

import numpy
from redis_tier import NS, arguments, batches, timed  # the same harness as the Redis tier's

from kvoffload.impl.testing.mooncake_master import MooncakeMaster, missing
from kvoffload.spec.records import seal


class Raw:
    """The client's own zero-copy batch calls, from and into one registered buffer holding every record."""

    def __init__(self, store, values: list[bytes]) -> None:
        self.store, self.sizes = store, [len(v) for v in values]
        self.buffer = bytearray(b"".join(values))
        self.offsets = [sum(self.sizes[:i]) for i in range(len(values))]
        self.address = ctypes.addressof((ctypes.c_char * len(self.buffer)).from_buffer(self.buffer))
        store.register_buffer(self.address, len(self.buffer))

    def put(self, part: list[int]) -> None:
        codes = self.store.batch_put_from([f"raw/{i}" for i in part], [self.address + self.offsets[i] for i in part],
                                          [self.sizes[i] for i in part])
        assert all(code == 0 for code in codes), codes

    def get(self, part: list[int]) -> None:
        codes = self.store.batch_get_into([f"raw/{i}" for i in part], [self.address + self.offsets[i] for i in part],
                                          [self.sizes[i] for i in part])
        assert codes == [self.sizes[i] for i in part], codes


def one_round(tier, raw: Raw, payloads: list[bytes], batch: int) -> dict[str, list[float]]:
    """Every batch stored raw and by us, then loaded raw and by us, side by side: the seconds of each call. Ours
    moves payloads staged where the engine stages them (``MooncakeTier.staging``; the engine's copy between the
    host pool and there is not timed, as the raw calls have no host pool)."""
    seconds: dict[str, list[float]] = {way: [] for way in ("raw_store", "store", "raw_load", "load")}
    size = len(payloads[0])
    outcomes: list[str] = []
    for n, part in enumerate(batches(list(range(len(payloads))), batch)):
        staged = staging(tier, part, size)
        for row, i in zip(staged, part):
            row[:] = numpy.frombuffer(payloads[i], dtype=numpy.uint8)
        records = [(i, row.data) for i, row in zip(part, staged)]
        for way in in_turn(n, "raw_store", "store"):
            seconds[way].append(timed(raw.put, part) if way == "raw_store"
                                else timed(lambda records=records: outcomes.extend(tier.put(records))))
    assert outcomes == ["stored"] * len(payloads), outcomes
    for n, part in enumerate(batches(list(range(len(payloads))), batch)):
        landing = staging(tier, part, size)
        landing[:] = 0xFF  # touched, as the engine's staging is
        rows = [row.data for row in landing]
        for way in in_turn(n, "raw_load", "load"):
            seconds[way].append(timed(raw.get, part) if way == "raw_load"
                                else timed(lambda part=part, rows=rows: assert_all(tier.get(part, rows))))
        assert all(row.tobytes() == payloads[i] for row, i in zip(landing, part))
    time.sleep(tier.settings.lease)  # the reads' leases end: then every object can go
    for i in range(len(payloads)):
        raw.store.remove(f"raw/{i}")
    tier.delete(list(range(len(payloads))))
    return seconds


def paired(rounds: list[dict[str, list[float]]], baseline: str, ours: str) -> float:
    """The median over every batch of every round of its raw call's seconds over ours. The two ran one after the
    other: a stall of the loopback transfer (a batch's time varies 2x between rounds here) skews a sum, not the
    median of pairs."""
    return statistics.median(a / b for r in rounds for a, b in zip(r[baseline], r[ours]))


def in_turn(n: int, *ways: str) -> tuple[str, ...]:
    """Who goes first takes turns, batch by batch: the second of two calls finds caches and the pool as the first
    left them."""
    return ways if n % 2 == 0 else ways[::-1]


def staging(tier, keys: list[int], size: int) -> numpy.ndarray:
    """Where the engine stages these records: the tier's frames, or (a batch past what the tier keeps) memory of
    the engine's own."""
    frames = tier.staging(keys, size)
    return frames if frames is not None else numpy.empty((len(keys), size), dtype=numpy.uint8)


def assert_all(hits: list[bool]) -> None:
    assert all(hits), hits


def main() -> None:
    args = arguments(__doc__, missing)
    from kvoffload.impl.tiers.mooncake import MooncakeSettings, MooncakeTier, client

    ratios = []
    # a get whose transfer outlasts its lease fails (LEASE_EXPIRED): 16 records of 4 MiB took over 50 ms at times
    with MooncakeMaster(lease_ms=300, node_bytes=max(4 * args.total_mib, 64) << 20) as master:  # its least: 16 MiB
        settings = MooncakeSettings(master=master.address, metadata=master.metadata, buffer_bytes=64 << 20,
                                    lease=0.35)
        for size in args.sizes_kib:
            payloads = [os.urandom(size << 10) for _ in range(max(args.total_mib * 1024 // size, 1))]
            nbytes = sum(map(len, payloads))
            tier = MooncakeTier(settings, NS, size << 10)
            raw = Raw(client(settings), [b"".join(seal(NS, i, payload)) for i, payload in enumerate(payloads)])
            rounds = [one_round(tier, raw, payloads, args.batch) for _ in range(args.repeat)]
            gbps = {way: nbytes / statistics.median(sum(r[way]) for r in rounds) / 1e9 for way in rounds[0]}
            ratios.append((paired(rounds, "raw_store", "store"), paired(rounds, "raw_load", "load")))
            print(f"{size:>5} KiB records x {len(payloads)}: store {gbps['store']:.2f} GB/s (raw "
                  f"{gbps['raw_store']:.2f}), load {gbps['load']:.2f} GB/s (raw {gbps['raw_load']:.2f}); "
                  f"ours/raw {ratios[-1][0]:.2f}, {ratios[-1][1]:.2f}", flush=True)
    print(f"mooncake_store_vs_raw={min(r[0] for r in ratios):.2f} "
          f"mooncake_load_vs_raw={min(r[1] for r in ratios):.2f}")


if __name__ == "__main__":
    main()
