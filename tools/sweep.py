"""Arms x seeds of real `flwr run`s, several at once on one machine, then one report.

    python -m tools.sweep --arm grpo='recipe="tiny-shop-grpo"' --arm gigpo='recipe="tiny-shop-gigpo"' \\
        --seeds 0,1,2 --run-config rounds=12 --jobs 6 --threads 2 --out sweeps/gigpo

Each job is `flwr run . --run-config '<arm> <--run-config> seed=S run-dir="OUT/ARM-sS"' --stream`
with a Flower of its own (FLWR_HOME, local SuperLink ports, Ray and runtime dirs: jobs never meet),
`FEDAGENT_CPU_THREADS` torch threads and, when the jobs fit the machine's cores, pinned to
`--threads` cores of their own, so that a job's numbers do not depend on its neighbours'. A job
whose run dir is already complete (`server_app.status` exit 0) is skipped and a partial one
resumes (the run dir is the state), so an interrupted sweep continues where it stopped. Every
arm is resolved before any process starts. At the end: `server_app.report` over every run dir
(OUT/report: the arms' table, bands.png). Exit 0 when every job's run completed, 1 otherwise.
On a 2-core machine, `--jobs 1`: two `flwr run`s at once there run several times slower.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flwr.common.config import parse_config_args

from envs.ports import choose_free_port
from fl_app.config import ConfigError, load_config
from fl_app.host import FlowerMissing, require_flwr
from server_app import report
from server_app.local_superlink import stop_superlink

ROOT = Path(__file__).resolve().parent.parent


class SweepError(ValueError):
    """An arm or option that cannot run; the message names it and the fix."""


def private_flower_env(home: Path, short: Path, flwr: str) -> dict[str, str]:
    """The environment of a `flwr run` that shares nothing with any other on the machine: its own
    FLWR_HOME and local SuperLink ports, Ray and runtime dirs under `short` (Unix socket paths
    are limited to 107 bytes), and `flwr`'s own interpreter first on PATH (flwr starts
    `flower-superlink` from PATH)."""
    http_port, control_port = choose_free_port(), choose_free_port()
    while control_port == http_port:
        control_port = choose_free_port()
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "RAY_TMPDIR": str(short / "ray"),
        "FEDAGENT_RUNTIME_DIR": str(short / "rt"),
        "PATH": os.pathsep.join([str(Path(flwr).parent), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


@dataclass
class Job:
    arm: str
    seed: int
    run_config: str
    run_dir: Path
    cores: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.arm}-s{self.seed}"


def parse_arm(text: str) -> tuple[str, str]:
    name, sep, overrides = text.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise SweepError(f"--arm {text!r}: write NAME=RUN_CONFIG, e.g. gigpo='recipe=\"tiny-shop-gigpo\"'")
    return name, overrides


def check_arm(name: str, run_config: str) -> None:
    """Resolve the arm's recipe as the ServerApp will (a typo fails here, before any process)."""
    try:
        overrides = parse_config_args([run_config]) if run_config.strip() else {}
        load_config(str(overrides.get("recipe") or "tiny-shop-grpo"), overrides=overrides)
    except (ConfigError, ValueError) as e:
        raise SweepError(f"arm {name!r}: {e}") from None


def plan(arms: Sequence[str], seeds: Sequence[int], common: str, out: Path) -> list[Job]:
    """The jobs, arm-major, each arm resolved once before any process starts."""
    planned: list[Job] = []
    names: set[str] = set()
    for text in arms:
        name, overrides = parse_arm(text)
        if name in names:
            raise SweepError(f"two arms are named {name!r}: give each arm its own name")
        names.add(name)
        check_arm(name, f"{overrides} {common}")
        for seed in seeds:
            run_dir = (out / f"{name}-s{seed}").resolve()
            rc = f'{overrides} {common} seed={seed} run-dir="{run_dir}"'
            planned.append(Job(name, seed, " ".join(rc.split()), run_dir))
    return planned


def core_slots(jobs: int, threads: int, cores: Sequence[int]) -> list[list[int]]:
    """`threads` of `cores` of their own per job slot when the slots fit in them, else no pinning."""
    if jobs * threads > len(cores):
        return []
    return [list(cores[s * threads : (s + 1) * threads]) for s in range(jobs)]


