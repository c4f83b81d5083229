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
    app.mkdir()
    for name in ("pyproject.toml", ".gitignore"):
        shutil.copy(ROOT / name, app / name)
    for package in ("fl_app", "client_app", "server_app", "envs", "partitions", "configs"):  # what fab-include names
        (app / package).mkdir()
        (app / package / ("app.py" if package != "configs" else "r.yaml")).write_text("app = None\n")
    flwr_home = app / home
    shutil.copytree(app, flwr_home / INSTALLED)  # what the previous run installed there
    for leftover in ("runtime-envs/env/lib/site.py", "credentials.yaml", "local-superlink/state.json"):
        (flwr_home / leftover).parent.mkdir(parents=True, exist_ok=True)
        (flwr_home / leftover).write_text("{}\n")
    names = _fab_names(app)
    assert "server_app/app.py" in names
    packed = (".info/", "pyproject.toml", "fl_app/", "client_app/", "server_app/", "envs/", "partitions/", "configs/")
    assert [n for n in names if not n.startswith(packed)] == []


def test_the_app_carries_the_packages_and_recipes_and_leaves_docs_tests_and_benches_out():
    """Every message of a deployment pulls and unpacks the FAB: only what a node runs goes in."""
    names = _fab_names(ROOT)
    tops = {n.split("/", 1)[0] for n in names if not n.startswith(".info/")}
    assert {"fl_app", "client_app", "server_app", "envs", "partitions", "configs", "pyproject.toml"} <= tops
    assert not tops & {"docs", "tests", "bench", "tools"}, sorted(tops)
    assert "configs/tiny-shop-grpo.yaml" in names and "client_app/superexec.py" in names
