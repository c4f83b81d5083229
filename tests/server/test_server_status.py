"""`python -m server_app.status` (issue 18, item 5) and the one-line errors summary.json carries
(item 4): what scripts and CI read, since `flwr run` exits 0 after a failed run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from fl_app.rundir import RunDir
from fl_app.weights import save_shards
from server_app.errors import one_line
from server_app.status import COMPLETE, FAILED, UNFINISHED, UNKNOWN, run_status, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _run_dir(tmp_path: Path, rounds: int) -> RunDir:
    rd = RunDir(tmp_path / "run", total_rounds=3)
    for r in range(rounds + 1):
        save_shards({"w": torch.full((4,), float(r))}, rd.member_dir(r), 1 << 20)
        rd.complete_round(r, {"val_success": 0.5})
    return rd


def _cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server_app.status", str(run_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_exit_codes_follow_the_summary_and_the_disk(tmp_path):
    assert _cli(tmp_path / "nope").returncode == UNKNOWN
    rd = _run_dir(tmp_path, 2)
    assert run_status(rd.path)[0] == UNFINISHED  # no summary yet
    rd.write_summary({"status": "running", "target_rounds": 2})
    p = _cli(rd.path)
    assert p.returncode == UNFINISHED and "running, 2 of 2 rounds done" in p.stdout
    rd.write_summary({"status": "complete", "final_round": 2})
    p = _cli(rd.path)
    assert p.returncode == COMPLETE and "complete, 2 rounds" in p.stdout, p.stdout
    save_shards({"w": torch.zeros(4)}, rd.member_dir(3), 1 << 20)  # the dir moved on after the summary
    rd.complete_round(3, {})
    assert run_status(rd.path)[0] == UNKNOWN


def test_a_failed_run_exits_1_with_its_one_line_error_and_log(tmp_path):
    rd = _run_dir(tmp_path, 1)
    rd.write_summary({"status": "failed", "error": "RoundError: round 2: client 3 failed", "error_log": "/x/log"})
    p = _cli(rd.path, "--json")
    out = json.loads(p.stdout)
    assert p.returncode == FAILED and out["exit_code"] == FAILED
    assert "failed after round 1: RoundError: round 2: client 3 failed (full log: /x/log)" in out["line"]
    (rd.path / "summary.json").write_text("{not json")
    assert _cli(rd.path).returncode == UNKNOWN


def test_wait_returns_when_the_run_ends(tmp_path):
    rd = _run_dir(tmp_path, 1)
    rd.write_summary({"status": "running", "target_rounds": 1})
    flip = threading.Timer(0.5, lambda: rd.write_summary({"status": "complete", "final_round": 1}))
    flip.start()
    t0 = time.monotonic()
    code, line, _ = wait_for(rd.path, timeout_s=30, poll_s=0.1)
    assert code == COMPLETE and time.monotonic() - t0 < 10, line
    rd.write_summary({"status": "running", "target_rounds": 1})
    assert wait_for(rd.path, timeout_s=0.3, poll_s=0.1)[0] == UNFINISHED


RAY_TRACEBACK = "\n".join(
    [
        "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=4242, ip=10.0.0.1)",
        "Traceback (most recent call last):",
        '  File "/x/flwr/simulation/ray_transport/ray_actor.py", line 60, in run',
        "    out_message = app(message=message, context=context)",
        *[f'  File "/x/frame{i}.py", line {i}, in f' for i in range(300)],
        "client_app.lane.ServiceError: trainer service for lane cpu failed during /fit: [Errno 104] Connection "
        "reset by peer; its log ends:",
        "2026-12-04 service[9] fit 3 (round 2, client 7): load 0.1 s",
        "\x1b[31mThe above exception was the direct cause of the following exception:\x1b[0m",
        "ray.exceptions.RayTaskError(ClientAppException): \x1b[36mray::ClientAppActor.run()\x1b[39m",
        "  class_name: ClientAppActor",
    ]
)


def test_one_line_keeps_the_root_cause_and_drops_ansi_and_tracebacks():
    line = one_line(RAY_TRACEBACK)
    assert "\x1b" not in line and "\n" not in line and len(line) <= 600
    assert line.startswith("client_app.lane.ServiceError: trainer service for lane cpu failed during /fit"), line
    flower = f"<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'{RAY_TRACEBACK}'>"
    assert one_line(flower) == line
    bare = "ClientAppException: \nException ClientAppException occurred. Message: WeightsError: bad shard"
    assert one_line(bare) == "WeightsError: bad shard"
    wrapped = (
        "<class 'client_app.lane.ServiceRequestError'>:<'trainer service /fit failed (HTTP 422): "
        "WeightsError: /r/x: no manifest.json'>"
    )
    assert one_line(wrapped) == (
        "ServiceRequestError: trainer service /fit failed (HTTP 422): WeightsError: /r/x: no manifest.json"
    )
    clientapp = (
        f"{RAY_TRACEBACK}\n\nThe above exception was the direct cause of the following exception:\n"
        "ray::ClientAppActor.run()\nflwr.clientapp.client_app.ClientAppException: \nException "
        "ClientAppException occurred. Message: trainer service for lane cpu failed during /fit: Server "
        "disconnected without sending a response.; its log ends:\n2026-12-04 service[9] fit 3"
    )
    assert one_line(f"<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'{clientapp}'>") == (
        "trainer service for lane cpu failed during /fit: Server disconnected without sending a response.; "
        "its log ends:"
    )
    assert one_line("") == "unknown error (no message)"
    assert one_line("x" * 5000).endswith("...") and len(one_line("x" * 5000)) == 600
