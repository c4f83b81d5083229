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

import functools
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from fl_app.host import flwr_home

CODE_PACKAGES = ("fl_app", "client_app", "server_app", "envs", "partitions")


class CodeMismatch(RuntimeError):
    """A process would run other code than the run's app; the message names both and the fix."""


def code_root() -> Path:
    """The directory this process imported the project's packages from."""
    return Path(__file__).resolve().parents[1]


def code_sha256(root: Path) -> str:
    """sha256 over the path and bytes of every `.py` file of the project's packages under `root`,
    but test modules, which Flower leaves out of a FAB (`test_*.py`, `*_test.py`)."""
    h = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.startswith("test_") or path.name.endswith("_test.py"):
                continue
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
    try:
        out = subprocess.run([python, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise CodeMismatch(
            f"could not ask {python} (in {cwd}) where it imports the project from: {e}; {e.stderr!r}"
        ) from e
    origin = out.stdout.strip()
    return Path(origin).resolve().parents[1] if origin else None


def check_server_code(app_dir: Path | None, cwd: Path, simulation: bool) -> str:
    """The digest of the run's app, after checking that this process imported exactly that code
    (Flower imports a ServerApp from the app's dir, so this holds unless something imported ours
    first) and, in a simulation, that a fresh process of this interpreter (the workers, the lanes),
    started in `cwd` or anywhere else, does too. In a deployment the nodes import the app's own
    copy and check themselves. `app_dir`: where Flower installed the run's FAB; None for a run
    without one, whose nodes are then held to this process's code."""
    ours = _own_code()
    if app_dir is None:
        return ours
    if not app_dir.is_dir():
        raise CodeMismatch(f"this run's app is not installed where Flower keeps it ({app_dir}); run `flwr run .` again")
    want = code_sha256(app_dir)
    digests = {code_root(): ours}  # each root hashed once
    found: list[tuple[str, Path | None]] = [("this ServerApp", code_root())]
    if simulation:
        with tempfile.TemporaryDirectory() as neutral:  # what the environment itself installs
            found += [("this environment's Python", imported_root(sys.executable, d)) for d in (cwd, Path(neutral))]
    for where, root in found:
        if root is None:
            continue
        if root not in digests:
            digests[root] = code_sha256(root)
        if digests[root] != want:
            raise CodeMismatch(
                f"{where} imports the project from {root}, which differs from this run's app "
                f"({app_dir}; python {sys.executable}, working dir {cwd}), and the run would execute "
                "that code. Either the SuperLink serving this run was started from another checkout or "
                "environment: stop it (a local SuperLink: `python -m server_app.local_superlink stop "
                f"--flwr-home {flwr_home()}`) and run `flwr run .` again; or the project is installed "
                "there without `-e` and this checkout has changed since: `pip install -e .` there"
            )
    return want


@functools.cache
def _own_code() -> str:
    """This process's code, hashed once: what it imported, even if the files change later."""
    return code_sha256(code_root())


def check_node_code(want: str, node: str) -> None:
    """Refuse to serve a run whose app (digest `want`, sent by the server) is not this code."""
    got = _own_code()
    if got != want:
        raise CodeMismatch(
            f"{node} imports the project from {code_root()} (python {sys.executable}), which differs "
            f"from this run's app (this node's sha256 {got[:12]}..., the run's {want[:12]}...): the "
            "SuperNode or SuperLink serving it was started from another checkout or environment, or "
            "its checkout changed after it started. Start it again from the run's code (a local "
            f"SuperLink: `python -m server_app.local_superlink stop --flwr-home {flwr_home()}`)"
        )
