"""One round, followed by reading: the files docs/architecture.md lists for it are few and real,
the ClientApp is a forwarder, and a static walk of the source finds the one typed call crossing
the round: built by the server, forwarded by the ClientApp, validated by the trainer service as
its request body, read by the fit loop, with the recipe's names for its keys."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fl_app.calls import EvalCall, FitCall, InitCall
from fl_app.config import FederationCfg

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES, MAX_CLIENTAPP_LINES = 32, 100


def _round_files() -> list[str]:
    """The files of the round, as docs/architecture.md lists them (its "Following one round" list)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Following one round", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([\w/.]+\.py)`", section, re.M)


def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def _calls_of(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _function(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]
    assert found, name
    return found[0]


def _annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    return {a.arg: ast.unparse(a.annotation) for a in fn.args.args if a.annotation is not None}


def test_the_round_is_a_short_list_of_real_files_and_the_clientapp_a_forwarder():
    files = _round_files()
    assert 10 <= len(files) <= MAX_FILES, files
    assert len(set(files)) == len(files)
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"docs/architecture.md lists files that do not exist: {missing}"
    for needed in ("server_app/app.py", "fl_app/calls.py", "client_app/app.py", "client_app/service.py"):
        assert needed in files
    lines = len((ROOT / "client_app" / "app.py").read_text().splitlines())
    assert lines <= MAX_CLIENTAPP_LINES, f"the ClientApp has {lines} lines"


def test_a_static_walk_finds_one_typed_call_from_the_server_to_the_loop():
    server = _tree("server_app/app.py")
    for kind in ("InitCall", "FitCall", "EvalCall"):  # 1. the server builds each call once
        assert len(_calls_of(server, kind)) == 1, kind
    # 2. the ClientApp forwards the call it was sent (its JSON, parsed by the call's own type)
    client = _tree("client_app/app.py")
    forwarded = [
        n
        for n in ast.walk(client)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "model_dump"
    ]
    assert forwarded and all(ast.unparse(c.func.value) == "call" for c in forwarded)
    assert not _calls_of(client, "FitCall"), "the ClientApp forwards the server's call; it builds none"
    # 3. the trainer service validates it: the call types are its request bodies
    service = _tree("client_app/service.py")
    for route, kind in (("fit", "FitCall"), ("evaluate", "EvalCall"), ("init", "InitCall")):
        handler = _function(_function(service, "create_app"), route)
        assert _annotations(handler)["call"] == kind, route
    # 4. the loop reads the same object
    loop = _tree("client_app/trainer/loop.py")
    assert _annotations(_function(loop, "fit"))["call"] == "FitCall"
    assert _annotations(_function(loop, "evaluate"))["call"] == "EvalCall"
    names = {
        n.id
        for path in ("client_app/service.py", "client_app/trainer/loop.py")
        for n in ast.walk(_tree(path))
        if isinstance(n, ast.Name)
    }
    assert {"FitBody", "FitRequest", "EvalBody", "EvalRequest"}.isdisjoint(names)


def test_each_key_of_the_call_has_the_recipe_s_name():
    """`federation.local_epochs` in the recipe is `local_epochs` on the wire and in the loop."""
    for key in ("local_epochs", "proximal_mu"):
        assert key in FitCall.model_fields and key in FederationCfg.model_fields
    header = {"run_id", "round", "recipe_sha256", "code_sha256", "run_dir", "run_dir_token", "weights"}
    for kind in (FitCall, EvalCall, InitCall):
        assert header <= set(kind.model_fields), kind
