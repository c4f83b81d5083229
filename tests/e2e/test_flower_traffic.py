"""Our traffic accounting against Flower's own count (issue 38): a real loopback deployment (a
`flower-superlink`, two SuperNodes) of the tiny recipe, 1 round, weights inline in the Flower
messages; `python -m server_app.traffic` reads Flower's count of the run through `flwr ls` and
records it in summary.json beside ours."""

from __future__ import annotations

import json
import subprocess
import sys

from flower_harness import ROOT, deployment, run_config, run_status

from fl_app.accounting import run_weight_bytes
from fl_app.rundir import RunDir
from server_app.traffic import TOLERANCE, agrees, compare

INLINE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"


def test_flower_s_count_of_a_deployment_run_agrees_with_our_message_bytes(tmp_path):
    """Flower counts every object and head of every message a SuperNode pulls and pushes; ours
    (`fleet_bytes`, per call and shutdown) counts the same messages: within 5% each way. The
    weights alone (what `bytes_down`/`bytes_up` count) miss the calls' records and the arrays'
    framing, and do not agree: the check can fail."""
    run_dir = tmp_path / "runs" / "r"
    with deployment(tmp_path, nodes=2) as d:
        p = d.run(run_config(INLINE, run_dir, rounds=1), timeout_s=1200)
        assert run_status(run_dir).returncode == 0, p.stdout[-3000:] + p.stderr[-2000:] + d.log("superlink")[-2000:]
        t = subprocess.run(
            [sys.executable, "-m", "server_app.traffic", str(run_dir), "--json"],
            env=d.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert t.returncode == 0, t.stdout + t.stderr
    rep = json.loads(t.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    flower = summary["flower_traffic"]
    assert flower["run_id"] == summary["run_id"] and flower["status"] == "finished:completed", flower
    print(json.dumps(rep["messages"], indent=1))
    for way, c in rep["messages"].items():
        assert abs(c["rel"]) <= TOLERANCE, (way, c)
    rows = RunDir(run_dir).read_metrics()
    weights = run_weight_bytes(rows)
    assert not agrees(compare(weights, flower)), compare(weights, flower)
    # every inline call carried its weights: the messages hold them and more
    assert all(m > w for m, w in zip(summary["message_bytes"].values(), weights.values(), strict=True))
