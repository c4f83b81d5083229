"""Compressed downloads resume exactly (fl_app.downlink, issue #38): the server's residual is round
state, sealed in the round's COMPLETE marker with the step, so a run killed while compressing a
round and resumed redoes it from the previous round's residual and every later round has the
uninterrupted run's bits (every shard of every member, step and residual); a run dir of another
update mode is refused, and redoing a round from zeros instead of the residual would give other bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_app import downlink
from fl_app.quant import write_update
from fl_app.robust import Rule, aggregate_manifests
from fl_app.rundir import RunDir, RunDirError
from fl_app.weights import Manifest, load_shards, save_shards

SHARD = 20_000
MEMBERS = ("actor", "critic")
RULE = Rule(update="delta-int8")


def _open(path: Path, update: str = "delta-int8") -> RunDir:
    state = downlink.state_entries(MEMBERS) if update != "full" else ()
    return RunDir(path, total_rounds=3, members=MEMBERS, opt_state=state)


def _aggregate(rd: RunDir, r: int) -> None:
    """Round r's exact model of every member: two clients' int8 updates from round r - 1's global
    model (pure functions of it), FedAvg-decoded into the round's member dir, as the server does."""
    for m in MEMBERS:
        base = Manifest.from_dir(rd.member_dir(r - 1, m))
        w = load_shards(base)
        ups = []
        for c in (0, 1):
            g = torch.Generator().manual_seed(100 * r + c)
            x = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in w.items()}
            up, _ = write_update(base, w, x, None, "delta-int8", 64, rd.client_dir(r, c) / m)
            ups.append((up, 1.0 + c))
        aggregate_manifests(ups, rd.member_dir(r - 1, m), rd.member_dir(r, m), SHARD, RULE)


def _play(rd: RunDir, r: int) -> None:
    if r == 0:
        for m in MEMBERS:
            g = torch.Generator().manual_seed(len(m))
            save_shards(
                {"w": torch.randn(9000, generator=g), "b": torch.randn(70, generator=g)}, rd.member_dir(0, m), SHARD
            )
    else:
        _aggregate(rd, r)
        downlink.compress_round(rd, r, "delta-int8", 64)
    rd.complete_round(r, {})


def _digests(rd: RunDir, r: int) -> dict[str, list[str]]:
    dirs = {m: rd.member_dir(r, m) for m in MEMBERS}
    dirs.update({e: rd.opt_state_dir(r, e) for e in downlink.state_entries(MEMBERS)})
    return {k: [s.digest for s in Manifest.from_dir(d).shards] for k, d in dirs.items()}


def test_a_run_killed_while_compressing_a_round_resumes_to_the_uninterrupted_bits(tmp_path):
    whole = _open(tmp_path / "whole")
    for r in range(4):
        _play(whole, r)
    killed = _open(tmp_path / "killed")
    for r in range(2):
        _play(killed, r)
    _aggregate(killed, 2)
    downlink.compress_round(killed, 2, "delta-int8", 64)  # round 2's step and residual written; killed before COMPLETE
    resumed = _open(killed.path)
    assert resumed.prepare_resume() == 1
    for r in (2, 3):
        _play(resumed, r)
    for r in (1, 2, 3):
        assert _digests(resumed, r) == _digests(whole, r), r
    marker = resumed.marker(3)
    assert marker is not None and set(marker) == set(MEMBERS)
    # the residual matters: round 2 redone from zeros instead of round 1's residual moves other bits
    zeros = _open(tmp_path / "zeros")
    for r in range(2):
        _play(zeros, r)
    _aggregate(zeros, 2)
    for m in MEMBERS:
        outs = [tmp_path / "zeros-out" / f"{p}-{m}" for p in ("step", "global", "residual")]
        _, glob = downlink.server_step(zeros.member_dir(1, m), zeros.member_dir(2, m), None, *outs, "delta-int8", 64)
        assert [s.digest for s in glob.shards] != _digests(whole, 2)[m]


def test_a_delta_run_dir_is_not_resumed_under_full_updates_nor_the_reverse(tmp_path):
    rd = _open(tmp_path / "run")
    for r in range(2):
        _play(rd, r)
    with pytest.raises(RunDirError, match="downlink/actor/residual"):
        _open(rd.path, "full").prepare_resume()
    full = RunDir(tmp_path / "full", total_rounds=3, members=MEMBERS, opt_state=())
    for m in MEMBERS:
        save_shards({"w": torch.zeros(10)}, full.member_dir(0, m), SHARD)
    full.complete_round(0, {})
    for m in MEMBERS:
        save_shards({"w": torch.ones(10)}, full.member_dir(1, m), SHARD)
    full.complete_round(1, {})
    with pytest.raises(RunDirError, match="update the run was started with"):
        _open(full.path).prepare_resume()
