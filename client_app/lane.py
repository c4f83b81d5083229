"""Find or start the trainer service of this process's GPU lane, and talk to it.

A lane is the device set in `CUDA_VISIBLE_DEVICES` (or a CPU lane: `cpu`, or with
`run.cpu_lanes: N` one of `cpu0`..`cpuN-1`, leased per call by `leased_lane`, so a host without
a GPU runs N fits at once). Every ClientApp message of a
node on a lane goes to the same long-lived service (`client_app.service`), found through a Unix
socket named after (run id, lane) in the node's private runtime dir (`client_app.runtime_dir`:
shared by a host's simulation actors, one per SuperNode in deployment). A file lock makes
concurrent first messages start exactly one service, and concurrent shutdowns stop it exactly
once; a service that died is restarted, and the reason (its log tail) is reported. A service
that answers a call and then exits (its lane lost its ranks: `"exits": true` in the error body)
is waited for before the call's error is raised, so the next call starts a fresh one.

Errors cross the process boundary with their message: the service answers a failed request
with `{"error": {"type", "message"}}` and `LaneService.request` raises `ServiceRequestError`
carrying both, so the ClientApp's error names the root cause (e.g. `WeightsError: ...`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from client_app.runtime_dir import SERVICE_MODULE, NodeOwner, node_owner, open_lock, read_private, write_private
from fl_app.config import RunCfg

START_TIMEOUT_S = 1800.0  # first start may build the tiny model (minutes on 2 cores)
EXIT_TIMEOUT_S = 120.0  # a service that said it exits closes its trainer and env service first
REQUEST_TIMEOUT_S = 24 * 3600.0


class ServiceError(RuntimeError):
    """The trainer service could not be started or failed a request."""


class ServiceRequestError(ServiceError):
    """The trainer service refused or failed a request; `error_type` is the service-side
    exception's type name and `status` the HTTP status (4xx: the request, 5xx: the service)."""

    def __init__(self, path: str, status: int, error_type: str, message: str) -> None:
        self.path, self.status, self.error_type, self.message = path, status, error_type, message
        super().__init__(f"trainer service {path} failed (HTTP {status}): {error_type}: {message}")


LEASE_POLL_S = 0.05


def current_lane() -> str:
    """The lane of this process: its visible CUDA devices, or `cpu`."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return devices.replace(",", "-") if devices else "cpu"


def lane_devices(lane: str) -> list[str]:
    """The device set of a lane: its GPU ids (`0-1` -> ["0", "1"]), or ["cpu"] for a CPU lane."""
    return ["cpu"] if is_cpu_lane(lane) else lane.split("-")


def is_cpu_lane(lane: str) -> bool:
    return lane.startswith("cpu")


def cpu_lanes(n: int) -> list[str]:
    """The names of a host's `n` CPU lanes: one is `cpu` (the lane of a run without CPU lanes)."""
    return ["cpu"] if n == 1 else [f"cpu{i}" for i in range(n)]


def host_gpus() -> int:
    """The GPUs of this host as the NVIDIA driver lists them (a Ray actor's `CUDA_VISIBLE_DEVICES`
    hides the others); read without initialising CUDA."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def host_lanes(lane: str, run: RunCfg) -> list[str]:
    """The lanes this host offers for a run: its CPU lanes, or its GPUs in groups of
    `run.lane_devices` (the ids Ray hands its actors). The server reports those no fit used as idle."""
    if is_cpu_lane(lane):
        return cpu_lanes(run.cpu_lanes)
    gpus_per_lane = run.lane_devices
    own = lane_devices(lane)
    if not all(d.isdigit() for d in own):
        return [lane]  # GPUs named by UUID: only this lane is known
    ids = [str(i) for i in range(max(host_gpus(), 1 + max(map(int, own))))]
    groups = ["-".join(ids[i : i + gpus_per_lane]) for i in range(0, len(ids) - gpus_per_lane + 1, gpus_per_lane)]
    return groups if lane in groups else [*groups, lane]


def node_lanes(run: RunCfg) -> list[str]:
    """The lanes this process may serve a call on: its GPU lane, or any of the host's CPU lanes."""
    own = current_lane()
    return cpu_lanes(run.cpu_lanes) if is_cpu_lane(own) else [own]


def lane_services(
    run_id: int, run_config: dict[str, Any], run: RunCfg, log_dir: Path, run_dir: Path
) -> list[LaneService]:
    """The handles of every lane this process may use for the run (`node_lanes`)."""
    return [
        LaneService(run_id, run_config, log_dir, lane=name, run_dir=run_dir, host_lanes=host_lanes(name, run))
        for name in node_lanes(run)
    ]


@contextmanager
def serving_lane(
    run_id: int, run_config: dict[str, Any], run: RunCfg, log_dir: Path, run_dir: Path
) -> Iterator[LaneService]:
    """The service of a lane this process leased for one call (`leased_lane`: a busy host's call queues)."""
    lanes = {lane.lane: lane for lane in lane_services(run_id, run_config, run, log_dir, run_dir)}
    with leased_lane(node_owner(), run_id, list(lanes)) as name:
        yield lanes[name]


@contextmanager
def leased_lane(owner: NodeOwner, run_id: int, lanes: list[str]) -> Iterator[str]:
    """A free lane of `lanes`, held for the caller's call (one fit at a time per lane): the first
    whose lease lock is free; while all are busy the call queues (polls) until one frees."""
    if len(lanes) == 1:
        yield lanes[0]
        return
    fds = {lane: open_lock(owner.runtime_dir() / f"lease-{run_id}-{lane}.lock") for lane in lanes}
    try:
        while True:
            for lane, fd in fds.items():
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                yield lane
                return
            time.sleep(LEASE_POLL_S)
    finally:
        for fd in fds.values():
            os.close(fd)  # releases the lease


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def error_of(response: httpx.Response) -> tuple[str, str, bool]:
    """(type, message, whether the service exits after it) of a failed service response,
    whatever shape its body has."""
    try:
        body = response.json()
    except ValueError:
        return "HTTPError", response.text[:2000] or response.reason_phrase, False
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("type", "Error")), str(err.get("message", "")), err.get("exits") is True
    return "HTTPError", json.dumps(body)[:2000], False


