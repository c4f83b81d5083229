"""summary.json `lanes` and the idle-lane report (issue 41): the lanes that served fits per host,
and those a host offers that served none."""

from __future__ import annotations

from fl_app.calls import Reply
from server_app.lanes import Lanes, lane_entry


def _fit(host: str, lane: str, offered: list[str]) -> Reply:
    return Reply(node_host=host, lane=lane, devices=lane.split("-"), host_lanes=offered, lane_span=(1.0, 2.0))


def test_lanes_count_fits_per_host_and_lane_and_name_the_idle_ones():
    lanes, said = Lanes(), []
    for lane in ("0", "1", "0"):
        lanes.note(_fit("a", lane, ["0", "1", "2", "3"]))
    lanes.note(_fit("b", "0-1", ["0-1"]))
    assert lanes.table() == {
        "served": {
            "a": {"0": {"fits": 2, "devices": ["0"]}, "1": {"fits": 1, "devices": ["1"]}},
            "b": {"0-1": {"fits": 1, "devices": ["0", "1"]}},
        },
        "idle": {"a": ["2", "3"]},
    }
    lanes.tell_idle(clients_per_round=2, log=said.append)
    lanes.tell_idle(clients_per_round=2, log=said.append)
    assert len(said) == 1 and "a: 2, 3" in said[0] and "clients_per_round=2 is below the 5 lanes" in said[0]
    assert lane_entry(_fit("a", "0", [])) == {"lane": "0", "devices": ["0"], "lane_span": [1.0, 2.0]}


def test_enough_clients_per_round_to_fill_the_lanes_says_nothing():
    lanes, said = Lanes(), []
    lanes.note(_fit("a", "cpu0", ["cpu0", "cpu1"]))
    lanes.tell_idle(clients_per_round=2, log=said.append)
    assert not said and lanes.idle() == {"a": ["cpu1"]}  # idle so far, but a round can fill both
