"""Run the real app through `flwr run` against a private local SuperLink, and clean up after.

Each use gets its own FLWR_HOME and SuperLink ports, so tests never touch a user's SuperLink,
and everything started is stopped by PID on every path.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from envs.ports import choose_free_port
from server_app.local_superlink import stop_superlink

ROOT = Path(__file__).resolve().parent.parent
FLWR = str(Path(sys.executable).with_name("flwr"))


def run_config(recipe: Path, run_dir: Path, **extra: object) -> str:
    """A `--run-config` string: the recipe, the run dir, and flat run-config keys."""
    items = {"recipe": f'"{recipe}"', "run-dir": f'"{run_dir}"', **{k: str(v) for k, v in extra.items()}}
    return " ".join(f"{k}={v}" for k, v in items.items())


class FlowerRun:
    def __init__(self, home: Path) -> None:
        self.home = home
        # Unix socket paths are limited to 107 bytes: Ray's and ours live in a short dir.
        self.short = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp"))
        http_port, control_port = choose_free_port(), choose_free_port()
        while control_port == http_port:
            control_port = choose_free_port()
        self.port = http_port
        self.env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
                    "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
                    "RAY_TMPDIR": str(self.short / "ray"), "FEDAGENT_RUNTIME_DIR": str(self.short / "rt"),
                    # flwr starts `flower-superlink` from PATH: this interpreter's, also without an activated venv
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}

    def run(self, run_config: str, timeout_s: float, federation_config: str = "num-supernodes=2"
            ) -> subprocess.CompletedProcess:
        cmd = [FLWR, "run", str(ROOT), "--run-config", run_config, "--federation-config", federation_config,
               "--stream"]
        return subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)

    def stop(self) -> None:
        stop_superlink(self.home)
        shutil.rmtree(self.short, ignore_errors=True)

    def superlink_log(self) -> str:
        p = self.home / "local-superlink" / "superlink.log"
        return p.read_text(errors="replace")[-20000:] if p.exists() else ""


@contextmanager
def flower(home: Path) -> Iterator[FlowerRun]:
    home.mkdir(parents=True, exist_ok=True)
    fr = FlowerRun(home)
    try:
        yield fr
    finally:
        fr.stop()
