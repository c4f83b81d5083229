"""The real thing: `flwr run` against a private local SuperLink, the real ServerApp, ClientApp,
trainer service, env service and tiny model (issue 4's must-shows, scaled to minutes).

One module, so the tests that need an uninterrupted two-round run read the same one (a run
costs 30-40 s on the 2-core box, most of it starting Flower's runtime and the trainer lane,
whatever its rounds): the resumed run and the served weight store are compared with it, and so
is the run on three CPU lanes (issue 41, items 1 and 3: two simulation actors,
`client-resources-num-cpus=1` on the box's 2 cores, each round's two fits on two lanes at once,
the third idle, the one-lane run's bits; invariant 39). Every run here pins each trainer to one
torch thread (`FEDAGENT_CPU_THREADS=1`): the thread count changes the order of fp32 reductions,
and a lane's share of the cores depends on how many lanes run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
import torch
from flower_harness import ROOT, flower, run_config, run_status, sigkill

from fl_app.host import CPU_THREADS_VAR
from fl_app.provenance import code_root, code_sha256
from fl_app.rundir import RunDir
from fl_app.weights import Manifest, load_shards
from server_app.local_superlink import find_superlink

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"
HTTP = ROOT / "tests" / "fixtures" / "e2e-http-recipe.yaml"
TWO_ACTORS = "num-supernodes=2 client-resources-num-cpus=1"


def _rc(run_dir: Path, **extra: object) -> str:
    return run_config(RECIPE, run_dir, **extra)


def _service_pids(fr) -> list[int]:
    rt = fr.short / "rt"
    return [int(p.read_text()) for p in rt.rglob("svc-*.pid")] if rt.exists() else []


@pytest.fixture(scope="module")
def fl(tmp_path_factory):
    with flower(tmp_path_factory.mktemp("flwr")) as fr:
        fr.env[CPU_THREADS_VAR] = "1"
        yield fr


@pytest.fixture(scope="module")
def two_rounds_run(fl, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("run") / "r"
    p = fl.run(_rc(run_dir, rounds=2), timeout_s=1500)
    status = run_status(run_dir)
    assert p.returncode == 0 and status.returncode == 0, status.stdout + p.stdout[-4000:] + p.stderr[-4000:]
    return run_dir, p.stdout + p.stderr + fl.superlink_log()


@pytest.fixture(scope="module")
def two_rounds(two_rounds_run) -> Path:
    return two_rounds_run[0]


def test_flwr_run_completes_rounds_and_writes_the_run_dir(two_rounds, fl):
    rd = RunDir(two_rounds, total_rounds=2)
    assert rd.last_complete_round() == 2
    rows = rd.read_metrics()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all("val_success" in r for r in rows)
    assert all(len(r["clients"]) == 2 and r["train_num-examples"] > 0 for r in rows[1:])
    summary = json.loads((two_rounds / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["final_round"] == 2
    assert summary["code_sha256"] == code_sha256(code_root())  # the FAB's code: this checkout's, checked
    beat = json.loads((two_rounds / "heartbeat.json").read_text())  # the server beat while it ran, then stopped
    assert beat["run_id"] == summary["run_id"] and beat["stopped_at"] == beat["beat_at"] > 0, beat
    assert "complete, 2 rounds (round 2 verified)" in run_status(two_rounds).stdout
    assert (two_rounds / "validation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (two_rounds / "phases.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # beside it (issue 38)
    assert (two_rounds / "config.yaml").exists()
    partition = json.loads((two_rounds / "partition.json").read_text())  # written before round 1 (issue 15)
    assert len(partition["clients"]) == summary["config"]["federation"]["clients"]
    assert summary["partition"]["digest"] == partition["digest"]
    assert summary["partition"]["partition"]["name"] == "uniform"
    for r in range(3):
        assert Manifest.from_dir(rd.member_dir(r)).tensor_bytes > 0


def test_every_round_says_how_its_episodes_ended(two_rounds_run):
    """Outcome shares of the validation and of the round's fits are in metrics.jsonl (they add up
    to 1, and `won` is the success rate), and each round's line names the validation misses."""
    run_dir, output = two_rounds_run
    rows = RunDir(run_dir, total_rounds=2).read_metrics()
    named = 0
    for row in rows:
        for prefix in ("val_", "train_") if row["round"] else ("val_",):
            shares = {k: v for k, v in row.items() if k.startswith(f"{prefix}outcome_")}
            assert sum(shares.values()) == pytest.approx(1.0), shares
            assert shares.get(f"{prefix}outcome_won", 0.0) == pytest.approx(row[f"{prefix}success"])
        misses = {
            k.removeprefix("val_outcome_"): v
            for k, v in row.items()
            if k.startswith("val_outcome_") and k != "val_outcome_won"
        }
        line = next(x for x in output.splitlines() if f"round {row['round']}" in x and "val success" in x)
        assert f"val success {row['val_success']:.3f}" in line
        assert all(f"{label} {v:.2f}" in line for label, v in misses.items()), line
        named += bool(misses)
    assert named, "the e2e run's random model should miss some validation episodes"


