"""Send a round's messages, collect the replies, and decide what a failed or slow client costs.

Flower reports a lost SuperNode as an error reply (`Node Unavailable`, after two missed
heartbeats) and a failed ClientApp as an error reply naming its exception; a node that hangs
sends nothing. A round sends its `clients_per_round` sampled clients, then the
`federation.over_select` over-selected ones (the sample order). Every client ends in exactly one
of these ways:

- it replied: its reply is kept;
- it failed (error reply, no reply within `federation.client_timeout_s`, or later a non-finite
  upload) and the round can afford it (at least `federation.min_clients_per_round` of the clients
  sent can still reply): it is dropped;
- it failed and the round cannot afford it: it is re-dispatched, once, to a connected node that
  has not failed this round; if there is none, the round fails (RoundError), closed;
- the round closed without it (`Close`): past `federation.round_deadline_s`, a client still
  pending is dropped as a straggler; an over-selected client the round did not need is spare.

The round closes as soon as the first `clients_per_round` clients in sample order that have not
failed all replied (without faults: the clients of a run without over-selection), or, past the
deadline, as soon as at least `min_clients_per_round` replied. It aggregates the first
`clients_per_round` clients in sample order among those that replied.

Every failed attempt is recorded (`ClientFailure`: client, node, one-line reason) for the
round's metrics row. A message the round stopped waiting for (a straggler, a spare, a timed-out
attempt) is handed to `Abandoned`: later polls pull its late reply and discard it, so it never
lingers in the SuperLink nor reaches a later round.
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
    replies: dict[int, Message] = field(default_factory=dict)  # client id -> its reply the round aggregates
    failures: list[ClientFailure] = field(default_factory=list)  # every failed attempt, in order
    dropped: list[int] = field(default_factory=list)  # failed clients the round completes without
    spare: list[int] = field(default_factory=list)  # over-selected clients the round did not need

    def drop(self, failure: ClientFailure) -> None:
        self.failures.append(failure)
        self.dropped.append(failure.client)
        self.replies.pop(failure.client, None)


class Abandoned:
    """The run's messages nobody waits for any more, message id -> (round, client): each poll of a
    later dispatch pulls them too (Flower deletes a message once its reply is pulled) and
    discards what comes back; `on_late(round, client)` then removes that attempt's upload."""

    def __init__(self, on_late: Callable[[int, int], None] = lambda r, c: None) -> None:
        self.on_late = on_late
        self.ids: dict[str, tuple[int, int]] = {}

    def add(self, msg_id: str, round_: int, client: int) -> None:
        self.ids[msg_id] = (round_, client)

    def discard(self, reply: Message, log: Callable[[str], None]) -> bool:
        """True when `reply` answers an abandoned message: it is then dropped, unread."""
        late = self.ids.pop(reply.metadata.reply_to_message_id, None)
        if late is None:
            return False
        what = error_line(reply) if reply.has_error() else "a reply"
        log(f"round {late[0]}: client {late[1]}'s late answer ({what}) discarded: the round closed without it")
        self.on_late(*late)
        return True


@dataclass(frozen=True)
class Close:
    """When a round stops waiting: `per_round` replies wanted, at least `min_ok` needed, and an
    optional deadline (seconds after the round's messages went out)."""

    per_round: int
    min_ok: int
    deadline_s: float | None = None

    def straggler_reason(self) -> str:
        return f"straggler: no reply at the {self.deadline_s:g} s deadline (federation.round_deadline_s)"


class RoundDispatch:
    """One round's train messages, with the failure and close rules of the module docstring."""

    def __init__(
        self,
        grid: Grid,
        make_message: MakeMessage,
        *,
        round_: int,
        close: Close,
        timeout_s: float,
        log: Callable[[str], None],
        abandoned: Abandoned | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.grid, self.make_message, self.round, self.close = grid, make_message, round_, close
        self.min_ok, self.timeout_s, self.log, self.poll_s = close.min_ok, timeout_s, log, poll_s
        self.abandoned = abandoned if abandoned is not None else Abandoned()

    def run(self, assignment: dict[int, int]) -> RoundOutcome:
        """Dispatch `assignment` (client -> node, in sample order) and wait until the round closes."""
        self.sampled = list(assignment)
        self.out = RoundOutcome()
        self.failed_nodes: set[int] = set()
        self.pending: dict[str, _Attempt] = {}
        t0 = time.monotonic()
        self._push([(cid, node, False) for cid, node in assignment.items()])
        while not self._wanted_replied():
            if self._past_deadline(t0):
                self._drop_stragglers()
                break
            replies = list(self.grid.pull_messages([*self.pending, *self.abandoned.ids]))
            for reply in replies:
                if self.abandoned.discard(reply, self.log):
                    continue
                attempt = self.pending.pop(reply.metadata.reply_to_message_id, None)
                if attempt is not None:
                    self._settle(attempt, reply)
            now = time.monotonic()
            for msg_id, attempt in list(self.pending.items()):
                if now - attempt.sent_at > self.timeout_s:
                    self._abandon(msg_id)
                    self._failed(attempt, f"no reply within federation.client_timeout_s={self.timeout_s:.0f} s")
            if not replies and not self._wanted_replied():
                time.sleep(self.poll_s)
        return self._closed()

    def _wanted_replied(self) -> bool:
        """True once the first `per_round` clients in sample order that have not failed replied."""
        alive = [c for c in self.sampled if c not in self.out.dropped]
        return all(c in self.out.replies for c in alive[: self.close.per_round])

    def _past_deadline(self, t0: float) -> bool:
        d = self.close.deadline_s
        return d is not None and time.monotonic() - t0 >= d and len(self.out.replies) >= self.min_ok

    def _drop_stragglers(self) -> None:
        """Drop every client still pending at the deadline, in one log line."""
        late = sorted(self.pending.items(), key=lambda kv: self.sampled.index(kv[1].client))
        for msg_id, attempt in late:
            self._abandon(msg_id)
            self.out.drop(ClientFailure(attempt.client, attempt.node, self.close.straggler_reason()))
        if late:
            who = ", ".join(f"client {a.client} (node {a.node})" for _, a in late)
            self.log(
                f"round {self.round}: {self.close.straggler_reason()}: dropped {who}; the round closes "
                f"with the {len(self.out.replies)} clients that replied "
                f"(federation.min_clients_per_round={self.min_ok})"
            )

    def _closed(self) -> RoundOutcome:
        """The round's outcome: the first `per_round` replies in sample order; spare the rest."""
        for msg_id in list(self.pending):
            self._abandon(msg_id)
        keep = [c for c in self.sampled if c in self.out.replies][: self.close.per_round]
        self.out.spare = [c for c in self.sampled if c not in keep and c not in self.out.dropped]
        self.out.replies = {c: self.out.replies[c] for c in keep}
        return self.out

    def _abandon(self, msg_id: str) -> None:
        attempt = self.pending.pop(msg_id)
        self.abandoned.add(msg_id, self.round, attempt.client)

    def can_drop(self) -> bool:
        """True when one more lost client still leaves min_ok of the clients sent."""
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
