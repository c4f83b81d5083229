"""Find and stop the local SuperLink that `flwr run .` starts and leaves running.

Flower 1.42 starts it detached (its own process session), with its log file in
`$FLWR_HOME/local-superlink/superlink.log`, and offers no command to stop it. We identify it by
that log file on its command line, i.e. by the FLWR_HOME it was started with, never by its port
alone (on a shared machine another user's, or another checkout's, SuperLink may hold the port
this environment would use). `stop` ends its process group plus the process group of every
process connected to one of its listening ports: the simulation runtime of a run in progress
(`flwr-simulation`, its Ray cluster and our trainer services) runs detached in a group of its
own and would otherwise keep training.

    python -m server_app.local_superlink status [--flwr-home DIR]
    python -m server_app.local_superlink stop [--flwr-home DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from fl_app.host import flwr_home

LOG_FLAG = "--log-file"


def _log_file(home: Path) -> Path:
    return Path(os.path.realpath(home / "local-superlink" / "superlink.log"))


def _started_with_log(proc: psutil.Process, want: Path) -> bool:
    cmd = proc.info["cmdline"] or []
    if not any(Path(a).name == "flower-superlink" for a in cmd[:2]) or LOG_FLAG not in cmd[:-1]:
        return False
    given = Path(cmd[cmd.index(LOG_FLAG) + 1])
    if not given.is_absolute():
        given = Path(proc.info["cwd"] or "/") / given
    return Path(os.path.realpath(given)) == want


def find_superlink(home: Path | None = None) -> psutil.Process | None:
    """This user's local SuperLink started with FLWR_HOME `home` (default: this environment's)."""
    want = _log_file(home or flwr_home())
    for proc in psutil.process_iter(["cmdline", "cwd", "uids"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if proc.info["uids"] and proc.info["uids"].real == os.getuid() and _started_with_log(proc, want):
                return proc
    return None


def stop_superlink(home: Path | None = None, timeout_s: float = 15.0) -> int | None:
    """Stop the local SuperLink of FLWR_HOME `home`, its process group and those of its connected
    runtimes; returns the SuperLink's PID, or None when none is running."""
    proc = find_superlink(home)
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
    ap.add_argument("--flwr-home", type=Path, default=None, help="default: $FLWR_HOME, else ~/.flwr")
    args = ap.parse_args(argv)
    home = args.flwr_home or flwr_home()
    if args.action == "status":
        proc = find_superlink(home)
        print(
            f"local SuperLink of {home}: pid {proc.pid}, started {time.ctime(proc.create_time())}"
            if proc
            else f"no local SuperLink of {home} is running"
        )
        return 0
    pid = stop_superlink(home)
    print(f"stopped the local SuperLink of {home}, pid {pid}" if pid else f"no local SuperLink of {home} is running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
