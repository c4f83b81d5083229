"""A host's CPU lanes (`run.cpu_lanes`): each call leases a free lane and holds it while it runs;
with every lane busy the next call queues until one frees (issue 41)."""

from __future__ import annotations

import threading
import time

import pytest

from client_app.lane import cpu_lanes, host_lanes, lane_devices, leased_lane
from client_app.runtime_dir import ENV_VAR, NodeOwner, node_owner
from fl_app.config import RunCfg


@pytest.fixture
def owner(tmp_path, monkeypatch) -> NodeOwner:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "rt"))
    return node_owner()


def test_lane_names_and_devices():
    assert cpu_lanes(1) == ["cpu"] and cpu_lanes(3) == ["cpu0", "cpu1", "cpu2"]
    assert lane_devices("cpu") == lane_devices("cpu1") == ["cpu"] and lane_devices("0-1") == ["0", "1"]
    assert host_lanes("cpu1", RunCfg(cpu_lanes=2)) == ["cpu0", "cpu1"]
    assert "3" in host_lanes("3", RunCfg()) and "GPU-5f" in host_lanes("GPU-5f", RunCfg())  # a GPU lane is its host's


def test_busy_lanes_make_the_next_call_wait_for_the_first_freed(owner):
    lanes = cpu_lanes(2)
    got: list[str] = []
    with leased_lane(owner, 7, lanes) as a, leased_lane(owner, 7, lanes) as b:
        assert {a, b} == set(lanes)
        waiter = threading.Thread(target=lambda: got.extend(_lease_once(owner, lanes)))
        waiter.start()
        time.sleep(0.5)
        assert not got, "a third call leased a lane while both were busy"
    waiter.join(10)
    assert got and got[0] in lanes


def test_one_lane_is_never_leased_and_another_run_has_its_own_leases(owner):
    with leased_lane(owner, 7, ["cpu"]) as a, leased_lane(owner, 7, ["cpu"]) as b:
        assert a == b == "cpu"  # one lane: the service serves the calls in turn, as without lanes
    with leased_lane(owner, 7, cpu_lanes(2)) as a, leased_lane(owner, 8, cpu_lanes(2)) as b:
        assert a == b == "cpu0"


def _lease_once(owner: NodeOwner, lanes: list[str]) -> list[str]:
    with leased_lane(owner, 7, lanes) as lane:
        return [lane]
