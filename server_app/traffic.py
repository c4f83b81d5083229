"""Flower's own count of a deployment run's traffic, recorded in its summary.json beside ours.

    python -m server_app.traffic runs/<name>                 # the default SuperLink connection
    python -m server_app.traffic runs/<name> SUPERLINK --json

Flower 1.42 counts each run's Fleet API traffic in the SuperLink: every message a SuperNode pulls
or pushes (the request's and the response's protobuf size) and every object of it (its bytes).
The ServerApp cannot read that count (its Runtime API has no call that returns it; `grid.run` is
the run as it was at start), so this reads it after the run through Flower's CLI, the supported
path (`flwr ls --run-id ID --format json`, its `network-traffic`), writes it into summary.json
as `flower_traffic` and prints it beside ours: `message_bytes`, the Flower messages of the run's
calls as the Fleet API carries them (`client_app.fleet_bytes`; Flower's outbound is our
down, its inbound our up), and the weight bytes (`bytes_down`/`bytes_up`: with a weight store
the store's, which Flower never sees). docs/deployment.md ("Traffic") gives measured numbers.

Exit 0 when the two counts agree within `--tolerance` (default 5%) each way, 1 when they do not,
3 when the run dir or Flower's count cannot be read (a run that has not finished, a simulation:
its messages never cross the Fleet API and Flower counts nothing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_app.accounting import run_weight_bytes
from fl_app.host import FlowerMissing, require_flwr
from fl_app.rundir import RunDir
from server_app.errors import one_line

TOLERANCE = 0.05
UNREADABLE = 3
WAYS = {"down": "outbound_bytes", "up": "inbound_bytes"}  # ours: the nodes' view; Flower's: the SuperLink's


class TrafficError(Exception):
    """The run dir or Flower's count cannot be read; the message says why and what to do."""


def read_flower_traffic(run_id: int, superlink: str | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    """Flower's count of run `run_id` (`flwr ls --run-id ID --format json`, the SuperLink
    connection `superlink` or the default one of $FLWR_HOME): its inbound and outbound bytes.
    A run that has not finished is refused (its count still grows), and so is a run Flower
    counted nothing for (a simulation)."""
    cmd = [require_flwr(), "ls", *([superlink] if superlink else []), "--run-id", str(run_id), "--format", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    try:
        out = json.loads(p.stdout)
    except ValueError:
        raise TrafficError(f"`{' '.join(cmd[1:])}` printed no JSON: {one_line(p.stdout + p.stderr)}") from None
    if not out.get("success") or not out.get("runs"):
        raise TrafficError(f"`flwr ls` could not read run {run_id}: {one_line(str(out.get('error-message', out)))}")
    run = out["runs"][0]
    if not str(run["status"]).startswith("finished"):
        raise TrafficError(
            f"run {run_id} is {run['status']}: Flower's count is final only once the run finished "
            "(wait for it: python -m server_app.status RUN_DIR --wait 3600)"
        )
    traffic = run["network-traffic"]
    inbound, outbound = int(traffic["inbound-bytes"]), int(traffic["outbound-bytes"])
    if inbound == 0 and outbound == 0:
        raise TrafficError(
            f"Flower counted no traffic for run {run_id}: a simulation (its messages never cross the "
            "Fleet API, which is where Flower counts); ours (message_bytes in summary.json) is the only count"
        )
    return {"run_id": run_id, "inbound_bytes": inbound, "outbound_bytes": outbound, "status": run["status"]}


def compare(message_bytes: Mapping[str, int], flower: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Ours (`message_bytes`: down, up) against Flower's count (`flower_traffic`) each way: both,
    the difference (Flower's less ours) and its share of Flower's."""
    out = {}
    for way, key in WAYS.items():
        ours, theirs = int(message_bytes[way]), int(flower[key])
        out[way] = {"ours": ours, "flower": theirs, "diff": theirs - ours, "rel": (theirs - ours) / theirs}
    return out


def agrees(comparison: Mapping[str, Mapping[str, float]], tolerance: float = TOLERANCE) -> bool:
    return all(abs(c["rel"]) <= tolerance for c in comparison.values())


def record(run_dir: Path, superlink: str | None = None) -> dict[str, Any]:
    """Read Flower's count of the run in `run_dir` (its summary's `run_id`), record it in
    summary.json as `flower_traffic`, and return the comparison with ours."""
    rd = RunDir(run_dir)
    try:
        summary = json.loads(rd.summary_path.read_text())
    except (OSError, ValueError) as e:
        raise TrafficError(f"{run_dir}: no readable summary.json ({e}): pass the run dir `flwr run` wrote") from None
    if summary.get("status") != "complete" or "message_bytes" not in summary:
        raise TrafficError(
            f"{run_dir}: summary.json has no message_bytes (status {summary.get('status')!r}): only a run that "
            "completed has its count of the Flower messages to compare"
        )
    flower = read_flower_traffic(int(summary["run_id"]), superlink)
    flower["read_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rd.write_summary({**summary, "flower_traffic": flower})
    rows = [r for r in rd.read_metrics() if r["round"] >= summary.get("first_round", 0)]
    weights = run_weight_bytes(rows)
    return {
        "run_id": flower["run_id"],
        "messages": compare(summary["message_bytes"], flower),
        "weights": compare(weights, flower),
    }


def _print(rep: Mapping[str, Any], tolerance: float) -> None:
    print(f"run {rep['run_id']}: Flower's count of its Fleet traffic against ours (its Flower messages)")
    for way, c in rep["messages"].items():
        print(
            f"  {way:>4}: Flower {c['flower']} B, ours {c['ours']} B, Flower counts {c['diff']:+d} B "
            f"({100 * c['rel']:+.2f}%)"
        )
    verdict = "agree" if agrees(rep["messages"], tolerance) else "DO NOT agree"
    print(f"  the counts {verdict} within {100 * tolerance:g}% each way")
    print("  the weights alone (bytes_down/bytes_up; through a weight store Flower never sees them):")
    for way, c in rep["weights"].items():
        print(f"  {way:>4}: {c['ours']} B ({100 * c['ours'] / c['flower']:.1f}% of Flower's count)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server_app.traffic", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    ap.add_argument("superlink", nargs="?", help="the SuperLink connection `flwr ls` uses (default: its default)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="the largest relative difference that agrees")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    a = ap.parse_args(argv)
    try:
        rep = record(a.run_dir, a.superlink)
    except (TrafficError, FlowerMissing, subprocess.TimeoutExpired) as e:
        print(f"server_app.traffic: {e}", file=sys.stderr)
        return UNREADABLE
    if a.json:
        print(json.dumps(rep, indent=1))
    else:
        _print(rep, a.tolerance)
    return 0 if agrees(rep["messages"], a.tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
