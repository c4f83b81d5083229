"""A failed call to the trainer service, answered as a Flower error reply of one line.

The service can die mid-call (killed, out of memory), drop the connection, fail to start, or
refuse (4xx) or fail (5xx) a call with its exception's type and message. Raised from the
ClientApp, each still reaches the server as an error reply, but in simulation Flower's backend
first logs the exception with its Ray traceback (~220 lines with ANSI codes) into the run's
stream. Answered here instead, the server's dispatch gets one line naming what failed and where
the service's log is, and drops or re-dispatches the client as for any failed client
(server_app.dispatch). Anything else the ClientApp raises is not a known failure and still raises.
"""

from __future__ import annotations

import socket

import httpx
from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from client_app.lane import LaneService, ServiceError, ServiceRequestError
from server_app.errors import printable


def failure_line(lane: LaneService, path: str, e: ServiceError) -> str:
    """What failed, in one line: the service's own error for a refused or failed request, else how
    the service went away, with where its log is (its last lines say why)."""
    if isinstance(e, ServiceRequestError):
        first = e.message.strip().splitlines()[0] if e.message.strip() else ""
        return printable(f"trainer service {e.path} failed (HTTP {e.status}): {e.error_type}: {first}")
    host, cause = socket.gethostname(), e.__cause__
    if isinstance(cause, httpx.TransportError):  # it died or dropped the connection mid-call
        why = f"{type(cause).__name__}: {cause}"
        return printable(
            f"trainer service for lane {lane.lane} failed during {path}: {why} (its log: {lane.log_path} on {host})"
        )
    first = (str(e).splitlines() or [type(e).__name__])[0]  # e.g. it could not start: the line names its log
    return printable(f"{first.rstrip(':')} (on {host})")


def failure_reply(msg: Message, lane: LaneService, path: str, e: ServiceError) -> Message:
    """The error reply to `msg` for a failed service call (the code Flower gives a raising ClientApp)."""
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=failure_line(lane, path, e)), reply_to=msg)