def test_each_round_splits_its_wall_time_into_work_and_named_overhead(two_rounds):
    """The round rows time the server's aggregation and sum the fits' phase times, so
    `bench.round_overhead` can split a real run's rounds (issue #17's <= 5% target): the parts
    it names are positive and within the round."""
    from bench.round_overhead import report

    rows = RunDir(two_rounds, total_rounds=2).read_metrics()[1:]
    for r in rows:
        assert 0 < r["aggregate_s"] < r["wall_s"]
        assert 0 < r["fits_rollout_update_s"] < r["fits_total_s"] < r["wall_s"]
        assert 0 < r["fits_load_s"] + r["fits_export_s"] < r["fits_total_s"]
    rep = report(two_rounds)
    for p in rep["rounds"].values():
        assert all(p[k] > 0 for k in ("fits_work", "val_work", "load", "export", "in_fits", "aggregate", "overhead"))
        assert p["load"] + p["export"] + p["in_fits"] + p["aggregate"] < p["overhead"] < p["wall"]
    assert rep["rounds_in_mean"] == 1 and 0 < rep["mean"]["overhead_frac"] < 1
    # the lane freezes what outlives each fit: over HTTP too, what it freezes must not pile up
    frozen = [r["train_service_frozen_objects"] for r in rows]
    assert frozen[0] > 100_000 and abs(frozen[1] - frozen[0]) < 500, frozen


def test_each_round_accounts_its_bytes_per_client_and_member_and_its_phases(two_rounds, tmp_path):
    """Inline weights: each client got the global model's arrays and sent back its own, per member;
    the phases are measured, within the round's wall; TensorBoard holds every row; the report
    reads the run (issue 38 part 4)."""
    from tb_support import events

    from server_app.report import main as report

    rd = RunDir(two_rounds, total_rounds=2)
    rows = rd.read_metrics()
    for r in rows[1:]:
        model = Manifest.from_dir(rd.member_dir(r["round"] - 1)).tensor_bytes
        assert sorted(r["per_client"]) == sorted(str(c) for c in r["clients"])
        for c in r["per_client"].values():
            assert c["bytes_down"] == {"actor": model} and c["bytes_up"] == {"actor": model}
            # the Flower messages that carried them: the arrays, the call's record, the metrics
            assert all(model < n < model + 2**16 for n in c["message_bytes"].values()), c["message_bytes"]
            assert all(c["phases"][p] > 0 for p in ("transport", "load", "rollout", "scoring", "update", "export"))
            assert sum(c["phases"].values()) < c["serve_s"]
        val = Manifest.from_dir(rd.member_dir(r["round"])).tensor_bytes
        assert r["bytes_down"] == {"actor": 2 * model + val} and r["bytes_up"] == {"actor": 2 * model}
        ph = r["phase_s"]
        assert all(ph[p] > 0 for p in ("dispatch", "aggregation", "validation", "rollout", "update"))
        assert ph["other"] >= 0 and sum(ph.values()) == pytest.approx(r["wall_s"])
    assert rows[0]["bytes_up"] == {"actor": Manifest.from_dir(rd.member_dir(0)).tensor_bytes}
    summary = json.loads((two_rounds / "summary.json").read_text())
    shutdown = [summary["message_bytes"][w] - sum(r["message_bytes"][w] for r in rows) for w in ("down", "up")]
    assert summary["first_round"] == 0 and all(0 < n < 2**16 for n in shutdown), shutdown  # + the shutdown calls
    board = events(two_rounds / "tb")
    assert [board[("val_success", r["round"])] for r in rows] == pytest.approx([r["val_success"] for r in rows])
    assert report([str(two_rounds), "--out", str(tmp_path)]) == 0


