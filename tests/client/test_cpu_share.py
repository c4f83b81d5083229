"""CPU SuperNodes on one host share its cores instead of each taking all of them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from client_app.runtime_dir import ENV_VAR, SERVICE_MODULE, live_cpu_services, private_dir, write_private
from fl_app.host import CPU_THREADS_VAR, cpu_threads, usable_cores


def test_cpu_threads_split_the_usable_cores_and_a_lone_trainer_keeps_torch_s_count(monkeypatch):
    monkeypatch.delenv(CPU_THREADS_VAR, raising=False)
    default = torch.get_num_threads()
    assert cpu_threads(0, default) == cpu_threads(1, default) == default  # alone: numerics unchanged
    for peers in (2, 3, 64):
        assert cpu_threads(peers, default) == max(1, min(default, usable_cores() // peers))
    assert cpu_threads(2, 1) == 1  # never more than torch's own count
    monkeypatch.setenv(CPU_THREADS_VAR, "3")
    assert cpu_threads(2, default) == cpu_threads(1, default) == 3  # the operator's count wins


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_malformed_thread_override_is_an_error_naming_it(monkeypatch, bad):
    monkeypatch.setenv(CPU_THREADS_VAR, bad)
    with pytest.raises(ValueError, match=f"{CPU_THREADS_VAR}=.*positive number"):
        cpu_threads(1, 4)


def test_live_cpu_services_counts_running_cpu_trainers_of_every_node_dir(tmp_path, monkeypatch):
    """Simulation's shared dir and each SuperNode's own dir count; a GPU lane, a dead pid and a
    live process that is not a trainer service (a stale file's reused pid) do not."""
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "rt"))
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    procs = [subprocess.Popen([*sleep, SERVICE_MODULE]) for _ in range(4)]
    stranger = subprocess.Popen(sleep)
    dead = subprocess.Popen([*sleep, SERVICE_MODULE])
    dead.kill()
    dead.wait()
    try:
        base = private_dir(tmp_path / "rt")
        files = {
            base / "svc-7-cpu.pid": procs[0],  # simulation: the shared dir
            base / "svc-7-cpu1.pid": procs[3],  # simulation: another of the host's CPU lanes (run.cpu_lanes)
            private_dir(base / "node-11-1") / "svc-7-cpu.pid": procs[1],  # a SuperNode of this host
            private_dir(base / "node-12-1") / "svc-7-0-1.pid": procs[2],  # a GPU lane
            private_dir(base / "node-13-1") / "svc-7-cpu.pid": dead,
            private_dir(base / "node-14-1") / "svc-7-cpu.pid": stranger,
        }
        for path, proc in files.items():
            write_private(path, str(proc.pid))
        write_private(private_dir(base / "node-15-1") / "svc-8-cpu.pid", "not a pid")
        assert live_cpu_services() == 3
        procs[1].kill()
        procs[1].wait()
        assert live_cpu_services() == 2
    finally:
        for p in [*procs, stranger]:
            p.kill()
            p.wait()
