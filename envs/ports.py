"""Ports for our listeners: outside the kernel's ephemeral range, checked by binding.

Why (invariant 23): the kernel hands ports of its ephemeral range (32768-60999 by default) to
any process that binds port 0 or connects out, at any moment. A service port inside it is a bet
that nothing draws it for the whole run; the predecessor lost a 70-round run at round 13 to a
Ray agent squatting an env-service port. So service ports live below the range, are checked
free at start, and a listener that must pick one draws from a private band and gets one clean
retry with a fresh port when the bind still collides (another process won the race between
probe and bind).
"""

from __future__ import annotations

import errno
import os
import random
import socket
from pathlib import Path

# The kernel's default; `ephemeral_range()` reads the live value where the kernel exposes it.
DEFAULT_EPHEMERAL = (32768, 60999)
# Where our listeners pick ports: below the ephemeral range, above most well-known services.
PRIVATE_BAND = (20000, 32767)
_KERNEL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class PortError(RuntimeError):
    """A port that cannot be used; the message names the port and the way out."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), or the Linux default where unreadable."""
    try:
        lo, hi = (int(x) for x in _KERNEL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def in_ephemeral_range(port: int) -> bool:
    lo, hi = ephemeral_range()
    return lo <= port <= hi


def check_port_allowed(port: int) -> None:
    """Refuse ports the kernel may hand to someone else mid-run (and nonsense values)."""
    if not 1024 <= port <= 65535:
        raise PortError(
            f"port {port} is not a usable unprivileged port; pick one in {PRIVATE_BAND[0]}-{PRIVATE_BAND[1]}"
        )
    if in_ephemeral_range(port):
        lo, hi = ephemeral_range()
        raise PortError(
            f"port {port} is inside the kernel's ephemeral range {lo}-{hi}, where any "
            f"process may be handed it mid-run; pick one in "
            f"{PRIVATE_BAND[0]}-{PRIVATE_BAND[1]} (or pass --relocate)"
        )


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with the options uvicorn itself uses."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a listener could bind (host, port) right now (a probe, not a reservation)."""
    try:
        _bound_socket(host, port).close()
        return True
    except OSError:
        return False


def choose_free_port(
    host: str = "127.0.0.1", band: tuple[int, int] = PRIVATE_BAND, rng: random.Random | None = None, tries: int = 200
) -> int:
    """A port of `band` that is free now and outside the ephemeral range.

    Probing starts at a random point (seeded by pid and time unless `rng` is given) so
    concurrent launchers do not all race for the band's first port.
    """
    rng = rng or random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    lo, hi = band
    eph_lo, eph_hi = ephemeral_range()
    candidates = [p for p in range(lo, hi + 1) if not eph_lo <= p <= eph_hi]
    if not candidates:
        raise PortError(f"band {lo}-{hi} lies entirely inside the ephemeral range {eph_lo}-{eph_hi}")
    start = rng.randrange(len(candidates))
    for i in range(min(tries, len(candidates))):
        port = candidates[(start + i) % len(candidates)]
        if port_is_free(port, host):
            return port
    raise PortError(f"no free port found in {lo}-{hi} after {tries} probes on {host}")


def bind_listener(
    host: str, port: int | None, relocate: bool = False, band: tuple[int, int] = PRIVATE_BAND
) -> socket.socket:
    """A listening socket: the "is it free" check and the bind are the same operation.

    `port=None` picks from `band`. A requested port that is busy or inside the ephemeral range
    is an error naming the fix, unless `relocate`, which moves to a free band port. A bind on a
    port *we* chose that still collides (another process won the race between probe and bind)
    gets exactly one clean retry with a fresh port; a second collision is reported, not looped.
    """
    if port is not None:
        try:
            check_port_allowed(port)
            return _listening(host, port)
        except (PortError, OSError) as e:
            if isinstance(e, OSError) and e.errno != errno.EADDRINUSE:
                raise
            if not relocate:
                if isinstance(e, PortError):
                    raise
                raise PortError(
                    f"port {port} on {host} is already in use; stop whatever listens "
                    f"there, pick another port, or pass --relocate"
                ) from e
    for attempt in (1, 2):
        fresh = choose_free_port(host, band)
        try:
            return _listening(host, fresh)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or attempt == 2:
                raise PortError(f"could not bind {host}:{fresh} ({e}) after one clean retry") from e
    raise AssertionError("unreachable")


def _listening(host: str, port: int) -> socket.socket:
    sock = _bound_socket(host, port)
    sock.listen(2048)
    return sock
