"""Slow clients against a real env service (uvicorn in a subprocess) over real sockets.

uvicorn bounds only the idle time between requests; a client that sends nothing, or trickles a
request's head or body a byte at a time, held its socket for as long as it liked (500 such
sockets were held 75 s). The service's head and body deadlines (`DeadlineProtocol`) answer
them 408 and close the socket, while ordinary clients go on being served.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from env_support import SHOP_PARAMS

from envs.client import EnvClient
from envs.service import serve_in_subprocess

HEAD_S, BODY_S = 1.0, 1.5
REQUEST_HEAD = b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"


@pytest.fixture(scope="module")
def url():
    with serve_in_subprocess("shop", 2, SHOP_PARAMS, header_timeout_s=HEAD_S, body_timeout_s=BODY_S) as base_url:
        yield base_url


async def _held(
    url: str, prefix: bytes, trickle: bytes, every_s: float = 0.1, give_up_s: float = 8.0
) -> tuple[float, bytes]:
    """Open a socket, send `prefix`, then one byte of `trickle` every `every_s` (never the
    whole request); how long until the service closed it (from just before connecting) and
    what it answered. `give_up_s` if it never closed it."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(prefix)
    await writer.drain()

    async def dribble() -> None:
        for i in range(len(trickle)):
            await asyncio.sleep(every_s)
            writer.write(trickle[i : i + 1])
            await writer.drain()

    sender = asyncio.ensure_future(dribble())
    try:
        answer = await asyncio.wait_for(reader.read(-1), give_up_s)  # until the service closes
        return time.monotonic() - start, answer
    except asyncio.TimeoutError:
        return give_up_s, b""
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        writer.close()


def test_slow_sockets_get_408_and_are_closed_while_others_are_served(url):
    """120 sockets that would hold the service forever: silent ones, ones trickling the head
    (a byte every 0.1 s: never idle, so no idle timer would catch them), ones trickling the
    body after a complete head, and a kept-alive one trickling its second request. Each is
    answered 408 and closed within its deadline (+ slack for a loaded machine) while a normal
    client plays an episode at the same time."""
    slow_head = b"POST /step HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200
    body = b'{"session_id": "ka", "seed": 1}'
    served = REQUEST_HEAD.replace(b"40", b"%d" % len(body)) + body

    async def go() -> tuple[list, list, list, list]:
        silent = [_held(url, b"", b"") for _ in range(40)]
        heads = [_held(url, b"", slow_head) for _ in range(40)]
        bodies = [_held(url, REQUEST_HEAD, b"{" + b" " * 200) for _ in range(39)]
        kept = [_held(url, served, slow_head)]  # first request answered (404), then a slow one
        async with EnvClient(url) as c:

            async def episode() -> dict:
                await c.create("normal")
                out = await c.reset("normal", 3)
                while not out.get("done"):
                    out = await c.step("normal", await c.expert("normal"))
                await c.close("normal")
                return out

            *results, final = await asyncio.gather(
                asyncio.gather(*silent),
                asyncio.gather(*heads),
                asyncio.gather(*bodies),
                asyncio.gather(*kept),
                episode(),
            )
            info = await c.info()
        assert final["reward"] == 1.0 and info["conserved"] and info["free"] == 2, (final, info)
        return tuple(results)

    silent, heads, bodies, kept = asyncio.run(go())
    slack = 3.0
    for name, rows, limit in (("silent", silent, HEAD_S), ("slow head", heads, HEAD_S), ("slow body", bodies, BODY_S)):
        held = sorted(t for t, _ in rows)
        assert limit - 0.1 <= held[0] and held[-1] <= limit + slack, (name, held[0], held[-1])
        assert all(a.startswith(b"HTTP/1.1 408 ") and b"did not arrive within" in a for _, a in rows), (
            name,
            rows[0][1],
        )
    ((held, answer),) = kept
    first, _, second = answer.partition(b"HTTP/1.1 408 ")
    assert first.startswith(b"HTTP/1.1 404 ") and b"unknown session" in first, answer
    assert b"request head did not arrive within 1 s" in second and held <= HEAD_S + slack


def test_a_request_inside_its_deadlines_is_served(url):
    """The deadlines bound the whole head and body, not each byte: a head that arrives in two
    parts and a body sent half a second later, both inside their deadlines, are answered."""

    async def go() -> bytes:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = b'{"session_id": "x"}'
        head = b"POST /close HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        for part in (head[:10], head[10:], body):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(HEAD_S / 2)
        answer = await asyncio.wait_for(reader.readuntil(b'{"ok":true}'), 5)
        writer.close()
        return answer

    assert asyncio.run(go()).startswith(b"HTTP/1.1 200 ")
