"""Is the ServerApp of a run alive? heartbeat.json in the run dir says, and who wrote it.

summary.json says `running` from the start of a run until its end, so a ServerApp that is
killed (or loses its host) leaves a run that looks running forever. While the ServerApp's
`main` runs, `beating` keeps heartbeat.json fresh: the server's process (pid, its start time
in kernel ticks, the kernel boot and pid namespace it lives in), its host, and the time of the
last beat, rewritten atomically every PERIOD_S seconds by a daemon thread; on every way out of
`main` a last beat records `stopped_at`. `check` judges a beat:

- stopped: the server left `main`;
- written in this kernel and pid namespace (the same host, seen from the same container): the
  process decides, at once: alive while that pid is the same process (same start ticks, so a
  reused pid is not taken for it) and not a zombie;
- written elsewhere: alive while the last beat is younger than STALE_S (three periods, plus
  slack for clock skew between hosts and a slow shared disk).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from fl_app.paths import PathEscapeError
from fl_app.rundir import RunDir

PERIOD_S = 5.0
STALE_S = 3 * PERIOD_S + 15.0


class Beat(BaseModel):
    """One heartbeat.json: what `check` trusts of it is typed here (anything else fails to parse)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    run_id: int
    pid: int = Field(gt=0, lt=2**31)
    start_ticks: int | None  # None: no /proc (not Linux); then only the beat's age counts
    proc_ns: str
    host: str
    beat_at: float
    stopped_at: float | None = None


@dataclass(frozen=True)
class Liveness:
    alive: bool
    why: str  # e.g. "pid 41 on host-a, beat 2 s ago" or "pid 41 on host-a is gone"


def _proc_ns() -> str:
    """This kernel boot and pid namespace: pids compare only within one ('' without /proc)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """The start time (kernel ticks since boot) of process `pid`; None when it is gone or a
    zombie (a killed server its parent has not reaped yet is dead), or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _beat(run_id: int) -> dict[str, object]:
    pid = os.getpid()
    return {"run_id": run_id, "pid": pid, "start_ticks": start_ticks(pid), "proc_ns": _proc_ns()}


@contextmanager
def every(seconds: float, tick: Callable[[], None], name: str) -> Iterator[None]:
    """Call `tick` every `seconds` from a daemon thread while the block runs; the thread is
    stopped and joined on every way out, so no tick runs after the block."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(seconds):
            tick()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def beating(rd: RunDir, run_id: int, log: Callable[[str], None], every_s: float = PERIOD_S) -> Iterator[None]:
    """heartbeat.json while the block runs. The first beat is written before the block starts
    (a server that cannot vouch for itself does not run); a failed later beat is logged once
    per distinct error; the last beat (`stopped_at`) is written on every way out."""
    me = {**_beat(run_id), "host": socket.gethostname(), "period_s": every_s}
    rd.write_heartbeat({**me, "beat_at": time.time(), "stopped_at": None})
    failing = ""

    def beat() -> None:
        nonlocal failing
        try:
            rd.write_heartbeat({**me, "beat_at": time.time(), "stopped_at": None})
            failing = ""
        except (OSError, PathEscapeError) as e:
            if str(e) != failing:
                log(f"cannot write {rd.heartbeat_path} ({e}); `server_app.status` may call this run dead")
            failing = str(e)

    try:
        with every(every_s, beat, "fedagent-liveness"):
            yield
    finally:
        now = time.time()
        try:
            rd.write_heartbeat({**me, "beat_at": now, "stopped_at": now})
        except (OSError, PathEscapeError) as e:  # never hide why the run ended
            log(f"cannot write the last beat to {rd.heartbeat_path} ({e})")


def check(beat: Beat, now: float | None = None) -> Liveness:
    """Whether the server that wrote `beat` is alive (see the module docstring for the rules)."""
    now = time.time() if now is None else now
    who = f"pid {beat.pid} on {beat.host}"
    if beat.stopped_at is not None:
        return Liveness(False, f"its ServerApp ({who}) stopped {_ago(now - beat.stopped_at)}")
    if beat.start_ticks is not None and beat.proc_ns and beat.proc_ns == _proc_ns():
        if start_ticks(beat.pid) != beat.start_ticks:
            return Liveness(False, f"its ServerApp ({who}) is gone")
        return Liveness(True, f"ServerApp {who}, beat {_ago(now - beat.beat_at)}")
    age = now - beat.beat_at
    if age > STALE_S:
        return Liveness(False, f"no heartbeat from its ServerApp ({who}) for {age:.0f} s (> {STALE_S:.0f} s)")
    return Liveness(True, f"ServerApp {who}, beat {_ago(age)}")


def _ago(seconds: float) -> str:
    return "just now" if not math.isfinite(seconds) or seconds < 1 else f"{seconds:.0f} s ago"