class LaneService:
    """Client-side handle of the trainer service for (node, run id, lane)."""

    def __init__(
        self,
        run_id: int,
        run_config: dict[str, Any],
        log_dir: Path,
        lane: str | None = None,
        owner: NodeOwner | None = None,
        run_dir: Path | None = None,
        host_lanes: list[str] | None = None,
    ) -> None:
        self.run_id, self.run_config, self.run_dir = run_id, run_config, run_dir
        self.lane = lane or current_lane()
        self.host_lanes = host_lanes or [self.lane]
        self.span: tuple[float, float] | None = None  # epoch seconds of the last request served
        self.owner = owner or node_owner()
        rt = self.owner.runtime_dir()
        stem = f"svc-{run_id}-{self.lane}"
        self.socket = rt / f"{stem}.sock"
        self.lock_path = rt / f"{stem}.lock"
        self.pid_path = rt / f"{stem}.pid"
        # one log per service: per lane in simulation, per (host, SuperNode, lane) in deployment
        node = f"{socket.gethostname()}-{self.owner.scope}-" if self.owner.scope else ""
        self.log_path = log_dir / f"service-{node}{self.lane}.log"

    def where(self) -> dict[str, Any]:
        """Where this node's trainer service runs and logs (the server lists it in summary.json)."""
        return {
            "node_host": socket.gethostname(),
            "lane": self.lane,
            "devices": lane_devices(self.lane),
            "host_lanes": self.host_lanes,
            "service_log": str(self.log_path),
        }

    def _client(self, timeout: float) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://svc", timeout=timeout)

    def health(self) -> dict[str, Any] | None:
        if not self.socket.exists():
            return None
        try:
            with self._client(5.0) as c:
                r = c.get("/health")
                return r.json() if r.status_code == 200 else None
        except httpx.TransportError:
            return None

    def pid(self) -> int | None:
        try:
            return int(read_private(self.pid_path) or "")
        except ValueError:
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
            old = self.pid()
            if old is not None and _alive(old):
                # Started by another ClientApp and still building: wait for it below.
                return self._wait_ready(old)
            if old is not None:
                print(
                    f"[lane {self.lane}] trainer service pid {old} died; restarting. Its log ends:\n{self._log_tail()}",
                    file=sys.stderr,
                )
            return self._start()

    def _start(self) -> dict[str, Any]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            SERVICE_MODULE,
            "--socket",
            str(self.socket),
            "--run-id",
            str(self.run_id),
            "--lane",
            self.lane,
            "--run-config",
            json.dumps(self.run_config),
            "--owner",
            self.owner.as_arg(),
        ]
        if self.run_dir is not None:
            cmd += ["--run-dir", str(self.run_dir)]
        with open(self.log_path, "ab") as log:
            # A new session: the service must outlive this (possibly per-message) ClientApp process.
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=Path(__file__).resolve().parent.parent,
            )
        write_private(self.pid_path, str(proc.pid))
        return self._wait_ready(proc.pid)

    def _wait_ready(self, pid: int) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            h = self.health()
            if h is not None:
                return h
            if not _alive(pid):
                raise ServiceError(
                    f"trainer service for lane {self.lane} exited during start-up "
                    f"(log: {self.log_path}):\n{self._log_tail()}"
                )
            time.sleep(0.5)
        raise ServiceError(
            f"trainer service for lane {self.lane} not ready after {START_TIMEOUT_S:.0f} s (log: {self.log_path})"
        )

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        start = time.time()
        pid = int(self.ensure_started()["pid"])
        try:
            with self._client(REQUEST_TIMEOUT_S) as c:
                r = c.post(path, json=body)
            self.span = (start, time.time())
        except httpx.TransportError as e:
            raise ServiceError(
                f"trainer service for lane {self.lane} failed during {path}: {e} (its log: "
                f"{self.log_path}); the log ends:\n{self._log_tail()}"
            ) from e
        if r.status_code != 200:
            error_type, message, exits = error_of(r)
            deadline = time.monotonic() + EXIT_TIMEOUT_S
            while exits and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            raise ServiceRequestError(path, r.status_code, error_type, message)
        return r.json()

    def shutdown(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """Stop the service and wait for its process; returns its last health (fits, evals, pid)
        if this call stopped it, None if none was running. Under the lane's lock, so of several
        nodes sharing a lane exactly one stops it and the others see it gone (issue 17)."""
        with _file_lock(self.lock_path):
            h = self.health()
            if h is None:
                return None
            with self._client(10.0) as c:
                c.post("/shutdown")
            pid = int(h["pid"])
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            return h


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


def stop_lanes(lanes: list[LaneService]) -> dict[str, int | float]:
    """Stop these lanes' services; how many this call stopped and what they served (fits, evals,
    the largest RSS). Zeros where another node of the host stopped them first (simulation)."""
    stopped = [h for h in (lane.shutdown() for lane in lanes) if h]
    return {
        "stopped": len(stopped),
        "fits": sum(int(h.get("fits", 0)) for h in stopped),
        "evals": sum(int(h.get("evals", 0)) for h in stopped),
        "rss_mb": max((float(h.get("rss_mb", 0.0)) for h in stopped), default=0.0),
    }
