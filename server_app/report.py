"""What runs did: one run's summary, or several runs compared, from their run dirs.

    python -m server_app.report runs/<name>                      # one run: summary + its plots
    python -m server_app.report runs/a-s0 runs/a-s1 runs/b-s0 --out report/
    python -m server_app.report runs/<name> --json               # the same, as JSON

One run: rounds, final and best validation success, wall per round and per phase (mean over
the rounds after round 0, `fl_app.accounting`), bytes per round down and up and per client,
and its plots (validation.png, phases.png: drawn into `--out`, default the run dir, when absent).
Several runs: grouped into arms by their resolved config (config.yaml) with the seed and names
left out, so the seeds of one recipe form one arm, each arm labelled by the config keys that
tell the arms apart; a table (mean and std over each arm's runs) and `bands.png`: validation
success per round, the mean of each arm with a band from its lowest to its highest run.
Reads metrics.jsonl, config.yaml and summary.json only (never a checkpoint): cheap on a live run.
Exit 3 when a path is not a run dir (as `server_app.status`), 1 when the runs cannot be compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fl_app.accounting import PHASES, bytes_of, mean_rows, phases_of
from fl_app.plots import plot_phases, plot_seed_bands, plot_validation
from fl_app.rundir import RunDir, RunDirError
from server_app.status import NOT_A_RUN_DIR, Unreadable, read_summary

# config keys that differ between the seeds of one arm (and name nothing the run did)
NOT_THE_ARM = ("run.seed", "run.name", "run.run_dir")
VAL = "val_success"


class NotARunDir(Exception):
    """A path the report cannot read as a run dir; the message says why and what to pass."""


@dataclass
class Run:
    """One run dir as the report reads it."""

    path: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any]
    status: str

    @property
    def trained(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["round"] >= 1]


def load_run(path: Path) -> Run:
    """`path` as a run dir: its metrics rows, flattened config and summary status."""
    if not path.is_dir():
        raise NotARunDir(f"{path}: no such run dir")
    try:
        rows = RunDir(path).read_metrics()
        summary = read_summary(path)
    except (RunDirError, Unreadable, OSError) as e:
        raise NotARunDir(f"{path}: unreadable run dir ({e})") from None
    if not rows:
        raise NotARunDir(
            f"{path}: no metrics.jsonl rows: not a run dir, or its run has not completed round 0 yet "
            "(pass runs/<name>, the dir `flwr run` wrote)"
        )
    config_path = path / "config.yaml"
    config = _flat(yaml.safe_load(config_path.read_text())) if config_path.is_file() else {}
    return Run(path, rows, config, summary.status if summary else "no summary.json yet")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return {k.rstrip("."): v for k, v in out.items()}


def summarize(run: Run) -> dict[str, Any]:
    """One run's numbers (module doc); means are over the rounds after round 0."""
    val = [(r["round"], r[VAL]) for r in run.rows if r.get(VAL) is not None]
    trained = run.trained
    phases = [p for r in trained if (p := phases_of(r)) is not None]
    traffic = [bytes_of(r) for r in trained]
    clients = [c for r in trained for c in (r.get("per_client") or {}).values()]
    return {
        "run_dir": str(run.path),
        "status": run.status,
        "rounds": max(r["round"] for r in run.rows),
        "final_val_success": val[-1][1] if val else None,
        "best_val_success": max(v for _, v in val) if val else None,
        "best_round": max(val, key=lambda x: x[1])[0] if val else None,
        "wall_s_per_round": statistics.fmean(r["wall_s"] for r in trained) if trained else None,
        "phase_s_per_round": mean_rows(phases) if phases else {},
        "bytes_down_per_round": statistics.fmean(d for d, _ in traffic) if traffic else None,
        "bytes_up_per_round": statistics.fmean(u for _, u in traffic) if traffic else None,
        "bytes_down_per_client": statistics.fmean(sum(c["bytes_down"].values()) for c in clients) if clients else None,
        "bytes_up_per_client": statistics.fmean(sum(c["bytes_up"].values()) for c in clients) if clients else None,
    }


def plots(run: Run, out: Path) -> dict[str, str]:
    """The run's validation.png and phases.png: its own when they exist, else drawn into `out`."""
    made = {}
    for name, draw in (("validation.png", plot_validation), ("phases.png", plot_phases)):
        own = run.path / name
        try:
            made[name] = str(own if own.is_file() else draw(run.path / "metrics.jsonl", out / name))
        except ValueError as e:  # nothing of that kind to plot yet (a run at round 0)
            made[name] = f"(none: {e})"
    return made


