"""The trainer service under bad input and on a shared host (issue 18, items 1, 2, 4; issue 17, item 4).

A real service process (`client_app.service` behind `LaneService`, random-weight tiny policy)
is asked to read and write outside its roots, to serve another run, to load nothing; its runtime
dir is pre-created by someone else or planted with symlinks; two nodes of one lane stop it at
once. Each case must be refused with the root cause in the caller's exception, nothing written.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
import threading
from pathlib import Path

import psutil
import pytest
from trainer_support import model_dir, one_torch_thread, small_config  # noqa: F401

from client_app.lane import LaneService, ServiceRequestError
from client_app.runtime_dir import NodeOwner, RuntimeDirError, node_owner, private_dir
from fl_app.channel import WeightsRef
from fl_app.config import load_config, recipe_sha256, save_config

RUN_ID = 7
OTHER_UID = 65534  # nobody


def _lane(root: Path, model_dir: Path, lane: str) -> LaneService:  # noqa: F811
    recipe = root / "recipe.yaml"
    save_config(
        small_config(model_dir, run={"run_dir": str(root / "run"), "weight_cache_dir": str(root / "cache")}), recipe
    )
    return LaneService(
        run_id=RUN_ID,
        run_config={"recipe": str(recipe)},
        log_dir=root / "run" / "logs",
        lane=lane,
        run_dir=root / "run",
    )


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model_dir):  # noqa: F811
    root = tmp_path_factory.mktemp("svc")
    lane = _lane(root, model_dir, f"hard{os.getpid()}")
    lane.ensure_started()
    init = root / "run" / "rounds" / "round-0000" / "actor"
    lane.request("/init", _init(root, str(init)))
    yield lane, root
    lane.shutdown()


def _refused(lane: LaneService, path: str, body: dict) -> ServiceRequestError:
    with pytest.raises(ServiceRequestError) as info:
        lane.request(path, body)
    return info.value


@functools.cache
def _recipe_sha256(root: Path) -> str:
    """The digest of the recipe as the lane resolves it (`client_app.service.main`)."""
    recipe = str(root / "recipe.yaml")
    return recipe_sha256(load_config(recipe, overrides={"recipe": recipe}))


def _call(root: Path, members: tuple[str, ...] = ("actor",), **fields: object) -> dict:
    """A call's JSON as the server sends it to this lane: its run, its recipe, a ref per member."""
    ref = WeightsRef(inline=True, nbytes=0).model_dump(mode="json")
    return {"run_id": RUN_ID, "recipe_sha256": _recipe_sha256(root), "weights": {m: ref for m in members}, **fields}


def _body(call: dict, weights_in: dict | None = None, weights_out: dict | None = None) -> dict:
    """What the ClientApp posts: the call and where its weights are on this node."""
    return {"call": call, "dirs": {"weights_in": weights_in or {}, "weights_out": weights_out or {}}}


def _init(root: Path, weights_out: str, **fields: object) -> dict:
    return _body(_call(root, members=(), **fields), weights_out={"actor": weights_out})


def _evaluate(root: Path, weights_in: str, **fields: object) -> dict:
    return _body(_call(root, **{"round": 0, "seed": 0, **fields}), weights_in={"actor": weights_in})


def _fit(root: Path, weights_in: str, weights_out: str, **fields: object) -> dict:
    call = _call(root, **{"round": 1, "client_id": 0, "local_epochs": 1, "seed": 0, **fields})
    return _body(call, {"actor": weights_in}, {"actor": weights_out})


def test_init_refuses_to_write_outside_the_run_dir(svc, tmp_path):
    lane, root = svc
    target = tmp_path / "elsewhere" / "actor"
    err = _refused(lane, "/init", _init(root, str(target)))
    assert err.status == 403 and err.error_type == "PathEscapeError", err
    assert str(target) in err.message and "outside the run dir" in err.message
    assert not (tmp_path / "elsewhere").exists()


