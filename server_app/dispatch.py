"""Send a round's messages, collect the replies, and decide what a failed client costs.

Flower reports a lost SuperNode as an error reply (`Node Unavailable`, after two missed
heartbeats) and a failed ClientApp as an error reply naming its exception; a node that hangs
sends nothing. Here every sampled client ends in exactly one of three ways:

- it replied: its reply is kept;
- it failed (error reply, no reply within `federation.client_timeout_s`, or later a non-finite
  upload) and the round can afford it (at least `federation.min_clients_per_round` still
  reply): it is dropped;
- it failed and the round cannot afford it: it is re-dispatched, once, to a connected node that
  has not failed this round; if there is none, the round fails (RoundError), closed.

Every failed attempt is recorded (`ClientFailure`: client, node, one-line reason) for the
round's metrics row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from server_app.errors import one_line
from server_app.strategy import ClientFailure, RoundError, reply_of

# replies are pulled this often: every round waits for a fit and a validation reply, and a 1 s
# poll cost ~1 s of idle per round (round walls came out as whole seconds + 0.04)
POLL_S = 0.1
_ERROR_NAMES = {v: k for k, v in vars(ErrorCode).items() if isinstance(v, int) and not k.startswith("_")}

MakeMessage = Callable[[int, int], Message]  # (client id, node id) -> the client's message


def error_line(reply: Message) -> str:
    """One line for an error reply: Flower's error code name and the reason's root cause."""
    code = _ERROR_NAMES.get(reply.error.code, str(reply.error.code))
    return f"{code}: {one_line(reply.error.reason or '')}"


@dataclass
class _Attempt:
    client: int
    node: int
    sent_at: float
    retry: bool = False


@dataclass
class RoundOutcome:
    replies: dict[int, Message] = field(default_factory=dict)  # client id -> its successful reply
    failures: list[ClientFailure] = field(default_factory=list)  # every failed attempt, in order
    dropped: list[int] = field(default_factory=list)  # clients the round completes without

    def drop(self, failure: ClientFailure) -> None:
        self.failures.append(failure)
        self.dropped.append(failure.client)
        self.replies.pop(failure.client, None)


class RoundDispatch:
    """One round's train messages, with the failure rules of the module docstring."""

    def __init__(
        self,
        grid: Grid,
        make_message: MakeMessage,
        *,
        round_: int,
        min_ok: int,
        timeout_s: float,
        log: Callable[[str], None],
        poll_s: float = POLL_S,
    ) -> None:
        self.grid, self.make_message, self.round = grid, make_message, round_
        self.min_ok, self.timeout_s, self.log, self.poll_s = min_ok, timeout_s, log, poll_s

    def run(self, assignment: dict[int, int]) -> RoundOutcome:
        self.sampled = list(assignment)
        self.out = RoundOutcome()
        self.failed_nodes: set[int] = set()
        self.pending: dict[str, _Attempt] = {}
        self._push([(cid, node, False) for cid, node in assignment.items()])
        while self.pending:
            replies = list(self.grid.pull_messages(list(self.pending)))
            for reply in replies:
                attempt = self.pending.pop(reply.metadata.reply_to_message_id, None)
                if attempt is not None:
                    self._settle(attempt, reply)
            now = time.monotonic()
            for msg_id, attempt in list(self.pending.items()):
                if now - attempt.sent_at > self.timeout_s:
                    del self.pending[msg_id]
                    self._failed(attempt, f"no reply within federation.client_timeout_s={self.timeout_s:.0f} s")
            if self.pending and not replies:
                time.sleep(self.poll_s)
        return self.out

    def can_drop(self) -> bool:
        """True when one more lost client still leaves min_ok of the sampled ones."""
        return len(self.sampled) - len(self.out.dropped) - 1 >= self.min_ok

    def _push(self, jobs: Sequence[tuple[int, int, bool]]) -> None:
        for cid, node, retry in jobs:
            msg_id = push_one(self.grid, self.make_message(cid, node))
            attempt = _Attempt(cid, node, time.monotonic(), retry)
            if msg_id is None:
                self._failed(attempt, "the SuperLink did not accept the message")
            else:
                self.pending[msg_id] = attempt

    def _settle(self, attempt: _Attempt, reply: Message) -> None:
        if reply.has_error():
            self._failed(attempt, error_line(reply))
            return
        got = reply_of(reply).client_id
        if got != attempt.client:
            self._failed(attempt, f"replied as client {got}")
            return
        self.out.replies[attempt.client] = reply

    def _failed(self, attempt: _Attempt, reason: str) -> None:
        failure = ClientFailure(attempt.client, attempt.node, reason)
        self.failed_nodes.add(attempt.node)
        where = f"round {self.round}: client {attempt.client} failed on node {attempt.node}: {reason}"
        if self.can_drop():
            self.out.drop(failure)
            self.log(
                f"{where}; dropped (the round completes with the others: "
                f"federation.min_clients_per_round={self.min_ok})"
            )
            return
        self.out.failures.append(failure)
        spare = sorted(set(self.grid.get_node_ids()) - self.failed_nodes)
        if attempt.retry or not spare:
            why = "it already failed once before" if attempt.retry else "no other node is connected"
            raise RoundError(
                f"{where}; {why}, and the round needs {self.min_ok} of its {len(self.sampled)} "
                "clients (federation.min_clients_per_round)"
            )
        busy = {a.node: 0 for a in self.pending.values()}
        for a in self.pending.values():
            busy[a.node] += 1
        node = min(spare, key=lambda n: (busy.get(n, 0), n))
        self.log(f"{where}; re-dispatching it to node {node}")
        self._push([(attempt.client, node, True)])


def push_one(grid: Grid, message: Message) -> str | None:
    """The message id, or None when the SuperLink refused it (its grids differ in how they say so)."""
    ids = list(grid.push_messages([message]))
    return ids[0] if ids else None


def request_one(
    grid: Grid,
    nodes: Sequence[int],
    make_message: Callable[[int], Message],
    what: str,
    timeout_s: float,
    log: Callable[[str], None],
) -> Message:
    """A single request (init, validation) to the first node that answers it: a node that is
    lost (or silent past the timeout) hands it to the next; an error reply is final."""
    for i, node in enumerate(nodes):
        msg_id = push_one(grid, make_message(node))
        if msg_id is None:
            raise RoundError(f"{what}: the SuperLink did not accept the message for node {node}")
        deadline = time.monotonic() + timeout_s
        replies: list[Message] = []
        while not replies and time.monotonic() < deadline:
            replies = list(grid.pull_messages([msg_id]))
            if not replies:
                time.sleep(POLL_S)
        if replies and not replies[0].has_error():
            return replies[0]
        if replies and replies[0].error.code not in _NODE_LOST:
            raise RoundError(f"{what} on node {node} failed: {error_line(replies[0])}")
        reason = error_line(replies[0]) if replies else f"no reply within {timeout_s:.0f} s"
        if i + 1 == len(nodes):
            raise RoundError(f"{what} on node {node} failed: {reason}; no other node to ask")
        log(f"{what}: node {node} is lost ({reason}); asking node {nodes[i + 1]}")
    raise RoundError(f"{what}: no node to ask")


_NODE_LOST = {
    ErrorCode.NODE_UNAVAILABLE,
    ErrorCode.MESSAGE_UNAVAILABLE,
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
    ErrorCode.CLIENT_APP_CRASHED,
}
