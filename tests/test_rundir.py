"""Run directory (invariant 6): resume is keyed on what is on disk, partial rounds are moved
aside (never deleted), rounds beyond the configured total are refused, no fabricated final round."""
from __future__ import annotations

import json

import matplotlib.image
import pytest
import torch

from fl_app.plots import plot_validation
from fl_app.rundir import MARKER, RunDir, RunDirError
from fl_app.store import DirStore
from fl_app.weights import save_shards

SHARD = 1 << 16


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))}


def _finish(run: RunDir, r: int, **metrics) -> None:
    for m in run.members:
        save_shards(_weights(r), run.member_dir(r, m), SHARD)
    run.complete_round(r, {"val_success": r / 10, **metrics})


def _run_with(tmp_path, complete: int, members=("actor",)) -> RunDir:
    run = RunDir(tmp_path / "run", total_rounds=10, members=members)
    for r in range(complete + 1):
        _finish(run, r)
    return run


def _relaunch(run: RunDir, total_rounds: int) -> int | None:
    """What the ServerApp does at start: open the run dir with the configured T and resume."""
    return RunDir(run.path, total_rounds=total_rounds, members=run.members).prepare_resume()


def _crash_during(run: RunDir, r: int) -> None:
    """What a run that dies in round r leaves: client uploads, maybe the aggregate, a metrics line, no marker."""
    save_shards(_weights(100 + r), run.client_dir(r, 1) / "actor", SHARD)
    save_shards(_weights(200 + r), run.member_dir(r), SHARD)
    with open(run.metrics_path, "a") as f:
        f.write(json.dumps({"round": r, "val_success": 0.99}) + "\n")


def test_resume_picks_highest_complete_round_on_disk(tmp_path):
    run = _run_with(tmp_path, complete=3)
    _crash_during(run, 4)
    assert run.rounds_on_disk() == [0, 1, 2, 3, 4]
    assert run.last_complete_round() == 3
    assert _relaunch(run, total_rounds=10) == 3
    assert run.rounds_on_disk() == [0, 1, 2, 3]
    assert RunDir(tmp_path / "fresh", total_rounds=10).prepare_resume() is None  # start at round 0


def test_resume_scan_is_not_bounded_by_the_configured_total(tmp_path):
    # Field log "find_resume_round": a smaller schedule pointed at a populated dir must not
    # "find nothing" and move every completed round aside; it is refused, nothing touched.
    run = _run_with(tmp_path, complete=5)
    before = sorted(p.name for p in run.rounds_dir.iterdir())
    with pytest.raises(RunDirError) as e:
        _relaunch(run, total_rounds=2)
    msg = str(e.value)
    assert "rounds up to 5" in msg and "rounds=2" in msg
    assert "raise `rounds`" in msg and "new run dir" in msg and "move the rounds above 2" in msg
    assert sorted(p.name for p in run.rounds_dir.iterdir()) == before
    assert run.last_complete_round() == 5


def test_run_dir_with_a_partial_round_beyond_total_is_refused(tmp_path):
    run = _run_with(tmp_path, complete=2)
    _crash_during(run, 3)
    with pytest.raises(RunDirError, match="rounds up to 3"):
        _relaunch(run, total_rounds=2)
    assert run.round_dir(3).is_dir()  # not moved: the user chooses the way out
    assert _relaunch(run, total_rounds=3) == 2  # raising `rounds` is one way out


def test_partial_rounds_are_moved_aside_never_deleted(tmp_path):
    run = _run_with(tmp_path, complete=1)
    _crash_during(run, 2)
    (moved,) = run.quarantine_partials()
    assert moved.parent == run.rounds_dir and moved.name.startswith("round-0002.partial-")
    assert (moved / "clients" / "client-0001" / "actor" / "manifest.json").is_file()
    assert (moved / "actor" / "manifest.json").is_file()
    _crash_during(run, 2)  # the re-run dies again, in the same second
    (again,) = run.quarantine_partials()
    assert again != moved and again.exists() and moved.exists()
    assert run.rounds_on_disk() == [0, 1]


def test_rerun_round_cannot_pick_up_a_dead_attempts_uploads(tmp_path):
    # Field log "RESUME could FedAvg a dead attempt's checkpoint": a re-run round starts empty.
    run = _run_with(tmp_path, complete=2)
    _crash_during(run, 3)
    store = DirStore(run.path, SHARD)
    dead_key = run.store_key(run.client_dir(3, 1) / "actor")
    assert store.exists(dead_key)
    assert _relaunch(run, total_rounds=5) == 2
    assert not store.exists(dead_key) and not run.round_dir(3).exists()
    save_shards(_weights(7), run.client_dir(3, 1) / "actor", SHARD)  # the re-run's own upload
    assert torch.equal(store.get(dead_key)["w"], _weights(7)["w"])