def arms(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs grouped by their config without `NOT_THE_ARM`, each group labelled by the fewest
    keys whose values tell the groups apart (the run name when there is one group)."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        key = json.dumps({k: v for k, v in run.config.items() if k not in NOT_THE_ARM}, sort_keys=True, default=str)
        groups.setdefault(key, []).append(run)
    configs = [g[0].config for g in groups.values()]
    keys = naming_keys(configs)
    labels = {}
    for i, g in enumerate(groups.values()):
        c = g[0].config
        label = ", ".join(f"{k}={c.get(k)}" for k in keys)
        labels[label or str(c.get("run.name") or f"arm {i}")] = g
    return labels


def naming_keys(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The fewest keys, picked greedily (most distinct values first, then by name), whose values
    tell every config apart: a LoRA arm beside a full one is `federation.update=lora`, not also
    its rank, alpha and learning rate (those differ too, but name nothing new)."""

    def value(c: Mapping[str, Any], k: str) -> str:
        return json.dumps(c.get(k), sort_keys=True, default=str)

    differ = [k for k in {k for c in configs for k in c} - set(NOT_THE_ARM) if len({value(c, k) for c in configs}) > 1]
    differ.sort(key=lambda k: (-len({value(c, k) for c in configs}), k))
    picked: list[str] = []
    for k in differ:
        if len({tuple(value(c, p) for p in picked) for c in configs}) == len(configs):
            break
        picked.append(k)
    return sorted(picked)


def compare(groups: Mapping[str, list[Run]], out: Path) -> dict[str, Any]:
    """Per arm the mean and std over its runs of the one-run numbers, and the band plot."""
    table: dict[str, dict[str, Any]] = {}
    for label, group in groups.items():
        sums = [summarize(r) for r in group]
        table[label] = {"runs": [s["run_dir"] for s in sums]}
        for key in ("final_val_success", "best_val_success", "wall_s_per_round", "bytes_down_per_round"):
            values = [s[key] for s in sums if s[key] is not None]
            table[label][key] = {
                "mean": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            }
    bands = plot_seed_bands({k: [r.path / "metrics.jsonl" for r in g] for k, g in groups.items()}, out / "bands.png")
    return {"arms": table, "bands.png": str(bands)}


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _print_one(s: Mapping[str, Any], made: Mapping[str, str]) -> None:
    mib = 2**20
    print(f"{s['run_dir']}: {s['status']}, {s['rounds']} rounds")
    print(
        f"  validation success: final {_num(s['final_val_success'])}, best {_num(s['best_val_success'])}"
        f" (round {s['best_round']})"
    )
    print(f"  wall per round: {_num(s['wall_s_per_round'], '.2f')} s (mean over rounds >= 1)")
    if s["phase_s_per_round"]:
        order = [p for p in (*PHASES, "other") if p in s["phase_s_per_round"]]
        print("  per phase: " + ", ".join(f"{p} {s['phase_s_per_round'][p]:.2f} s" for p in order))
    down, up = s["bytes_down_per_round"], s["bytes_up_per_round"]
    if down is not None:
        print(f"  bytes per round: down {down / mib:.2f} MiB, up {up / mib:.2f} MiB")
    if s["bytes_down_per_client"] is not None:
        print(
            f"  bytes per client fit: down {s['bytes_down_per_client'] / mib:.2f} MiB, "
            f"up {s['bytes_up_per_client'] / mib:.2f} MiB"
        )
    for name, where in made.items():
        print(f"  {name}: {where}")


def _print_arms(rep: Mapping[str, Any]) -> None:
    width = max([40, *(len(label) for label in rep["arms"])])
    print(f"{'arm':<{width}} {'runs':>4} {'final val':>15} {'best val':>15} {'wall/round s':>15}")
    for label, row in rep["arms"].items():
        cells = [
            f"{_num(row[k]['mean'])}±{_num(row[k]['std'])}"
            for k in ("final_val_success", "best_val_success", "wall_s_per_round")
        ]
        print(f"{label:<{width}} {len(row['runs']):>4} " + " ".join(f"{c:>15}" for c in cells))
    print(f"band plot: {rep['bands.png']}")


def report(paths: Sequence[Path], out: Path | None) -> dict[str, Any]:
    """The report of `paths` as a dict (what --json prints); draws its plots."""
    runs = [load_run(Path(p)) for p in paths]
    if len(runs) == 1:
        return {"run": summarize(runs[0]), "plots": plots(runs[0], out or runs[0].path)}
    return compare(arms(runs), out or Path("report"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server_app.report", description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    ap.add_argument("--out", type=Path, help="where plots go (one run: its dir; several: ./report)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    try:
        rep = report(a.run_dirs, a.out)
    except NotARunDir as e:
        print(f"server_app.report: {e}", file=sys.stderr)
        return NOT_A_RUN_DIR
    except ValueError as e:  # the runs cannot be compared (fl_app.plots says why)
        print(f"server_app.report: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(rep, indent=1))
    elif "run" in rep:
        _print_one(rep["run"], rep["plots"])
    else:
        _print_arms(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
