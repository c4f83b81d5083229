"""Where a federated round's time goes: the rollouts and updates, against everything else.

    python -m bench.round_overhead runs/<name>                 # a finished (or running) run dir
    python -m bench.round_overhead runs/<name> --json /tmp/overhead.json

Reads the run's `metrics.jsonl` (what `flwr run` writes) and splits each round's wall time:
- *work*: the fits' rollouts, scoring and updates (`fits_rollout_update_s`, summed over the round's
  replies) and the validation's episodes (`val_eval_s`);
- *overhead*: the rest, to keep at <= 5% of the round: loading the global into
  each lane (the fits' `fits_load_s` and the validation's `val_load_s`), exporting each fit's
  weights (`fits_export_s`), what the fits spend outside those phases (`in_fits`: fresh
  optimizers, rows, releasing memory), the server's streaming FedAvg and checkpoint
  (`aggregate_s`), and what none of these name (`other`: Flower's message round trips, the
  server's bookkeeping, the time of a lost attempt).
Valid for fits that run one after another (one lane, as a simulation on one GPU does); with
several lanes in parallel the summed fit times exceed the round's critical path. The first
round is shown but left out of the mean: it pays the lanes' one-time costs (torch.compile).
The overhead fraction of the mean is the ratio of the mean times.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fl_app.accounting import OVERHEAD_NEEDED, mean_rows, overhead_split
from fl_app.rundir import RunDir

COLUMNS = ("wall", "fits_work", "val_work", "load", "export", "in_fits", "aggregate", "other", "overhead")


def report(run_dir: Path) -> dict[str, Any]:
    rounds = [r for r in RunDir(run_dir).read_metrics() if r["round"] >= 1]
    old = [r["round"] for r in rounds if any(k not in r for k in OVERHEAD_NEEDED)]
    if not rounds or old:
        what = "no training round" if not rounds else f"rounds {old} without the fit times"
        raise SystemExit(f"{run_dir}/metrics.jsonl has {what}; run rounds with this version of fedagent-flower first")
    per_round = {r["round"]: overhead_split(r) for r in rounds}
    steady = [p for rnd, p in per_round.items() if rnd > rounds[0]["round"]] or list(per_round.values())
    mean = mean_rows(steady)
    mean["overhead_frac"] = mean["overhead"] / mean["wall"]
    return {"run_dir": str(run_dir), "rounds": per_round, "mean": mean, "rounds_in_mean": len(steady)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.round_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the report here")
    a = ap.parse_args(argv)
    rep = report(a.run_dir)
    print("round " + " ".join(f"{c:>9}" for c in COLUMNS) + "  overhead/round")
    for rnd, p in rep["rounds"].items():
        print(f"{rnd:>5} " + " ".join(f"{p[c]:>9.2f}" for c in COLUMNS) + f"  {100 * p['overhead_frac']:.1f}%")
    m, n = rep["mean"], rep["rounds_in_mean"]
    print(
        "mean  " + " ".join(f"{m[c]:>9.2f}" for c in COLUMNS) + f"  {100 * m['overhead_frac']:.1f}%"
        f"  ({n} round{'s' if n > 1 else ''}{' after the first' if n < len(rep['rounds']) else ''})"
    )
    print(json.dumps({"overhead_frac": round(m["overhead_frac"], 4), "round_s": round(m["wall"], 2)}))
    if a.json:
        a.json.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
