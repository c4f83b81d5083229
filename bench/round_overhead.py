"""Where a federated round's time goes: the rollouts and updates, against everything else.

    python -m bench.round_overhead runs/<name>                 # a finished (or running) run dir
    python -m bench.round_overhead runs/<name> --json /tmp/overhead.json

Reads the run's `metrics.jsonl` (what `flwr run` writes) and splits each round's wall time:
- *work*: the fits' rollouts and updates (`fits_rollout_update_s`, summed over the round's
  clients) and the validation's episodes (`val_eval_s`);
- *overhead*: the rest, which issue #17 wants at <= 5% of the round: loading the global into
  each lane (`load_s` of every fit and of the validation), exporting each fit's weights
  (`export_s`), the server's streaming FedAvg and checkpoint (`aggregate_s`), and what none of
  these name (`other`: scoring rows for the update, metrics, Flower messaging, the server's
  round bookkeeping).
Valid for fits that run one after another (one lane, as a simulation on one GPU does); with
several lanes in parallel the summed fit times exceed the round's critical path. The first
round is shown but left out of the mean: it pays the lanes' one-time costs (torch.compile).
Per-fit times come as example-weighted means over the round's clients; they are multiplied
by the number of clients that replied (exact when clients train the same number of episodes,
as every recipe's do).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def split(row: dict[str, Any]) -> dict[str, float]:
    """One round's wall time, split into work and overhead parts (seconds)."""
    fits = len(row["clients"]) - len(row.get("dropped", []))
    parts = {
        "wall": row["wall_s"],
        "fits_work": row["fits_rollout_update_s"],
        "val_work": row.get("val_eval_s", 0.0),
        "load": fits * row.get("train_load_s", 0.0) + row.get("val_load_s", 0.0),
        "export": fits * row.get("train_export_s", 0.0),
        "aggregate": row["aggregate_s"],
    }
    parts["overhead"] = parts["wall"] - parts["fits_work"] - parts["val_work"]
    parts["other"] = parts["overhead"] - parts["load"] - parts["export"] - parts["aggregate"]
    parts["overhead_frac"] = parts["overhead"] / parts["wall"]
    return parts


def report(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rounds = [r for r in rows if r["round"] >= 1]
    if not rounds or "aggregate_s" not in rounds[0]:
        raise SystemExit(
            f"{run_dir}/metrics.jsonl has no training round with aggregate_s; run a round with this "
            "version of fedagent-flower first"
        )
    per_round = {r["round"]: split(r) for r in rounds}
    steady = [p for rnd, p in per_round.items() if rnd > rounds[0]["round"]] or list(per_round.values())
    mean = {k: sum(p[k] for p in steady) / len(steady) for k in steady[0]}
    mean["overhead_frac"] = mean["overhead"] / mean["wall"]
    return {"run_dir": str(run_dir), "rounds": per_round, "mean_after_first": mean, "rounds_in_mean": len(steady)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.round_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write the report here")
    a = ap.parse_args(argv)
    rep = report(a.run_dir)
    cols = ("wall", "fits_work", "val_work", "load", "export", "aggregate", "other", "overhead")
    print("round " + " ".join(f"{c:>10}" for c in cols) + "  overhead/round")
    for rnd, p in rep["rounds"].items():
        print(f"{rnd:>5} " + " ".join(f"{p[c]:>10.2f}" for c in cols) + f"  {100 * p['overhead_frac']:.1f}%")
    m = rep["mean_after_first"]
    print(
        "mean " + " ".join(f"{m[c]:>10.2f}" for c in cols) + f"  {100 * m['overhead_frac']:.1f}%"
        f"  (rounds after the first: {rep['rounds_in_mean']})"
    )
    print(json.dumps({"overhead_frac": round(m["overhead_frac"], 4), "round_s": round(m["wall"], 2)}))
    if a.json:
        a.json.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
