"""The ServerApp's own work cannot deadlock the process it shares with Flower's simulation engine.

In a simulation the ServerApp runs as a thread of `flwr-simulation` while that process's main
thread starts Ray's processes with `fork` (Ray's `start_ray_process` passes a `preexec_fn`, so
Python forks instead of spawning). OpenBLAS's fork handler stops its worker threads; a BLAS call
in flight in another thread then waits for them forever. The partition report's matrix products
were such a call: `flwr run .` hung at "Starting Flower Simulation" in 2 of 8 runs on the 2-core
box (2026-12-05), and the script below without `fl_app.host.single_threaded_blas` (which
loading the ServerApp module calls) hangs 3 times in 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The real partition report of the default recipe, in a loop in a thread, while the main thread
# forks 100 times the way Ray starts its processes.
RACE = """
import subprocess, threading
from fl_app.config import load_config
from partitions.pool import build_pool
from partitions.realized import client_rows, realized
from partitions.registry import plan_partition
import server_app.app  # what Flower loads into flwr-simulation before it calls main

cfg = load_config("tiny-shop-grpo")
plan = plan_partition(cfg, build_pool(cfg.env.name, cfg.env.params))
rows = client_rows(plan)
stop = threading.Event()
reports = []

def report():
    while not stop.is_set():
        reports.append(realized(plan, rows))

t = threading.Thread(target=report)
t.start()
for _ in range(100):
    subprocess.run(["true"], preexec_fn=lambda: None, check=True)
stop.set()
t.join()
print("reports", len(reports))
"""


def test_the_server_app_s_numpy_work_never_deadlocks_a_fork_beside_it() -> None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", RACE], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError("a fork beside the partition report hung: OpenBLAS runs threaded in the ServerApp") from e
    reports = int(out.stdout.split()[-1])
    assert reports > 0  # the report really ran beside the forks


def test_loading_the_server_app_puts_numpy_s_blas_on_one_thread() -> None:
    """Read back through threadpoolctl in a fresh process, before and after the import."""
    code = (
        "import json, numpy\n"
        "from threadpoolctl import threadpool_info\n"
        "def blas(): return [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas']\n"
        "before = blas()\n"
        "import server_app.app\n"
        "print(json.dumps([before, blas()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    before, after = json.loads(out.stdout.splitlines()[-1])
    assert before, "numpy loaded no BLAS that threadpoolctl can see"
    assert after == [1] * len(before), out.stdout
