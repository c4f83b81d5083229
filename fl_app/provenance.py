"""Which code a run executes: one digest over the project's Python packages.

`flwr run .` ships the checkout as a FAB, but a process runs whatever its interpreter imports. A
local SuperLink outlives its `flwr run`; a later `flwr run .` from another checkout or virtual
environment is then served by it, and its simulation imports the *first* environment's packages
(Ray workers resolve our modules by name, before Flower puts the FAB on their path): the new
run's config executes the old code, silently, and relative paths resolve against the old
checkout. So the server compares the FAB with the code it and its environment import, sends the
FAB's digest with every message, and every node compares it with its own code.

Standard library only: the check runs before anything heavy is imported.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CODE_PACKAGES = ("fl_app", "client_app", "server_app", "envs", "partitions")


class CodeMismatch(RuntimeError):
    """A process would run other code than the run's app; the message names both and the fix."""


def code_root() -> Path:
    """The directory this process imported the project's packages from."""
    return Path(__file__).resolve().parents[1]


def code_sha256(root: Path) -> str:
    """sha256 over the path and bytes of every `.py` file of the project's packages under `root`."""
    h = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            data = path.read_bytes()
            h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def imported_root(python: str, cwd: Path) -> Path | None:
    """Where a fresh `python` process started in `cwd` (as the simulation's workers and the
    trainer lanes are) finds the project's packages; None if it finds none of them."""
    probe = (
        "import importlib.util, sys\n"
        f"for name in {CODE_PACKAGES!r}:\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    if spec and spec.origin:\n"
        "        print(spec.origin)\n"
        "        break\n"
    )
    out = subprocess.run([python, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
    origin = out.stdout.strip()
    return Path(origin).resolve().parents[1] if origin else None


def check_server_code(app_dir: Path | None, cwd: Path) -> str:
    """The digest of the run's app, after checking that this process and a fresh process of its
    interpreter (the simulation's workers, the lanes), started in `cwd` or anywhere else, import
    exactly that code. `app_dir`: where
    Flower installed the run's FAB (None for a run without one: then this process's code is the
    reference the nodes are held to)."""
    ours = code_sha256(code_root())
    if app_dir is None:
        return ours
    if not app_dir.is_dir():
        raise CodeMismatch(f"this run's app is not installed where Flower keeps it ({app_dir}); run `flwr run .` again")
    want = code_sha256(app_dir)
    with tempfile.TemporaryDirectory() as neutral:  # what the environment itself installs
        found = [("this ServerApp", code_root())] + [
            ("this environment's Python", root)
            for root in (imported_root(sys.executable, cwd), imported_root(sys.executable, Path(neutral)))
            if root is not None
        ]
    for where, root in found:
        if code_sha256(root) != want:
            raise CodeMismatch(
                f"{where} imports the project from {root}, which differs from this run's app "
                f"({app_dir}; python {sys.executable}, working dir {cwd}), and the run would execute "
                "that code. Either the SuperLink serving this run was started from another checkout or "
                f"environment: stop it (`python -m server_app.local_superlink stop --flwr-home {_flwr_home()}`) "
                "and run `flwr run .` again; or the project is installed there without `-e` and this "
                "checkout has changed since: `pip install -e .` in that environment"
            )
    return want


def _flwr_home() -> str:
    return os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")


def check_node_code(want: str, node: str) -> None:
    """Refuse to serve a run whose app (digest `want`, sent by the server) is not this code."""
    got = code_sha256(code_root())
    if got != want:
        raise CodeMismatch(
            f"{node} imports the project from {code_root()} (python {sys.executable}), which differs "
            f"from this run's app (sha256 {got[:12]}... vs {want[:12]}...): the SuperNode or SuperLink "
            "serving it was started from another checkout or environment. Stop it and start it from "
            "the environment the run's app belongs to (a local SuperLink: `python -m "
            "server_app.local_superlink stop`)"
        )