def test_fit_refuses_dotdot_and_symlinks_out_of_the_run_dir_before_any_work(svc, tmp_path):
    lane, root = svc
    good_in = str(root / "run" / "rounds" / "round-0000" / "actor")
    outside = tmp_path / "victim"
    outside.mkdir()
    link = root / "run" / "rounds" / "escape"
    link.symlink_to(outside)
    cases = {
        "dotdot out": _fit(root, good_in, str(root / "run" / ".." / ".." / "x" / "actor")),
        "symlink out (write)": _fit(root, good_in, str(link / "actor")),
        "symlink out (read)": _fit(root, str(link), str(root / "run" / "out" / "actor")),
        "absolute elsewhere (read)": _fit(root, "/etc", str(root / "run" / "out" / "actor")),
    }
    health = lane.health()
    for what, body in cases.items():
        err = _refused(lane, "/fit", body)
        assert err.status == 403 and err.error_type == "PathEscapeError", (what, err)
    assert list(outside.iterdir()) == []
    assert not (root / "run" / "out").exists()
    assert lane.health()["fits"] == health["fits"]  # nothing trained


def test_evaluate_refuses_a_weights_dir_outside_its_roots(svc):
    lane, root = svc
    err = _refused(lane, "/evaluate", _evaluate(root, "/proc/self"))
    assert err.status == 403 and "/proc/self" in err.message


def test_the_node_weight_cache_is_the_one_other_root(svc):
    lane, root = svc
    cache_in = root / "cache" / "fetched" / "actor"  # inside run.weight_cache_dir: accepted, then read
    cache_in.mkdir(parents=True)
    err = _refused(lane, "/evaluate", _evaluate(root, str(cache_in)))
    assert err.status == 422 and err.error_type == "WeightsError" and "manifest" in err.message


def test_service_errors_arrive_with_their_type_and_message_not_a_bare_500(svc):
    lane, root = svc
    empty = root / "run" / "scratch" / "nothing-exported"
    empty.mkdir(parents=True)
    err = _refused(lane, "/fit", _fit(root, str(empty), str(root / "run" / "o1" / "actor")))
    assert (err.status, err.error_type) == (422, "WeightsError")
    assert "no manifest.json" in err.message and str(empty) in err.message
    assert "WeightsError: " in str(err) and "Internal Server Error" not in str(err)
    err = _refused(lane, "/fit", _fit(root, str(empty), str(empty), run_id=RUN_ID + 1))
    assert err.status == 409 and f"belongs to run {RUN_ID}" in err.message
    critic = _fit(root, str(empty), str(empty))  # a critic in, where this GRPO trainer federates an actor only
    critic["call"]["weights"] = _call(root, members=("critic",))["weights"]
    critic["dirs"]["weights_in"] = {"critic": str(empty)}
    err = _refused(lane, "/fit", critic)
    assert err.status == 409 and "federates ['actor']" in err.message
    err = _refused(lane, "/fit", {"call": {"run_id": RUN_ID, "round": -1}, "dirs": {}})
    assert err.status == 422 and err.error_type == "RequestValidationError" and "round" in err.message


@pytest.mark.parametrize("digest", ["0" * 64, ""], ids=["another recipe", "no recipe named"])
def test_a_call_of_another_recipe_is_refused_before_any_work(svc, tmp_path, digest):
    """A node trains, validates and exports only for the recipe it resolved itself: a call whose
    recipe digest differs (a server with other recipe files or run config) is refused, 409 naming
    the lane's digest, before any dir is looked at, and nothing is read, trained or written."""
    lane, root = svc
    good_in = str(root / "run" / "rounds" / "round-0000" / "actor")
    out = root / "run" / "other-recipe"
    cases = {
        "fit": ("/fit", _fit(root, good_in, str(out / "fit" / "actor"), recipe_sha256=digest)),
        "fit, dirs outside": ("/fit", _fit(root, "/etc", str(tmp_path / "x" / "actor"), recipe_sha256=digest)),
        "evaluate": ("/evaluate", _evaluate(root, good_in, recipe_sha256=digest)),
        "init": ("/init", _init(root, str(out / "init" / "actor"), recipe_sha256=digest)),
    }
    health = lane.health()
    for what, (path, body) in cases.items():
        err = _refused(lane, path, body)
        assert (err.status, err.error_type) == (409, "Refused"), (what, err)
        assert "different recipe" in err.message and _recipe_sha256(root)[:12] in err.message, (what, err)
    assert not out.exists() and not (tmp_path / "x").exists()
    after = lane.health()
    assert (after["fits"], after["evals"]) == (health["fits"], health["evals"])  # nothing trained nor validated


