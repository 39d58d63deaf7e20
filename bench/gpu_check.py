"""GPU check: the CUDA test suite, then the connector's copy bandwidth against raw cudaMemcpyAsync.

    python bench/gpu_check.py [--out DIR]

Writes DIR/gpu_report.json (DIR: --out, else $OUT, else ./gpu-report), prints a table, then ``name=value`` lines
ending with ``gpu_copy_vs_memcpy`` (ours / memcpy GB/s for 2 MiB blocks, GPU -> host). Without CUDA it writes a
"skipped" report and exits 0. Exits 1 when the GPU tests or the benchmark fail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Literal
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_BLOCKS = 1024  # blocks in the GPU cache
BLOCKS = 256  # blocks per transfer
DIRECTIONS = ("store", "load", "both")
STRATEGIES = ("auto", "runs", "staged")  # the connector's choice, then each strategy forced
CASES = {  # key -> human name
    "frag32k": "32 KiB fragments (32 layers, K/V split)",
    "block2m": "2 MiB blocks (one cross-layer tensor)",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-report", help="report folder")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats first")
    parser.add_argument("--skip-tests", action="store_true", help="only run the benchmark")
    return parser.parse_args()


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: report written to {out / 'gpu_report.json'}", flush=True)


# ---- (a) the CUDA test suite -----------------------------------------------------------------------------
def run_tests() -> dict:
    print("gpu_check: running pytest -q tests/gpu ...", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=ROOT, capture_output=True,
                              text=True, timeout=240)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial: bytes | str = exc.stdout or b""  # bytes even with text=True, on POSIX
        returncode = None
        output = (partial.decode(errors="replace") if isinstance(partial, bytes) else partial) + "\n[timed out]"
    lines = output.rstrip().splitlines()
    summary = lines[-1] if lines else ""
    # rc 0 with everything skipped (a child that cannot see the GPU) is not a pass
    result = {"passed": returncode == 0 and " passed" in f" {summary}", "returncode": returncode,
              "seconds": round(time.perf_counter() - start, 1), "summary": summary, "tail": "\n".join(lines[-40:])}
    print("\n".join(lines[-15:]), flush=True)
    print(f"gpu_check: tests {'passed' if result['passed'] else 'FAILED'} in {result['seconds']}s", flush=True)
    return result


# ---- (b) transfer bandwidth ------------------------------------------------------------------------------
def timed(launch, streams, warmup: int, repeats: int) -> tuple[float, float]:
    """Median seconds from an event before ``launch()`` to one after the last copy on any of ``streams``, and median
    host seconds inside ``launch()`` (what the engine's step thread spends issuing the copies).

    Measured on the GPU timeline from an idle GPU, so the host's launch overhead counts (the engine pays it too)."""
    current = torch.cuda.current_stream()
    times, launches = [], []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()  # nothing queued earlier may delay or overlap this repeat
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(current)
        for stream in streams:
            stream.wait_stream(current)  # no copy starts before `start`
        issued = time.perf_counter()
        launch()
        issued = time.perf_counter() - issued
        for stream in streams:
            current.wait_stream(stream)  # `end` fires after the last copy on every stream
        end.record(current)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1000)  # elapsed_time is in milliseconds
            launches.append(issued)
    return statistics.median(times), statistics.median(launches)


