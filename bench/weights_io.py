"""Shard export and load (fl_app.weights, what the trainer does every fit) against a raw write and
read of the very same files, side by side in one run.

    python bench/weights_io.py --size-gb 1.0
    python bench/weights_io.py --size-gb 1.0 --baseline-src /tmp/v1   # + the old code, same run
    python bench/weights_io.py --size-gb 1.9 --device cuda            # a fit's export from a GPU lane

Rows, each the best of --repeat runs:
  export   save_shards (hash every byte while writing it, manifest last), durable (fsync) and not,
           against writing the same shard files' bytes with plain write() (+ fsync)
  load     load_shards (read, verify every byte, build tensors) with the files in the page cache
           (warm) and evicted from it (cold), and warm without verification, against reading the
           same files into the same kind of fresh buffer with plain readinto()
  fit      what a lane's fit export once did (a fresh CPU copy of the masters, then
           save_shards with fsync) against what it does now (save_shards of the masters where
           they live, --device: CUDA tensors stream through pinned buffers; no fsync), same run
MB/s = model bytes / seconds. Linux only (page-cache eviction by posix_fadvise).
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--baseline" not in sys.argv:  # the baseline child imports the fl_app its PYTHONPATH names
    sys.path.insert(0, str(ROOT))

from bench.aggregate import evict, random_model  # noqa: E402
from fl_app.weights import Manifest, load_shards, save_shards  # noqa: E402


def best(repeat: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None) -> float:
    seconds = float("inf")
    for _ in range(repeat):
        setup()
        t0 = time.perf_counter()
        fn()
        seconds = min(seconds, time.perf_counter() - t0)
    return seconds


def fresh_buffer(size: int) -> mmap.mmap:
    """The kind of memory load_shards reads a shard into (private anonymous mmap)."""
    return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def run(a: argparse.Namespace) -> dict[str, float]:
    """Seconds per row (one process: the same model, the same files)."""
    work = Path(a.work)
    shard_bytes = int(a.shard_mb * 2**20)
    state = random_model(int(a.size_gb * 1e9), seed=0)
    out = work / "export"
    rows: dict[str, float] = {}
    durable = (True,) if a.baseline else (True, False)  # the old code always fsyncs
    for d in durable:
        kwargs = {} if a.baseline else {"durable": d}
        rows[f"export save_shards{'' if d else ' (no fsync)'}"] = best(
            a.repeat,
            functools.partial(save_shards, state, out, shard_bytes, **kwargs),
            lambda: shutil.rmtree(out, True),
        )
    manifest = Manifest.from_dir(out)
    files = [out / s.file for s in manifest.shards]
    if not a.baseline:
        blobs = [f.read_bytes() for f in files]
        raw = work / "raw"

        def write_raw(fsync: bool) -> None:
            raw.mkdir()
            for f, blob in zip(files, blobs):
                with open(raw / f.name, "wb") as fh:
                    fh.write(blob)
                    if fsync:
                        os.fsync(fh.fileno())

        for d in durable:
            rows[f"export raw write{' + fsync' if d else ''}"] = best(
                a.repeat, functools.partial(write_raw, d), lambda: shutil.rmtree(raw, True)
            )
        del blobs

    def read_raw() -> None:
        for f in files:
            buf = fresh_buffer(f.stat().st_size)
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(buf)

    for cold in (False, True):
        setup = (lambda: evict(files)) if cold else (lambda: None)
        tag = "cold" if cold else "warm"
        rows[f"load load_shards ({tag})"] = best(a.repeat, lambda: load_shards(out), setup)
        if not a.baseline:
            rows[f"load raw readinto ({tag})"] = best(a.repeat, read_raw, setup)
    if not a.baseline:
        rows["load load_shards (warm, not verified)"] = best(a.repeat, lambda: load_shards(out, verify=False))
        live = {k: v.to(a.device) for k, v in state.items()}
        fit = work / "fit"
        clear = lambda: shutil.rmtree(fit, True)  # noqa: E731
        copy = lambda: {k: v.to("cpu", copy=True) for k, v in live.items()}  # noqa: E731
        before = lambda: save_shards(copy(), fit, shard_bytes)  # noqa: E731
        rows["fit export before (CPU copy + fsync)"] = best(a.repeat, before, clear)
        rows["fit export now (in place, no fsync)"] = best(
            a.repeat, functools.partial(save_shards, live, fit, shard_bytes, durable=False), clear
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 model size (1 GB = 1e9 bytes)")
    ap.add_argument("--shard-mb", type=float, default=512.0, help="max shard size (MiB), as run.shard_max_mb")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the fastest is reported")
    ap.add_argument("--tmp-dir", default=None, help="where the shards go (default: system temp)")
    ap.add_argument("--device", default="cpu", help="where the fit rows' masters live (cpu, cuda)")
    ap.add_argument("--baseline-src", default=None, help="a source tree whose fl_app to bench side by side")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.baseline:
        print(json.dumps(run(a)))
        return
    load_before = os.getloadavg()[0]
    a.work = tempfile.mkdtemp(prefix="bench-weights-io-", dir=a.tmp_dir)
    try:
        rows = run(a)
        base: dict[str, float] = {}
        if a.baseline_src:
            bwork = Path(a.work) / "baseline"
            bwork.mkdir()
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([a.baseline_src, str(ROOT), os.environ.get("PYTHONPATH", "")]),
            }
            res = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--baseline",
                    "--work",
                    str(bwork),
                    "--size-gb",
                    str(a.size_gb),
                    "--shard-mb",
                    str(a.shard_mb),
                    "--repeat",
                    str(a.repeat),
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            if res.returncode:
                raise SystemExit(f"baseline failed:\n{res.stderr[-3000:]}")
            base = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    mb = a.size_gb * 1e9 / 1e6
    print(
        f"# python bench/weights_io.py --size-gb {a.size_gb} --shard-mb {a.shard_mb} --repeat {a.repeat}"
        + f" --device {a.device}"
        + (f" --baseline-src {a.baseline_src}" if a.baseline_src else "")
    )
    print(f"# {os.cpu_count()} CPUs, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; best of {a.repeat}")
    ref = {
        "export save_shards": "export raw write + fsync",
        "export save_shards (no fsync)": "export raw write",
        "load load_shards (warm)": "load raw readinto (warm)",
        "load load_shards (cold)": "load raw readinto (cold)",
        "load load_shards (warm, not verified)": "load raw readinto (warm)",
    }
    print(
        f"{'row':42s} {'s':>7s} {'MB/s':>8s} {'vs raw':>7s}"
        + (f" {'baseline MB/s':>14s} {'x baseline':>11s}" if base else "")
    )
    for name, s in rows.items():
        vs = f"{rows[ref[name]] / s:7.1%}" if name in ref else ""
        extra = f" {mb / base[name]:14.0f} {base[name] / s:11.2f}" if name in base else ""
        print(f"{name:42s} {s:7.2f} {mb / s:8.0f} {vs:>7s}{extra}")
    speedup = rows["fit export before (CPU copy + fsync)"] / rows["fit export now (in place, no fsync)"]
    print(f"fit export, now / before ({a.device}): {speedup:.2f}x")


if __name__ == "__main__":
    main()
