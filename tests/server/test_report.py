"""`python -m server_app.report`: one run's summary, several runs grouped into arms by their
config (seeds of one recipe together) with a band plot, rows from before the accounting keys,
and clear refusals of what is not a run dir. Run dirs here are written as the ServerApp writes
them (metrics.jsonl rows, config.yaml, summary.json); the e2e test reports a real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from metrics_support import old_row

from fl_app.accounting import client_entry, client_traffic, round_accounting
from server_app.report import main, naming_keys, report

PNG = b"\x89PNG\r\n\x1a\n"


def _row(rnd: int, val: float) -> dict:
    """A round row with the accounting keys (two clients, 1000 bytes down and 600 up each)."""
    if rnd == 0:
        return {"round": 0, "val_success": val, "wall_s": 2.0, "bytes_down": {"actor": 1000}, "bytes_up": {}}
    metrics = {"load_s": 0.5, "rollout_s": 2.0, "update_s": 1.0, "fit_total_s": 4.0}
    traffic = client_traffic({"actor": 1000}, {"actor": 600}, 0.1, 4.5)
    clients = {c: client_entry({**metrics, **traffic}) for c in (1, 2)}
    server = {"train": 10.0, "aggregation": 0.5, "validation": 1.0}
    acc = round_accounting(clients, server, {"val_bytes_down_actor": 1000}, wall_s=12.0)
    return {"round": rnd, "clients": [1, 2], "val_success": val, "wall_s": 12.0, **acc}


def _run(root: Path, name: str, seed: int, vals: list[float], lr: float = 1e-4, rows=None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    rows = rows or [_row(r, v) for r, v in enumerate(vals)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"run": {"name": name, "seed": seed, "run_dir": str(d)}, "algo": {"lr": lr}, "federation": {"rounds": 2}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "summary.json").write_text(json.dumps({"status": "complete", "final_round": len(rows) - 1}))
    return d


def test_one_run_summary_has_validation_wall_phases_bytes_and_plots(tmp_path, capsys):
    d = _run(tmp_path, "a-s0", 0, [0.1, 0.4, 0.3])
    rep = report([d], None)
    s = rep["run"]
    assert (s["status"], s["rounds"], s["final_val_success"], s["best_val_success"], s["best_round"]) == (
        "complete",
        2,
        0.3,
        0.4,
        1,
    )
    assert s["wall_s_per_round"] == 12.0
    phases = s["phase_s_per_round"]
    assert phases["rollout"] == 4.0 and phases["dispatch"] == pytest.approx(1.8)  # 10 s less 2 x (4 s lane + 0.1 s)
    assert (s["bytes_down_per_round"], s["bytes_up_per_round"]) == (3000, 1200)
    assert (s["bytes_down_per_client"], s["bytes_up_per_client"]) == (1000, 600)
    for name in ("validation.png", "phases.png"):
        assert Path(rep["plots"][name]) == d / name and (d / name).read_bytes()[:8] == PNG
    assert main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "a-s0: complete, 2 rounds" in out and "rollout 4.00 s" in out and "phases.png" in out


def test_several_runs_form_arms_by_config_with_a_table_and_a_band_plot(tmp_path, capsys):
    runs = [
        _run(tmp_path, "a-s0", 0, [0.1, 0.4, 0.3]),
        _run(tmp_path, "a-s1", 1, [0.1, 0.2, 0.5]),
        _run(tmp_path, "b-s0", 0, [0.1, 0.6, 0.7], lr=3e-4),
    ]
    out = tmp_path / "out"
    rep = report(runs, out)
    assert set(rep["arms"]) == {"algo.lr=0.0001", "algo.lr=0.0003"}  # the seeds of one recipe: one arm
    a = rep["arms"]["algo.lr=0.0001"]
    assert len(a["runs"]) == 2 and a["final_val_success"]["mean"] == pytest.approx(0.4)
    assert a["final_val_success"]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert rep["arms"]["algo.lr=0.0003"]["final_val_success"] == {"mean": 0.7, "std": 0.0}
    assert (out / "bands.png").read_bytes()[:8] == PNG
    assert main([*map(str, runs), "--out", str(out)]) == 0
    assert "algo.lr=0.0001" in capsys.readouterr().out


def test_rows_from_before_the_accounting_keys_still_report(tmp_path):
    """A run dir written before per_client, bytes_down/up and phase_s: its fit sums and
    bytes_moved still give phases and bytes."""
    old = old_row(1, val_success=0.5)
    d = _run(tmp_path, "old", 0, [], rows=[{"round": 0, "val_success": 0.1, "wall_s": 1.0}, old])
    s = report([d], None)["run"]
    assert s["phase_s_per_round"]["rollout"] == 6.0 and s["phase_s_per_round"]["other"] == pytest.approx(2.0)
    assert (s["bytes_down_per_round"], s["bytes_up_per_round"]) == (2000, 2000)
    assert s["bytes_down_per_client"] is None
    assert (d / "phases.png").read_bytes()[:8] == PNG


def test_what_is_not_a_run_dir_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "missing")]) == 3
    assert "no such run dir" in capsys.readouterr().err
    assert main([str(tmp_path / "empty")]) == 3
    assert "no metrics.jsonl rows: not a run dir" in capsys.readouterr().err
    a = _run(tmp_path, "a", 0, [0.1, 0.2, 0.3])
    b = _run(tmp_path, "b", 1, [0.1, 0.2])  # validated other rounds: no band to draw
    assert main([str(a), str(b), "--out", str(tmp_path / "o")]) == 1
    assert "same rounds" in capsys.readouterr().err


def test_arms_are_named_by_the_fewest_keys_that_tell_them_apart():
    """A LoRA arm beside full and int8 ones differs in its update mode, rank, alpha and learning
    rate; the update mode alone names the three (a label of every differing key hid them)."""
    full = {"federation.update": "full", "federation.lora.rank": 8, "algo.lr": 2e-4, "run.seed": 0}
    int8 = {**full, "federation.update": "delta-int8", "run.seed": 1}
    lora = {**full, "federation.update": "lora", "federation.lora.rank": 4, "algo.lr": 1e-3}
    assert naming_keys([full, int8, lora]) == ["federation.update"]
    assert naming_keys([full, lora]) == ["algo.lr"]  # two values each: the first by name names both
    assert naming_keys([full, {**full, "run.seed": 3}]) == []  # seeds name no arm
    two = [{"a": 1, "b": 1}, {"a": 1, "b": 2}, {"a": 2, "b": 1}]
    assert naming_keys(two) == ["a", "b"]
