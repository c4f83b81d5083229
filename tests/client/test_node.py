"""client_app.node: one command starts a SuperNode with its warm SuperExec, stops that SuperExec
by PID on every way out, and naps at most `FEDAGENT_NODE_POLL_S` where Flower's Fleet loop sleeps.
A real deployment through it: tests/e2e/test_deployment.py (the harness's default node)."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from flwr.supernode import start_client_internal as fleet_loop

from client_app.node import CappedSleep, NodeArgsError, poll_seconds, superexec_command
from envs.ports import choose_free_port

ROOT = Path(__file__).resolve().parents[2]


def test_flowers_fleet_loop_naps_through_its_time_module_and_the_cap_bounds_each_nap():
    """The patch works only while Flower's loop sleeps via its module's `time`, its idle nap
    (before the next pull) 3 s and its checks of its own state 0.5 s apart (flwr is pinned: a
    Flower that sleeps otherwise fails here, not silently in a deployment)."""
    source = inspect.getsource(fleet_loop)
    assert fleet_loop.time is time and "time.sleep(3)" in source and "time.sleep(0.5)" in source
    assert source.count("time.sleep(") == source.count("time.sleep(3)") + source.count("time.sleep(0.5)")
    capped = CappedSleep(time, 0.3, local_s=0.01)
    for flowers, most in ((3, 0.3), (0.5, 0.01)):
        t0 = time.monotonic()
        capped.sleep(flowers)
        assert time.monotonic() - t0 < most + 0.15
    assert capped.monotonic is time.monotonic  # the rest of the module is the real one


def test_the_superexec_dials_the_nodes_runtime_api_as_flowers_own_does():
    cmd = superexec_command(["--insecure", "--superlink", "s:9093"], parent_pid=42)
    assert cmd[1:4] == ["-m", "client_app.superexec", "--insecure"]
    assert cmd[4:] == ["--runtime-api-address", "127.0.0.1:9094", "--parent-pid", "42"]
    bound = superexec_command(["--host", "0.0.0.0", "--port", "9200", "--ssl-ca-certfile", "ca.pem"], parent_pid=7)
    assert bound[3:7] == ["--root-certificates", "ca.pem", "--runtime-api-address", "127.0.0.1:9200"]
    with pytest.raises(NodeArgsError, match="drop the flag"):
        superexec_command(["--isolation", "subprocess"], parent_pid=7)


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "30"])
def test_a_bad_poll_is_refused_naming_the_variable(raw):
    with pytest.raises(NodeArgsError, match="FEDAGENT_NODE_POLL_S"):
        poll_seconds({"FEDAGENT_NODE_POLL_S": raw})
    assert poll_seconds({}) == 0.2 and poll_seconds({"FEDAGENT_NODE_POLL_S": "1.5"}) == 1.5


def _start_node(tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "client_app.node", "--insecure", "--superlink", f"127.0.0.1:{choose_free_port()}"]
    cmd += ["--port", str(choose_free_port())]
    full_env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr"), "FLWR_TELEMETRY_ENABLED": "0", **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _superexec_of(node: subprocess.Popen, timeout_s: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process(node.pid).children():
            argv = child.cmdline()
            if argv[1:3] == ["-m", "client_app.superexec"] and argv[-2:] == ["--parent-pid", str(node.pid)]:
                return child
        assert node.poll() is None, node.stdout.read().decode() if node.stdout else ""
        time.sleep(0.1)
    raise AssertionError("the node started no SuperExec")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_nodes_superexec_stops_with_the_node(tmp_path, sig):
    """SIGTERM: the node stops its SuperExec by PID; SIGKILL (nothing runs in the node any more):
    the SuperExec sees its `--parent-pid` gone and exits by itself. Either way nothing is left."""
    node = _start_node(tmp_path)  # no SuperLink listens: the node keeps retrying, as a node does
    try:
        superexec = _superexec_of(node)
        os.kill(node.pid, sig)
        node.wait(timeout=30)
        superexec.wait(timeout=30)  # raises psutil.TimeoutExpired while it lives
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_bad_poll_fails_before_anything_starts(tmp_path):
    node = _start_node(tmp_path, {"FEDAGENT_NODE_POLL_S": "soon"})
    out, _ = node.communicate(timeout=60)
    assert node.returncode != 0 and b"FEDAGENT_NODE_POLL_S='soon'" in out
