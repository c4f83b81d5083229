"""Invariant 23: service ports live outside the ephemeral range, are checked free at start
(relocated only when asked), and a bind collision gets exactly one clean retry."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from envs import ports
from envs.ports import (
    PRIVATE_BAND,
    PortError,
    bind_listener,
    check_port_allowed,
    choose_free_port,
    ephemeral_range,
    in_ephemeral_range,
    port_is_free,
)
from envs.service import READY_PREFIX, stop_process

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy():
    """A port some other listener holds, in the private band."""
    sock = bind_listener("127.0.0.1", None)
    yield sock.getsockname()[1]
    sock.close()


def test_ephemeral_range_is_the_kernels():
    lo, hi = ephemeral_range()
    kernel = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if kernel.exists():
        assert [lo, hi] == [int(x) for x in kernel.read_text().split()]
    assert in_ephemeral_range(lo) and in_ephemeral_range(hi) and not in_ephemeral_range(lo - 1)


def test_service_port_in_ephemeral_range_is_refused():
    lo, _ = ephemeral_range()
    with pytest.raises(PortError, match="ephemeral range"):
        check_port_allowed(lo + 5)
    with pytest.raises(PortError, match="ephemeral range"):
        bind_listener("127.0.0.1", lo + 5)
    with pytest.raises(PortError, match="unprivileged"):
        check_port_allowed(80)


def test_chosen_ports_are_free_and_in_the_private_band():
    for _ in range(20):
        p = choose_free_port()
        assert PRIVATE_BAND[0] <= p <= PRIVATE_BAND[1] and not in_ephemeral_range(p)
        assert port_is_free(p)


def test_busy_port_is_refused_with_the_fix_or_relocated(busy):
    assert not port_is_free(busy)
    with pytest.raises(PortError, match="already in use.*--relocate"):
        bind_listener("127.0.0.1", busy)
    moved = bind_listener("127.0.0.1", busy, relocate=True)
    try:
        assert moved.getsockname()[1] != busy
        assert not in_ephemeral_range(moved.getsockname()[1])
    finally:
        moved.close()


def test_bind_collision_gets_one_clean_retry(busy, monkeypatch):
    """Another process wins the race between our probe and our bind: the first chosen port is
    taken, so the listener retries once with a fresh port; a second collision is an error."""
    fresh = choose_free_port()
    picks = iter([busy, fresh])
    monkeypatch.setattr(ports, "choose_free_port", lambda *a, **k: next(picks))
    sock = bind_listener("127.0.0.1", None)
    try:
        assert sock.getsockname()[1] == fresh
    finally:
        sock.close()
    monkeypatch.setattr(ports, "choose_free_port", lambda *a, **k: busy)
    with pytest.raises(PortError, match="after one clean retry"):
        bind_listener("127.0.0.1", None)


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "envs.service",
            "--env",
            "shop",
            "--pool-size",
            "1",
            "--params",
            '{"num_goals": 100, "val_size": 8}',
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_refuses_busy_and_ephemeral_ports(busy):
    cases = [(busy, "already in use"), (ephemeral_range()[0] + 7, "ephemeral range")]
    procs = [_cli("--port", str(port)) for port, _ in cases]
    for proc, (port, why) in zip(procs, cases):
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and why in err and str(port) in err, err


def test_cli_relocate_prints_the_chosen_port(busy):
    proc = _cli("--port", str(busy), "--relocate")
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), line + proc.stderr.read()
        ready = json.loads(line[len(READY_PREFIX) :])
        assert ready["port"] != busy and not in_ephemeral_range(ready["port"])
        assert ready["pid"] == proc.pid
        with socket.create_connection(("127.0.0.1", ready["port"]), timeout=5):
            pass
    finally:
        stop_process(proc)
