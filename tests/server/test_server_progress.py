"""The ServerApp never sits silent while it waits on clients (a tiny-model build, a long round)."""

from __future__ import annotations

import threading
import time

from server_app.app import _heartbeat


def test_heartbeat_logs_elapsed_time_while_waiting_and_stops_after(capsys):
    with _heartbeat("round 0: waiting for the lane", every_s=0.05):
        time.sleep(0.28)
    beats = [line for line in capsys.readouterr().out.splitlines() if "round 0: waiting for the lane" in line]
    assert len(beats) >= 3, beats
    assert all(line.startswith("[fedagent] ") and line.endswith(" s)") for line in beats)
    time.sleep(0.15)
    assert capsys.readouterr().out == ""  # stopped with the block
    assert not any(t.name == "fedagent-heartbeat" for t in threading.enumerate())


def test_heartbeat_stops_when_the_block_raises(capsys):
    try:
        with _heartbeat("validating", every_s=0.05):
            raise KeyError("boom")
    except KeyError:
        pass
    time.sleep(0.12)
    assert "validating" not in capsys.readouterr().out
    assert not any(t.name == "fedagent-heartbeat" for t in threading.enumerate())
