"""What a failed or slow client costs a round (issue 14, item 4; issue 39: over-selection and
the round deadline), on Flower's own message machinery.

The grid is Flower's `InMemoryGrid` over a real `InMemoryLinkState` (what simulation runs on);
the nodes are threads that answer their messages as a node would: reply, reply after a delay
(`slow:S`), reply with an error, stay silent, or die (stop heartbeating: Flower itself then
answers `Node Unavailable`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, ErrorCode
from grid_support import grid, link_state, task_identity

from fl_app.calls import RECORD, FitCall, Reply
from server_app.dispatch import Abandoned, Close, RoundDispatch, request_one
from server_app.strategy import RoundError

RUN_ID, TASK_ID = 7, 11


def _call(cid: int) -> str:
    """Client `cid`'s fit call of round 3, as the server sends it."""
    return FitCall(run_id=RUN_ID, round=3, client_id=cid, local_epochs=1, seed=0).model_dump_json()


TRACEBACK = (
    "<class 'client_app.lane.ServiceRequestError'>:<'trainer service /fit failed (HTTP 422): "
    'WeightsError: /r/x: no manifest.json\nTraceback (most recent call last):\n  File "x.py"\'>'
)


class Federation:
    """A SuperLink's state and grid, and nodes that behave as told: ok | slow:S | error | silent | dead."""

    def __init__(self, behaviours: list[str]) -> None:
        factory, self.state, run = link_state(RUN_ID, TASK_ID)
        self.behaviour: dict[int, str] = {}
        for b in behaviours:
            beat = 0.3 if b == "dead" else 1e300  # a dead node stops heartbeating at once
            node = self.state.create_node(
                NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32), heartbeat_interval=beat
            )
            self.state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=beat)
            self.behaviour[node] = b
        self.nodes = list(self.behaviour)
        self.grid = grid(factory, run)
        self.served: dict[int, list[int]] = {n: [] for n in self.nodes}
        self.due: list[tuple[float, Message]] = []  # a slow node's replies, sent when due
        self.late: list[tuple[int, int]] = []  # (round, client) of every late answer discarded
        self.abandoned = Abandoned(lambda r, c: self.late.append((r, c)))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.wait(0.02):
            for node, b in self.behaviour.items():
                if b in ("dead", "silent"):
                    continue
                for msg in self.state.get_message_ins(node_id=node, limit=10, run_id=RUN_ID):
                    cid = FitCall.model_validate_json(str(msg.content[RECORD][RECORD])).client_id
                    self.served[node].append(cid)
                    if b == "error":
                        reply = Message(
                            Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=TRACEBACK), reply_to=msg
                        )
                    else:
                        done = Reply(client_id=cid).model_dump_json()
                        reply = Message(content=RecordDict({RECORD: ConfigRecord({RECORD: done})}), reply_to=msg)
                    reply.metadata.__dict__["_message_id"] = reply.object_id
                    delay = float(b.split(":")[1]) if b.startswith("slow:") else 0.0
                    self.due.append((time.monotonic() + delay, reply))
            now = time.monotonic()
            for due, reply in [d for d in self.due if d[0] <= now]:
                self.due.remove((due, reply))
                self.state.store_message_res(reply)

    def message(self, cid: int, node: int) -> Message:
        return Message(
            content=RecordDict({RECORD: ConfigRecord({RECORD: _call(cid)})}), dst_node_id=node, message_type="train"
        )

    def dispatch(
        self,
        assignment: dict[int, int],
        min_ok: int,
        timeout_s: float = 60.0,
        *,
        per_round: int | None = None,
        deadline_s: float | None = None,
        round_: int = 3,
    ):
        """One round of `assignment` (client -> node, in sample order); `per_round` defaults to all."""
        log: list[str] = []
        close = Close(per_round or len(assignment), min_ok, deadline_s)
        outcome = RoundDispatch(
            self.grid,
            self.message,
            round_=round_,
            close=close,
            timeout_s=timeout_s,
            log=log.append,
            abandoned=self.abandoned,
            poll_s=0.05,
        ).run(assignment)
        return outcome, log


@pytest.fixture
def federation() -> Iterator[callable]:
    made: list[Federation] = []

    def make(*behaviours: str) -> Federation:
        made.append(Federation(list(behaviours)))
        return made[-1]

    with task_identity(RUN_ID, TASK_ID):
        yield make
        for f in made:
            f.stop.set()
            f.thread.join(5)


def test_every_client_replies(federation):
    f = federation("ok", "ok")
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=2)
    assert sorted(out.replies) == [4, 9] and not out.failures and not log


def test_a_lost_node_s_client_is_re_dispatched_when_every_client_must_reply(federation):
    f = federation("ok", "dead")
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=2)
    assert sorted(out.replies) == [4, 9] and out.dropped == []
    (failure,) = out.failures
    assert (failure.client, failure.node) == (9, f.nodes[1]) and failure.reason.startswith("NODE_UNAVAILABLE")
    assert f.served[f.nodes[0]] == [4, 9]  # the live node trained both
    assert "re-dispatching it to node" in log[0]


def test_a_lost_node_s_client_is_dropped_when_the_round_can_afford_it(federation):
    f = federation("ok", "dead")
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=1)
    assert list(out.replies) == [4] and out.dropped == [9] and out.failures[0].client == 9
    assert f.served[f.nodes[0]] == [4] and "dropped" in log[0]


def test_the_round_fails_closed_when_no_node_can_take_the_client(federation):
    f = federation("error", "dead")
    with pytest.raises(RoundError, match="round 3: client .* failed on node") as info:
        f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=2)
    assert "\n" not in str(info.value)


