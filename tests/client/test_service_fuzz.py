"""Property-based fuzzing of the trainer service's request schemas (issue 18, item 10), against the
real service process over its Unix socket.

Properties, for any body hypothesis builds (well-typed or not, paths inside, outside, through
symlinks, `..` walks, NUL bytes): the answer is 200 or a 4xx carrying the error's type and
message, never a 5xx; nothing is ever written outside the service's roots; the service stays
healthy. The default run fuzzes a few hundred requests; `-m slow` fuzzes thousands.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trainer_support import model_dir, one_torch_thread, small_config  # noqa: F401

from client_app.lane import LaneService
from fl_app.config import save_config

RUN_ID = 7
FAST, LONG = 120, 3000


@pytest.fixture(scope="module")
def target(tmp_path_factory, model_dir):  # noqa: F811
    root = tmp_path_factory.mktemp("fuzz")
    (root / "outside").mkdir()
    (root / "run" / "rounds").mkdir(parents=True)
    (root / "run" / "rounds" / "escape").symlink_to(root / "outside")
    recipe = root / "recipe.yaml"
    save_config(
        small_config(
            model_dir,
            run={"run_dir": str(root / "run"), "weight_cache_dir": str(root / "cache")},
            federation={"val_tasks": 2},
        ),
        recipe,
    )
    lane = LaneService(
        run_id=RUN_ID,
        run_config={"recipe": str(recipe)},
        log_dir=root / "logs",
        lane=f"fuzz{os.getpid()}",
        run_dir=root / "run",
    )
    lane.ensure_started()
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(lane.socket)), base_url="http://svc", timeout=600)
    yield root, lane, client
    client.close()
    lane.shutdown()


def _paths(root: Path) -> st.SearchStrategy[str]:
    run = root / "run"
    fixed = [
        str(root / "outside" / "x"),
        str(run / "rounds" / "escape"),
        str(run / "rounds" / "escape" / "a"),
        "/",
        "/etc/passwd",
        "/proc/self/environ",
        "..",
        "../../tmp/x",
        str(run / ".." / "outside"),
        str(run / "a\x00b"),
        "",
        str(run),
        str(root / "cache" / "w"),
        "relative/inside",
    ]
    walked = st.lists(st.sampled_from(["..", ".", "a", "escape", "rounds", "round-0000", "actor"]), max_size=6)
    return st.one_of(
        st.sampled_from(fixed),
        st.text(max_size=40),
        walked.map(lambda parts: str(run.joinpath(*parts)) if parts else str(run)),
    )


_json = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=6,
)


def _ints() -> st.SearchStrategy[object]:
    return st.one_of(st.integers(-3, 5), st.integers(), st.just(RUN_ID), _json)


def _bodies(root: Path) -> st.SearchStrategy[tuple[str, object]]:
    members = st.dictionaries(st.sampled_from(["actor", "critic", ""]) | st.text(max_size=6), _paths(root), max_size=3)
    dirs = st.one_of(members, _json)
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), _json)
    fit = st.fixed_dictionaries(
        {
            "run_id": _ints(),
            "round": _ints(),
            "client_id": _ints(),
            "local_epochs": st.integers(-1, 2) | _json,
            "seed": _ints(),
            "weights_in": dirs,
            "weights_out": dirs,
        },
        optional={"proximal_mu": floats, "extra": _json},
    )
    evaluate = st.fixed_dictionaries(
        {"run_id": _ints(), "round": _ints(), "seed": _ints(), "weights_in": _paths(root) | _json}
    )
    init = st.fixed_dictionaries({"run_id": _ints(), "weights_out": dirs})
    return st.one_of(
        st.tuples(st.just("/fit"), fit),
        st.tuples(st.just("/evaluate"), evaluate),
        st.tuples(st.just("/init"), init),
        st.tuples(st.sampled_from(["/fit", "/init", "/evaluate"]), _json),
    )


def _written_outside(root: Path) -> list[Path]:
    return [p for p in (root / "outside").rglob("*")]


def _check(root: Path, lane: LaneService, client: httpx.Client, path: str, body: object) -> None:
    r = client.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["type"] and err["message"], r.text
    assert not _written_outside(root), (path, body)


def _fuzz(n: int):
    def decorate(test):
        return settings(max_examples=n, deadline=None, derandomize=n == FAST, suppress_health_check=list(HealthCheck))(
            test
        )

    return decorate


def test_fuzzed_requests_get_a_4xx_with_the_cause_never_a_5xx_nor_a_write_outside(target):
    root, lane, client = target

    nul = str(root / "run" / "a\x00b")

    @_fuzz(FAST)
    @given(_bodies(root))
    @example(("/init", {"run_id": RUN_ID, "weights_out": {"actor": nul}}))
    @example(("/evaluate", {"run_id": RUN_ID, "round": 0, "seed": 0, "weights_in": nul}))
    @example(
        (
            "/fit",
            {
                "run_id": RUN_ID,
                "round": 1,
                "client_id": 0,
                "local_epochs": 1,
                "seed": 2**64,
                "weights_in": {"actor": nul},
                "weights_out": {"actor": str(root / "outside")},
            },
        )
    )
    def run(case: tuple[str, object]) -> None:
        _check(root, lane, client, *case)

    run()
    assert lane.health()["ok"]


@pytest.mark.slow
def test_fuzzed_requests_long(target):
    root, lane, client = target

    @_fuzz(LONG)
    @given(_bodies(root))
    def run(case: tuple[str, object]) -> None:
        _check(root, lane, client, *case)

    run()
    assert lane.health()["ok"]
