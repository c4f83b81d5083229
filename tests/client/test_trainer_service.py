"""The lane's trainer service as a real process (`client_app.service` behind `LaneService`): once
its owner (the simulation actor that started it) is gone, it exits within seconds, even in the
middle of its start-up or of a fit, since nobody would read the answer, and it stops the env
service it started (invariant 22). A stopped run must not keep a lane training. And it computes
on one thread, so its OpenMP threads spin instead of sleeping at every barrier."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from trainer_support import model_dir, one_torch_thread, random_model_dir, small_config  # noqa: F401

from client_app.lane import LaneService, ServiceError
from client_app.runtime_dir import NodeOwner, started
from fl_app.calls import FitCall, InitCall
from fl_app.channel import WeightsRef
from fl_app.config import load_config, recipe_sha256, save_config
from fl_app.host import usable_cores, voluntary_context_switches

EXIT_WITHIN_S = 5.0


@pytest.fixture
def owner() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def _lane_service(tmp_path: Path, model_dir: Path, owner_pid: int) -> LaneService:  # noqa: F811
    recipe = tmp_path / "recipe.yaml"
    save_config(small_config(model_dir, run={"run_dir": str(tmp_path / "run")}), recipe)
    # a lane name of this test's own, so the socket never meets another run's service
    owner = NodeOwner(owner_pid, started(psutil.Process(owner_pid)), "")
    return LaneService(
        run_id=7,
        run_config={"recipe": str(recipe)},
        log_dir=tmp_path / "logs",
        lane=f"test{os.getpid()}-{tmp_path.name[-12:]}",
        owner=owner,
    )


def _body(tmp_path: Path, kind: type[FitCall | InitCall], dirs: dict[str, dict[str, str]], **fields: object) -> dict:
    """What the ClientApp posts: the call as the server sends it (run 7, the recipe's digest as the
    service resolves it, a ref per member it reads) and this node's dirs."""
    recipe = str(tmp_path / "recipe.yaml")
    refs = {m: WeightsRef(inline=True, nbytes=0) for m in dirs.get("weights_in", {})}
    digest = recipe_sha256(load_config(recipe, overrides={"recipe": recipe}))
    call = kind(run_id=7, recipe_sha256=digest, weights=refs, **fields)
    return {"call": call.model_dump(mode="json"), "dirs": dirs}


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _kill_owner_and_time_exit(owner: subprocess.Popen, service: psutil.Process) -> float:
    children = service.children(recursive=True)
    owner.kill()
    owner.wait()
    t0 = time.monotonic()
    gone, alive = psutil.wait_procs([service], timeout=30)
    waited = time.monotonic() - t0
    for p in alive:
        p.kill()
    assert not alive, "the trainer service outlived its owner by 30 s"
    _, orphans = psutil.wait_procs(children, timeout=10)
    assert not orphans, f"the service left children running: {[p.pid for p in orphans]}"
    return waited


def _in_background(fn) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_service_whose_owner_dies_during_start_up_exits_at_once(tmp_path, model_dir, owner):  # noqa: F811
    lane = _lane_service(tmp_path, model_dir, owner.pid)
    starter, errors = _in_background(lane.ensure_started)
    _wait_for(lambda: lane.pid() is not None, 30, "the service was not spawned")
    service = psutil.Process(lane.pid())
    # its env service child exists once start-up is under way (the trainer is not built yet)
    _wait_for(lambda: service.children(), 120, "the service never started its env service")
    waited = _kill_owner_and_time_exit(owner, service)
    starter.join(30)
    log = lane.log_path.read_text()
    assert "serving run" not in log, "start-up finished before the owner died; the test did not test start-up"
    assert "exiting without finishing it" in log, log[-2000:]
    assert waited < EXIT_WITHIN_S, f"the service took {waited:.1f} s to notice its owner was gone"
    assert errors and isinstance(errors[0], ServiceError)  # the caller hears that start-up failed
    assert not lane.socket.exists()


def test_service_whose_owner_dies_mid_fit_abandons_the_fit(tmp_path, model_dir, owner):  # noqa: F811
    lane = _lane_service(tmp_path, model_dir, owner.pid)
    health = lane.ensure_started()
    init_dir = tmp_path / "run" / "w0" / "actor"  # the service works only inside its run dir
    lane.request("/init", _body(tmp_path, InitCall, {"weights_out": {"actor": str(init_dir)}}))
    out_dir = tmp_path / "run" / "w1" / "actor"
    body = _body(
        tmp_path,
        FitCall,
        {"weights_in": {"actor": str(init_dir)}, "weights_out": {"actor": str(out_dir)}},
        round=1,
        client_id=0,
        local_epochs=200,  # minutes of work
        seed=0,
    )
    fitter, errors = _in_background(lambda: lane.request("/fit", body))
    time.sleep(2.0)  # well inside the fit
    assert fitter.is_alive(), "the 200-epoch fit ended within 2 s; the test did not test a fit in progress"
    waited = _kill_owner_and_time_exit(owner, psutil.Process(health["pid"]))
    fitter.join(30)
    log = lane.log_path.read_text()
    assert "exiting without finishing it" in log, log[-2000:]
    assert "fit 1 (" not in log and not out_dir.exists()  # abandoned, not finished
    assert waited < EXIT_WITHIN_S, f"the service took {waited:.1f} s to abandon its fit"
    assert errors and isinstance(errors[0], ServiceError)