def test_one_trainer_service_serves_every_fit_and_stops(two_rounds, fl):
    summary = json.loads((two_rounds / "summary.json").read_text())
    (svc,) = summary["services"]  # one lane (CPU) -> one service
    assert svc["fits"] == 4 and svc["evals"] == 3  # 2 rounds x 2 clients; rounds 0, 1, 2
    for pid in _service_pids(fl):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # the run dir says where every node's trainer log is
    assert summary["nodes"] and all(Path(n["service-log"]).exists() for n in summary["nodes"].values())


def test_two_nodes_on_one_lane_shut_it_down_once_without_a_traceback(two_rounds_run):
    """Issue 17: the second node's shutdown used to post to the socket the first had closed."""
    run_dir, output = two_rounds_run
    assert "ClientAppException" not in output and "Connection refused" not in output, output[-6000:]
    assert "shutdown on node" not in output  # no failed shutdown reply
    assert len(json.loads((run_dir / "summary.json").read_text())["services"]) == 1


def test_bf16_unrepresentable_value_survives_client_aggregation_and_reload(two_rounds):
    """Invariant 1: fp32 end to end (a bf16 round trip would collapse these values)."""
    state = load_shards(RunDir(two_rounds).member_dir(2))
    flat = next(iter(t for t in state.values() if t.is_floating_point() and t.numel() > 1000)).flatten()
    assert not (flat == flat.bfloat16().float()).all()


def test_resume_continues_after_the_last_round_on_disk_and_matches_uninterrupted(fl, two_rounds, tmp_path):
    """rounds=1 then rounds=2 on the same dir == the uninterrupted rounds=2 run, bit for bit."""
    stopped = tmp_path / "stopped"
    for rounds in (1, 2):
        p = fl.run(_rc(stopped, rounds=rounds), timeout_s=900)
        assert run_status(stopped).returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "resuming after round 1" in p.stdout, p.stdout[-4000:]
    for rnd in (1, 2):
        resumed, uninterrupted = (Manifest.from_dir(RunDir(d).member_dir(rnd)) for d in (stopped, two_rounds))
        assert [s.digest for s in resumed.shards] == [s.digest for s in uninterrupted.shards], rnd


@pytest.mark.slow
def test_a_fedadam_run_stopped_after_round_1_resumes_to_the_uninterrupted_bits(fl, tmp_path):
    """The server optimizer's moments are part of the round (fl_app.server_opt): rounds=1 then
    rounds=3 on the same dir == an uninterrupted rounds=3 run, every shard of the global model
    and of both moments, every round."""
    adam = {"federation.server_optimizer": '"fedadam"', "server-lr": 0.01}
    stopped, fresh = tmp_path / "stopped", tmp_path / "fresh"
    out = []
    for run_dir, rounds in ((stopped, 1), (stopped, 3), (fresh, 3)):
        p = fl.run(_rc(run_dir, rounds=rounds, **adam), timeout_s=1500)
        assert run_status(run_dir).returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        out.append(p.stdout)
    assert "resuming after round 1" in out[1], out[1][-4000:]
    entries = ("fedadam/actor/m", "fedadam/actor/v")
    for r in (1, 2, 3):
        got, want = RunDir(stopped), RunDir(fresh)
        dirs = [(got.member_dir(r), want.member_dir(r))]
        dirs += [(got.opt_state_dir(r, e), want.opt_state_dir(r, e)) for e in entries]
        for a, b in dirs:
            assert [s.digest for s in Manifest.from_dir(a).shards] == [s.digest for s in Manifest.from_dir(b).shards]
    marker = json.loads((stopped / "rounds" / "round-0003" / "COMPLETE").read_text())
    assert sorted(marker["server_opt"]) == list(entries)


