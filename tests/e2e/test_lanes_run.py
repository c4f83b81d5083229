"""Issue 41, items 1 and 3: virtual clients on several CPU lanes, through the real `flwr run`.

Two simulation actors (`client-resources-num-cpus=1` on the box's 2 cores) and three CPU lanes
(`run.cpu_lanes=3`): each round's two fits lease two lanes and run at the same time (their
lane spans, epoch seconds from the ClientApp, overlap), the third lane serves nothing and is
reported idle, and the global models are the bits of the same run on the one default lane
(invariant 39). Both runs pin each trainer to one torch thread (`FEDAGENT_CPU_THREADS=1`):
the thread count changes the order of fp32 reductions, and a lane's share of the cores
depends on how many lanes run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.host import CPU_THREADS_VAR
from fl_app.rundir import RunDir
from fl_app.weights import Manifest

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"
TWO_ACTORS = "num-supernodes=2 client-resources-num-cpus=1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """run dir and output of the two-round run on 1 and on 3 CPU lanes."""
    out = {}
    with flower(tmp_path_factory.mktemp("flwr")) as fr:
        fr.env[CPU_THREADS_VAR] = "1"
        for lanes in (1, 3):
            run_dir = tmp_path_factory.mktemp(f"lanes{lanes}") / "r"
            rc = run_config(RECIPE, run_dir, rounds=2, **{"run.cpu_lanes": lanes})
            p = fr.run(rc, timeout_s=1500, federation_config=TWO_ACTORS)
            status = run_status(run_dir)
            assert p.returncode == 0 and status.returncode == 0, status.stdout + p.stdout[-4000:] + p.stderr[-4000:]
            out[lanes] = (run_dir, p.stdout + p.stderr)
    return out


def test_a_round_s_fits_run_at_once_on_two_cpu_lanes_and_the_third_is_idle(runs):
    """A lane serves one fit at a time; two fits of a round overlap (a round's first fits may
    not: the second actor may still be importing); the lane nobody needed is idle."""
    run_dir, output = runs[3]
    overlapped = 0
    for row in RunDir(run_dir, total_rounds=2).read_metrics()[1:]:
        (a, b) = row["per_client"].values()
        assert a["devices"] == b["devices"] == ["cpu"] and {a["lane"], b["lane"]} <= {"cpu0", "cpu1"}
        if max(a["lane_span"][0], b["lane_span"][0]) < min(a["lane_span"][1], b["lane_span"][1]):
            assert a["lane"] != b["lane"], row["per_client"]
            overlapped += 1
    assert overlapped, "no round ran its two fits at once"
    summary = json.loads((run_dir / "summary.json").read_text())
    (served,) = summary["lanes"]["served"].values()
    assert sorted(served) == ["cpu0", "cpu1"] and sum(lane["fits"] for lane in served.values()) == 4
    assert list(summary["lanes"]["idle"].values()) == [["cpu2"]]
    assert "lanes idle" in output and "clients_per_round=2 is below the 3 lanes" in output, output[-4000:]
    assert sum(s["stopped"] for s in summary["services"]) == 2  # both lanes that served stopped once


def test_the_lanes_a_fit_ran_on_do_not_change_the_global_models(runs):
    for rnd in (1, 2):
        one, three = (Manifest.from_dir(RunDir(runs[n][0]).member_dir(rnd)) for n in (1, 3))
        assert [s.digest for s in one.shards] == [s.digest for s in three.shards], rnd


def test_one_cpu_lane_is_the_lane_cpu_and_idles_nothing(runs):
    """The default: every fit on the one lane `cpu`; the round walls of both runs are printed."""
    for n, (run_dir, _) in sorted(runs.items()):
        rows = RunDir(run_dir, total_rounds=2).read_metrics()[1:]
        print(f"\n{n} CPU lane(s): round walls {[round(r['wall_s'], 1) for r in rows]} s")
        if n == 1:
            assert all(f["lane"] == "cpu" for r in rows for f in r["per_client"].values())
    summary = json.loads((runs[1][0] / "summary.json").read_text())
    assert list(summary["lanes"]["served"].values()) == [{"cpu": {"fits": 4, "devices": ["cpu"]}}]
    assert summary["lanes"]["idle"] == {}