def test_a_client_error_arrives_as_one_line_naming_the_root_cause(federation):
    f = federation("error", "ok")
    out, _ = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=1)
    (failure,) = out.failures
    assert failure.reason == (
        "CLIENT_APP_RAISED_EXCEPTION: ServiceRequestError: trainer service /fit failed "
        "(HTTP 422): WeightsError: /r/x: no manifest.json"
    )


def test_a_silent_node_times_out_and_its_client_goes_elsewhere(federation):
    f = federation("silent", "ok")
    t0 = time.monotonic()
    out, _ = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=2, timeout_s=1.0)
    assert sorted(out.replies) == [4, 9] and "no reply within" in out.failures[0].reason
    assert time.monotonic() - t0 < 20


def test_a_single_request_moves_on_from_a_lost_node(federation):
    f = federation("dead", "ok")
    log: list[str] = []
    reply = request_one(f.grid, f.nodes, lambda n: f.message(0, n), "validation", 60.0, log.append)
    assert not reply.has_error() and reply.metadata.src_node_id == f.nodes[1] and "is lost" in log[0]


# ---- over-selection and the round deadline (issue 39) -------------------------------------------


def test_a_straggler_is_dropped_at_the_deadline_and_the_round_closes_with_the_others(federation):
    f = federation("ok", "slow:30")
    t0 = time.monotonic()
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=1, deadline_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 5
    assert list(out.replies) == [4] and out.dropped == [9] and out.spare == []
    (failure,) = out.failures
    assert (failure.client, failure.node) == (9, f.nodes[1])
    assert failure.reason == "straggler: no reply at the 1 s deadline (federation.round_deadline_s)"
    (line,) = log
    assert line.startswith("round 3: straggler: no reply at the 1 s deadline")
    assert f"dropped client 9 (node {f.nodes[1]})" in line
    assert f.served[f.nodes[1]] == [9]  # never re-dispatched


def test_past_the_deadline_the_round_waits_for_min_clients_then_closes(federation):
    """Nobody replied at the deadline: the round closes with the first reply (min_ok 1), not before."""
    f = federation("slow:1.5", "slow:30")
    t0 = time.monotonic()
    out, _ = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=1, deadline_s=0.2)
    assert 1.5 <= time.monotonic() - t0 < 5
    assert list(out.replies) == [4] and out.dropped == [9] and "straggler" in out.failures[0].reason


def test_a_deadline_no_client_misses_changes_nothing(federation):
    f = federation("ok", "ok")
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=1, deadline_s=5.0)
    assert list(out.replies) == [4, 9] and not out.failures and not out.dropped and not log


def test_over_selection_without_faults_aggregates_the_first_clients_in_sample_order(federation):
    """Clients 4 and 9 are the round's draw, 2 the over-selected one: the round closes once 4 and 9
    replied, without waiting for 2 (slow) or using it (fast): the clients of a run without it."""
    f = federation("ok", "ok", "slow:30")
    t0 = time.monotonic()
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1], 2: f.nodes[2]}, min_ok=2, per_round=2)
    assert time.monotonic() - t0 < 5 and list(out.replies) == [4, 9] and out.spare == [2]
    assert not out.failures and not out.dropped and not log
    f.behaviour[f.nodes[2]] = "ok"
    out, _ = f.dispatch({9: f.nodes[0], 4: f.nodes[1], 2: f.nodes[2]}, min_ok=2, per_round=2, round_=4)
    assert list(out.replies) == [9, 4] and out.spare == [2]


def test_an_over_selected_client_steps_in_for_a_failed_one(federation):
    f = federation("error", "ok", "ok")
    out, log = f.dispatch({4: f.nodes[0], 9: f.nodes[1], 2: f.nodes[2]}, min_ok=2, per_round=2)
    assert list(out.replies) == [9, 2] and out.dropped == [4] and out.spare == []
    assert f.served[f.nodes[0]] == [4] and "dropped" in log[0]  # not re-dispatched: 2 replaces it


def test_at_the_deadline_the_round_keeps_the_first_replies_in_sample_order(federation):
    """Draw 4, 9, over-selected 2 and 7; 9 straggles: the round aggregates 4 and 2 (the first two
    that replied, in sample order), 7 is spare, 9 dropped."""
    f = federation("ok", "slow:30", "ok", "ok")
    out, _ = f.dispatch(
        {4: f.nodes[0], 9: f.nodes[1], 2: f.nodes[2], 7: f.nodes[3]}, min_ok=2, per_round=2, deadline_s=1.0
    )
    assert list(out.replies) == [4, 2] and out.dropped == [9] and out.spare == [7]


def test_a_straggler_s_late_answer_is_pulled_and_discarded_never_reaching_a_later_round(federation):
    """The round closed without client 9; its answer arrives during the next round, which pulls it
    (so the SuperLink keeps neither message), discards it and removes its upload (`on_late`)."""
    f = federation("ok", "slow:1.0")
    out, _ = f.dispatch({4: f.nodes[0], 9: f.nodes[1]}, min_ok=1, deadline_s=0.2)
    assert out.dropped == [9] and len(f.abandoned.ids) == 1
    time.sleep(1.5)  # the late answer is in the SuperLink now
    f.behaviour[f.nodes[1]] = "ok"
    out, log = f.dispatch({9: f.nodes[0], 4: f.nodes[1]}, min_ok=2, round_=4)
    assert list(out.replies) == [9, 4] and not out.failures
    assert f.late == [(3, 9)] and not f.abandoned.ids
    assert log == ["round 3: client 9's late answer (a reply) discarded: the round closed without it"]
    assert not f.state.message_ins_store and not f.state.message_res_store
