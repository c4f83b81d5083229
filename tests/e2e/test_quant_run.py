"""A real run uploading compressed updates (`federation.update: delta-int8`, issue #38): every
client's bytes up are its int8 update (about 3.8x fewer than its fp32 model, counted where they
travelled), the global model stays fp32 and finite (and moves down as a step from round 2 on),
a client's second fit starts from its error feedback residual; and a run stopped after round 1 and
resumed gives the uninterrupted run's bits (the nodes keep their residuals: fl_app.quant.Residuals)."""

from __future__ import annotations

import json

import pytest
import torch
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.rundir import RunDir
from fl_app.weights import Manifest, load_shards

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"
INT8 = {"federation.update": '"delta-int8"', "clients": 2}  # 2 of 2 clients: round 2 reads round 1's residuals


@pytest.mark.slow  # three tiny runs: 206 s on the 2-core box
def test_a_delta_int8_run_sends_a_quarter_of_the_bytes_up_and_resumes_to_the_uninterrupted_bits(tmp_path):
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    with flower(tmp_path / "flwr") as fr:
        out = []
        for run_dir, rounds in ((whole, 2), (stopped, 1), (stopped, 2)):
            p = fr.run(run_config(RECIPE, run_dir, rounds=rounds, **INT8), timeout_s=1500)
            status = run_status(run_dir)
            assert p.returncode == 0 and status.returncode == 0, status.stdout + p.stdout[-4000:] + p.stderr[-4000:]
            out.append(p.stdout)
    assert "resuming after round 1" in out[2], out[2][-4000:]
    rd = RunDir(whole, total_rounds=2)
    rows = rd.read_metrics()
    model = Manifest.from_dir(rd.member_dir(0)).tensor_bytes
    for r in rows[1:]:
        for c in r["per_client"].values():  # round 2's global model: only its step, or nothing (fl_app.downlink)
            assert c["bytes_down"]["actor"] == model if r["round"] == 1 else c["bytes_down"]["actor"] < model / 3.7
            assert 3.7 < model / c["bytes_up"]["actor"] < 3.8, (model, c["bytes_up"])  # 256 / 68 at block 64
        assert model * len(r["clients"]) / sum(r["bytes_up"].values()) > 3.7
    assert rows[1]["train_ef_residual_zeros"] == 1 and rows[2]["train_ef_residual_zeros"] == 0, rows
    state = load_shards(rd.member_dir(2))
    assert all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in state.values())
    for r in (1, 2):
        got, want = Manifest.from_dir(RunDir(stopped).member_dir(r)), Manifest.from_dir(rd.member_dir(r))
        assert [s.digest for s in got.shards] == [s.digest for s in want.shards], r
    print(json.dumps([{k: r.get(k) for k in ("round", "bytes_up", "bytes_down", "val_success")} for r in rows]))
