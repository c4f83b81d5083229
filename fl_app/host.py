"""What this process may use of its machine."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from threadpoolctl import threadpool_limits


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch's CPU ops on one intra-op thread inside the block (restored after): a process
    whose own threads use the other cores, or tiny ops on shared cores, gain nothing from a
    second one and wait for the slowest thread at every op."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one (`taskset`,
    a cpuset), else the machine's count. A CPU-time quota (`docker --cpus`) does not show here."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


CPU_THREADS_VAR = "FEDAGENT_CPU_THREADS"


def cpu_threads(peers: int, default: int) -> int:
    """Intra-op threads for one of `peers` CPU trainers that share this host's cores.

    Each trainer's OpenMP pool takes every core by default; two pools on the same cores make
    libgomp sleep at every barrier, and two CPU SuperNodes on one host ran 7-9x slower per fit.
    So each takes its share of the usable cores, never more than `default` (torch's own count,
    which a lone trainer keeps, so its numerics do not change). `$FEDAGENT_CPU_THREADS` sets the
    count outright (a positive integer), e.g. for a node that shares its host with other work."""
    if (forced := os.environ.get(CPU_THREADS_VAR, "").strip()) != "":
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{CPU_THREADS_VAR}={forced!r}: give a positive number of threads, or unset it")
        return int(forced)
    if peers <= 1:
        return default
    return max(1, min(default, usable_cores() // peers))


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows. Float kernels
    differ by CPU model, so CPU-built weights record it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def flwr_home() -> Path:
    """The FLWR_HOME `flwr` uses: $FLWR_HOME, else ~/.flwr."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


def voluntary_context_switches(pid: int | str = "self") -> int:
    """How often the threads of process `pid` went to sleep so far, all threads summed (Linux
    /proc; psutil's count is the main thread's). Sleeps at OpenMP barriers show up here."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def single_threaded_blas() -> None:
    """Run numpy's BLAS in the calling thread, for the rest of this process.

    In a Flower simulation the ServerApp is a thread of `flwr-simulation`, whose main thread
    meanwhile starts Ray's processes with `fork`. OpenBLAS's fork handler stops its worker
    threads, and a BLAS call in flight in another thread (the partition report's matrix products)
    then waits for them forever: the run hangs at "Starting Flower Simulation" (docs/reliability.md).
    One thread needs no worker, so nothing waits; the server's numpy work is small. (torch's own
    CPU kernels do not go through this BLAS.)
    """
    threadpool_limits(1, user_api="blas")


class FlowerMissing(RuntimeError):
    """A Flower command a tool runs is not installed here; the message names it and the fix."""


def flwr_requirement() -> str:
    """The Flower this project pins (its installed metadata), for an install command to print."""
    try:
        requires = importlib.metadata.requires("fedagent-flower") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    return next((r.split(";")[0].strip() for r in requires if r.startswith("flwr")), "flwr[simulation]")


def require_flwr(*beside: str) -> str:
    """Flower's `flwr` command of this environment (beside this Python: a venv's own, also when
    it is not activated; else the one on PATH), and every command of `beside` that `flwr` starts
    itself (e.g. `flower-superlink`: beside it, else on PATH). FlowerMissing names the first one
    missing: a `pip install --target` dir has the packages but may lack their console scripts."""
    here = Path(sys.executable).with_name("flwr")
    flwr = str(here) if here.exists() else shutil.which("flwr")
    missing = (
        "flwr"
        if flwr is None
        else next((c for c in beside if not (Path(flwr).with_name(c).exists() or shutil.which(c))), None)
    )
    if flwr is None or missing is not None:
        raise FlowerMissing(
            f"no `{missing}` command beside this Python ({here.parent}) or on PATH: install the project's Flower "
            f"into this environment (pip install '{flwr_requirement()}'), or put the bin dir that holds Flower's "
            "console scripts on PATH"
        )
    return flwr