def bench_ours(views: list, warmup: int, repeats: int, strategy: str | None) -> dict[str, tuple[float, float]]:
    """(GPU, launch) seconds per direction through the connector's own path: Copier closures run by
    CudaStreamExecutor, with the copy strategy it chooses (None) or a forced one. Both directions go in the engine's
    order: a step's loads before its forward pass, its stores after it."""
    from kvoffload.impl.transfer import Copier, CudaStreamExecutor, HostPool  # needs the package installed
    from kvoffload.spec.types import Job

    device = views[0].device
    # stores use rows [0, 256), loads [256, 512): both at once
    copier = Copier(views, HostPool(views, 2 * BLOCKS), strategy)
    executor = CudaStreamExecutor(device)
    perm = np.random.default_rng(0).permutation(GPU_BLOCKS).astype(np.int64)  # scattered GPU ids, disjoint sets
    store_blocks, load_blocks = perm[:BLOCKS], perm[BLOCKS:2 * BLOCKS]
    store_rows, load_rows = np.arange(BLOCKS, dtype=np.int64), np.arange(BLOCKS, 2 * BLOCKS, dtype=np.int64)
    plans = {"store": copier.plan("store", store_blocks, store_rows),
             "load": copier.plan("load", load_blocks, load_rows)}
    submitted: list[int] = []

    def submit(*kinds: Literal["store", "load"]) -> None:
        for kind in kinds:
            submitted.append(len(submitted))
            executor.submit(Job(submitted[-1], "bench", kind, (), plans[kind]))

    # random bytes on both sides, so the check below cannot pass by accident
    for view in views:
        view.random_()
    for region in copier.pool.regions:
        region[BLOCKS:].copy_(torch.empty_like(region[BLOCKS:], device=device).random_())
    torch.cuda.synchronize()  # the load stream does not wait for the current one, where the fills ran
    submit("store", "load")
    torch.cuda.synchronize()
    gpu_store, gpu_load = torch.from_numpy(store_blocks).to(device), torch.from_numpy(load_blocks).to(device)
    for view, region in zip(views, copier.pool.regions):
        if not (torch.equal(region[:BLOCKS].to(device), view[gpu_store])
                and torch.equal(view[gpu_load], region[BLOCKS:].to(device))):
            raise AssertionError("the connector's copies moved the wrong bytes")

    streams = executor.streams
    seconds = {
        "store": timed(lambda: submit("store"), [streams["store"]], warmup, repeats),
        "load": timed(lambda: submit("load"), [streams["load"]], warmup, repeats),
        "both": timed(lambda: submit("load", "store"), [streams["store"], streams["load"]], warmup, repeats),
    }
    results = executor.poll()
    if len(results) != len(submitted) or not all(ok for _job, ok in results):
        raise AssertionError(f"{len(submitted)} jobs submitted, reported: {results}")
    return seconds


