"""`python -m server_app.local_superlink status|stop` find the SuperLink by the FLWR_HOME it was
started with, never by a port alone (issue 18, item 9): on a shared machine the port this
environment would use may belong to someone else's SuperLink."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from envs.ports import choose_free_port

ROOT = Path(__file__).resolve().parents[2]
SUPERLINK = str(Path(sys.executable).with_name("flower-superlink"))


def _start_local_superlink(home: Path, port: int) -> subprocess.Popen:
    """A SuperLink started the way `flwr run` starts its local one (flwr/cli/local_superlink.py)."""
    log = home / "local-superlink" / "superlink.log"
    log.parent.mkdir(parents=True)
    proc = subprocess.Popen(
        [
            SUPERLINK,
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--control-api-address",
            f"127.0.0.1:{choose_free_port()}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-file",
            str(log),
        ],
        env={**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"flower-superlink exited: {log.read_text()[-2000:]}"
        time.sleep(0.3)
    raise AssertionError("flower-superlink did not start")


def _cli(action: str, home: Path, port: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)}
    return subprocess.run(
        [sys.executable, "-m", "server_app.local_superlink", action],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def someone_elses(tmp_path):
    home, port = tmp_path / "theirs", choose_free_port()
    proc = _start_local_superlink(home, port)
    yield home, port, proc
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait()


def test_stop_and_status_never_touch_a_superlink_of_another_flwr_home_on_our_port(tmp_path, someone_elses):
    theirs, port, proc = someone_elses
    mine = tmp_path / "mine"
    status = _cli("status", mine, port)
    assert f"no local SuperLink of {mine}" in status.stdout, status.stdout + status.stderr
    stop = _cli("stop", mine, port)
    assert f"no local SuperLink of {mine}" in stop.stdout
    time.sleep(0.5)
    assert proc.poll() is None, "stop killed the SuperLink of another FLWR_HOME that held this port"
    status = _cli("status", theirs, port)
    assert f"pid {proc.pid}" in status.stdout
    stop = _cli("stop", theirs, port)
    assert f"pid {proc.pid}" in stop.stdout
    proc.wait(timeout=30)
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
