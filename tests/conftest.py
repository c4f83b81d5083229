"""Session-wide test isolation."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from client_app.runtime_dir import ENV_VAR


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the README's `-n 2`) the workers share the machine's cores: each
    computes on one torch thread. Two OpenMP pools as wide as the machine spin against each
    other (a 0.5 s test took 10 s); the services a test starts choose their own threads."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def private_runtime_dir() -> Iterator[None]:
    """Lanes started by tests keep their sockets, pid and lock files in a directory of this test
    session, removed at its end, never in the user's runtime dir next to real runs' lanes."""
    path = tempfile.mkdtemp(prefix="fa-rt-")  # short: Unix socket paths are limited to ~107 bytes
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = path
    yield
    if before is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = before
    shutil.rmtree(path, ignore_errors=True)
