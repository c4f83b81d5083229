"""Streaming fp32 FedAvg (fl_app.aggregate) next to in-memory axpy and Flower's own aggregation.

    python bench/aggregate.py --clients 2 --size-gb 1.0

Writes N random fp32 client models (LLM-like tensor shapes) as safetensors shards to a temp dir,
then measures, each in a fresh child process so peak RSS is its own:
  axpy      the same FedAvg arithmetic on in-memory buffers (memory-bandwidth ceiling)
  ours      fedavg_manifests: read + sha256-verify + accumulate + write + fsync the global,
            with the input files in the page cache (warm), evicted from it (cold), and warm
            without sha256 verification (to show what verification costs)
  flower    flwr's aggregate_arrayrecords on the same tensors held as ArrayRecords (all
            clients in memory; run on a smaller model if that would exceed --flower-max-gb)
GB/s = input bytes (N x model size) / seconds, best of --repeat runs. Peak RSS = high-water RSS above the RSS at the
start of the measured phase (Linux: /proc/self/clear_refs resets the mark). Linux only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fl_app.aggregate import fedavg_manifests, weight_factors  # noqa: E402
from fl_app.weights import Manifest, load_shards, save_shards  # noqa: E402

HIDDEN = 1536  # Qwen2.5-1.5B width: the tensor shapes resemble that model's


def _status_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


class PeakRSS:
    """High-water RSS growth of this process inside the `with` block."""

    def __enter__(self) -> "PeakRSS":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_kb = _status_kb("VmRSS")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.peak_bytes = (_status_kb("VmHWM") - self.start_kb) * 1024


def model_shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """An LLM-like layout: an embedding of ~15%, then per layer an MLP matrix and a norm vector."""
    numel = size_bytes // 4
    vocab = max(1, int(numel * 0.15) // HIDDEN)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, HIDDEN))]
    left, layer = numel - vocab * HIDDEN, 0
    while left >= 4 * HIDDEN * HIDDEN + HIDDEN:
        shapes += [(f"model.layers.{layer}.mlp.up_proj.weight", (4 * HIDDEN, HIDDEN)),
                   (f"model.layers.{layer}.input_layernorm.weight", (HIDDEN,))]
        left -= 4 * HIDDEN * HIDDEN + HIDDEN
        layer += 1
    if left > 0:
        shapes.append(("lm_head.bias", (left,)))
    return shapes


def random_model(size_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in model_shapes(size_bytes)}


# ---- child measurements (each runs in its own process) ---------------------------------------
def child_write(a: argparse.Namespace) -> dict:
    size, total_s = int(a.size_gb * 1e9), 0.0
    for c in range(a.clients):
        state = random_model(size, seed=c)
        t0 = time.perf_counter()
        save_shards(state, Path(a.work) / f"client-{c}", int(a.shard_mb * 2**20))
        total_s += time.perf_counter() - t0
        del state
    return {"name": "save_shards (write + sha256 + fsync)", "bytes": a.clients * size, "seconds": total_s}


def _inputs(a: argparse.Namespace) -> list[tuple[Manifest, float]]:
    return [(Manifest.from_dir(Path(a.work) / f"client-{c}"), float(100 + 37 * c)) for c in range(a.clients)]


def best_of(repeat: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None) -> tuple[float, int]:
    """Fastest wall time and largest peak-RSS growth over `repeat` runs of fn (setup is untimed).

    Best-of, because the machine is shared: the fastest run is the least disturbed one.
    """
    seconds, peak = float("inf"), 0
    for _ in range(repeat):
        setup()
        with PeakRSS() as p:
            fn()
        seconds, peak = min(seconds, p.seconds), max(peak, p.peak_bytes)
    return seconds, peak


def child_ours(a: argparse.Namespace) -> dict:
    inputs = _inputs(a)
    out = Path(a.work) / "global"

    def setup() -> None:
        shutil.rmtree(out, ignore_errors=True)
        for m, _ in inputs if a.cold else []:
            for i in range(len(m.shards)):
                fd = os.open(m.shard_path(i), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop our files from the page cache
                os.close(fd)

    seconds, peak = best_of(a.repeat, lambda: fedavg_manifests(inputs, out, int(a.shard_mb * 2**20),
                                                               verify=not a.no_verify), setup)
    label = f"ours, streaming ({'cold' if a.cold else 'warm'} cache, " + \
            ("no sha256)" if a.no_verify else "sha256 verified)")
    return {"name": label, "bytes": sum(m.tensor_bytes for m, _ in inputs), "seconds": seconds, "peak_bytes": peak}


def child_axpy(a: argparse.Namespace) -> dict:
    size = int(a.size_gb * 1e9) // 4 * 4
    factors = weight_factors([100 + 37 * c for c in range(a.clients)])
    g = torch.Generator().manual_seed(0)
    with PeakRSS() as held:
        xs = [torch.rand(size // 4, generator=g) for _ in range(a.clients)]

    def axpy() -> None:
        acc = xs[0].mul(factors[0])
        for x, f in zip(xs[1:], factors[1:]):
            acc.add_(x, alpha=f)

    seconds, peak = best_of(a.repeat, axpy)
    out = torch.empty_like(xs[0])
    copy_s, _ = best_of(a.repeat, lambda: out.copy_(xs[-1]))
    sha_s, _ = best_of(a.repeat, lambda: hashlib.sha256(memoryview(xs[0].numpy()).cast("B")).digest())
    scratch = Path(a.work) / "disk-floor.bin"

    def write_and_fsync() -> None:  # what writing one durable global model costs at the least
        with open(scratch, "wb") as f:
            f.write(memoryview(xs[0].numpy()).cast("B"))
            os.fsync(f.fileno())

    disk_s, _ = best_of(a.repeat, write_and_fsync, setup=lambda: scratch.unlink(missing_ok=True))
    scratch.unlink()
    return {"name": "axpy in RAM (acc = x0*f0; acc += xi*fi)", "bytes": a.clients * size, "seconds": seconds,
            "peak_bytes": peak, "inputs_held_bytes": held.peak_bytes,
            "memcpy_gbps": size / copy_s / 1e9, "sha256_gbps": size / sha_s / 1e9,
            "disk_write_gbps": size / disk_s / 1e9}


def child_flower(a: argparse.Namespace) -> dict:
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    weights = [100 + 37 * c for c in range(a.clients)]
    size = int(a.flower_size_gb * 1e9)
    full = a.flower_size_gb == a.size_gb
    records, nbytes = [], 0
    with PeakRSS() as held:
        for c, w in enumerate(weights):
            state = load_shards(Path(a.work) / f"client-{c}") if full else random_model(size, seed=c)
            nbytes += sum(t.nbytes for t in state.values())
            records.append(RecordDict({"arrays": ArrayRecord(state),
                                       "metrics": MetricRecord({"num-examples": w})}))
            del state
    result = []
    seconds, peak = best_of(a.repeat, lambda: result.append(aggregate_arrayrecords(records, "num-examples")),
                            setup=result.clear)
    row = {"name": "flower aggregate_arrayrecords (all in RAM)", "bytes": nbytes, "seconds": seconds,
           "peak_bytes": peak, "inputs_held_bytes": held.peak_bytes}
    if full:  # the two aggregations must agree (within fp32 rounding)
        del records
        ours = load_shards(Path(a.work) / "global")
        row["max_abs_diff_vs_ours"] = max(float((ours[k] - torch.from_numpy(v.numpy())).abs().max())
                                          for k, v in result[0].items())
    return row


CHILDREN = {"write": child_write, "ours": child_ours, "axpy": child_axpy, "flower": child_flower}


# ---- driver --------------------------------------------------------------------------------
def run_child(a: argparse.Namespace, which: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--work", a.work, "--clients", str(a.clients),
           "--size-gb", str(a.size_gb), "--shard-mb", str(a.shard_mb), "--flower-size-gb",
           str(a.flower_size_gb), "--repeat", str(a.repeat), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"child {which} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 model size per client (1 GB = 1e9 bytes)")
    ap.add_argument("--shard-mb", type=float, default=512.0, help="max shard size (MiB), as run.shard_max_mb")
    ap.add_argument("--flower-max-gb", type=float, default=10.0,
                    help="memory budget for the Flower run; it uses a smaller model if (N+2) x size exceeds it")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported")
    ap.add_argument("--tmp-dir", default=None, help="where the client shards go (default: system temp)")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--flower-size-gb", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return

    a.flower_size_gb = min(a.size_gb, a.flower_max_gb / (a.clients + 2))
    a.work = tempfile.mkdtemp(prefix="bench-aggregate-", dir=a.tmp_dir)
    load_before = os.getloadavg()[0]
    try:
        rows = [run_child(a, "write"), run_child(a, "axpy"), run_child(a, "ours"),
                run_child(a, "ours", "--cold"), run_child(a, "ours", "--no-verify"), run_child(a, "flower")]
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    print(f"# python bench/aggregate.py --clients {a.clients} --size-gb {a.size_gb} --shard-mb {a.shard_mb} "
          f"--repeat {a.repeat}   (best of {a.repeat} runs per row; save_shards: one run)")
    print(f"# {a.clients} clients x {a.size_gb} GB fp32, shards <= {a.shard_mb} MiB, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f} (other work on the machine slows every row alike)")
    if a.flower_size_gb != a.size_gb:
        print(f"# flower ran on {a.flower_size_gb:.2f} GB per client: ({a.clients}+2) x {a.size_gb} GB would "
              f"exceed --flower-max-gb {a.flower_max_gb}")
    ours = rows[2]["bytes"] / rows[2]["seconds"]
    print(f"{'method':46s} {'GB in':>6s} {'s':>7s} {'GB/s':>6s} {'x ours':>7s} {'peak RSS':>9s}")
    for r in rows:
        gbps = r["bytes"] / r["seconds"]
        peak = f"{r['peak_bytes'] / 2**20:7.0f}Mi" if "peak_bytes" in r else "-"
        print(f"{r['name']:46s} {r['bytes'] / 1e9:6.2f} {r['seconds']:7.2f} {gbps / 1e9:6.2f} "
              f"{gbps / ours:7.2f} {peak:>9s}")
    axpy, flower = rows[1], rows[5]
    print(f"one model: memcpy {axpy['memcpy_gbps']:.2f} GB/s (torch copy_), sha256 {axpy['sha256_gbps']:.2f} GB/s "
          f"(one core; ours hashes every input and output byte), write + fsync to disk "
          f"{axpy['disk_write_gbps']:.2f} GB/s (ours writes the global once: {a.size_gb} GB)")
    print(f"axpy inputs held in RAM: "
          f"{axpy['inputs_held_bytes'] / 2**20:.0f} MiB; flower inputs held as ArrayRecords: "
          f"{flower['inputs_held_bytes'] / 2**20:.0f} MiB (peak while building them)")
    if "max_abs_diff_vs_ours" in flower:
        print(f"max |ours - flower| over all tensors: {flower['max_abs_diff_vs_ours']:.3g}")


if __name__ == "__main__":
    main()
