"""A round's accounting (fl_app.accounting): phases that never add up to more than the round's
wall, whatever the lanes; bytes per client and member summed into the round; rows written
before the accounting keys still plot; TensorBoard event files that hold the rows."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from metrics_support import old_row
from tb_support import events as _events

from client_app.fleet_bytes import count_reply, fleet_bytes
from fl_app.accounting import (
    CLIENT_PHASES,
    MESSAGE_DOWN,
    MESSAGE_UP,
    PHASES,
    client_entry,
    client_traffic,
    phases_of,
    round0_accounting,
    round_accounting,
    run_message_bytes,
)
from fl_app.board import Board
from fl_app.plots import plot_phases

PNG = b"\x89PNG\r\n\x1a\n"


def _reply(serve_s: float, down: int, up: int, **phases: float) -> dict[str, float]:
    """A reply's metrics as the ClientApp and the trainer service write them (its lane time:
    the serve time less its transport)."""
    return {
        **{f"{p}_s": v for p, v in phases.items()},
        "fit_total_s": serve_s - 0.5,
        **client_traffic({"actor": down, "critic": down // 2}, {"actor": up, "critic": up // 2}, 0.5, serve_s),
        MESSAGE_DOWN: down + 100.0,
        MESSAGE_UP: up + 50.0,
        "num-examples": 8.0,
    }


def _round(train_s: float, serve_s: float) -> dict:
    clients = {c: client_entry(_reply(serve_s, 1000 + c, 2000 + c, load=1.0, rollout=3.0, update=2.0)) for c in (4, 9)}
    server = {"train": train_s, "transport": 0.25, "aggregation": 1.0, "checkpoint": 0.5, "validation": 2.0}
    val = {"val_bytes_down_actor": 777, f"val_{MESSAGE_DOWN}": 900, f"val_{MESSAGE_UP}": 300, "val_success": 0.5}
    return round_accounting(clients, server, val, wall_s=train_s + 4.0)


def test_one_lane_phases_are_the_measured_times_and_the_rest_is_dispatch_and_other():
    acc = _round(train_s=20.0, serve_s=8.0)  # fits take turns: 16 s busy in a 20 s dispatch
    ph = acc["phase_s"]
    assert set(ph) == {*PHASES, "other"}
    assert ph["rollout"] == 6.0 and ph["load"] == 2.0 and ph["update"] == 4.0
    assert ph["transport"] == pytest.approx(2 * 0.5 + 0.25)  # both clients' + the server's payload
    assert ph["dispatch"] == pytest.approx(4.0)  # the dispatch's wall that no client served
    assert (ph["aggregation"], ph["checkpoint"], ph["validation"]) == (1.0, 0.5, 2.0)
    assert sum(ph.values()) == pytest.approx(24.0) and ph["other"] >= 0


def test_overlapping_lanes_scale_the_client_phases_into_the_round_s_wall():
    acc = _round(train_s=9.0, serve_s=8.0)  # two lanes at once: 16 s busy in 9 s
    ph = acc["phase_s"]
    assert ph["dispatch"] == 0.0
    assert ph["rollout"] == pytest.approx(6.0 * 9 / 16)
    assert sum(v for k, v in ph.items() if k != "other") <= 13.0 and ph["other"] >= 0


def test_bytes_per_client_and_member_add_up_to_the_round_s_totals():
    acc = _round(train_s=20.0, serve_s=8.0)
    assert acc["per_client"]["4"]["bytes_down"] == {"actor": 1004, "critic": 502}
    assert acc["per_client"]["9"]["bytes_up"] == {"actor": 2009, "critic": 1004}
    assert acc["bytes_down"] == {"actor": 1004 + 1009 + 777, "critic": 502 + 504}  # the validation's too
    assert acc["bytes_up"] == {"actor": 4013, "critic": 2006}
    assert acc["bytes_moved"] == sum(acc["bytes_down"].values()) + sum(acc["bytes_up"].values())
    assert set(acc["per_client"]["4"]["phases"]) == set(CLIENT_PHASES)
    # the Flower messages that carried them: per client, and summed with the validation's
    assert acc["per_client"]["9"]["message_bytes"] == {"down": 1109, "up": 2059}
    assert acc["message_bytes"] == {"down": 1104 + 1109 + 900, "up": 2054 + 2059 + 300}


def test_a_flower_run_s_message_bytes_add_its_rows_round_0_and_its_shutdown():
    init = {**client_traffic({}, {"actor": 40}, 0.1, 1.0), MESSAGE_DOWN: 70.0, MESSAGE_UP: 90.0}
    row0 = {"round": 0, **round0_accounting(init, {f"val_{MESSAGE_DOWN}": 60, f"val_{MESSAGE_UP}": 5})}
    assert row0["message_bytes"] == {"down": 130, "up": 95} and row0["bytes_up"] == {"actor": 40}
    row1 = {"round": 1, **_round(train_s=20.0, serve_s=8.0)}
    total = run_message_bytes([row0, row1, old_row(2)], {"down": 7, "up": 3})  # an old row counts none
    assert total == {"down": 130 + 3113 + 7, "up": 95 + 4413 + 3}


def _call(arrays: list[np.ndarray]) -> Message:
    """A train call to node 42 as the ClientApp receives it: inline arrays beside the call's record."""
    meta = Metadata(
        run_id=7,
        message_id="",
        src_node_id=1,
        dst_node_id=42,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=600.0,
        message_type="train",
    )
    content = RecordDict({"arrays-actor": ArrayRecord(arrays), "call": ConfigRecord({"call": "{}" * 500})})
    return Message(content=content, metadata=meta)


