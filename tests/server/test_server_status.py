"""`python -m server_app.status` (issue 18, item 5; issue 37) and the one-line errors summary.json
carries (issue 18, item 4): what scripts and CI read, since `flwr run` exits 0 after a failed run.
Real run dirs, real heartbeats (the `beating` thread, a killed server process), the real CLI."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fl_app.rundir import RunDir
from fl_app.weights import Manifest, save_shards
from server_app.errors import one_line
from server_app.liveness import STALE_S, _proc_ns, beating, start_ticks
from server_app.status import (
    COMPLETE,
    CORRUPT,
    DEAD,
    FAILED,
    NOT_A_RUN_DIR,
    UNFINISHED,
    main,
    run_status,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
CODES = {COMPLETE, FAILED, UNFINISHED, NOT_A_RUN_DIR, DEAD, CORRUPT}


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


def _beat(rd: RunDir, **fields: object) -> None:
    """A heartbeat as the ServerApp writes it (this process by default), with `fields` changed."""
    pid = os.getpid()
    beat = {"run_id": 5, "pid": pid, "start_ticks": start_ticks(pid), "proc_ns": _proc_ns(), "host": "here"}
    rd.write_heartbeat({**beat, "beat_at": time.time(), "stopped_at": None, **fields})


def test_exit_codes_follow_the_summary_the_heartbeat_and_the_disk(tmp_path):
    assert _cli(tmp_path / "nope").returncode == NOT_A_RUN_DIR
    rd = _run_dir(tmp_path, 2)
    assert run_status(rd.path)[0] == UNFINISHED  # no summary and no heartbeat yet: not started
    with beating(rd, 5, print):
        rd.write_summary({"status": "running", "target_rounds": 2})
        p = _cli(rd.path)
        assert p.returncode == UNFINISHED and "2 of 2 rounds done" in p.stdout, p.stdout
        assert f"running (ServerApp pid {os.getpid()} on " in p.stdout
        rd.write_summary({"status": "complete", "final_round": 2})
        assert run_status(rd.path)[0] == UNFINISHED  # its server has not finished yet
    p = _cli(rd.path)
    assert p.returncode == COMPLETE and "complete, 2 rounds (round 2 verified)" in p.stdout, p.stdout
    save_shards({"w": torch.zeros(4)}, rd.member_dir(3), 1 << 20)  # the dir moved on after the summary
    rd.complete_round(3, {})
    code, line, _ = run_status(rd.path)
    assert code == CORRUPT and "highest complete round on disk is 3" in line


def test_a_failed_run_exits_1_with_its_one_line_error_and_log(tmp_path):
    rd = _run_dir(tmp_path, 1)
    rd.write_summary({"status": "failed", "error": "RoundError: round 2: client 3 failed", "error_log": "/x/log"})
    p = _cli(rd.path, "--json")
    out = json.loads(p.stdout)
    assert p.returncode == FAILED and out["exit_code"] == FAILED and out["outcome"] == "failed"
    assert "failed after round 1: RoundError: round 2: client 3 failed (full log: /x/log)" in out["line"]
    (rd.path / "summary.json").write_text("{not json")
    p = _cli(rd.path)
    assert p.returncode == CORRUPT and p.stdout.startswith("unreadable: ") and "summary.json: not JSON" in p.stdout


def test_wait_returns_when_the_run_ends(tmp_path):
    rd = _run_dir(tmp_path, 1)

    def server(summary: dict, started: threading.Event) -> None:
        with beating(rd, 5, print, every_s=0.1):
            rd.write_summary({"status": "running", "target_rounds": 1})
            started.set()
            time.sleep(0.5)
            rd.write_summary(summary)

    for summary, code in (({"status": "complete", "final_round": 1}, COMPLETE), ({"status": "running"}, DEAD)):
        started = threading.Event()
        thread = threading.Thread(target=server, args=(summary, started))
        thread.start()
        assert started.wait(10)
        t0 = time.monotonic()
        got, line, _ = wait_for(rd.path, timeout_s=30, poll_s=0.1)
        thread.join()
        assert got == code and time.monotonic() - t0 < 10, line
    with beating(rd, 5, print):
        rd.write_summary({"status": "running", "target_rounds": 1})
        assert wait_for(rd.path, timeout_s=0.3, poll_s=0.1)[0] == UNFINISHED


SERVER = """
import sys, time
from pathlib import Path
from fl_app.rundir import RunDir
from server_app.liveness import beating
rd = RunDir(Path(sys.argv[1]))
with beating(rd, 9, print, every_s=0.2):
    rd.write_summary({"status": "running", "target_rounds": 3})
    print("running", flush=True)
    time.sleep(600)
