"""The two cuts of a forked ClientApp's message path (docs/benchmarks.md, the deployment round):
object pulls that retry after 50 ms instead of Flower's 1 s (`server_app.pull_backoff`), and the
run's FAB installed once per FAB, not once per message (`client_app.fab_once`), never reusing a
dir another FAB installed. A real deployment through both: tests/e2e/test_deployment.py."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord
from flwr.cli.build import build_fab_from_files
from flwr.cli.install import install_from_fab
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.superlink.grid import http_grid
from flwr.supernode import start_client_internal as fleet_loop
from flwr.supernode.runtime import run_clientapp as clientapp_runtime

from client_app.fab_once import FAB_MARK, StaleAppDir, install_once
from server_app import pull_backoff
from server_app.pull_backoff import FlowerChanged, shorten_pull_backoff

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def flowers_waits():
    """Flower's own pull waits again after the test (the setting is per process)."""
    saved = [dict(fn.__kwdefaults__) for fn in pull_backoff.PULLS]
    yield
    for fn, defaults in zip(pull_backoff.PULLS, saved, strict=True):
        fn.__kwdefaults__ = defaults


def _pull_once_unavailable() -> float:
    """Seconds a real ClientApp-side pull takes when the SuperNode does not have the message's
    head object yet at the first ask (as when a ClientApp is forked before its node pulled it)."""
    record = ConfigRecord({"k": 1})
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(record).items()}
    asked: set[str] = set()

    def pull(object_id: str) -> bytes:
        if object_id not in asked:
            asked.add(object_id)
            raise inflatable_utils.ObjectUnavailableError(object_id)
        return contents[object_id]

    t0 = time.monotonic()
    got = inflatable_utils.pull_and_inflate_object_from_tree(
        get_object_tree(record), pull, lambda _oid: None, return_type=ConfigRecord
    )
    assert got["k"] == 1
    return time.monotonic() - t0


def test_flowers_pulls_take_their_first_wait_from_the_defaults_set_here():
    """Tripwire (flwr is pinned): the ClientApp's, the SuperNode's and the ServerApp's pulls leave
    the waits to the functions' defaults, so setting those reaches every pull of the process."""
    callers = {
        clientapp_runtime.pull_task_input: "pull_and_inflate_object_from_tree(",
        fleet_loop._pull_and_store_message: "pull_objects(",
        http_grid.HttpGrid.pull_messages: "pull_objects(",
    }
    for caller, pull in callers.items():
        source = inspect.getsource(caller)
        assert pull in source and "initial_backoff" not in source and "backoff_cap" not in source


def test_a_pull_that_asks_too_early_retries_after_50_ms_not_a_second(flowers_waits):
    assert _pull_once_unavailable() > 0.7  # Flower's 1 s (+-20%)
    shorten_pull_backoff(cap_s=0.2)
    assert _pull_once_unavailable() < 0.3
    assert all(fn.__kwdefaults__["backoff_cap"] == 0.2 for fn in pull_backoff.PULLS)


def test_a_flower_whose_pulls_take_no_waits_is_refused(monkeypatch):
    def pull(object_ids, pull_object_fn): ...

    monkeypatch.setattr(pull_backoff, "PULLS", (pull,))
    with pytest.raises(FlowerChanged, match="initial_backoff"):
        shorten_pull_backoff()


_PYPROJECT = (
    '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
    '[project]\nname = "probe"\nversion = "1.0.0"\ndependencies = []\n'
    '[tool.hatch.build.targets.wheel]\npackages = ["."]\n'
    '[tool.flwr.app]\npublisher = "fedagent"\n'
    '[tool.flwr.app.components]\nserverapp = "probe_app:server"\nclientapp = "probe_app:client"\n'
    "[tool.flwr.app.config]\nx = 1\n"
)


def _fab(module_text: str) -> bytes:
    return build_fab_from_files({"pyproject.toml": _PYPROJECT.encode(), "probe_app.py": module_text.encode()})[0]


