"""Find and stop the local SuperLink that `flwr run .` starts and leaves running.

Flower 1.42 starts it detached (its own process session) on 127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT
(default 39091) and offers no command to stop it. We find it by the PID listening on that port
(never by a name pattern: other users' SuperLinks may run on the same machine) and stop its
process group, plus the process group of every process connected to one of its listening ports:
the simulation runtime of a run in progress (`flwr-simulation`, its Ray cluster and our trainer
services) runs detached in a group of its own and would otherwise keep training.

    python -m server_app.local_superlink status
    python -m server_app.local_superlink stop
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

import psutil


def superlink_port() -> int:
    return int(os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "39091"))


def find_superlink(port: int | None = None) -> psutil.Process | None:
    """The process of this user listening on the local SuperLink port, if any."""
    port = port or superlink_port()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            proc = psutil.Process(conn.pid)
            if proc.uids().real == os.getuid():
                return proc
    return None


def stop_superlink(port: int | None = None, timeout_s: float = 15.0) -> int | None:
    """Stop the local SuperLink's process group and those of its connected runtimes; returns
    the SuperLink's PID, or None when none is running."""
    proc = find_superlink(port)
    if proc is None:
        return None
    groups = {os.getpgid(proc.pid)} | _connected_groups(proc)
    members = [p for p in psutil.process_iter() if _pgid(p) in groups]
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    _, alive = psutil.wait_procs(members, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return proc.pid


def _connected_groups(proc: psutil.Process) -> set[int]:
    """Process groups (this user's, never our own) of processes connected to `proc`'s listening ports."""
    ports = {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    own = os.getpgid(0)
    groups = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.pid and conn.pid != proc.pid and conn.raddr and conn.raddr.port in ports:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                if psutil.Process(conn.pid).uids().real == os.getuid() and (g := os.getpgid(conn.pid)) != own:
                    groups.add(g)
    return groups


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["status", "stop"])
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    if args.action == "status":
        proc = find_superlink(args.port)
        print(f"local SuperLink: pid {proc.pid}, started {time.ctime(proc.create_time())}" if proc
              else "no local SuperLink is running")
        return 0
    pid = stop_superlink(args.port)
    print(f"stopped local SuperLink pid {pid}" if pid else "no local SuperLink is running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
