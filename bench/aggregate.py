"""Streaming fp32 FedAvg (fl_app.aggregate) next to Flower's own aggregation and physical limits.

    python bench/aggregate.py --clients 2,4,8 --size-gb 0.5
    python bench/aggregate.py --clients 2 --size-gb 1.0 --baseline-src /tmp/v1   # + the old code, same run

For each client count N, writes N random fp32 client models (LLM-like tensor shapes) as shards
to a temp dir, then measures, each in a fresh child process so peak RSS is its own:
  limits    one model's memcpy, BLAKE3 and sha256 on one core, write + fsync to disk; and the
            same FedAvg arithmetic on buffers already in RAM (axpy)
  ours      fedavg_manifests: read + verify every byte + accumulate + check finite + write, hash
            and fsync the global; input files in the page cache (warm), evicted from it (cold),
            and warm without input verification (what verification costs)
  flower    flwr's aggregate_arrayrecords on the same tensors held as ArrayRecords (all
            clients in memory; run on a smaller model if that would exceed --flower-max-gb),
            its runs interleaved with runs of ours in the same process (the ours/flower ratio)
  baseline  (--baseline-src DIR: a checkout whose fl_app is the code to compare against) its
            save_shards + fedavg_manifests on its own copy of the inputs, one run per child
            process alternating with one of ours (the ours/baseline ratio)
  --aggregators  instead of the rows above: every `federation.aggregator` (fl_app.robust) on
            the same inputs and the same global model w, runs interleaved in one process,
            as ratios to plain FedAvg (fedavg_manifests, which never reads w): `fedavg` there
            is FedAvg plus the anomaly scores (w read, the updates' Gram accumulated)
GB/s = input bytes (N x model size) / seconds, best of --repeat runs (the least disturbed run
on a shared machine). Peak RSS = high-water RSS above the RSS at the start of the measured phase
(Linux: /proc/self/clear_refs resets the mark). The integrity floor is the time to hash every
input and output byte once on all cores, or to write the global durably, whichever is longer:
no verified, durable aggregation can beat it on this machine. Linux only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--baseline" not in sys.argv:  # a baseline child imports the fl_app its PYTHONPATH names
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fl_app.aggregate import fedavg_manifests, weight_factors  # noqa: E402
from fl_app.weights import Manifest, load_shards, save_shards  # noqa: E402

HIDDEN = 1536  # Qwen2.5-1.5B width: the tensor shapes resemble that model's


def _status_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


class PeakRSS:
    """Wall time, CPU time (all threads) and high-water RSS growth of this process inside the
    `with` block. CPU time barely depends on what else runs on the machine: it is the work."""

    def __enter__(self) -> PeakRSS:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_kb = _status_kb("VmRSS")
        self.cpu0 = _cpu_seconds()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = _cpu_seconds() - self.cpu0
        self.peak_bytes = (_status_kb("VmHWM") - self.start_kb) * 1024


def model_shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """An LLM-like layout: an embedding of ~15%, then per layer an MLP matrix and a norm vector."""
    numel = size_bytes // 4
    vocab = max(1, int(numel * 0.15) // HIDDEN)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, HIDDEN))]
    left, layer = numel - vocab * HIDDEN, 0
    while left >= 4 * HIDDEN * HIDDEN + HIDDEN:
        shapes += [
            (f"model.layers.{layer}.mlp.up_proj.weight", (4 * HIDDEN, HIDDEN)),
            (f"model.layers.{layer}.input_layernorm.weight", (HIDDEN,)),
        ]
        left -= 4 * HIDDEN * HIDDEN + HIDDEN
        layer += 1
    if left > 0:
        shapes.append(("lm_head.bias", (left,)))
    return shapes


def random_model(size_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in model_shapes(size_bytes)}


def evict(paths: list[Path]) -> None:
    """Drop these files from the page cache (the next read comes from disk)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def best_of(repeat: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Fastest wall time, least CPU time and largest peak-RSS growth over `repeat` runs of fn
    (setup is untimed). Best-of, because the machine is shared: the fastest run is the least
    disturbed one."""
    best = {"seconds": float("inf"), "cpu_seconds": float("inf"), "peak_bytes": 0}
    for _ in range(repeat):
        setup()
        with PeakRSS() as p:
            fn()
        best = {
            "seconds": min(best["seconds"], p.seconds),
            "cpu_seconds": min(best["cpu_seconds"], p.cpu_seconds),
            "peak_bytes": max(best["peak_bytes"], p.peak_bytes),
        }
    return best


def _weights(n: int) -> list[float]:
    return [float(100 + 37 * c) for c in range(n)]


# ---- child measurements (each runs in its own process) ---------------------------------------
def child_write(a: argparse.Namespace) -> dict:
    size, total_s = int(a.size_gb * 1e9), 0.0
    for c in range(a.clients):
        state = random_model(size, seed=c)
        t0 = time.perf_counter()
        save_shards(state, Path(a.work) / f"client-{c}", int(a.shard_mb * 2**20))
        total_s += time.perf_counter() - t0
        del state
    return {"name": "save_shards (clients' export)", "bytes": a.clients * size, "seconds": total_s}


def child_ours(a: argparse.Namespace) -> dict:
    inputs = [(Manifest.from_dir(Path(a.work) / f"client-{c}"), w) for c, w in enumerate(_weights(a.clients))]
    out = Path(a.work) / "global"

    def setup() -> None:
        shutil.rmtree(out, ignore_errors=True)
        if a.cold:
            evict([m.shard_path(i) for m, _ in inputs for i in range(len(m.shards))])

    m = best_of(a.repeat, lambda: fedavg_manifests(inputs, out, int(a.shard_mb * 2**20), verify=not a.no_verify), setup)
    label = "baseline" if a.baseline else "ours"
    label += f" ({'cold' if a.cold else 'warm'} cache" + (", inputs not verified)" if a.no_verify else ")")
    return {"name": label, "bytes": sum(m.tensor_bytes for m, _ in inputs), **m}


def child_aggregators(a: argparse.Namespace) -> dict:
    from fl_app.robust import Rule, aggregate_manifests

    shard = int(a.shard_mb * 2**20)
    inputs = [(Manifest.from_dir(Path(a.work) / f"client-{c}"), w) for c, w in enumerate(_weights(a.clients))]
    w = Manifest.from_dir(Path(a.work) / "global-w")
    out = Path(a.work) / "global"

    def robust(rule: Rule) -> Callable[[], object]:
        return lambda: aggregate_manifests(inputs, w, out, shard, rule)

    runs: dict[str, Callable[[], object]] = {
        "fedavg_manifests": lambda: fedavg_manifests(inputs, out, shard),
        "fedavg": robust(Rule("fedavg")),
        "clipped": robust(Rule("clipped")),
        "trimmed_mean": robust(Rule("trimmed_mean", trim_fraction=1 / a.clients)),  # one per side
        "median": robust(Rule("median")),
    }
    best: dict[str, dict[str, float]] = {}
    for _ in range(a.repeat):  # interleaved, so slow drifts of the machine's load hit every method alike
        for name, fn in runs.items():
            got = best_of(1, fn, lambda: shutil.rmtree(out, ignore_errors=True))
            old = best.setdefault(name, got)
            best[name] = {k: (max if k == "peak_bytes" else min)(old[k], v) for k, v in got.items()}
    return {"name": "aggregators", "bytes": sum(m.tensor_bytes for m, _ in inputs), "rows": best}


def child_limits(a: argparse.Namespace) -> dict:
    import blake3

    size = int(a.size_gb * 1e9) // 4 * 4
    factors = weight_factors(_weights(a.clients))
    g = torch.Generator().manual_seed(0)
    with PeakRSS() as held:
        xs = [torch.rand(size // 4, generator=g) for _ in range(a.clients)]
    acc = torch.empty_like(xs[0])  # preallocated, as a streaming sum reuses its buffers

    def axpy() -> None:
        torch.mul(xs[0], factors[0], out=acc)
        for x, f in zip(xs[1:], factors[1:]):
            acc.add_(x, alpha=f)

    m = best_of(a.repeat, axpy)
    raw = xs[0].numpy().data.cast("B")
    copy_s = best_of(a.repeat, lambda: acc.copy_(xs[-1]))["seconds"]
    blake_s = best_of(a.repeat, lambda: blake3.blake3(raw).digest())["seconds"]
    sha_s = best_of(a.repeat, lambda: hashlib.sha256(raw).digest())["seconds"]
    scratch = Path(a.work) / "disk-floor.bin"

    def write_and_fsync() -> None:  # what writing one durable global model costs at the least
        with open(scratch, "wb") as f:
            f.write(raw)
            os.fsync(f.fileno())

    disk_s = best_of(a.repeat, write_and_fsync, setup=lambda: scratch.unlink(missing_ok=True))["seconds"]
    scratch.unlink()
    return {
        "name": "axpy in RAM (same arithmetic, no IO)",
        "bytes": a.clients * size,
        **m,
        "inputs_held_bytes": held.peak_bytes,
        "memcpy_gbps": size / copy_s / 1e9,
        "blake3_gbps": size / blake_s / 1e9,
        "sha256_gbps": size / sha_s / 1e9,
        "disk_write_gbps": size / disk_s / 1e9,
    }


def child_flower(a: argparse.Namespace) -> dict:
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    size = int(a.flower_size_gb * 1e9)
    full = a.flower_size_gb == a.size_gb
    records, nbytes = [], 0
    with PeakRSS() as held:
        for c, w in enumerate(_weights(a.clients)):
            state = load_shards(Path(a.work) / f"client-{c}") if full else random_model(size, seed=c)
            nbytes += sum(t.nbytes for t in state.values())
            arrays = ArrayRecord(state)
            records.append(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": w})}))
            del state, arrays
    result: list = []
    inputs = [(Manifest.from_dir(Path(a.work) / f"client-{c}"), w) for c, w in enumerate(_weights(a.clients))]
    out = Path(a.work) / "global"
    flower: dict[str, float] = {"seconds": float("inf"), "cpu_seconds": float("inf"), "peak_bytes": 0}
    ours = dict(flower)
    runs: list[tuple[dict[str, float], Callable[[], object], Callable[[], object]]] = [
        (flower, lambda: result.append(aggregate_arrayrecords(records, "num-examples")), result.clear),
        (ours, lambda: fedavg_manifests(inputs, out, int(a.shard_mb * 2**20)), lambda: shutil.rmtree(out, True)),
    ]
    for _ in range(a.repeat):  # interleaved with ours, so slow drifts of the machine's load hit both alike
        for best, fn, setup in runs:
            best.update({k: (max if k == "peak_bytes" else min)(best[k], v) for k, v in best_of(1, fn, setup).items()})
    row: dict = {
        "name": "flower aggregate_arrayrecords (all in RAM)",
        "bytes": nbytes,
        **flower,
        "inputs_held_bytes": held.peak_bytes,
        "ours_interleaved": ours,
        "ours_interleaved_bytes": sum(m.tensor_bytes for m, _ in inputs),
    }
    if full:  # the two aggregations must agree (within fp32 rounding)
        del records
        avg = load_shards(out)
        row["max_abs_diff_vs_ours"] = max(
            float((avg[k] - torch.from_numpy(v.numpy())).abs().max()) for k, v in result[0].items()
        )
    return row


def child_write_w(a: argparse.Namespace) -> dict:
    """The round's global model w the aggregators step from (one more random model)."""
    save_shards(random_model(int(a.size_gb * 1e9), seed=10_000), Path(a.work) / "global-w", int(a.shard_mb * 2**20))
    return {}


CHILDREN = {
    "write": child_write,
    "ours": child_ours,
    "limits": child_limits,
    "flower": child_flower,
    "write_w": child_write_w,
    "aggregators": child_aggregators,
}


# ---- driver --------------------------------------------------------------------------------
def run_child(a: argparse.Namespace, which: str, *extra: str, src: str | None = None, work: str | None = None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        which,
        "--work",
        work or a.work,
        "--clients",
        str(a.clients),
        "--size-gb",
        str(a.size_gb),
        "--shard-mb",
        str(a.shard_mb),
        "--flower-size-gb",
        str(a.flower_size_gb),
        "--repeat",
        str(a.repeat),
        *extra,
    ]
    env = dict(os.environ)
    if src:  # the baseline's fl_app first on the path
        cmd.append("--baseline")
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"child {which} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_n(a: argparse.Namespace) -> dict:
    """Every row for one client count, in one work dir (removed afterwards)."""
    a.flower_size_gb = min(a.size_gb, a.flower_max_gb / (a.clients + 2))
    a.work = tempfile.mkdtemp(prefix="bench-aggregate-", dir=a.tmp_dir)
    try:
        if a.aggregators:
            run_child(a, "write")
            run_child(a, "write_w")
            return run_child(a, "aggregators")
        rows = {
            "write": run_child(a, "write"),
            "limits": run_child(a, "limits"),
            "ours": run_child(a, "ours"),
            "cold": run_child(a, "ours", "--cold"),
            "noverify": run_child(a, "ours", "--no-verify"),
            "flower": run_child(a, "flower"),
        }
        if a.baseline_src:  # one run per child, alternating with ours, best of --repeat each
            base_work = os.path.join(a.work, "baseline")
            os.mkdir(base_work)
            run_child(a, "write", src=a.baseline_src, work=base_work)
            single = argparse.Namespace(**{**vars(a), "repeat": 1})
            pairs = [
                (run_child(single, "ours", src=a.baseline_src, work=base_work), run_child(single, "ours"))
                for _ in range(a.repeat)
            ]
            rows["baseline"] = min((b for b, _ in pairs), key=lambda r: r["seconds"])
            rows["ours_vs_baseline"] = {
                **min((o for _, o in pairs), key=lambda r: r["seconds"]),
                "name": "ours (warm, alternating with the baseline)",
            }
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    return rows


def report_aggregators(a: argparse.Namespace, n: int, got: dict) -> None:
    rows, base = got["rows"], got["rows"]["fedavg_manifests"]["seconds"]
    print(f"\n## N = {n} clients x {a.size_gb} GB (+ the global model w)")
    print(f"{'aggregator':40s} {'s':>7s} {'GB/s':>6s} {'x FedAvg':>9s} {'CPU s':>7s} {'peak RSS':>9s}")
    for name, r in rows.items():
        label = {"fedavg_manifests": "FedAvg (fedavg_manifests, w not read)", "fedavg": "fedavg + scores"}.get(
            name, name
        )
        print(
            f"{label:40s} {r['seconds']:7.2f} {got['bytes'] / r['seconds'] / 1e9:6.2f} {r['seconds'] / base:9.2f} "
            f"{r['cpu_seconds']:7.2f} {r['peak_bytes'] / 2**20:7.0f}Mi"
        )


def report(a: argparse.Namespace, n: int, rows: dict) -> dict:
    lim, ours, flower = rows["limits"], rows["ours"], rows["flower"]
    rows["ours_vs_flower"] = {
        "name": "ours (warm, interleaved with flower)",
        "bytes": flower["ours_interleaved_bytes"],
        **flower["ours_interleaved"],
        "peak_bytes": None,
    }
    gbps = {k: r["bytes"] / r["seconds"] / 1e9 for k, r in rows.items()}
    size = a.size_gb * 1e9
    hash_floor = (n + 1) * size / (os.cpu_count() * lim["blake3_gbps"] * 1e9)
    disk_floor = size / (lim["disk_write_gbps"] * 1e9)
    floor_gbps = n * size / max(hash_floor, disk_floor) / 1e9
    print(
        f"\n## N = {n} clients x {a.size_gb} GB"
        + (
            f" (flower on {a.flower_size_gb:.2f} GB per client: --flower-max-gb {a.flower_max_gb})"
            if a.flower_size_gb != a.size_gb
            else ""
        )
    )
    print(f"{'method':52s} {'GB in':>6s} {'s':>7s} {'GB/s':>6s} {'x ours':>7s} {'CPU s/GB':>9s} {'peak RSS':>9s}")
    for k, r in rows.items():
        peak = f"{r['peak_bytes'] / 2**20:7.0f}Mi" if r.get("peak_bytes") is not None else "-"
        cpu = f"{r['cpu_seconds'] / (r['bytes'] / 1e9):9.2f}" if "cpu_seconds" in r else "        -"
        print(
            f"{r['name']:52s} {r['bytes'] / 1e9:6.2f} {r['seconds']:7.2f} {gbps[k]:6.2f} "
            f"{gbps[k] / gbps['ours']:7.2f} {cpu} {peak:>9s}"
        )
    print(
        f"one model: memcpy {lim['memcpy_gbps']:.2f} GB/s, BLAKE3 {lim['blake3_gbps']:.2f} GB/s and sha256 "
        f"{lim['sha256_gbps']:.2f} GB/s on one core, write + fsync {lim['disk_write_gbps']:.2f} GB/s; integrity floor "
        f"(hash {n + 1} models on {os.cpu_count()} cores, or write 1 durably) {floor_gbps:.2f} GB/s of input"
    )
    print(
        f"inputs held in RAM: axpy {lim['inputs_held_bytes'] / 2**20:.0f} MiB, flower (as ArrayRecords) "
        f"{flower['inputs_held_bytes'] / 2**20:.0f} MiB"
        + (f"; max |ours - flower| {flower['max_abs_diff_vs_ours']:.3g}" if "max_abs_diff_vs_ours" in flower else "")
    )
    return {
        "n": n,
        "ours": gbps["ours"],
        "flower": gbps["flower"],
        "memcpy": lim["memcpy_gbps"],
        "floor": floor_gbps,
        "vs_flower": gbps["ours_vs_flower"] / gbps["flower"],
        "cpu_vs_flower": flower["cpu_seconds"]
        / flower["bytes"]
        / (rows["ours_vs_flower"]["cpu_seconds"] / rows["ours_vs_flower"]["bytes"]),
        "vs_baseline": gbps["ours_vs_baseline"] / gbps["baseline"] if "baseline" in gbps else None,
        "ours_peak": ours["peak_bytes"],
        "flower_peak": flower["peak_bytes"] + flower["inputs_held_bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="2", help="client counts to bench, comma-separated (e.g. 2,4,8)")
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 model size per client (1 GB = 1e9 bytes)")
    ap.add_argument("--shard-mb", type=float, default=512.0, help="max shard size (MiB), as run.shard_max_mb")
    ap.add_argument(
        "--flower-max-gb",
        type=float,
        default=10.0,
        help="memory budget for the Flower run; it uses a smaller model if (N+2) x size exceeds it",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported")
    ap.add_argument("--tmp-dir", default=None, help="where the client shards go (default: system temp)")
    ap.add_argument(
        "--baseline-src",
        default=None,
        help="a source tree whose fl_app to bench side by side (e.g. `git worktree add /tmp/v1 <commit>`)",
    )
    ap.add_argument(
        "--aggregators",
        action="store_true",
        help="bench every federation.aggregator against FedAvg on the same inputs (fl_app.robust)",
    )
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--flower-size-gb", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        a.clients = int(a.clients)
        print(json.dumps(CHILDREN[a.child](a)))
        return

    counts = [int(c) for c in a.clients.split(",")]
    load_before = os.getloadavg()[0]
    print(
        f"# python bench/aggregate.py --clients {a.clients} --size-gb {a.size_gb} --shard-mb {a.shard_mb} "
        f"--repeat {a.repeat}"
        + (f" --baseline-src {a.baseline_src}" if a.baseline_src else "")
        + (" --aggregators" if a.aggregators else "")
    )
    print(
        f"# shards <= {a.shard_mb} MiB, torch {torch.__version__}, {os.cpu_count()} CPUs, best of {a.repeat} runs "
        "per row (save_shards: one run); other work on the machine slows every row alike"
    )
    if a.aggregators:
        for n in counts:
            a.clients = n
            report_aggregators(a, n, bench_n(a))
        print(f"\n(load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; best of {a.repeat} interleaved runs)")
        return
    summary = []
    for n in counts:
        a.clients = n
        summary.append(report(a, n, bench_n(a)))
    print(f"\n## Summary (load average {load_before:.1f} -> {os.getloadavg()[0]:.1f})")
    print(
        f"{'N':>3s} {'ours GB/s':>10s} {'flower':>7s} {'ours/flower':>12s} {'CPU flower/ours':>16s} "
        f"{'ours/memcpy':>12s} {'ours/floor':>11s} {'peak RSS ours / flower':>24s}"
        + (f" {'ours/baseline':>14s}" if a.baseline_src else "")
    )
    for s in summary:
        print(
            f"{s['n']:3d} {s['ours']:10.2f} {s['flower']:7.2f} {s['vs_flower']:12.2f} {s['cpu_vs_flower']:16.2f} "
            f"{s['ours'] / s['memcpy']:12.1%} {s['ours'] / s['floor']:11.1%} "
            f"{s['ours_peak'] / 2**20:9.0f} / {s['flower_peak'] / 2**20:6.0f} MiB"
            + (f" {s['vs_baseline']:14.2f}" if s["vs_baseline"] else "")
        )
    print(
        "ours/flower and ours/baseline compare runs interleaved in time (best of each); CPU flower/ours is CPU "
        "seconds per input GB (all threads), the work each does whatever the load; the other columns use the "
        "'ours (warm cache)' row"
    )


if __name__ == "__main__":
    main()