def test_the_served_weight_store_gives_the_inline_runs_bits(fl, two_rounds, tmp_path):
    """run.weight_store=http with every weight above the inline limit: the ServerApp serves its
    run dir over HTTP, nodes fetch the global model into their node-local cache and upload their
    results with a credential per call, writing only node-local files; rounds 0 and 1 are the inline
    run's bits (issue 14: weights without a shared disk)."""
    run_dir, cache = tmp_path / "http", tmp_path / "node-cache"
    p = fl.run(run_config(HTTP, run_dir, rounds=1, **{"run.weight_cache_dir": f'"{cache}"'}), timeout_s=900)
    status = run_status(run_dir)
    assert status.returncode == 0, status.stdout + p.stdout[-3000:] + p.stderr[-3000:]
    assert "weight store: serving" in p.stdout + p.stderr
    for rnd in (0, 1):
        served = Manifest.from_dir(RunDir(run_dir).member_dir(rnd))
        inline = Manifest.from_dir(RunDir(two_rounds).member_dir(rnd))
        assert [s.digest for s in served.shards] == [s.digest for s in inline.shards]
    # through the channel: round 0's model was uploaded into the server's run dir by a node, the
    # nodes fetched the global models into their own cache and wrote only there
    assert (run_dir / "scratch" / "init-0000" / "actor" / "manifest.json").is_file()
    assert len([d for d in cache.iterdir() if (d / "manifest.json").is_file()]) == 2  # rounds 0 and 1
    assert not list((cache / "work").rglob("*.safetensors")), "published dirs are dropped"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sum(s["fits"] for s in summary["services"]) == 2
    # what travelled: shard files, each global model downloaded once per node cache (round 0's by
    # its validation, before round 1's clients found it cached), each client's upload in full
    rows, files = RunDir(run_dir).read_metrics(), lambda r: Manifest.from_dir(RunDir(run_dir).member_dir(r)).total_bytes
    assert rows[0]["bytes_down"] == {"actor": files(0)} and rows[0]["bytes_up"] == {"actor": files(0)}
    assert [c["bytes_down"] for c in rows[1]["per_client"].values()] == [{"actor": 0}] * 2
    assert [c["bytes_up"] for c in rows[1]["per_client"].values()] == [{"actor": files(1)}] * 2
    assert rows[1]["bytes_down"] == {"actor": files(1)}


# ---- several CPU lanes (issue 41, items 1 and 3) -----------------------------------------------


@pytest.fixture(scope="module")
def three_lanes(fl, tmp_path_factory) -> tuple[Path, str]:
    """run dir and output of the two-round run on 3 CPU lanes, served by two actors at once."""
    run_dir = tmp_path_factory.mktemp("lanes3") / "r"
    p = fl.run(_rc(run_dir, rounds=2, **{"run.cpu_lanes": 3}), timeout_s=1500, federation_config=TWO_ACTORS)
    status = run_status(run_dir)
    assert p.returncode == 0 and status.returncode == 0, status.stdout + p.stdout[-4000:] + p.stderr[-4000:]
    return run_dir, p.stdout + p.stderr


def test_a_round_s_fits_run_at_once_on_two_cpu_lanes_and_the_third_is_idle(three_lanes):
    """A lane serves one fit at a time; two fits of a round overlap (a round's first fits may
    not: the second actor may still be importing); the lane nobody needed is idle."""
    run_dir, output = three_lanes
    overlapped = 0
    for row in RunDir(run_dir, total_rounds=2).read_metrics()[1:]:
        (a, b) = row["per_client"].values()
        assert a["devices"] == b["devices"] == ["cpu"] and {a["lane"], b["lane"]} <= {"cpu0", "cpu1"}
        if max(a["lane_span"][0], b["lane_span"][0]) < min(a["lane_span"][1], b["lane_span"][1]):
            assert a["lane"] != b["lane"], row["per_client"]
            overlapped += 1
    assert overlapped, "no round ran its two fits at once"
    summary = json.loads((run_dir / "summary.json").read_text())
    (served,) = summary["lanes"]["served"].values()
    assert sorted(served) == ["cpu0", "cpu1"] and sum(lane["fits"] for lane in served.values()) == 4
    assert list(summary["lanes"]["idle"].values()) == [["cpu2"]]
    assert "lanes idle" in output and "clients_per_round=2 is below the 3 lanes" in output, output[-4000:]
    assert sum(s["stopped"] for s in summary["services"]) == 2  # both lanes that served stopped once


