"""Kill a part of a real run at a random point, then resume: the final weights must be bit-identical
to an uninterrupted run's (issue 18, item 10).

Parts: the trainer service (SIGKILL mid-work: the client's fit fails and is re-dispatched, or
the round fails and a rerun resumes), the ClientApp (the Ray actor that runs it), and the server
(the SuperLink with the ServerApp's simulation runtime: the server machine dies). After each,
the same `flwr run` command is rerun until `python -m server_app.status` says complete; a
failed attempt must have left a one-line root cause in summary.json, never a traceback or ANSI
codes. The seed of the random points is printed (`FEDAGENT_FAULT_SEED` replays it).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import psutil
import pytest
from flower_harness import ROOT, flower, run_config, run_status, sigkill

from fl_app.rundir import RunDir
from fl_app.weights import Manifest
from server_app.local_superlink import find_superlink

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"
ROUNDS = 3
KINDS = ("trainer service", "ClientApp", "server")


def _digests(run_dir: Path) -> list[str]:
    return [s.digest for s in Manifest.from_dir(RunDir(run_dir).member_dir(ROUNDS)).shards]


def _targets(fr, kind: str) -> list[psutil.Process]:
    if kind == "server":
        sl = find_superlink(fr.home)
        return [sl] if sl else []
    out = []
    for p in fr.own_processes():
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if kind == "trainer service" and cmd[1:3] == ["-m", "client_app.service"]:
            out.append(p)
        elif kind == "ClientApp" and "ClientAppActor" in " ".join(cmd):
            out.append(p)
    return out


def _mean_round_s(run_dir: Path) -> float:
    """The mean wall time of a finished run's rounds after round 0."""
    rows = [r for r in RunDir(run_dir).read_metrics() if r["round"] > 0]
    return sum(r["wall_s"] for r in rows) / len(rows)


def _last(rd: RunDir) -> int:
    last = rd.last_complete_round() if rd.path.exists() else None
    return -1 if last is None else last


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_a_kill_at_a_random_point_then_resume_gives_the_uninterrupted_weights(tmp_path):
    seed = int(os.environ.get("FEDAGENT_FAULT_SEED", time.time_ns() % 2**31))
    rng = random.Random(seed)
    print(f"\nfault seed {seed}")
    report = []
    with flower(tmp_path / "flwr") as fr:
        ref_dir = tmp_path / "uninterrupted"
        p = fr.run(run_config(RECIPE, ref_dir, rounds=ROUNDS), timeout_s=2400)
        assert run_status(ref_dir).returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        reference = _digests(ref_dir)
        # the kill lands in the first half of the round after `after`: a delay in seconds longer
        # than the rounds left would find the run already finished, with nothing to kill
        round_s = _mean_round_s(ref_dir)
        for kind in KINDS:
            run_dir = tmp_path / kind.replace(" ", "-")
            log = tmp_path / f"{kind.replace(' ', '-')}.log"
            proc = fr.start(run_config(RECIPE, run_dir, rounds=ROUNDS), log)
            rd = RunDir(run_dir, total_rounds=ROUNDS)
            after, delay = rng.randint(0, ROUNDS - 1), rng.uniform(0.0, 0.5 * round_s)
            deadline = time.monotonic() + 2400
            while _last(rd) < after:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            time.sleep(delay)
            targets: list[psutil.Process] = []
            while not targets and proc.poll() is None and time.monotonic() < deadline:
                targets = _targets(fr, kind)
                time.sleep(0.2)
            killed_in = rd.last_complete_round()
            if targets:
                sigkill(rng.choice(targets), tree=kind == "server")
            try:
                proc.wait(timeout=900)
            except Exception:  # noqa: BLE001 - a stream that outlived its server is ended here
                proc.kill()
                proc.wait()
            attempts = 1
            while run_status(run_dir).returncode != 0:
                summary = json.loads((run_dir / "summary.json").read_text())
                if summary["status"] == "failed":
                    error = summary["error"]
                    assert "\n" not in error and "\x1b" not in error and len(error) <= 600, error
                    assert Path(summary["error_log"]).exists()
                assert attempts < 4, log.read_text()[-3000:]
                fr.run(run_config(RECIPE, run_dir, rounds=ROUNDS), timeout_s=2400)
                attempts += 1
            report.append(
                f"{kind}: killed {'a process' if targets else 'nothing (none found)'} after round "
                f"{killed_in} (+{delay:.1f} s); complete after {attempts} attempt(s)"
            )
            assert targets, f"no {kind} process to kill"
            assert _digests(run_dir) == reference, f"{kind}: resumed weights differ from the uninterrupted run"
    print("\n".join(report))
