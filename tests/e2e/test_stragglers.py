"""Stragglers through `flwr run` (issue 39): over-selection without faults keeps the run's bits, a
client made slow on purpose (`faults.straggler_*`) is dropped at `federation.round_deadline_s`
and its round completes with the others, and a resume after that round is exact.

Two ClientApps run at once (`client-resources-num-cpus=1` on the 2-core default): a sleeping
straggler holds one, the other serves every other message. The deadline is well above a normal
round (its fits take turns on the nodes' one lane, after the straggler's late fit), the
straggler wakes just after it, so its late answer reaches a later round, which discards it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.config import load_config
from fl_app.rundir import RunDir
from fl_app.weights import Manifest
from partitions.uniform import sampling_seed
from server_app.strategy import ClientSampler

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"
NODES = "num-supernodes=2 client-resources-num-cpus=1"
DEADLINE_S, SLEEP_S = 45, 50  # a round without faults: 7-12 s (2 loaded cores)


def _sample(rnd: int) -> list[int]:
    """Round `rnd`'s clients with one over-selected, as the server draws them."""
    cfg = load_config(str(RECIPE))
    f = cfg.federation
    seed = sampling_seed(cfg.run.seed, f.sampling_seed)
    return ClientSampler(seed=seed, num_clients=f.clients, per_round=f.clients_per_round, over_select=1).sample(rnd)


def _digests(run_dir: Path, rnd: int) -> list[str]:
    return [s.digest for s in Manifest.from_dir(RunDir(run_dir).member_dir(rnd)).shards]


@pytest.fixture(scope="module")
def fl(tmp_path_factory):
    with flower(tmp_path_factory.mktemp("flwr")) as fr:
        yield fr


def _run(fl, run_dir: Path, rounds: int, **keys: Any) -> tuple[list[dict[str, Any]], str]:
    """A complete `flwr run` of the e2e recipe: its metrics rows and its output."""
    p = fl.run(run_config(RECIPE, run_dir, rounds=rounds, **keys), timeout_s=1500, federation_config=NODES)
    out = p.stdout + p.stderr
    status = run_status(run_dir)
    assert status.returncode == 0, status.stdout + out[-4000:]
    return RunDir(run_dir).read_metrics(), out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_over_selection_without_faults_aggregates_the_clients_and_bits_of_a_run_without_it(fl, tmp_path):
    plain, _ = _run(fl, tmp_path / "plain", 1)
    over, _ = _run(fl, tmp_path / "over", 1, **{"federation.over_select": 1})
    drawn = _sample(1)
    assert plain[1]["clients"] == drawn[:2] and over[1]["clients"] == drawn
    assert over[1]["spare"] == drawn[2:] and "failed" not in over[1] and "dropped" not in over[1]
    assert over[1]["train_num-examples"] == plain[1]["train_num-examples"]
    assert _digests(tmp_path / "over", 1) == _digests(tmp_path / "plain", 1)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_straggler_is_dropped_at_the_deadline_and_a_resume_after_its_round_is_exact(fl, tmp_path):
    """Round 1 draws a, b and over-selects r; b sleeps: at the deadline the round closes with a and
    r (the first two replies in sample order), b is dropped and named with its reason."""
    a, b, r = _sample(1)
    keys = {
        "federation.over_select": 1,
        "federation.round_deadline_s": DEADLINE_S,
        "faults.straggler_clients": f'"[{b}]"',  # a list travels as a TOML string, read as YAML
        "faults.straggler_rounds": '"[1]"',
        "faults.straggler_s": SLEEP_S,
    }
    rows, out = _run(fl, tmp_path / "uninterrupted", 3, **keys)
    row = rows[1]
    assert row["clients"] == [a, b, r] and row["dropped"] == [b] and "spare" not in row, row
    (failed,) = row["failed"]
    assert failed["client"] == b and failed["reason"] == (
        f"straggler: no reply at the {DEADLINE_S} s deadline (federation.round_deadline_s)"
    )
    assert DEADLINE_S <= row["wall_s"] < SLEEP_S
    (line,) = [x for x in out.splitlines() if "straggler: no reply" in x]
    assert f"dropped client {b} (node {failed['node']})" in line
    assert f"round 1: client {b}'s late answer" in out  # pulled by a later round and discarded
    assert all("failed" not in row and len(row["spare"]) == 1 for row in rows[2:]), rows[2:]
    assert not RunDir(tmp_path / "uninterrupted").client_dir(1, b).exists()  # its late upload, removed

    resumed = tmp_path / "resumed"
    _run(fl, resumed, 1, **keys)
    rows, out = _run(fl, resumed, 3, **keys)
    assert "resuming after round 1" in out and rows[1]["dropped"] == [b]
    assert _digests(resumed, 3) == _digests(tmp_path / "uninterrupted", 3)