def test_a_call_whose_weights_differ_from_its_dirs_is_refused_before_any_work(svc):
    """The members a call carries weights for, the dirs the node got them into and the dirs it
    writes must all be the ones the call needs (a fit: the trainer's members in and out; a
    validation: the actor in, nothing out; round 0: nothing in, the members out), else 409."""
    lane, root = svc
    good_in = str(root / "run" / "rounds" / "round-0000" / "actor")
    out = root / "run" / "mismatch"

    def refs(*members: str) -> dict:
        return _call(root, members=members)["weights"]

    def fit(weights: dict, weights_out: dict | None = None) -> dict:
        body = _fit(root, good_in, str(out / "actor"))
        body["call"]["weights"] = weights
        if weights_out is not None:
            body["dirs"]["weights_out"] = weights_out
        return body

    evaluate_with_out = _evaluate(root, good_in)
    evaluate_with_out["dirs"]["weights_out"] = {"actor": str(out / "eval")}
    evaluate_with_critic = _evaluate(root, good_in)
    evaluate_with_critic["call"]["weights"] = refs("actor", "critic")
    init_with_weights = _init(root, str(out / "init"))
    init_with_weights["call"]["weights"] = refs("actor")
    cases = {
        "fit: a critic the dirs lack": ("/fit", fit(refs("actor", "critic")), "['actor', 'critic'] (dirs in ['actor']"),
        "fit: no weights named": ("/fit", fit({}), "weights for [] (dirs in ['actor']"),
        "fit: another member": ("/fit", fit(refs("critic")), "weights for ['critic'] (dirs in ['actor']"),
        "fit: nothing out": ("/fit", fit(refs("actor"), weights_out={}), "out []) but this fit needs"),
        "evaluate: a dir out": ("/evaluate", evaluate_with_out, "this evaluate needs ['actor'] in and [] out"),
        "evaluate: a critic": ("/evaluate", evaluate_with_critic, "this evaluate needs ['actor'] in"),
        "init: weights in": ("/init", init_with_weights, "this init needs [] in and ['actor'] out"),
    }
    health = lane.health()
    for what, (path, body, words) in cases.items():
        err = _refused(lane, path, body)
        assert (err.status, err.error_type) == (409, "Refused"), (what, err)
        assert "the call carries weights for" in err.message and words in err.message, (what, err.message)
        assert "federates ['actor']" in err.message, (what, err.message)
    assert not out.exists()
    after = lane.health()
    assert (after["fits"], after["evals"]) == (health["fits"], health["evals"])


def test_socket_is_private_to_its_user(svc):
    lane, _ = svc
    assert stat.S_IMODE(os.stat(lane.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(lane.socket.parent).st_mode) == 0o700


def _runtime_env(monkeypatch, path: Path) -> None:
    monkeypatch.setenv("FEDAGENT_RUNTIME_DIR", str(path))


@pytest.mark.parametrize("case", ["world-writable", "group-writable", "someone else's", "a symlink"])
def test_a_runtime_dir_we_do_not_own_privately_is_refused(tmp_path, monkeypatch, model_dir, case):  # noqa: F811
    rt = tmp_path / "rt"
    if case == "a symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        rt.symlink_to(tmp_path / "real")
    else:
        rt.mkdir()
        os.chmod(rt, {"world-writable": 0o777, "group-writable": 0o770}.get(case, 0o700))
        if case == "someone else's":
            os.chown(rt, OTHER_UID, OTHER_UID)
    _runtime_env(monkeypatch, rt)
    with pytest.raises(RuntimeDirError, match=f"runtime dir {rt}"):
        _lane(tmp_path, model_dir, "cpu").ensure_started()


def test_a_fresh_runtime_dir_is_created_private(tmp_path, monkeypatch):
    _runtime_env(monkeypatch, tmp_path / "new" / "rt")
    owner = node_owner(argv=["python"])
    assert stat.S_IMODE(os.stat(owner.runtime_dir()).st_mode) == 0o700


def test_planted_symlinks_for_pid_and_lock_files_are_refused_not_written_through(tmp_path, monkeypatch, model_dir):  # noqa: F811
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    _runtime_env(monkeypatch, rt)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lane = _lane(tmp_path, model_dir, "cpu")
    lane.pid_path.symlink_to(victim)
    with pytest.raises(RuntimeDirError, match="symlink"):
        lane.pid()
    lane.lock_path.symlink_to(victim)
    with pytest.raises(RuntimeDirError, match="symlink"):
        lane.ensure_started()
    assert victim.read_text() == "precious\n"
    assert not lane.log_path.exists()  # nothing was started


def test_private_dir_accepts_its_own_dir_again(tmp_path):
    d = private_dir(tmp_path / "mine")
    assert private_dir(d) == d


def test_a_deployed_clientapp_belongs_to_the_root_of_its_parent_pid_chain(tmp_path, monkeypatch):
    """flwr-clientapp --parent-pid <SuperExec>; flower-superexec --parent-pid <SuperNode>: the
    SuperNode owns the node's services, in a runtime dir of its own."""
    import subprocess
    import sys

    _runtime_env(monkeypatch, tmp_path / "rt")
    supernode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    superexec = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--parent-pid", str(supernode.pid)]
    )
    try:
        owner = node_owner(argv=["flwr-clientapp", "--token", "t", "--parent-pid", str(superexec.pid)])
        assert owner.pid == supernode.pid and owner.alive()
        assert owner.scope.startswith(f"node-{supernode.pid}-")
        assert owner.runtime_dir() == tmp_path / "rt" / owner.scope
        sim = node_owner(argv=["ray::ClientAppActor"])
        assert sim.pid == os.getpid() and sim.scope == "" and sim.runtime_dir() == tmp_path / "rt"
        supernode.kill()
        supernode.wait()
        assert not owner.alive()
        assert not NodeOwner.from_arg(owner.as_arg()).alive()
    finally:
        for p in (supernode, superexec):
            p.kill()
            p.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux derives the boot time from the clock")
