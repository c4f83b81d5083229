"""Flower's FAB install, run once per FAB instead of once per message.

Each ClientApp of a deployment gets its run's FAB (1.2 MB) and Flower's `install_from_fab`
extracts it to a temporary dir and checks the sha256 of every file in it before it finds the app
already installed: 0.1-0.3 s of every message on a 2-core box. `install_once` wraps it: the first
time a FAB is seen, Flower's install runs as ever and the installed dir is then marked with the
sha256 of the FAB's bytes (`FAB_MARK`); a later ClientApp given the same bytes (same sha256)
reuses the dir Flower verified from them. Any other FAB (another run, changed code) has another
sha256, so it goes through Flower's install; and a dir that Flower hands back under another
FAB's mark (Flower names app dirs by 8 hex digits of the hash) is refused, never reused.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

from flwr.common.config import get_metadata_from_config, get_project_dir
from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION
from flwr.supercore.utils import get_flwr_home

FAB_MARK = ".fedagent-fab.sha256"

Install = Callable[..., Path]


class StaleAppDir(RuntimeError):
    """Flower returned an app dir that another FAB installed; the message names the fix."""


def installed_dir(fab: bytes, sha256: str) -> Path:
    """Where Flower installs this FAB: `get_project_dir` of the FAB's own pyproject.toml."""
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        config = tomllib.loads(z.read("pyproject.toml").decode())
    fab_id, version = get_metadata_from_config(config)
    return get_project_dir(fab_id, version, sha256)


def fab_mark(app_dir: Path) -> str | None:
    """The sha256 of the FAB this dir was installed and verified from, if `install_once` did it."""
    try:
        return (app_dir / FAB_MARK).read_text().strip()
    except OSError:
        return None


def marked_app_dir(fab_sha256: str) -> Path | None:
    """The dir `install_once` installed and marked for the FAB of this sha256, if there is one."""
    candidates = (get_flwr_home() / APP_DIR).glob(f"*.{fab_sha256[:FAB_HASH_TRUNCATION]}")
    return next((d for d in sorted(candidates) if fab_mark(d) == fab_sha256), None)


def _write_mark(app_dir: Path, sha256: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=app_dir, prefix=FAB_MARK, delete=False) as f:
        f.write(sha256)
    os.replace(f.name, app_dir / FAB_MARK)


def install_once(install: Install, seen: Callable[[str], None] = lambda _sha256: None) -> Install:
    """`install` (Flower's `install_from_fab`), skipped for FAB bytes whose installed dir carries
    their sha256 already; `seen` is told the sha256 of every FAB before it is installed."""

    def install_from_fab(fab_file: Path | bytes, install_dir: Path | None = None, skip_prompt: bool = False) -> Path:
        if not isinstance(fab_file, bytes) or install_dir is not None:
            return install(fab_file, install_dir, skip_prompt)
        sha256 = hashlib.sha256(fab_file).hexdigest()
        seen(sha256)
        try:
            known: Path | None = installed_dir(fab_file, sha256)
        except (KeyError, ValueError, zipfile.BadZipFile, tomllib.TOMLDecodeError, UnicodeDecodeError):
            known = None  # not a FAB Flower can install: Flower's install says why
        if known is not None and fab_mark(known) == sha256:
            return known
        path = install(fab_file, install_dir, skip_prompt)  # extracts, checks every file's sha256
        mark = fab_mark(path)
        if mark is None:
            _write_mark(path, sha256)
        elif mark != sha256:
            raise StaleAppDir(
                f"{path} holds the app of FAB {mark[:12]}..., not this run's FAB {sha256[:12]}... (Flower names "
                "an app dir by 8 hex digits of its FAB's sha256): remove that dir and start the run again"
            )
        return path

    return install_from_fab
