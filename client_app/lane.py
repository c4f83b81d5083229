"""Find or start the trainer service of this process's GPU lane, and talk to it.

A lane is the device set in `CUDA_VISIBLE_DEVICES` (or `cpu`). Every ClientApp message on a
lane goes to the same long-lived service (`client_app.service`), found through a Unix socket
named after (run id, lane). A file lock makes concurrent first messages start exactly one
service; a service that died is restarted, and the reason (its log tail) is reported.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

START_TIMEOUT_S = 1800.0    # first start may build the tiny model (minutes on 2 cores)
REQUEST_TIMEOUT_S = 24 * 3600.0


class ServiceError(RuntimeError):
    """The trainer service could not be started or failed a request."""


def current_lane() -> str:
    """The lane of this process: its visible CUDA devices, or `cpu`."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return devices.replace(",", "-") if devices else "cpu"


def runtime_dir() -> Path:
    """Short per-user directory for sockets (Unix socket paths are limited to ~100 bytes)."""
    d = Path(os.environ.get("FEDAGENT_RUNTIME_DIR") or Path(tempfile.gettempdir()) / f"fedagent-{os.getuid()}")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class LaneService:
    """Client-side handle of the trainer service for (run id, lane)."""

    def __init__(self, run_id: int, run_config: dict[str, Any], log_dir: Path, lane: str | None = None,
                 owner_pid: int | None = None) -> None:
        self.run_id, self.run_config = run_id, run_config
        self.lane = lane or current_lane()
        stem = f"svc-{run_id}-{self.lane}"
        self.socket = runtime_dir() / f"{stem}.sock"
        self.lock_path = runtime_dir() / f"{stem}.lock"
        self.pid_path = runtime_dir() / f"{stem}.pid"
        self.log_path = log_dir / f"service-{self.lane}.log"
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid

    def _client(self, timeout: float) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://svc",
                            timeout=timeout)

    def health(self) -> dict[str, Any] | None:
        if not self.socket.exists():
            return None
        try:
            with self._client(5.0) as c:
                r = c.get("/health")
                return r.json() if r.status_code == 200 else None
        except httpx.TransportError:
            return None

    def _pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no service log)"

    def ensure_started(self) -> dict[str, Any]:
        """Return the live service's health, starting it (once per lane) if needed."""
        with _file_lock(self.lock_path):
            h = self.health()
            if h is not None:
                return h
            old = self._pid()
            if old is not None and _alive(old):
                # Started by another ClientApp and still building: wait for it below.
                return self._wait_ready(old)
            if old is not None:
                print(f"[lane {self.lane}] trainer service pid {old} died; restarting. Its log ends:\n"
                      f"{self._log_tail()}", file=sys.stderr)
            return self._start()

    def _start(self) -> dict[str, Any]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "client_app.service", "--socket", str(self.socket),
               "--run-id", str(self.run_id), "--lane", self.lane,
               "--run-config", json.dumps(self.run_config), "--owner-pid", str(self.owner_pid)]
        with open(self.log_path, "ab") as log:
            # A new session: the service must outlive this (possibly per-message) ClientApp process.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=Path(__file__).resolve().parent.parent)
        self.pid_path.write_text(str(proc.pid))
        return self._wait_ready(proc.pid)

    def _wait_ready(self, pid: int) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            h = self.health()
            if h is not None:
                return h
            if not _alive(pid):
                raise ServiceError(f"trainer service for lane {self.lane} exited during start-up "
                                   f"(log: {self.log_path}):\n{self._log_tail()}")
            time.sleep(0.5)
        raise ServiceError(f"trainer service for lane {self.lane} not ready after {START_TIMEOUT_S:.0f} s "
                           f"(log: {self.log_path})")

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.ensure_started()
        try:
            with self._client(REQUEST_TIMEOUT_S) as c:
                r = c.post(path, json=body)
        except httpx.TransportError as e:
            raise ServiceError(f"trainer service for lane {self.lane} failed during {path}: {e}; "
                               f"its log ends:\n{self._log_tail()}") from e
        if r.status_code != 200:
            raise ServiceError(f"trainer service {path} -> HTTP {r.status_code}: {r.text[:2000]}")
        return r.json()

    def shutdown(self, timeout_s: float = 60.0) -> bool:
        """Ask the service to exit and wait for its process; True if one was running."""
        pid = self._pid()
        if self.health() is None:
            return False
        with self._client(10.0) as c:
            c.post("/shutdown")
        deadline = time.monotonic() + timeout_s
        while pid is not None and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
