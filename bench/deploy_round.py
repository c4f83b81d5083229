"""A one-SuperNode deployment round against the same round in simulation, back to back.

    python -m bench.deploy_round                       # tests/fixtures/e2e-recipe.yaml, 3 rounds
    python -m bench.deploy_round --rounds 4 --json out.json --keep /tmp/deploy-round   # keep the run dirs

Runs the recipe once per arm, one after the other on this machine: `flwr run .` as a simulation
with one virtual SuperNode, then a real loopback `flower-superlink` and one SuperNode
(`tests/flower_harness.py`) three ways: `flower-supernode` in Flower's default subprocess
isolation (every message starts a `flwr-clientapp` process); `flower-supernode --isolation
process` beside `client_app.superexec` (every message a fork of a warm process, Flower's 3 s
idle polls); `client_app.node` (those forks, idle polls of 0.2 s, object pulls that retry after
50 ms: docs/deployment.md).
Compares the mean `wall_s` of the rounds after the first (round 1 pays the lane's start) and
splits what one `flwr-clientapp` process pays before it can serve a message (`python -X
importtime`): the interpreter, Flower's own modules, torch, and the rest of ours.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import emit
from fl_app.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from flower_harness import deployment, flower, run_config  # noqa: E402

CLIENTAPP = "flwr.supernode.cli.flwr_clientapp"  # what `flwr-clientapp` imports first


def round_walls(run_dir: Path) -> dict[int, float]:
    return {r["round"]: r["wall_s"] for r in RunDir(run_dir).read_metrics() if r["round"] >= 1}


def steady_mean(walls: dict[int, float]) -> float:
    """Mean round time after the first round (which starts the lane)."""
    later = [w for rnd, w in walls.items() if rnd > min(walls)] or list(walls.values())
    return sum(later) / len(later)


def clientapp_imports() -> dict[str, float]:
    """Seconds a fresh `flwr-clientapp` process spends importing: Flower's modules, torch (via
    our app), the rest of our app, and the whole process (interpreter start included)."""
    code = f"import {CLIENTAPP}, client_app.app"
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True)
    total = time.perf_counter() - t0
    cumulative: dict[str, float] = {}
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if m:  # a module may show twice (nested in its package's import, then on its own): the larger
            cumulative[m.group(3)] = max(cumulative.get(m.group(3), 0.0), int(m.group(1)) / 1e6)
    app, torch = cumulative.get("client_app.app", 0.0), cumulative.get("torch", 0.0)
    return {
        "process_s": round(total, 2),
        "flower_s": round(cumulative.get(CLIENTAPP, 0.0), 2),
        "torch_s": round(torch, 2),
        "ours_without_torch_s": round(app - torch, 2),
    }


ARMS = {"simulation": None, "deployment": "subprocess", "deployment-fork": "fork", "deployment-node": "node"}


def run_arms(recipe: Path, rounds: int, work: Path, timeout_s: float, arms: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"recipe": str(recipe), "rounds": rounds}
    for arm in arms:
        run_dir = work / "runs" / arm
        if ARMS[arm] is None:
            with flower(work / "flwr-sim") as fr:
                p = fr.run(run_config(recipe, run_dir, rounds=rounds), timeout_s, federation_config="num-supernodes=1")
        else:
            with deployment(work / arm, nodes=1, isolation=ARMS[arm]) as d:
                p = d.run(run_config(recipe, run_dir, rounds=rounds), timeout_s)
        assert p.returncode == 0 and round_walls(run_dir), p.stdout[-3000:] + p.stderr[-3000:]
        walls = round_walls(run_dir)
        rounded = {r: round(w, 2) for r, w in walls.items()}
        out[arm] = {"round_s": rounded, "steady_mean_s": round(steady_mean(walls), 2)}
    if "simulation" in out:
        base = out["simulation"]["steady_mean_s"]
        out["ratio_to_simulation"] = {a: round(out[a]["steady_mean_s"] / base, 3) for a in arms if a != "simulation"}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.deploy_round", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "tests" / "fixtures" / "e2e-recipe.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="run in this (new) dir and keep its run dirs and logs")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    a = ap.parse_args(argv)
    report: dict[str, Any] = {"clientapp_imports": clientapp_imports()}
    with tempfile.TemporaryDirectory(prefix="deploy-round-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=a.keep is None)  # --keep names a new dir; the temp dir exists
        report.update(run_arms(a.recipe.resolve(), a.rounds, work, a.timeout_s, a.arms.split(",")))
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return emit(report, a.json)


if __name__ == "__main__":
    sys.exit(main())