def bench_memcpy(nbytes: int, device: torch.device, warmup: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Seconds per direction for one contiguous pinned <-> device copy of the same bytes (cudaMemcpyAsync)."""
    gpu = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]  # one per direction, like the executor

    def store() -> None:
        with torch.cuda.stream(streams[0]):
            host[0].copy_(gpu[0], non_blocking=True)

    def load() -> None:
        with torch.cuda.stream(streams[1]):
            gpu[1].copy_(host[1], non_blocking=True)

    def both() -> None:
        load()
        store()

    return {"store": timed(store, streams[:1], warmup, repeats), "load": timed(load, streams[1:], warmup, repeats),
            "both": timed(both, streams, warmup, repeats)}


def make_views(case: str, device: torch.device) -> list:
    from kvoffload.impl.testing import LayeredKV
    from kvoffload.impl.transfer import block_views

    if case == "frag32k":  # Llama-8B-like: K or V of one layer for one block = 16 * 8 * 128 * 2 bytes = 32 KiB
        kv = LayeredKV(GPU_BLOCKS, shape="kv_first", layers=32, block_size=16, heads=8, head_dim=128,
                       dtype=torch.bfloat16, device=device)
        return kv.views
    cache = torch.empty(GPU_BLOCKS, 2 << 20, dtype=torch.uint8, device=device)  # a whole block is one 2 MiB span
    return block_views({"all_layers": cache}, "blocks_first")


def bench_transfers(device: torch.device, warmup: int, repeats: int) -> list[dict]:
    rows = []
    for case, name in CASES.items():
        print(f"gpu_check: benchmarking {name} ...", flush=True)
        views = make_views(case, device)
        span = views[0].shape[1]
        nbytes = BLOCKS * sum(v.shape[1] for v in views)  # one direction, one transfer
        base = bench_memcpy(nbytes, device, warmup, repeats)
        for strategy in STRATEGIES:
            ours = bench_ours(views, warmup, repeats, None if strategy == "auto" else strategy)
            for direction in DIRECTIONS:
                moved = nbytes * (2 if direction == "both" else 1)
                (ours_s, launch_s), (base_s, _) = ours[direction], base[direction]
                ours_gbps, base_gbps = moved / ours_s / 1e9, moved / base_s / 1e9
                rows.append({"case": case, "name": name, "strategy": strategy, "direction": direction,
                             "span_bytes": span, "copies_per_transfer": len(views) * BLOCKS, "bytes": moved,
                             "ours_ms": round(ours_s * 1e3, 3), "memcpy_ms": round(base_s * 1e3, 3),
                             "launch_ms": round(launch_s * 1e3, 3), "ours_gbps": round(ours_gbps, 2),
                             "memcpy_gbps": round(base_gbps, 2), "ratio": round(ours_gbps / base_gbps, 3)})
                print(f"gpu_check:   {strategy:6s} {direction:5s} ours {ours_gbps:7.2f} GB/s  "
                      f"memcpy {base_gbps:7.2f} GB/s  launch {launch_s * 1e3:.2f} ms", flush=True)
        del views
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give the 2 GiB cache back before the next case
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':40s} {'copy':6s} {'dir':5s} {'copies':>7s} {'ours GB/s':>10s} {'memcpy GB/s':>12s} {'ratio':>6s} "
          f"{'launch ms':>10s}")
    for r in rows:
        print(f"{r['name']:40s} {r['strategy']:6s} {r['direction']:5s} {r['copies_per_transfer']:7d} "
              f"{r['ours_gbps']:10.2f} {r['memcpy_gbps']:12.2f} {r['ratio']:6.3f} {r['launch_ms']:10.2f}")
    print()


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    if not torch.cuda.is_available():
        reason = f"torch.cuda.is_available() is False (torch {torch.__version__})"
        print("gpu_check: no CUDA device, skipped", flush=True)
        write_report(out, {"skipped": True, "reason": reason})
        return 0

    device = torch.device("cuda", torch.cuda.current_device())
    report = {"skipped": False, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "gpu_blocks": GPU_BLOCKS, "blocks_per_transfer": BLOCKS,
              "warmup": args.warmup, "repeats": args.repeats}
    print(f"gpu_check: {report['device']}, torch {report['torch']}, CUDA {report['cuda']}", flush=True)
    # tests first, in their own process, before this one holds GPU or pinned memory
    report["tests"] = {"passed": True, "skipped_by_flag": True} if args.skip_tests else run_tests()

    summary: dict[str, Any] = {"gpu_tests": "passed" if report["tests"]["passed"] else "failed"}
    try:
        rows = bench_transfers(device, args.warmup, args.repeats)
    except Exception:  # noqa: BLE001 - still write the report, with the reason
        report["bench_error"] = traceback.format_exc()
        print(report["bench_error"], flush=True)
        rows = []
    report["transfers"] = rows
    if rows:
        print_table(rows)
    for r in rows:
        key = f"{r['case']}_{r['direction']}" + ("" if r["strategy"] == "auto" else f"_{r['strategy']}")
        summary.update({f"{key}_gbps": r["ours_gbps"], f"{key}_memcpy_gbps": r["memcpy_gbps"],
                        f"{key}_vs_memcpy": r["ratio"], f"{key}_launch_ms": r["launch_ms"]})
    headline = [r["ratio"] for r in rows if (r["case"], r["strategy"], r["direction"]) == ("block2m", "auto", "store")]
    summary["gpu_copy_vs_memcpy"] = headline[0] if headline else None  # null in the JSON: no measurement
    report["summary"] = summary
    write_report(out, report)
    for name, value in summary.items():  # gpu_copy_vs_memcpy last
        print(f"{name}={'nan' if value is None else value}")
    return 0 if report["tests"]["passed"] and rows else 1


if __name__ == "__main__":
    sys.exit(main())