def test_a_step_of_the_system_clock_does_not_make_a_live_owner_look_gone(tmp_path, monkeypatch):
    """Linux reports the boot time as the clock now minus the uptime, so psutil's create_time()
    moves with every NTP step of the clock; a service that compared it took its live owner for
    a reused PID and quit during start-up. The owner's identity and its node scope are fixed."""
    import subprocess

    import psutil._pslinux as pslinux

    _runtime_env(monkeypatch, tmp_path / "rt")
    supernode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        argv = ["flwr-clientapp", "--parent-pid", str(supernode.pid)]
        owner = node_owner(argv=argv)
        before, boot = psutil.Process(supernode.pid).create_time(), pslinux.boot_time()
        monkeypatch.setattr(pslinux, "boot_time", lambda: boot + 1.0)  # the clock stepped 1 s
        assert psutil.Process(supernode.pid).create_time() == before + 1.0  # psutil's moved
        assert owner.alive() and NodeOwner.from_arg(owner.as_arg()).alive()
        assert node_owner(argv=argv) == owner  # the next ClientApp finds the same scope
    finally:
        supernode.kill()
        supernode.wait()


def test_two_nodes_of_one_lane_stop_its_service_exactly_once(svc, model_dir):  # noqa: F811
    """Issue 17: both used to pass the health check and the second posted to a closed socket.
    (Runs last: it stops the module's service.)"""
    lane, root = svc
    lanes = [lane, _lane(root, model_dir, lane.lane)]
    health = lanes[0].ensure_started()
    gate = threading.Barrier(2)
    results: list[object] = [None, None]

    def stop(i: int) -> None:
        gate.wait()
        try:
            results[i] = lanes[i].shutdown()
        except BaseException as e:  # noqa: BLE001 - the assertion below shows it
            results[i] = e

    threads = [threading.Thread(target=stop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stopped = [r for r in results if isinstance(r, dict)]
    assert len(stopped) == 1 and results.count(None) == 1, results
    assert stopped[0]["pid"] == health["pid"]
    assert lanes[0].health() is None and not lanes[0].socket.exists()


def test_files_a_process_removes_at_exit_go_on_every_exit_but_a_forked_child_s(tmp_path):
    """`remove_at_exit` (the verl lane's rendezvous file): gone after an `os._exit` that calls
    `remove_own_files` first, as the service's abandon path does; a forked child's exit keeps them."""
    import subprocess
    import sys

    files = [tmp_path / "a", tmp_path / "b"]
    child = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from client_app.runtime_dir import remove_at_exit, remove_own_files\n"
        "files = [Path(p) for p in sys.argv[1:]]\n"
        "for f in files:\n"
        "    f.touch()\n"
        "    remove_at_exit(f)\n"
        "if os.fork() == 0:\n"
        "    sys.exit(0)  # a normal exit: atexit runs in the forked child\n"
        "os.wait()\n"
        "if not all(f.exists() for f in files):\n"
        "    os._exit(3)\n"
        "remove_own_files()\n"
        "os._exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, *map(str, files)], cwd=Path(__file__).parents[2])
    assert done.returncode == 0, "a forked child's exit removed its parent's files"
    assert not any(f.exists() for f in files)
