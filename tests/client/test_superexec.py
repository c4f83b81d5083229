"""client_app.superexec: ClientApps forked from a warm SuperExec run the FAB's code, and every
child is stopped by its PID. A real deployment through it: tests/e2e/test_deployment.py (the
harness starts every SuperNode in process isolation beside `python -m client_app.superexec`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from client_app.superexec import APP_PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_app_packages_are_the_distributions_packages():
    """What a fork forgets is exactly what the FAB ships: the project's packages."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in include) == sorted(APP_PACKAGES)


def test_a_forked_clientapp_loads_the_fabs_code_not_the_superexecs(tmp_path):
    """The SuperExec imported `client_app` from this checkout; a ClientApp forked from it must load
    the run's FAB (first on sys.path, as Flower puts it), not this checkout's copy."""
    fab = tmp_path / "fab"
    (fab / "client_app").mkdir(parents=True)
    (fab / "client_app" / "__init__.py").write_text("")
    (fab / "client_app" / "fab_only.py").write_text("WHERE = 'fab'\n")
    p = _python(
        f"""
        import importlib, sys
        import client_app.superexec as se
        sys.path.insert(0, {str(fab)!r})
        try:
            importlib.import_module("client_app.fab_only")
            print("without forgetting: loaded")
        except ModuleNotFoundError:
            print("without forgetting: not found")
        se.forget_app_modules()
        m = importlib.import_module("client_app.fab_only")
        print("after forgetting:", m.WHERE, importlib.import_module("client_app").__file__)
        """
    )
    assert p.returncode == 0, p.stderr
    assert "without forgetting: not found" in p.stdout  # the checkout's package hides the FAB's module
    assert f"after forgetting: fab {fab / 'client_app' / '__init__.py'}" in p.stdout, p.stdout


def test_a_preload_that_cannot_import_stops_the_superexec_naming_it():
    p = subprocess.run(
        [sys.executable, "-m", "client_app.superexec", "--insecure"],
        cwd=ROOT,
        env={**os.environ, "FEDAGENT_SUPEREXEC_PRELOAD": "torch,no_such_module_here"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "cannot preload 'no_such_module_here'" in p.stderr and "FEDAGENT_SUPEREXEC_PRELOAD" in p.stderr, p.stderr


def test_close_stops_every_forked_clientapp_by_pid():
    """A forked ClientApp whose SuperNode does not answer keeps retrying; the SuperExec's close
    stops it (SIGTERM, then SIGKILL after the grace) and reaps it: no child outlives the SuperExec."""
    p = _python(
        """
        import json, os, socket, time
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import ExecutionSpec
        from client_app.superexec import ForkExecutor

        with socket.socket() as s:  # a port nobody listens on: the SuperNode is gone
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ex = ForkExecutor()
        spec = ExecutionSpec(task_type=TaskType.CLIENT_APP, runtime_api_address=f"127.0.0.1:{port}",
                             token="ab" * 32, insecure=True, root_certificates_path=None,
                             runtime_dependency_install=False, parent_pid=os.getpid(),
                             suppress_output=True, task_id=1)
        ex.launch(spec)
        pids = sorted(ex.children)
        time.sleep(1.0)
        ex.reconcile()
        running = sorted(ex.children)
        t0 = time.monotonic()
        ex.close()
        gone = []
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone.append(pid)
        print(json.dumps({"pids": pids, "running": running, "left": sorted(ex.children),
                          "gone": gone, "close_s": time.monotonic() - t0}))
        """
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["pids"]) == 1 and out["running"] == out["pids"], out  # still retrying after 1 s
    assert out["left"] == [] and out["gone"] == out["pids"], out  # stopped and reaped