@pytest.mark.skipif(usable_cores() < 2 or not Path("/proc/self/task").is_dir(), reason="needs 2 cores and Linux /proc")
def test_a_lane_s_openmp_threads_keep_spinning_through_a_fit(tmp_path, owner):
    """All of a lane's torch work runs on one thread (`client_app.service.compute_thread`). Built
    on one thread and fitting on another, the lane had two OpenMP pools, and libgomp then put its
    threads to sleep at every barrier: ~8,800 sleeps a second, fits 1.25-1.35x slower. (A model
    wide enough that loading and training it run parallel regions: 128 wide.)"""
    lane = _lane_service(tmp_path, random_model_dir(tmp_path / "wide", hidden_size=128), owner.pid)
    service = psutil.Process(lane.ensure_started()["pid"])
    init_dir = tmp_path / "run" / "w0" / "actor"
    lane.request("/init", _body(tmp_path, InitCall, {"weights_out": {"actor": str(init_dir)}}))
    body = _body(
        tmp_path,
        FitCall,
        {"weights_in": {"actor": str(init_dir)}, "weights_out": {"actor": str(tmp_path / "run" / "w1" / "actor")}},
        round=1,
        client_id=0,
        local_epochs=4,
        seed=0,
    )
    before, t0 = voluntary_context_switches(service.pid), time.monotonic()
    lane.request("/fit", body)
    rate = (voluntary_context_switches(service.pid) - before) / (time.monotonic() - t0)
    lane.request("/shutdown", {})
    assert rate < 1000, f"the lane's threads slept {rate:.0f} times a second during a fit"


def _fit_body(tmp_path: Path, init_dir: Path, out: str, epochs: int) -> dict:
    dirs = {"weights_in": {"actor": str(init_dir)}, "weights_out": {"actor": str(tmp_path / "run" / out / "actor")}}
    return _body(tmp_path, FitCall, dirs, round=1, client_id=0, local_epochs=epochs, seed=0)


def _post_and_vanish(sock_path: Path, body: dict, after_s: float) -> None:
    """What a ClientApp killed mid-request leaves: its /fit sent, its connection closed unread."""
    data = json.dumps(body).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        s.sendall(
            b"POST /fit HTTP/1.1\r\nHost: svc\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
        )
        time.sleep(after_s)


def test_a_fit_whose_clientapp_vanished_ends_and_its_redispatched_duplicate_runs_after_it(
    tmp_path,
    model_dir,  # noqa: F811
    owner,
):
    """A /fit whose ClientApp died mid-request (its node, the service's owner, alive) is not
    abandoned: nothing can stop a fit half-way, so it runs to its end (its weights written,
    counted) and then frees the lane; the re-dispatched duplicate of the same call, sent while
    it runs, waits for it (one request at a time: one compute thread, `TrainerService.lock`)
    and then runs: never both at once, and the lane is never held past the first fit's end."""
    lane = _lane_service(tmp_path, model_dir, owner.pid)
    lane.ensure_started()
    init_dir = tmp_path / "run" / "w0" / "actor"
    lane.request("/init", _body(tmp_path, InitCall, {"weights_out": {"actor": str(init_dir)}}))
    one_epoch = time.monotonic()
    lane.request("/fit", _fit_body(tmp_path, init_dir, "warm", 1))
    one_epoch = time.monotonic() - one_epoch
    epochs = max(4, int(3.0 / one_epoch) + 1)  # a few seconds of fit
    _post_and_vanish(lane.socket, _fit_body(tmp_path, init_dir, "orphan", epochs), after_s=min(1.0, one_epoch))
    sent = time.monotonic()
    duplicate = lane.request("/fit", _fit_body(tmp_path, init_dir, "redispatched", epochs))
    answered = time.monotonic()
    orphan_done = (tmp_path / "run" / "orphan" / "actor" / "manifest.json").stat().st_mtime
    duplicate_started = time.time() - (time.monotonic() - answered) - duplicate["metrics"]["fit_total_s"]
    assert duplicate["metrics"]["service_fits"] == 3.0  # warm-up, the orphan (ran to its end), the duplicate
    assert duplicate_started >= orphan_done - 0.05, "the duplicate ran while the orphaned fit was still running"
    assert answered - sent < 2 * duplicate["metrics"]["fit_total_s"] + 2 * one_epoch + 10, "the lane was held"
    assert lane.health() is not None and lane.request("/shutdown", {})["ok"]
    assert "Traceback" not in lane.log_path.read_text()
