"""Request deadlines for the project's uvicorn servers (the env service, the weight store).

uvicorn has no deadline on a request's head or body (its issue #157): a client that trickles
bytes, or sends none, holds its socket for as long as it likes, since uvicorn's keep-alive
timeout covers only the idle time between requests. `DeadlineProtocol` adds them at the
protocol level, because an app first sees a request once its head is complete.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head deadline and a body deadline.

    A request's head must arrive within `header_timeout_s` of the connection opening or of the
    request's first byte. Its body must arrive within `body_timeout_s` of the head, or, with
    `body_idle=True`, no `body_timeout_s` may pass without a byte of it: a total deadline suits
    small bodies (the env service's), while a shard of several GB on a slow link takes as long
    as it takes and only a stalled sender is cut. Time during which the server itself stopped
    reading (uvicorn pauses a connection whose body the app has not consumed yet) counts as
    progress: that stall is the server's, not the client's.

    On expiry the client gets 408 (unless an answer is already on its way) and the connection
    is closed; an app still reading that body sees a disconnect.
    """

    def __init__(
        self, *args: Any, header_timeout_s: float, body_timeout_s: float, body_idle: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.body_timeout_s, self.body_idle = header_timeout_s, body_timeout_s, body_idle
        self._deadline: asyncio.TimerHandle | None = None
        self._last_byte = 0.0

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if what == "request body" and self.body_idle:
            if self.flow.read_paused:  # the app has not taken what arrived yet
                self._last_byte = self.loop.time()
            quiet = self.loop.time() - self._last_byte
            if quiet < seconds:
                self._deadline = self.loop.call_later(seconds - quiet, self._expire, what, seconds)
                return
        cycle = self.cycle  # in the head phase: the previous request's (if any)
        if cycle is not None and (what == "request body" or not cycle.response_complete):
            if cycle.response_started:  # an answer is on its way: just end the connection
                self.transport.close()
                return
            cycle.disconnected = True  # the app's receive() now reports a disconnect
            cycle.message_event.set()
        idle = what == "request body" and self.body_idle
        detail = f"no byte of the {what} arrived for" if idle else f"the {what} did not arrive within"
        body = orjson.dumps({"detail": f"{detail} {seconds:g} s"})
        self.transport.write(
            b"".join(
                [
                    STATUS_LINE[408],
                    b"content-type: application/json\r\nconnection: close\r\n",
                    b"content-length: %d\r\n\r\n" % len(body),
                    body,
                ]
            )
        )
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, "request head")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # the next request on a kept-alive connection
            self._arm(self.header_timeout_s, "request head")

    def on_headers_complete(self) -> None:
        self._last_byte = self.loop.time()
        self._arm(self.body_timeout_s, "request body")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._last_byte = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the connection now belongs to the WebSocket protocol: no HTTP deadline
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