class CountingInstall:
    """Flower's real `install_from_fab`, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs) -> Path:
        self.calls += 1
        return install_from_fab(*args, **kwargs)


def test_a_fab_is_installed_and_checked_once_then_its_dir_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    flower = CountingInstall()
    install = install_once(flower)
    fab = _fab("client = 1\n")
    first = install(fab, skip_prompt=True)
    assert flower.calls == 1 and (first / "probe_app.py").read_text() == "client = 1\n"
    assert install(fab, skip_prompt=True) == first and flower.calls == 1


def test_another_fab_never_gets_the_dir_of_the_first(tmp_path, monkeypatch):
    """Changed code is another FAB: Flower installs it to its own dir (the reused dir is only ever
    the one made from the same bytes)."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    flower = CountingInstall()
    install = install_once(flower)
    first = install(_fab("client = 1\n"), skip_prompt=True)
    second = install(_fab("client = 2\n"), skip_prompt=True)
    assert flower.calls == 2 and second != first
    assert (second / "probe_app.py").read_text() == "client = 2\n"
    assert (first / FAB_MARK).read_text() != (second / FAB_MARK).read_text()


def test_a_dir_that_another_fab_installed_is_refused(tmp_path, monkeypatch):
    """Flower names an app dir by 8 hex digits of the FAB's sha256 and hands back a dir that exists;
    a dir marked with another FAB's sha256 (a collision of those 8 digits) is an error, not reused."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    install = install_once(CountingInstall())
    fab = _fab("client = 1\n")
    app_dir = install(fab, skip_prompt=True)
    (app_dir / FAB_MARK).write_text("f" * 64)
    with pytest.raises(StaleAppDir, match="remove that dir"):
        install(fab, skip_prompt=True)


def test_the_wrapper_takes_flowers_arguments_as_the_clientapp_passes_them():
    assert "install_from_fab(fab.content, skip_prompt=True)" in inspect.getsource(clientapp_runtime.run_clientapp)


def _app_fab(where: str) -> bytes:
    """A FAB whose ClientApp module is `client_app.app` (ours, as in the project's FAB) saying `where`."""
    pyproject = _PYPROJECT.replace('clientapp = "probe_app:client"', 'clientapp = "client_app.app:app"')
    files = {
        "pyproject.toml": pyproject.encode(),
        "client_app/__init__.py": b"",
        "client_app/app.py": f"WHERE = {where!r}\n",
    }
    return build_fab_from_files({k: v.encode() if isinstance(v, str) else v for k, v in files.items()})[0]


def test_a_warm_app_serves_only_the_fab_it_was_imported_from(tmp_path):
    """The SuperExec imports an installed FAB's ClientApp ahead (`WarmApp.load`); a fork of that
    FAB keeps it, a fork given another FAB's bytes forgets it and its dir, and imports the other
    FAB's code; loading another FAB swaps both. In a fresh process: it forgets this one's modules."""
    fabs = {w: tmp_path / f"{w}.fab" for w in ("A", "B")}
    for where, path in fabs.items():
        path.write_bytes(_app_fab(where))
    code = f"""
        import hashlib, importlib, sys
        from pathlib import Path
        from flwr.cli.install import install_from_fab
        from client_app.fab_once import install_once
        from client_app.superexec import WarmApp
        fab = {{w: Path(p).read_bytes() for w, p in { ({w: str(p) for w, p in fabs.items()})!r}.items()}}
        sha = {{w: hashlib.sha256(b).hexdigest() for w, b in fab.items()}}
        warm = WarmApp()
        install = install_once(install_from_fab, seen=warm.keep_for)
        warm.load(sha["A"])
        print("before install:", warm.fab)
        dirs = {{w: str(install(fab[w], skip_prompt=True)) for w in fab}}
        warm.load(sha["A"])
        m = sys.modules["client_app.app"]
        print("loaded:", m.WHERE, m.__file__.startswith(dirs["A"]), sys.path[0] == dirs["A"])
        warm.keep_for(sha["A"])
        print("same FAB keeps:", sys.modules["client_app.app"] is m)
        install(fab["B"], skip_prompt=True)  # a fork handed B's bytes
        print("other FAB forgets:", "client_app.app" in sys.modules, dirs["A"] in sys.path, warm.fab)
        sys.path.insert(0, dirs["B"])
        print("imports:", importlib.import_module("client_app.app").WHERE)
        warm.load(sha["A"]); warm.load(sha["B"])
        print("swapped:", sys.modules["client_app.app"].WHERE, dirs["A"] in sys.path, warm.fab == sha["B"])
    """
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "FLWR_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert [line for line in p.stdout.splitlines() if not line.startswith("Successfully installed")] == [
        "before install: None",
        "loaded: A True True",
        "same FAB keeps: True",
        "other FAB forgets: False False None",
        "imports: B",
        "swapped: B False True",
    ]
