"""Issue #4's headline must-show, with issue #17's bar, as a newcomer runs it: `flwr run .` with
the embedded default (no run-config but a private run dir; a private SuperLink) completes its 9
rounds and the last round's validation success beats round 0's by >= 15 points. Measured
0.234 -> 0.422 (+18.8) on the 2-core AMD box with an empty model cache (README, "What the default
run shows"; another CPU model computes other bits, so another curve); the wall time is printed,
not asserted (speed lives in benchmarks)."""

from __future__ import annotations

import time

import pytest
from flower_harness import flower, run_status

from fl_app.rundir import RunDir
from tools import sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # one run is ~8-11 min on 2 cores, three ~20


def test_default_flwr_run_gains_15_points(tmp_path):
    run_dir = tmp_path / "run"
    with flower(tmp_path / "flwr") as fr:
        t0 = time.monotonic()
        p = fr.run(f'run-dir="{run_dir}"', timeout_s=3600)
        wall = time.monotonic() - t0
        status = run_status(run_dir)
        assert p.returncode == 0 and status.returncode == 0, (
            status.stdout + p.stdout[-4000:] + p.stderr[-4000:] + fr.superlink_log()[-4000:]
        )
    rows = RunDir(run_dir, total_rounds=9).read_metrics()
    curve = [round(r["val_success"], 3) for r in rows]
    print(f"\ndefault run: {wall:.0f} s, validation success by round {curve}")
    assert [r["round"] for r in rows] == list(range(10)), curve
    assert rows[-1]["val_success"] - rows[0]["val_success"] >= 0.15, curve


def test_the_default_learns_on_seeds_0_1_and_2(tmp_path):
    """Issue #40's three seeds, played as `python -m tools.sweep` plays them: two pinned one-thread
    runs at once, which compute the default's own bits (docs/trainer.md). Every seed must end at
    least one task of 64 above its round 0, and the mean gain must stay >= 8 points. Measured on
    the 2-core AMD box: +18.8, +6.2 and +4.7 (mean +9.9; README). The issue's bar, a mean of +15,
    is not met by the default yet (docs/trainer.md, what was tried); this guards what holds."""
    out = tmp_path / "sweep"
    argv = ["--arm", 'default=recipe="tiny-shop-grpo"', "--seeds", "0,1,2", "--jobs", "2", "--threads", "1"]
    assert sweep.main([*argv, "--out", str(out)]) == 0
    gains, curves = [], {}
    for seed in (0, 1, 2):
        rows = RunDir(out / f"default-s{seed}", total_rounds=9).read_metrics()
        assert [r["round"] for r in rows] == list(range(10))
        curves[seed] = [round(r["val_success"], 3) for r in rows]
        gains.append(rows[-1]["val_success"] - rows[0]["val_success"])
    print(f"\nthe default's seeds: {curves}; gains {[round(100 * g, 1) for g in gains]}")
    assert all(g >= 1 / 64 for g in gains), curves
    assert sum(gains) / 3 >= 0.08, curves