"""


def test_a_killed_server_is_dead_at_once_with_the_way_to_resume(tmp_path):
    rd = _run_dir(tmp_path, 1)
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(rd.path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "running"
        p = _cli(rd.path)
        assert p.returncode == UNFINISHED and f"pid {server.pid}" in p.stdout, p.stdout
        waiter = subprocess.Popen(
            [sys.executable, "-m", "server_app.status", str(rd.path), "--wait", "120"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(3.0)  # the waiter polls a running run
        assert waiter.poll() is None
        server.send_signal(signal.SIGKILL)  # no finally runs: the beat keeps saying running
        server.wait(10)
        t0 = time.monotonic()
        out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == DEAD and time.monotonic() - t0 < 10, out
        assert json.loads(rd.heartbeat_path.read_text())["stopped_at"] is None
    finally:
        server.kill()
        server.wait(10)
    line = out.strip()
    assert "\n" not in line and "dead after round 1: the summary says running but its ServerApp" in line
    assert f"(pid {server.pid} on " in line
    assert "is gone; resume: rerun the same `flwr run` command with the same run-dir" in line


def test_a_reused_pid_or_a_silent_host_is_dead_and_a_fresh_beat_from_elsewhere_alive(tmp_path):
    rd = _run_dir(tmp_path, 1)
    rd.write_summary({"status": "running", "target_rounds": 3})
    _beat(rd)
    assert run_status(rd.path)[0] == UNFINISHED
    _beat(rd, start_ticks=start_ticks(os.getpid()) - 1)  # this pid, but not the process that beat
    code, line, _ = run_status(rd.path)
    assert code == DEAD and f"its ServerApp (pid {os.getpid()} on here) is gone" in line
    _beat(rd, proc_ns="another-host/pid:[1]", beat_at=time.time() - 5)  # no pid to ask: the age decides
    assert run_status(rd.path)[0] == UNFINISHED
    _beat(rd, proc_ns="another-host/pid:[1]", beat_at=time.time() - STALE_S - 5)
    code, line, _ = run_status(rd.path)
    assert code == DEAD and "no heartbeat from its ServerApp (pid" in line and f"for {STALE_S + 5:.0f} s" in line


def test_a_server_that_stops_without_its_final_summary_is_dead(tmp_path):
    rd = _run_dir(tmp_path, 1)
    with pytest.raises(RuntimeError), beating(rd, 5, print):
        raise RuntimeError("refused to resume")  # e.g. prepare_resume refused: no summary was written
    code, line, _ = run_status(rd.path)
    assert code == DEAD and "dead before it started: its ServerApp" in line and "`flwr log 5`" in line
    rd.write_summary({"status": "running", "target_rounds": 3})  # an earlier attempt's summary
    code, line, _ = run_status(rd.path)
    assert code == DEAD and "stopped just now" in line
    rd.heartbeat_path.unlink()  # a summary no server vouches for
    code, line, _ = run_status(rd.path)
    assert code == DEAD and "there is no heartbeat.json" in line


def test_a_heartbeat_that_cannot_be_written_stops_the_server_before_it_runs(tmp_path):
    (tmp_path / "run").write_text("a file, not a dir")
    ran = []
    with pytest.raises(OSError), beating(RunDir(tmp_path / "run"), 5, print):
        ran.append(1)
    assert not ran


def test_beats_are_refreshed_and_the_last_one_says_stopped(tmp_path):
    rd = RunDir(tmp_path / "run")
    with beating(rd, 5, print, every_s=0.05):
        first = json.loads(rd.heartbeat_path.read_text())
        time.sleep(0.5)
        later = json.loads(rd.heartbeat_path.read_text())
        assert later["beat_at"] > first["beat_at"] and later["stopped_at"] is None
    last = json.loads(rd.heartbeat_path.read_text())
    assert last["stopped_at"] is not None and last["pid"] == os.getpid() and last["run_id"] == 5


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_complete_only_when_the_final_round_verifies_and_nothing_below_it_is_missing(tmp_path):
    rd = _run_dir(tmp_path, 3)
    rd.write_summary({"status": "complete", "final_round": 3})
    assert run_status(rd.path)[0] == COMPLETE
    shard = rd.member_dir(3) / Manifest.from_dir(rd.member_dir(3)).shards[0].file
    _flip_a_byte(shard)  # bit rot after the run: marker and manifest still match
    code, line, _ = run_status(rd.path)
    assert code == CORRUPT and "complete at round 3, but its checkpoint fails verification" in line, line
    assert shard.name in line and "resume moves round 3 aside and redoes it" in line
    assert rd.rounds_on_disk() == [0, 1, 2, 3]  # status moves nothing
    _flip_a_byte(shard)
    assert run_status(rd.path)[0] == COMPLETE
    (rd.round_dir(1) / "COMPLETE").unlink()  # a gap below the final round
    code, line, _ = run_status(rd.path)
    assert code == CORRUPT and "round(s) [1] below it are missing or incomplete" in line, line
    assert str(rd.round_dir(1) / "COMPLETE") + " is missing or invalid" in line
    (rd.round_dir(1)).rename(rd.rounds_dir / "elsewhere")
    code, line, _ = run_status(rd.path)
    assert code == CORRUPT and f"{rd.round_dir(1)} is missing" in line


def test_a_bad_command_line_is_one_line_and_not_the_running_code(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "server_app.status", "--wait"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == NOT_A_RUN_DIR and len(p.stdout.splitlines()) == 1 and not p.stderr, p


# ---- arbitrary files: a documented exit code and one line, never a traceback -----------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ANY = JSON | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text()


@st.composite
def _near(draw: st.DrawFn, fields: dict[str, st.SearchStrategy]) -> dict:
    """A document shaped like the real file, with up to two fields dropped or given any value."""
    doc = draw(st.fixed_dictionaries(fields))
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        if draw(st.booleans()):
            del doc[key]
        else:
            doc[key] = draw(ANY)
    return doc


SUMMARIES = _near(
    {
        "status": st.sampled_from(["running", "complete", "failed", "paused"]),
        "final_round": st.sampled_from([0, 1, 2, None]),
        "target_rounds": st.integers(0, 9),
        "error": st.text(),
        "error_log": st.text(),
        "members": st.sampled_from([["actor"], ["actor", "critic"], [], ["../x"]]),
    }
)
BEATS = _near(
    {
        "run_id": st.integers(0, 9),
        "pid": st.sampled_from([os.getpid(), 1, 2**22 + 7]),
        "start_ticks": st.sampled_from([start_ticks(os.getpid()), 0, None]),
        "proc_ns": st.sampled_from([_proc_ns(), "", "other/pid:[1]"]),
        "host": st.text(),
        "beat_at": st.sampled_from([0.0, -10.0, -STALE_S - 10, 1e9]).map(lambda ago: time.time() + ago),
        "stopped_at": st.none() | st.floats(allow_nan=False, allow_infinity=False),
    }
)
FILE = st.none() | st.binary(max_size=200) | JSON.map(json.dumps) | st.text().map(str.encode)


def _contents(doc: st.SearchStrategy) -> st.SearchStrategy:
    """No file, arbitrary bytes or JSON (1 in 4), or a near-real document."""
    return st.integers(0, 3).flatmap(lambda i: FILE if i == 0 else doc.map(lambda d: json.dumps(d).encode()))


@pytest.fixture(scope="module")
def fuzzed_dir(tmp_path_factory) -> RunDir:
    return _run_dir(tmp_path_factory.mktemp("fuzz"), 1)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(summary=_contents(SUMMARIES), beat=_contents(BEATS))
def test_any_summary_and_heartbeat_get_a_documented_exit_code_and_one_line(fuzzed_dir, summary, beat):
    rd = fuzzed_dir
    for path, data in ((rd.summary_path, summary), (rd.heartbeat_path, beat)):
        path.unlink(missing_ok=True)
        if data is not None:
            path.write_bytes(data if isinstance(data, bytes) else data.encode())
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(rd.path)])
    text = out.getvalue()
    event(f"exit {code}")
    assert code in CODES and text.endswith("\n") and text.count("\n") == 1, text
    assert text[:-1].isprintable() and "Traceback" not in text, text  # no ANSI code, no control character
    if code == COMPLETE:  # only ever for what the disk proves: rounds 0..1, final round 1
        doc = json.loads(summary)
        assert doc["status"] == "complete" and doc["final_round"] == 1


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
