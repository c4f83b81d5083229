"""Which code a run executes (fl_app.provenance): the digest of the project's packages, and the
server's check that it, and a fresh process of its interpreter started where the simulation's
workers start, import the run's app. Real files and real subprocesses."""

from __future__ import annotations

import io
import shutil
import sys
import zipfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.supercore.run import Run

from fl_app.provenance import CODE_PACKAGES, CodeMismatch, check_server_code, code_root, code_sha256, imported_root
from server_app.app import _app_dir


def _copy_of_the_code(dest: Path) -> Path:
    for package in CODE_PACKAGES:
        shutil.copytree(code_root() / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_digest_covers_every_source_file_and_nothing_else(tmp_path):
    app = _copy_of_the_code(tmp_path / "app")
    same = code_sha256(app)
    assert same == code_sha256(code_root())  # where the files are does not count
    (app / "fl_app" / "notes.txt").write_text("not code")
    (app / "fl_app" / "__pycache__").mkdir(exist_ok=True)
    assert code_sha256(app) == same
    edited = app / "client_app" / "rollout.py"
    edited.write_text(edited.read_text() + "\n# one more line\n")
    assert code_sha256(app) != same
    edited.write_text(edited.read_text().removesuffix("\n# one more line\n"))
    assert code_sha256(app) == same
    (app / "envs" / "new_module.py").write_text("")
    assert code_sha256(app) != same


def test_a_fresh_process_finds_the_packages_of_its_working_dir_first(tmp_path):
    other = _copy_of_the_code(tmp_path / "other-checkout")
    assert imported_root(sys.executable, other) == other.resolve()
    assert imported_root(sys.executable, tmp_path) == code_root()  # this environment's install


def test_the_server_accepts_its_own_app_and_refuses_another_checkout_s_environment(tmp_path, monkeypatch):
    app = _copy_of_the_code(tmp_path / "fab")
    assert check_server_code(app, tmp_path, simulation=True) == code_sha256(code_root())
    assert check_server_code(None, tmp_path, simulation=True) == code_sha256(code_root())  # a run without a FAB
    # a SuperLink started in another checkout: its workers would import that checkout's code
    stale = _copy_of_the_code(tmp_path / "old-checkout")
    (stale / "fl_app" / "config.py").write_text((stale / "fl_app" / "config.py").read_text() + "\n# older\n")
    with pytest.raises(CodeMismatch, match="this environment's Python imports the project from .*old-checkout"):
        check_server_code(app, stale, simulation=True)
    # the same code installed into the environment (here: on its path), whatever the working dir
    monkeypatch.setenv("PYTHONPATH", str(stale))
    with pytest.raises(CodeMismatch, match="this environment's Python imports the project from .*old-checkout"):
        check_server_code(app, tmp_path, simulation=True)
    # a deployment's nodes import the app's own copy: the SuperLink host's install does not count
    assert check_server_code(app, stale, simulation=False) == code_sha256(code_root())
    monkeypatch.delenv("PYTHONPATH")
    # the run's app itself differs from what this ServerApp imported
    (app / "server_app" / "app.py").write_text("# newer\n")
    with pytest.raises(CodeMismatch, match=r"this ServerApp imports the project from .*checkout.*pip install -e"):
        check_server_code(app, tmp_path, simulation=True)
    with pytest.raises(CodeMismatch, match="not installed where Flower keeps it"):
        check_server_code(tmp_path / "missing", tmp_path, simulation=True)


def test_the_digest_of_a_fab_flower_builds_from_this_checkout_is_the_checkout_s(tmp_path):
    """Flower leaves files out of a FAB (test modules, what .gitignore names, fab-exclude): the
    digest must cover the same files, or every run of this checkout would be refused."""
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(code_root()))) as fab:
        fab.extractall(tmp_path / "fab")
    assert code_sha256(tmp_path / "fab") == code_sha256(code_root())


def test_the_server_finds_the_app_flower_installed_for_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    empty = Run.create_empty(run_id=1)
    assert _app_dir(SimpleNamespace(run=empty)) is None  # type: ignore[arg-type]  # started from Python: no FAB
    run = replace(empty, fab_id="fedagent/fedagent-flower", fab_version="0.1.0", fab_hash="ab" * 32)
    want = tmp_path / "apps" / f"fedagent.fedagent-flower.0.1.0.{'ab' * 4}"
    assert _app_dir(SimpleNamespace(run=run)) == want  # type: ignore[arg-type]