def test_fleet_bytes_count_each_object_once_and_a_reply_its_own_size_as_sent():
    """The call's arrays down (an array twice in the message travels once: content-addressed),
    its record and the framing; the reply's count is measured with the 0.0s it replaces, so it
    is the size of the reply that travels."""
    w = np.arange(10_000, dtype=np.float32)
    call = _call([w, w.copy(), np.ones(8, np.float32)])
    metrics = MetricRecord(client_traffic({"actor": 40_032}, {}, 0.1, 1.0))
    reply = Message(RecordDict({"metrics": metrics}), reply_to=call)
    before = fleet_bytes(call, reply)
    count_reply(call, reply)
    down, up = fleet_bytes(call, reply)
    assert (down, up) == before  # the counts filled in did not change the reply's size
    assert (metrics[MESSAGE_DOWN], metrics[MESSAGE_UP]) == (down, up)
    arrays = w.nbytes + 32
    assert arrays + 1000 < down < arrays + 4000, down  # w once, its record's 1000 chars, the framing
    assert 200 < up < 2000, up  # the reply's metrics and framing, no arrays
    with pytest.raises(ValueError, match="needs message_bytes_down"):
        count_reply(call, reply)  # counted already: the keys no longer hold the 0.0 placeholders


def test_counting_a_call_leaves_its_metadata_as_the_superlink_holds_it():
    """The call a ClientApp counts is, in an in-process runtime, the SuperLink's own record of it:
    counting must not touch it. Before: `delivered_at` went back to "" and Flower handed the
    same call to a second worker (a duplicate reply, logged as an error)."""
    call = _call([np.ones(8, np.float32)])
    call.metadata.delivered_at = "2026-12-07T00:00:00+00:00"
    metrics = MetricRecord(client_traffic({"actor": 32}, {}, 0.1, 1.0))
    count_reply(call, Message(RecordDict({"metrics": metrics}), reply_to=call))
    assert call.metadata.delivered_at == "2026-12-07T00:00:00+00:00"


def test_a_row_from_before_the_accounting_keys_still_has_phases_and_plots(tmp_path):
    ph = phases_of(old_row(1))
    assert ph is not None and ph["rollout"] == 6.0 and ph["other"] == pytest.approx(2.0)
    assert phases_of({"round": 0, "wall_s": 3.0, "val_success": 0.1}) is None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in ({"round": 0, "val_success": 0.1}, old_row(1))) + "\n")
    assert plot_phases(metrics, tmp_path / "phases.png").read_bytes()[:8] == PNG
    metrics.write_text(json.dumps({"round": 0, "val_success": 0.1}) + "\n")
    with pytest.raises(ValueError, match="no round with phase times"):
        plot_phases(metrics, tmp_path / "none.png")


def test_tensorboard_holds_every_row_as_it_is_written_and_a_resume_appends(tmp_path):
    row = {**old_row(1), **_round(20.0, 8.0), "clients": [4, 9]}
    board = Board(tmp_path)
    t0 = time.perf_counter()
    board.add_row(1, row)
    per_row = time.perf_counter() - t0
    got = _events(tmp_path / "tb")  # flushed: readable before the writer closes
    assert got[("val_success", 1)] == 0.25 and got[("phase_s/rollout", 1)] == 6.0
    assert got[("bytes_down/actor", 1)] == 1004 + 1009 + 777
    assert not any(tag.startswith(("per_client", "clients")) for tag, _ in got)
    board.close()
    again = Board(tmp_path)  # a resumed run: a new event file beside the old one
    again.add_row(2, {**row, "val_success": 0.5})
    again.close()
    got = _events(tmp_path / "tb")
    assert (got[("val_success", 1)], got[("val_success", 2)]) == (0.25, 0.5)
    assert per_row < 0.5, f"a row took {per_row:.3f} s"
