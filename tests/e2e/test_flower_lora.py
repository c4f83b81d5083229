"""`federation.update: lora` through the real thing (`flwr run`, ServerApp, ClientApp, trainer
service, env service, tiny model): only the adapters travel and are checkpointed, every round
and the summary record the frozen base's digest, a round moves fewer bytes than full fp32 by
exactly the ratio of the tensors, and a resumed run ends on the uninterrupted run's bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.rundir import RunDir
from fl_app.weights import Manifest, load_shards

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"
LORA = {"federation.update": '"lora"', "federation.lora.rank": 2, "federation.lora.alpha": 4.0}
SUFFIXES = {"B": {".lora_B"}, "smaller": {".lora_A", ".lora_B"}}  # smaller: A on gate and up, B elsewhere


def _run(fr, run_dir: Path, rounds: int, **extra: object) -> str:
    p = fr.run(run_config(RECIPE, run_dir, rounds=rounds, **extra), timeout_s=1500)
    out = p.stdout + p.stderr
    status = run_status(run_dir)
    assert p.returncode == 0 and status.returncode == 0, status.stdout + out[-4000:] + fr.superlink_log()[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(2400)  # four `flwr run`s of the e2e recipe (1 + 1 + 2 + 1 rounds)
@pytest.mark.parametrize("trained", ["B", "smaller"])
def test_a_lora_run_moves_adapters_only_records_its_base_and_resumes_bit_for_bit(tmp_path, trained):
    resumed, fresh, full = tmp_path / "resumed", tmp_path / "fresh", tmp_path / "full"
    lora = {**LORA, "federation.lora.trained": f'"{trained}"'}
    with flower(tmp_path / "flwr") as fr:
        _run(fr, resumed, 1, **lora)
        out = _run(fr, resumed, 2, **lora)
        assert "resuming after round 1" in out, out[-4000:]
        _run(fr, fresh, 2, **lora)
        _run(fr, full, 1)
    rows = {d: RunDir(d, total_rounds=2).read_metrics() for d in (resumed, fresh)}
    base = rows[fresh][0]["base_sha256"]
    assert len(base) == 64 and all(r["base_sha256"] == base for d in rows for r in rows[d])
    assert json.loads((resumed / "summary.json").read_text())["base_sha256"] == base
    assert "base_sha256" not in RunDir(full, total_rounds=1).read_metrics()[1]  # full weights: no base

    rd, rd_full = RunDir(fresh), RunDir(full)
    adapters = load_shards(rd.member_dir(1))
    assert adapters and {name[name.rindex(".") :] for name in adapters} == SUFFIXES[trained]
    assert any(t.abs().max() > 0 for t in adapters.values())  # round 1 trained the factors from zeros
    want = load_shards(rd.member_dir(2))
    got = load_shards(RunDir(resumed).member_dir(2))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)

    lora_bytes = Manifest.from_dir(rd.member_dir(1)).tensor_bytes
    full_bytes = Manifest.from_dir(rd_full.member_dir(1)).tensor_bytes
    lora_row, full_row = rows[fresh][1], rd_full.read_metrics()[1]
    for row, size in ((lora_row, lora_bytes), (full_row, full_bytes)):
        assert all(c["bytes_down"]["actor"] == size == c["bytes_up"]["actor"] for c in row["per_client"].values())
    assert full_row["bytes_moved"] * lora_bytes == lora_row["bytes_moved"] * full_bytes  # inline: tensor bytes
    ratio = full_bytes / lora_bytes
    print(f"bytes per round: full {full_row['bytes_moved']}, lora {lora_row['bytes_moved']}: x{ratio:.1f}")
    assert ratio > 20
