"""Compressed updates resume exactly (fl_app.quant, issue #38): a run killed mid-round, after some
clients uploaded and kept their round's error-feedback residual, redoes the round from the same
residuals its first attempt read (the newest of an earlier round), so every later round has the
uninterrupted run's bits; reading the killed attempt's own residual would not."""

from __future__ import annotations

from pathlib import Path

import torch

from fl_app.quant import Residuals, write_update
from fl_app.robust import Rule, aggregate_manifests
from fl_app.rundir import RunDir
from fl_app.weights import Manifest, load_shards, save_shards

SHARD = 20_000
MEMBERS = ("actor", "critic")
SAMPLED = {1: (0, 1), 2: (1, 2), 3: (0, 2)}  # client 0 skips round 2: round 3 reads its round-1 residual
RULE = Rule(update="delta-int8")


def _open(path: Path) -> RunDir:
    return RunDir(path, total_rounds=3, members=MEMBERS)


def _fit(rd: RunDir, res: Residuals, r: int, c: int, m: str) -> Manifest:
    """Client c's round-r fit of member m as its trainer service does it: a trained model (a pure
    function of the global model, round and client), its update with the newest earlier residual."""
    base = Manifest.from_dir(rd.member_dir(r - 1, m))
    w = load_shards(base)
    g = torch.Generator().manual_seed(100 * r + c)
    x = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in w.items()}
    _, residual = res.read(c, m, r)
    out = rd.client_dir(r, c) / m
    manifest, new = write_update(base, w, x, residual, "delta-int8", 64, out)
    res.write(c, m, r, new, SHARD)
    return manifest


def _play(rd: RunDir, res: Residuals, r: int, fits: tuple[int, ...] | None = None) -> None:
    """Round r: round 0 the initial model; later rounds the sampled clients' fits, the trimmed
    FedAvg of their decoded updates, COMPLETE. `fits`: only these fits, then killed."""
    if r == 0:
        for m in MEMBERS:
            g = torch.Generator().manual_seed(len(m))
            save_shards(
                {"w": torch.randn(9000, generator=g), "b": torch.randn(70, generator=g)}, rd.member_dir(0, m), SHARD
            )
        rd.complete_round(0, {})
        return
    for c in SAMPLED[r] if fits is None else fits:
        for m in MEMBERS:
            _fit(rd, res, r, c, m)
    if fits is not None:
        return
    for m in MEMBERS:
        ups = [(Manifest.from_dir(rd.client_dir(r, c) / m), 1.0 + c) for c in SAMPLED[r]]
        aggregate_manifests(ups, rd.member_dir(r - 1, m), rd.member_dir(r, m), SHARD, RULE)
    rd.complete_round(r, {})


def _digests(rd: RunDir, r: int) -> dict[str, list[str]]:
    return {m: [s.digest for s in Manifest.from_dir(rd.member_dir(r, m)).shards] for m in MEMBERS}


def test_a_run_killed_mid_round_redoes_it_from_the_same_residuals_bit_for_bit(tmp_path):
    cache = tmp_path / "node-cache"  # one node's weight cache, shared by both runs (keyed by run dir)
    whole = _open(tmp_path / "whole")
    for r in range(4):
        _play(whole, Residuals(cache, whole.path), r)
    killed = _open(tmp_path / "killed")
    res = Residuals(cache, killed.path)
    for r in range(2):
        _play(killed, res, r)
    _play(killed, res, 2, fits=(1,))  # client 1 fitted round 2 and kept its residual; then the kill
    assert res.read(1, "actor", 3)[0] == 2  # the killed attempt's residual is on the node
    resumed = _open(killed.path)
    assert resumed.prepare_resume() == 1
    for r in (2, 3):
        _play(resumed, Residuals(cache, resumed.path), r)
    for r in (1, 2, 3):
        assert _digests(resumed, r) == _digests(whole, r), r
    # the rule matters: client 1's redo from its own killed attempt's residual uploads other bits
    base = Manifest.from_dir(whole.member_dir(1, "actor"))
    w = load_shards(base)
    g = torch.Generator().manual_seed(200 + 1)
    x = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in w.items()}
    right, _ = res.read(1, "actor", 2)
    assert right == 1
    _, own = Residuals(cache, whole.path).read(1, "actor", 3)  # round 2's residual
    wrong, _ = write_update(base, w, x, own, "delta-int8", 64, tmp_path / "wrong")
    uploaded = Manifest.from_dir(resumed.client_dir(2, 1) / "actor")
    assert [s.digest for s in wrong.shards] != [s.digest for s in uploaded.shards]