def test_the_lanes_a_fit_ran_on_do_not_change_the_global_models(two_rounds, three_lanes):
    for rnd in (1, 2):
        one, three = (Manifest.from_dir(RunDir(d).member_dir(rnd)) for d in (two_rounds, three_lanes[0]))
        assert [s.digest for s in one.shards] == [s.digest for s in three.shards], rnd


def test_one_cpu_lane_is_the_lane_cpu_and_idles_nothing(two_rounds, three_lanes):
    """The default: every fit on the one lane `cpu`; the round walls of both runs are printed."""
    for n, run_dir in ((1, two_rounds), (3, three_lanes[0])):
        rows = RunDir(run_dir, total_rounds=2).read_metrics()[1:]
        print(f"\n{n} CPU lane(s): round walls {[round(r['wall_s'], 1) for r in rows]} s")
        if n == 1:
            assert all(f["lane"] == "cpu" for r in rows for f in r["per_client"].values())
    summary = json.loads((two_rounds / "summary.json").read_text())
    assert list(summary["lanes"]["served"].values()) == [{"cpu": {"fits": 4, "devices": ["cpu"]}}]
    assert summary["lanes"]["idle"] == {}


@pytest.mark.slow  # 33 s; test_aggregate.py holds server_lr to its definition bit for bit
def test_a_server_learning_rate_steps_from_the_round_s_global_model(fl, two_rounds, tmp_path):
    """`server-lr=1.5`: the same clients train from the same round 0 as the FedAvg run, and the
    server writes w0 + 1.5 * (their mean - w0), the mean being the FedAvg run's round 1."""
    run_dir = tmp_path / "eta"
    p = fl.run(_rc(run_dir, rounds=1, **{"server-lr": 1.5}), timeout_s=900)
    status = run_status(run_dir)
    assert status.returncode == 0, status.stdout + p.stdout[-3000:] + p.stderr[-3000:]
    w0, mean = (load_shards(RunDir(two_rounds).member_dir(r)) for r in (0, 1))
    got = load_shards(RunDir(run_dir).member_dir(1))
    assert (
        Manifest.from_dir(RunDir(run_dir).member_dir(0)).sha256
        == Manifest.from_dir(RunDir(two_rounds).member_dir(0)).sha256
    )
    moved = 0
    for name, w in w0.items():
        want = w.double() + 1.5 * (mean[name].double() - w.double())
        torch.testing.assert_close(got[name].double(), want, rtol=1e-5, atol=1e-6)
        moved += int(not torch.equal(got[name], mean[name]))
    assert moved > len(w0) // 2  # not FedAvg's mean


@pytest.mark.slow  # 17 s; test_rundir.py refuses it in the default run (invariant 6)
def test_run_dir_with_more_rounds_than_asked_is_refused(fl, two_rounds):
    p = fl.run(_rc(two_rounds, rounds=1), timeout_s=600)
    out = p.stdout + p.stderr
    assert "refusing to resume" in out and "Ways out" in out, out[-4000:]


def test_bad_config_fails_before_anything_starts(fl, tmp_path):
    run_dir = tmp_path / "bad"
    p = fl.run(_rc(run_dir, **{"clients-per-round": 9}), timeout_s=600)
    out = p.stdout + p.stderr
    assert "exceeds federation.clients" in out, out[-4000:]
    assert not run_dir.exists()  # nothing was created
    assert not _service_pids(fl) or all(not psutil.pid_exists(p) for p in _service_pids(fl))