def test_metrics_beyond_the_resume_point_are_dropped(tmp_path):
    run = _run_with(tmp_path, complete=3)
    _crash_during(run, 4)
    with open(run.metrics_path, "a") as f:
        f.write('{"round": 5, "val_succ')  # torn append
    assert _relaunch(run, total_rounds=10) == 3
    rows = run.read_metrics()
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["val_success"] == pytest.approx(0.3)
    _finish(run, 4)
    assert [r["round"] for r in run.read_metrics()] == [0, 1, 2, 3, 4]


def test_round_is_complete_only_with_its_marker_and_required_members(tmp_path):
    run = RunDir(tmp_path / "ppo", members=("actor", "critic"))
    save_shards(_weights(0), run.member_dir(0, "actor"), SHARD)
    with pytest.raises(RunDirError, match="'critic' has no complete weights"):
        run.complete_round(0, {})
    assert not run.is_complete(0) and not (run.round_dir(0) / MARKER).exists()
    save_shards(_weights(0), run.member_dir(0, "critic"), SHARD)
    run.complete_round(0, {"val_success": 0.5})
    assert run.is_complete(0)
    marker = json.loads((run.round_dir(0) / MARKER).read_text())
    assert marker["round"] == 0 and marker["metrics"] == {"val_success": 0.5} and marker["time"].endswith("Z")
    assert set(marker["members"]) == {"actor", "critic"}


def test_actor_only_rounds_are_not_silently_resumed_as_ppo(tmp_path):
    _run_with(tmp_path, complete=2)  # a GRPO run dir: rounds hold only the actor
    ppo = RunDir(tmp_path / "run", members=("actor", "critic"))
    assert ppo.last_complete_round() is None
    with pytest.raises(RunDirError, match="without required member 'critic'"):
        _relaunch(ppo, total_rounds=5)
    assert ppo.rounds_on_disk() == [0, 1, 2]  # refused, not quarantined


def test_weights_replaced_after_completion_break_the_round(tmp_path):
    run = _run_with(tmp_path, complete=1)
    manifest = run.member_dir(1) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"max_shard_bytes": 65536', '"max_shard_bytes": 65537'))
    assert not run.is_complete(1) and run.last_complete_round() == 0
    with pytest.raises(RunDirError, match="replaced after the round completed"):
        _relaunch(run, total_rounds=3)


def test_rounds_complete_in_order_once(tmp_path):
    run = _run_with(tmp_path, complete=0)
    save_shards(_weights(2), run.member_dir(2), SHARD)
    with pytest.raises(RunDirError, match="next one is 1"):
        run.complete_round(2, {})
    with pytest.raises(RunDirError, match="next one is 1"):
        run.complete_round(0, {})


def test_summary_refuses_to_label_an_incomplete_round_final(tmp_path):
    # Field log "fabricated round T": a run that died mid-loop has no final round.
    run = _run_with(tmp_path, complete=2)
    _crash_during(run, 3)
    with pytest.raises(RunDirError, match="refusing to label round 3 final"):
        run.write_summary({"val_success": 0.7, "final_round": 3})
    summary = json.loads(run.write_summary({"val_success": 0.7}).read_text())
    assert summary["final_round"] is None and summary["last_complete_round"] == 2
    summary = json.loads(run.write_summary({"x": torch.tensor(1.5), "final_round": 2}).read_text())
    assert summary["final_round"] == 2 and summary["x"] == 1.5


def test_client_uploads_are_dropped_only_after_the_round_completes(tmp_path):
    run = _run_with(tmp_path, complete=0)
    save_shards(_weights(1), run.client_dir(1, 4) / "actor", SHARD)
    with pytest.raises(RunDirError, match="not complete"):
        run.drop_client_uploads(1)
    save_shards(_weights(1), run.member_dir(1), SHARD)
    run.complete_round(1, {})
    run.drop_client_uploads(1)
    assert not (run.round_dir(1) / "clients").exists() and run.is_complete(1)


def test_plot_validation_writes_a_png(tmp_path):
    run = RunDir(tmp_path / "run")
    for r in range(6):
        save_shards(_weights(r), run.member_dir(r), SHARD)
        run.complete_round(r, {"val_success": r / 10, "train_success": r / 8} if r % 2 == 0 else
                           {"train_success": r / 8})
    out = plot_validation(run.metrics_path, tmp_path / "plots" / "validation.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 400 and height > 200
    with pytest.raises(ValueError, match="no 'val_reward' values"):
        plot_validation(run.metrics_path, tmp_path / "x.png", val_key="val_reward")
