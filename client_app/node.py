"""One command per SuperNode: `flower-supernode` with its warm SuperExec beside it, and no idle naps.

`python -m client_app.node FLAGS` is `flower-supernode FLAGS --isolation process` (same flags,
same Fleet loop: Flower's own `flower_supernode`) that also starts the node's SuperExec, the
warm one that forks each ClientApp (`client_app.superexec`), as its child, tied to it by
`--parent-pid` and stopped by PID on every way out. Two things differ from Flower's node:

- Flower's Fleet loop sleeps 3 s whenever a pull finds no message, and 0.5 s between checks of
  its own state for a ClientApp's reply; a message therefore waited 1.75 s on average before it
  was served and answered, three messages a round (docs/benchmarks.md). Here the idle nap lasts
  at most `FEDAGENT_NODE_POLL_S` (default 0.2 s): a pull every 0.2 s while idle, one small
  request to the SuperLink each, which a SuperLink serving a few hundred nodes absorbs; raise it
  for more. The checks of its own state (no request) come every `LOCAL_POLL_S` (20 ms). Its
  object pulls retry after 50 ms instead of 1 s (`server_app.pull_backoff`).
- The isolation is always `process`: the ClientApps are forks of the SuperExec started here.
  `--isolation subprocess` is refused; plain `flower-supernode` is that.

    CUDA_VISIBLE_DEVICES=0 python -m client_app.node --insecure --superlink server:9093 \\
        --port 9094 --node-config "partition-id=0 num-partitions=2"
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import ModuleType

from flwr.common.constant import ISOLATION_MODE_PROCESS
from flwr.supercore.address import resolve_bind_address
from flwr.supercore.constant import SUPERNODE_UVICORN_DEFAULT_PORT, UVICORN_DEFAULT_HOST
from flwr.supercore.exit import add_exit_handler
from flwr.supernode import start_client_internal as fleet_loop  # the module (its loop's sleeps)

from server_app.pull_backoff import shorten_pull_backoff

POLL_ENV, POLL_DEFAULT_S = "FEDAGENT_NODE_POLL_S", 0.2
LOCAL_POLL_S = 0.02  # Flower's 0.5 s between checks of the node's own state for a reply
STOP_GRACE_S = 10.0


class NodeArgsError(ValueError):
    """The command line or environment cannot start a node; the message says how to fix it."""


class CappedSleep:
    """The `time` module, except that `sleep` naps at most `cap_s` where Flower's loop naps its
    idle `IDLE_S` before the next pull, and at most `local_s` where it naps less, between checks
    of its own state (the caller loops again)."""

    IDLE_S = 3.0

    def __init__(self, real: ModuleType, cap_s: float, local_s: float = LOCAL_POLL_S):
        self._real, self.cap_s, self.local_s = real, cap_s, local_s

    def sleep(self, seconds: float) -> None:
        self._real.sleep(min(seconds, self.cap_s if seconds >= self.IDLE_S else self.local_s))

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def poll_seconds(environ: Mapping[str, str]) -> float:
    raw = environ.get(POLL_ENV, "")
    if not raw:
        return POLL_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3:
        raise NodeArgsError(f"{POLL_ENV}={raw!r}: give the idle poll in seconds, above 0 and at most 3 (Flower's)")
    return value


def superexec_command(argv: Sequence[str], parent_pid: int) -> list[str]:
    """The SuperExec this node starts: it dials the node's Runtime API (loopback when the API
    binds every address, as Flower's own node does), with TLS when the API serves TLS."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolation")
    parser.add_argument("--host", default=UVICORN_DEFAULT_HOST)
    parser.add_argument("--port", default=str(SUPERNODE_UVICORN_DEFAULT_PORT))
    parser.add_argument("--ssl-ca-certfile")
    known, _ = parser.parse_known_args(list(argv))
    if known.isolation not in (None, ISOLATION_MODE_PROCESS):
        raise NodeArgsError(
            f"--isolation {known.isolation}: client_app.node always runs its ClientApps as forks of its own "
            "SuperExec (process isolation); drop the flag, or run plain flower-supernode for Flower's isolation"
        )
    host = f"[{known.host}]" if ":" in known.host else known.host
    tls = ["--root-certificates", known.ssl_ca_certfile] if known.ssl_ca_certfile else ["--insecure"]
    address = resolve_bind_address(f"{host}:{known.port}")
    cmd = [sys.executable, "-m", "client_app.superexec", *tls, "--runtime-api-address", address]
    return [*cmd, "--parent-pid", str(parent_pid)]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the SuperExec by PID: SIGTERM (it stops its ClientApps), SIGKILL after the grace."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def main() -> None:
    argv = sys.argv[1:]
    try:
        cap_s = poll_seconds(os.environ)
        cmd = superexec_command(argv, os.getpid())
    except NodeArgsError as e:
        sys.exit(f"client_app.node: {e}")
    if "--isolation" not in argv:
        argv = [*argv, "--isolation", ISOLATION_MODE_PROCESS]
    superexec = subprocess.Popen(cmd)
    add_exit_handler(lambda: stop(superexec))
    fleet_loop.time = CappedSleep(time, cap_s)  # type: ignore[assignment]
    shorten_pull_backoff()
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *argv]
    try:
        flower_supernode()
    finally:
        stop(superexec)


if __name__ == "__main__":
    main()