def parse_cores(text: str) -> list[int]:
    """'0-11,14' -> [0, ..., 11, 14]; '' -> every core this process may run on."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            cores += list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SweepError(f"--cores {text!r}: write core numbers and ranges, e.g. 0-11,14") from None
    return cores


def complete(run_dir: Path) -> bool:
    """`server_app.status` says the run is complete (exit 0)."""
    cmd = [sys.executable, "-m", "server_app.status", str(run_dir)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=120).returncode == 0


class Running:
    """One job's `flwr run` in its own process session and its own Flower."""

    def __init__(self, job: Job, out: Path, threads: int, federation_config: str, flwr: str):
        self.job = job
        self.home = out / ".flwr" / job.name
        self.home.mkdir(parents=True, exist_ok=True)
        self.short = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp"))
        env = private_flower_env(self.home, self.short, flwr) | {"FEDAGENT_CPU_THREADS": str(threads)}
        cmd = [flwr, "run", str(ROOT), "--run-config", job.run_config, "--stream"]
        if federation_config:
            cmd += ["--federation-config", federation_config]
        self.log = out / "logs" / f"{job.name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cores = job.cores
        with open(self.log, "ab") as fh:
            fh.write(f"+ {shlex.join(cmd)}\n".encode())
            fh.flush()
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
            )
        self.t0 = time.monotonic()

    def stop(self) -> None:
        """End the job's process group and its local SuperLink (and the runtimes under it), by PID."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        stop_superlink(self.home)
        shutil.rmtree(self.short, ignore_errors=True)


def summary_line(job: Job, ok: bool, seconds: float) -> str:
    try:
        vals = [r["val_success"] for r in report.load_run(job.run_dir).rows if "val_success" in r]
    except Exception:  # noqa: BLE001 - a failed job may leave no readable run dir
        vals = []
    curve = f"val {vals[0]:.3f} -> {vals[-1]:.3f} over {len(vals) - 1} rounds" if vals else "no validation"
    return f"{job.name}: {'complete' if ok else 'NOT complete'}, {curve}, {seconds:.0f} s"


def run_jobs(
    planned: list[Job], out: Path, jobs: int, threads: int, federation_config: str, cores: Sequence[int], flwr: str
) -> list[Job]:
    """Run every job not yet complete, `jobs` at a time; returns the jobs whose run did not complete."""
    todo = [j for j in planned if not complete(j.run_dir)]
    for j in planned:
        if j not in todo:
            print(f"{j.name}: already complete, skipped", flush=True)
    free = core_slots(jobs, threads, cores)
    running: list[Running] = []
    failed: list[Job] = []
    done = len(planned) - len(todo)
    try:
        while todo or running:
            while todo and len(running) < jobs:
                job = todo.pop(0)
                job.cores = free.pop(0) if free else []
                running.append(Running(job, out, threads, federation_config, flwr))
            time.sleep(1.0)
            for r in [r for r in running if r.proc.poll() is not None]:
                r.stop()
                running.remove(r)
                if r.job.cores:
                    free.append(r.job.cores)
                ok = complete(r.job.run_dir)
                done += 1
                if not ok:
                    failed.append(r.job)
                line = summary_line(r.job, ok, time.monotonic() - r.t0)
                print(f"[{done}/{len(planned)}] {line}" + ("" if ok else f" (log: {r.log})"), flush=True)
    finally:
        for r in running:
            r.stop()
    return failed


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the sweep through `run_jobs`' `finally`, which stops every job it
    started: each runs in a process group of its own, so a signal to the sweep's group alone
    would leave its Flowers running."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME=RUN_CONFIG (repeat per arm)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (default 0,1,2)")
    ap.add_argument("--run-config", default="", help="run-config keys every arm gets (e.g. rounds=12)")
    ap.add_argument("--federation-config", default="", help="passed to every flwr run")
    ap.add_argument("--jobs", type=int, default=1, help="flwr runs at once (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (and pinned cores) per run")
    ap.add_argument("--cores", default="", help="the cores to pin jobs on, e.g. 0-11 (default: all of them)")
    ap.add_argument("--out", type=Path, required=True, help="run dirs OUT/ARM-sSEED, logs, report")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        if a.jobs < 1 or a.threads < 1 or not seeds:
            raise SweepError("--jobs and --threads must be at least 1, and --seeds name at least one seed")
        planned = plan(a.arm, seeds, a.run_config, a.out)
        cores = parse_cores(a.cores)
        flwr = require_flwr("flower-superlink")  # refused before any job starts
    except (SweepError, FlowerMissing, ValueError) as e:
        print(f"tools.sweep: {e}", file=sys.stderr)
        return 2
    _stop_on_signals()
    pinned = "pinned" if core_slots(a.jobs, a.threads, cores) else "not pinned (more than the cores)"
    print(f"{len(planned)} runs, {a.jobs} at a time, {a.threads} threads each, {pinned}; logs in {a.out / 'logs'}")
    failed = run_jobs(planned, a.out, a.jobs, a.threads, a.federation_config, cores, flwr)
    dirs = [str(j.run_dir) for j in planned if j not in failed]
    if len(dirs) > 1:
        report.main([*dirs, "--out", str(a.out / "report")])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