@pytest.mark.slow  # 18 s; test_heterogeneity.py::test_labels_from_another_task_order_are_refused in the default run
def test_labels_of_another_env_fail_the_run_before_any_lane_starts(fl, tmp_path):
    """Hardness labels made on another task order are refused by the server before round 0 (issue 15)."""
    recipe = tmp_path / "hardness.yaml"
    labels = ROOT / "configs" / "labels" / "tiny-shop.json"  # the tiny default's pool, not this recipe's
    recipe.write_text(f"extends: {RECIPE}\npartition: {{name: hardness, params: {{xi_prime: 1}}, labels: {labels}}}\n")
    p = fl.run(run_config(recipe, tmp_path / "run"), timeout_s=600)
    out = p.stdout + p.stderr
    assert "task order" in out and "label_tasks" in out, out[-4000:]
    assert not (tmp_path / "run" / "partition.json").exists()
    assert not _service_pids(fl) or all(not psutil.pid_exists(p) for p in _service_pids(fl))


@pytest.mark.slow
def test_sigkill_mid_round_then_rerun_resumes_cleanly(tmp_path):
    """Kill the whole run (SuperLink, simulation, Ray actors) mid-round; the trainer service of
    the dead attempt exits by itself and the rerun resumes from the last complete round."""
    run_dir = tmp_path / "killed"
    home = tmp_path / "flwr"
    with flower(home) as fr:
        proc = fr.start(_rc(run_dir, rounds=4), tmp_path / "first-attempt.log")
        try:
            deadline = time.monotonic() + 1200
            rd = RunDir(run_dir, total_rounds=4)
            while time.monotonic() < deadline and (rd.last_complete_round() or 0) < 1 and proc.poll() is None:
                time.sleep(1)
            assert rd.last_complete_round() == 1, (tmp_path / "first-attempt.log").read_text()[-4000:]
            time.sleep(2)  # now inside round 2
            first_services = _service_pids(fr)
            assert first_services
            sigkill(find_superlink(fr.home))
        finally:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in first_services):
            time.sleep(0.5)
        assert not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in first_services
        ), "a trainer service outlived its killed run"
        p = fr.run(_rc(run_dir, rounds=4), timeout_s=1200)
        assert "resuming after round" in p.stdout, p.stdout[-4000:]
        assert RunDir(run_dir, total_rounds=4).last_complete_round() == 4
        assert [r["round"] for r in rd.read_metrics()] == [0, 1, 2, 3, 4]  # one line per round
        assert set(_service_pids(fr)) - set(first_services)  # the rerun got a service of its own


@pytest.mark.slow  # 26 s; test_local_superlink.py stops a SuperLink by its FLWR_HOME in the default run
def test_stopping_the_local_superlink_mid_run_stops_the_runtime_too(tmp_path):
    """`python -m server_app.local_superlink stop` during a run: the detached simulation runtime
    (its own process group) and the lane's trainer service must not keep training."""
    run_dir = tmp_path / "stopped"
    with flower(tmp_path / "flwr") as fr:
        proc = fr.start(_rc(run_dir, rounds=50), tmp_path / "run.log", "num-supernodes=1")
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not _service_pids(fr) and proc.poll() is None:
                time.sleep(1)
            services = _service_pids(fr)
            assert services, (tmp_path / "run.log").read_text()[-4000:]
            superlink = find_superlink(fr.home)
            ports = {c.laddr.port for c in superlink.net_connections() if c.status == psutil.CONN_LISTEN}
            runtime = [
                psutil.Process(c.pid)
                for c in psutil.net_connections(kind="tcp")
                if c.pid and c.pid not in (superlink.pid, proc.pid) and c.raddr and c.raddr.port in ports
            ]
            assert runtime, "no process of the run is connected to the SuperLink"
            fr.stop()

            def gone(pid):
                return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

            # stop returns after its targets exited; a runtime left to notice the lost SuperLink by
            # itself lingers for many seconds, so allow only a moment for zombies to be reaped
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not all(gone(p) for p in services + [r.pid for r in runtime]):
                time.sleep(0.5)
            assert all(gone(r.pid) for r in runtime), "the simulation runtime outlived the stopped SuperLink"
            assert all(gone(p) for p in services), "a trainer service outlived the stopped SuperLink"
        finally:
            proc.kill()
            proc.wait()
