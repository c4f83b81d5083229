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
from fl_app.config import load_config, recipe_sha256, save_config

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
    digest = recipe_sha256(load_config(str(recipe), overrides={"recipe": str(recipe)}))  # as the lane resolves it
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(lane.socket)), base_url="http://svc", timeout=600)
    yield root, digest, lane, client
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


def _texts() -> st.SearchStrategy[object]:
    return st.one_of(st.text(max_size=12), _json)


def _members(values: st.SearchStrategy[object]) -> st.SearchStrategy[dict[str, object]]:
    return st.dictionaries(st.sampled_from(["actor", "critic", ""]) | st.text(max_size=6), values, max_size=3)


_REF = {"inline": True, "nbytes": 0}


def _calls(root: Path, digest: str) -> dict[str, st.SearchStrategy[dict[str, object]]]:
    """Per path, a call's JSON: every field of `fl_app.calls` well typed or not, any of them left
    out, one too many; the recipe digest mostly the lane's own, so the checks behind it are reached."""
    refs = st.fixed_dictionaries(
        {"inline": st.booleans() | _json, "nbytes": _ints()},
        optional={"key": _texts(), "manifest_sha256": _texts(), "extra": _json},
    )
    header = {
        "run_id": _ints(),
        "round": _ints(),
        "recipe_sha256": st.sampled_from([digest, digest, digest, "", "0" * 64]) | _json,
        "weights": _members(st.just(_REF) | refs | _json) | _json,
    }
    optional = {
        "code_sha256": _texts(),
        "run_dir": _paths(root) | _json,
        "run_dir_token": _texts(),
        "weight_store": st.sampled_from(["", "http://127.0.0.1:1/store", "file:///etc"]) | _json,
        "weight_store_token": _texts(),
        "kind": st.sampled_from(["fit", "evaluate", "init"]) | _json,
        "extra": _json,
    }
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), _json)
    fit = {"client_id": _ints(), "local_epochs": st.integers(-1, 2) | _json, "seed": _ints()}
    return {
        "/fit": st.fixed_dictionaries({**header, **fit}, optional={**optional, "proximal_mu": floats}),
        "/evaluate": st.fixed_dictionaries({**header, "seed": _ints()}, optional=optional),
        "/init": st.fixed_dictionaries(header, optional=optional),
    }


def _well_typed(root: Path, digest: str) -> st.SearchStrategy[tuple[str, object]]:
    """Well-typed calls, mostly of this run and recipe, naming members and dirs that mostly match:
    these reach the checks behind validation (run, recipe, members, the dirs' confinement) and,
    inside the roots, the reads and writes."""
    paths = _paths(root)
    members = st.sampled_from([("actor",)] * 4 + [(), ("critic",), ("actor", "critic")])
    header = st.fixed_dictionaries(
        {
            "run_id": st.sampled_from([RUN_ID] * 4 + [RUN_ID + 1]),
            "round": st.integers(0, 2),
            "recipe_sha256": st.sampled_from([digest] * 4 + ["", "0" * 64]),
        }
    )

    def dirs_of(names: tuple[str, ...]) -> st.SearchStrategy[dict[str, str]]:
        return st.fixed_dictionaries({m: paths for m in names})

    def body(kind: str, call: dict, weights: tuple[str, ...], ins: tuple[str, ...], outs: tuple[str, ...]):
        refs = {m: _REF for m in weights}
        return st.tuples(dirs_of(ins), dirs_of(outs)).map(
            lambda d: (
                f"/{kind}",
                {"call": {**call, "weights": refs}, "dirs": {"weights_in": d[0], "weights_out": d[1]}},
            )
        )

    fit = st.builds(
        lambda h, client, epochs: {**h, "client_id": client, "local_epochs": epochs, "seed": 0},
        header,
        st.integers(0, 2),
        st.integers(1, 2),
    )
    evaluate = header.map(lambda h: {**h, "seed": 0})
    return st.one_of(
        st.tuples(fit, members, members, members).flatmap(lambda a: body("fit", *a)),
        st.tuples(evaluate, members, members, st.sampled_from([(), (), ("actor",)])).flatmap(
            lambda a: body("evaluate", *a)
        ),
        st.tuples(header, st.sampled_from([(), (), ("actor",)]), members).flatmap(
            lambda a: body("init", a[0], a[1], (), a[2])
        ),
    )


def _bodies(root: Path, digest: str) -> st.SearchStrategy[tuple[str, object]]:
    dirs = st.fixed_dictionaries(
        {}, optional={"weights_in": _members(_paths(root)) | _json, "weights_out": _members(_paths(root)) | _json}
    )
    bodies = [
        st.tuples(
            st.just(path),
            st.fixed_dictionaries({"call": call | _json}, optional={"dirs": dirs | _json, "extra": _json}),
        )
        for path, call in _calls(root, digest).items()
    ]
    return st.one_of(
        *bodies,
        _well_typed(root, digest),
        _well_typed(root, digest),
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
    root, digest, lane, client = target

    nul = str(root / "run" / "a\x00b")
    call = {"run_id": RUN_ID, "round": 1, "recipe_sha256": digest, "weights": {"actor": _REF}}
    fit = {**call, "client_id": 0, "local_epochs": 1, "seed": 0}

    @_fuzz(FAST)
    @given(_bodies(root, digest))
    @example(("/init", {"call": {**call, "weights": {}}, "dirs": {"weights_out": {"actor": nul}}}))
    @example(("/evaluate", {"call": {**call, "seed": 0}, "dirs": {"weights_in": {"actor": nul}}}))
    @example(
        (
            "/fit",
            {
                "call": {**fit, "seed": 2**64},
                "dirs": {"weights_in": {"actor": nul}, "weights_out": {"actor": str(root / "outside")}},
            },
        )
    )
    @example(("/fit", {"call": fit, "dirs": {"weights_in": {"actor": nul}, "weights_out": {"actor": nul}}}))
    @example(  # wrong types inside the call: a ref that is no ref, a string count, a list of a digest
        (
            "/fit",
            {
                "call": {**fit, "weights": {"actor": {"inline": "yes", "nbytes": -1}}, "client_id": "0"},
                "dirs": {"weights_in": {"actor": str(root / "outside")}, "weights_out": {}},
            },
        )
    )
    @example(("/evaluate", {"call": {**call, "seed": 0, "recipe_sha256": [digest]}, "dirs": {}}))
    @example(("/init", {"call": {**call, "kind": "fit"}, "dirs": {"weights_out": {"actor": str(root / "outside")}}}))
    @example(("/fit", {"call": [fit], "dirs": {"weights_in": {"actor": str(root / "outside")}}}))
    def run(case: tuple[str, object]) -> None:
        _check(root, lane, client, *case)

    run()
    assert lane.health()["ok"]


@pytest.mark.slow
def test_fuzzed_requests_long(target):
    root, digest, lane, client = target

    @_fuzz(LONG)
    @given(_bodies(root, digest))
    def run(case: tuple[str, object]) -> None:
        _check(root, lane, client, *case)

    run()
    assert lane.health()["ok"]
