"""What `flwr run .` packs into the app (FAB): Flower's own build code over the project's
pyproject.toml and .gitignore. Flower installs each run's app in `$FLWR_HOME/apps/`; with FLWR_HOME
inside the checkout, a FAB that took those in would nest them, run after run, until Flower
refuses the depth ("exceeds the maximum directory depth of 10")."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = "apps/fedagent.fedagent-flower.0.1.0.0123abcd"  # Flower's <publisher>.<name>.<version>.<hash>


def _fab_names(app: Path) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))).namelist()


@pytest.mark.parametrize("home", [".flwr-home", "runs-of-mine/flwr", "."])
def test_a_flwr_home_inside_the_checkout_stays_out_of_the_app(tmp_path, home):
    app = tmp_path / "fedagent-flower"
    (app / "server_app").mkdir(parents=True)
    for name in ("pyproject.toml", ".gitignore"):
        shutil.copy(ROOT / name, app / name)
    (app / "server_app" / "app.py").write_text("app = None\n")
    flwr_home = app / home
    shutil.copytree(app, flwr_home / INSTALLED)  # what the previous run installed there
    for leftover in ("runtime-envs/env/lib/site.py", "credentials.yaml", "local-superlink/state.json"):
        (flwr_home / leftover).parent.mkdir(parents=True, exist_ok=True)
        (flwr_home / leftover).write_text("{}\n")
    names = _fab_names(app)
    assert "server_app/app.py" in names
    assert [n for n in names if not n.startswith((".info/", "server_app/", "pyproject.toml"))] == []
