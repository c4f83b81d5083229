"""What a server optimizer's step (fl_app.server_opt) costs next to the average it steps from.

    python bench/server_opt.py --clients 2 --size-gb 0.25 --repeat 3

N random fp32 client models shaped like Qwen2.5-1.5B layers (bench/aggregate.py's) and a global
model are written as shards to a temp dir; then, in one process, interleaved round by round:
  average   fedavg_manifests of the N clients (what every round pays, sgd included)
  <opt>     the step from the global model along that average, for fedavgm, fedadam and
            nesterov: reads w, the mean and the moments (zeros in round 1, so the bench feeds
            the moments of a first step, as every later round reads them), writes the global
            model and the moments, everything hashed, fsynced and checked finite
Each row is the best of --repeat runs (the least disturbed one on a shared machine), with its
ratio to the average's time; bytes = what the step reads plus writes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.aggregate import best_of, random_model  # noqa: E402
from fl_app.aggregate import fedavg_manifests  # noqa: E402
from fl_app.server_opt import ServerOptimizer  # noqa: E402
from fl_app.weights import Manifest, save_shards  # noqa: E402

OPTIMIZERS = (
    ServerOptimizer("fedavgm", lr=1.0, momentum=0.9),
    ServerOptimizer("fedadam", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3),
    ServerOptimizer("nesterov", lr=0.7, momentum=0.9),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--size-gb", type=float, default=0.25, help="fp32 model size (1 GB = 1e9 bytes)")
    ap.add_argument("--shard-mb", type=float, default=512.0, help="max shard size (MiB), as run.shard_max_mb")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tmp-dir", default=None)
    a = ap.parse_args()
    size, shard = int(a.size_gb * 1e9), int(a.shard_mb * 2**20)
    tmp = Path(tempfile.mkdtemp(prefix="bench-server-opt-", dir=a.tmp_dir))
    try:
        ups = [(save_shards(random_model(size, c), tmp / f"client-{c}", shard), 1.0 + c) for c in range(a.clients)]
        glob, mean = tmp / "global", tmp / "mean"
        save_shards(random_model(size, 99), glob, shard)
        fedavg_manifests(ups, mean, shard)
        moments = {}
        for opt in OPTIMIZERS:  # the moments a later round reads (a first step's)
            moments[opt.name] = [tmp / "state" / opt.name / m for m in opt.moments]
            opt.step(glob, mean, None, tmp / "first" / opt.name, moments[opt.name])
        out = tmp / "out"
        clear = lambda: shutil.rmtree(out, ignore_errors=True)  # noqa: E731
        rows: dict[str, dict[str, float]] = {"average": {"seconds": float("inf")}}
        for opt in OPTIMIZERS:
            rows[opt.name] = {"seconds": float("inf")}
        for _ in range(a.repeat):  # interleaved: each arm sees the same machine
            r = best_of(1, lambda: fedavg_manifests(ups, out / "mean", shard), clear)
            rows["average"] = min(rows["average"], r, key=lambda x: x["seconds"])
            for opt in OPTIMIZERS:
                state_out = [out / "state" / m for m in opt.moments]
                step = lambda o=opt, s=state_out: o.step(glob, mean, moments[o.name], out / "global", s)  # noqa: E731
                r = best_of(1, step, clear)
                rows[opt.name] = min(rows[opt.name], r, key=lambda x: x["seconds"])
        model = Manifest.from_dir(glob).tensor_bytes
        base = rows["average"]["seconds"]
        report = {
            "clients": a.clients,
            "model_bytes": model,
            "rows": {
                k: {
                    **v,
                    "vs_average": v["seconds"] / base,
                    "io_bytes": model * (a.clients + 1) if k == "average" else model * (3 + 2 * len(_moments(k))),
                }
                for k, v in rows.items()
            },
        }
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _moments(name: str) -> tuple[str, ...]:
    return next(o.moments for o in OPTIMIZERS if o.name == name)


if __name__ == "__main__":
    main()
