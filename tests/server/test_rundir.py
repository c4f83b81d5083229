"""Run directory (invariant 6): resume is keyed on what is on disk, partial rounds are moved
aside (never deleted), rounds beyond the configured total are refused, no fabricated final round."""

from __future__ import annotations

import json
import os
import shutil

import matplotlib.image
import pytest
import torch

from fl_app.channel.run_dir import DirStore
from fl_app.paths import PathEscapeError
from fl_app.plots import plot_validation
from fl_app.rundir import MARKER, RunDir, RunDirError, sibling_member
from fl_app.weights import Manifest, save_shards

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
        run.complete_round(
            r, {"val_success": r / 10, "train_success": r / 8} if r % 2 == 0 else {"train_success": r / 8}
        )
    out = plot_validation(run.metrics_path, tmp_path / "plots" / "validation.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 400 and height > 200
    with pytest.raises(ValueError, match="no 'val_reward' values"):
        plot_validation(run.metrics_path, tmp_path / "x.png", val_key="val_reward")

    # outcome shares (labels come and go between rounds) add a stacked panel below the curve
    shares = run.path / "with_outcomes.jsonl"
    shares.write_text(
        "\n".join(
            json.dumps(
                {"round": r, "val_success": r / 10, "val_outcome_won": r / 10, f"val_outcome_miss{r % 2}": 1 - r / 10}
            )
            for r in range(4)
        )
    )
    stacked = plot_validation(shares, tmp_path / "stacked.png")
    assert matplotlib.image.imread(stacked).shape[0] > 1.5 * height


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x20
    path.write_bytes(bytes(data))


def _shard(run: RunDir, r: int, member: str = "actor"):
    return run.member_dir(r, member) / Manifest.from_dir(run.member_dir(r, member)).shards[0].file


def test_resume_reads_the_resume_rounds_shards_and_moves_a_corrupt_round_aside(tmp_path):
    run = _run_with(tmp_path, complete=3, members=("actor", "critic"))
    _flip_last_byte(_shard(run, 3, "critic"))  # bit rot: marker and manifest still match
    _flip_last_byte(_shard(run, 2))
    fresh = RunDir(run.path, total_rounds=10, members=run.members)
    assert fresh.prepare_resume() == 1  # 3 and 2 are corrupt: resume after round 1
    aside = sorted(p.name for p in run.rounds_dir.iterdir() if ".corrupt-" in p.name)
    assert [n[:10] for n in aside] == ["round-0002", "round-0003"]  # renamed, never deleted
    assert run.rounds_on_disk() == [0, 1]
    assert [str(p.name)[:10] for p, _ in fresh.moved_aside] == ["round-0003", "round-0002"]
    assert "corrupt" in fresh.moved_aside[0][1]
    assert [row["round"] for row in run.read_metrics()] == [0, 1]
    _finish(run, 2)  # the re-run round writes into a fresh dir
    assert run.last_complete_round() == 2


def test_a_corrupt_round_zero_restarts_from_scratch(tmp_path):
    run = _run_with(tmp_path, complete=0)
    (run.member_dir(0) / Manifest.from_dir(run.member_dir(0)).shards[0].file).unlink()
    assert _relaunch(run, total_rounds=3) is None
    assert run.rounds_on_disk() == [] and any(
        p.name.startswith("round-0000.corrupt-") for p in run.rounds_dir.iterdir()
    )


@pytest.mark.parametrize("how", ["deleted", "marker removed"])
def test_a_gap_below_the_last_complete_round_is_refused_naming_the_ways_out(tmp_path, how):
    run = _run_with(tmp_path, complete=3)
    if how == "deleted":
        shutil.rmtree(run.round_dir(2))
    else:
        (run.round_dir(2) / MARKER).unlink()
    before = sorted(p.name for p in run.rounds_dir.iterdir())
    with pytest.raises(RunDirError) as e:
        _relaunch(run, total_rounds=10)
    msg = str(e.value)
    assert "round(s) [2] are missing or incomplete below the last complete round 3" in msg
    assert "put the missing round dirs back" in msg and "move rounds 2..3 aside" in msg and "new run dir" in msg
    assert sorted(p.name for p in run.rounds_dir.iterdir()) == before  # nothing touched
    os.rename(run.round_dir(3), run.rounds_dir / "round-0003.moved")  # way out (2)
    assert _relaunch(run, total_rounds=10) == 1


@pytest.mark.parametrize(
    "marker",
    [
        "{not json",
        "[]",
        '{"members": []}',
        '{"members": {"actor": 3}}',
        '{"members": {"actor": {}}}',
        "{}",
        '{"members": {"actor": {"manifest_sha256": 5}}}',
        "\udcff",
    ],
)
def test_malformed_markers_are_run_dir_errors_naming_the_file(tmp_path, marker):
    run = _run_with(tmp_path, complete=1)
    path = run.round_dir(1) / MARKER
    path.write_bytes(marker.encode("utf-8", "surrogateescape"))
    for call in (
        lambda: _relaunch(run, total_rounds=5),
        lambda: run.recorded_members(1),
        lambda: sibling_member(run.member_dir(1), "critic"),
    ):
        with pytest.raises(RunDirError, match=str(path)):
            call()
    assert run.rounds_on_disk() == [0, 1]  # refused, nothing moved


@pytest.mark.parametrize(
    "manifest",
    ["{", '{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": 5, "shards": 7}', "null"],
)
def test_a_malformed_member_manifest_is_a_run_dir_error_naming_it(tmp_path, manifest):
    run = _run_with(tmp_path, complete=1)
    (run.member_dir(1) / "manifest.json").write_text(manifest)
    with pytest.raises(RunDirError, match=str(run.member_dir(1) / "manifest.json")):
        _relaunch(run, total_rounds=5)


def test_a_metrics_line_that_is_not_a_row_is_a_run_dir_error(tmp_path):
    run = _run_with(tmp_path, complete=1)
    with open(run.metrics_path, "a") as f:
        f.write("[1, 2]\n" + json.dumps({"round": 1}) + "\n")
    with pytest.raises(RunDirError, match=r"metrics.jsonl:3 is not a metrics row"):
        _relaunch(run, total_rounds=5)


def test_round_and_client_dirs_are_never_read_or_written_through_a_symlink_out_of_the_run_dir(tmp_path):
    run = _run_with(tmp_path, complete=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, run.round_dir(2))  # a planted rounds/round-0002 -> outside
    with pytest.raises(PathEscapeError):
        run.member_dir(2)  # the server's aggregate target
    with pytest.raises(PathEscapeError):
        run.client_dir(2, 3)  # a client's upload dir
    with pytest.raises(PathEscapeError):
        _relaunch(run, total_rounds=5)  # resume does not read through it either
    os.unlink(run.rounds_dir / "round-0002")
    run.metrics_path.rename(run.path / "metrics.real")
    os.symlink(outside / "m.jsonl", run.path / "metrics.jsonl")
    with pytest.raises(PathEscapeError):
        _finish(run, 2)
    os.symlink(outside / "planted", run.path / "summary.json.tmp")
    os.unlink(run.path / "metrics.jsonl")
    run.write_summary({"status": "x"})  # a planted tmp link is replaced, not written through
    assert not (outside / "planted").exists() and not (outside / "m.jsonl").exists()
    assert json.loads(run.summary_path.read_text())["status"] == "x"
