"""Real deployments (issue 14): a `flower-superlink` and `flower-supernode`s as real processes,
`flwr run` against them, the real ServerApp, ClientApps (one process per message), trainer
services, env services and tiny model.

- loopback: two SuperNodes on one host (and one lane) get one persistent trainer service each,
  which serves every message of its node and stops with the run; Flower's count of a run's
  traffic agrees with ours (issue 38). One deployment serves both runs: each test reads its own
  run's services and its part of the logs;
- network + mount namespaces: each SuperNode on a host of its own (veth, private addresses)
  without the server's disk; TLS with a CA made here and SuperNode authentication;
- faults: a SuperNode killed mid-round; the round still completes, the failure is in the
  metrics row, and the dead node's trainer stops.

Tests that need root and `ip netns` skip with the reason when those are missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from flower_harness import ROOT, Deployment, deployment, netns_unavailable, run_config, run_status

from fl_app.accounting import run_weight_bytes
from fl_app.rundir import RunDir
from server_app.traffic import TOLERANCE, agrees, compare

FIXTURES = ROOT / "tests" / "fixtures"
INLINE, STORE, HTTP = (FIXTURES / f"e2e-{k}recipe.yaml" for k in ("", "store-", "http-"))
TOLERANT = FIXTURES / "e2e-tolerant-recipe.yaml"
NO_NETNS = netns_unavailable()
needs_netns = pytest.mark.skipif(bool(NO_NETNS), reason=f"network/mount namespaces unavailable: {NO_NETNS}")


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _complete(d, p: subprocess.CompletedProcess, run_dir: Path) -> dict:
    status = run_status(run_dir)
    assert status.returncode == 0, (
        status.stdout
        + p.stdout[-3000:]
        + p.stderr[-2000:]
        + "\n--- superlink\n"
        + d.log("superlink")[-3000:]
        + "\n--- n0\n"
        + d.log("n0")[-3000:]
    )
    return _summary(run_dir)


def _one_service_per_node(d, summary: dict, rounds: int, nodes: int = 2) -> None:
    """One trainer service per SuperNode served every fit and validation of its node, then stopped."""
    services = summary["services"]
    assert len(services) == nodes and len({s["node"] for s in services}) == nodes, services
    assert sum(s["fits"] for s in services) == 2 * rounds  # 2 clients per round
    assert sorted(s["evals"] for s in services) == [0] * (nodes - 1) + [rounds + 1]
    scopes = d.service_pids(summary["run_id"])
    assert len(scopes) == nodes and all(len(p) == 1 for p in scopes.values()), scopes  # never restarted
    assert all(_gone(pid) for pids in scopes.values() for pid in pids)  # stopped with the run
    assert len(summary["nodes"]) == nodes and all("service-log" in n for n in summary["nodes"].values())


@pytest.fixture(scope="module")
def loopback(tmp_path_factory) -> Iterator[Deployment]:
    """A SuperLink and two SuperNodes on this host (process isolation: `python -m client_app.node`),
    shared by the loopback runs: a deployment takes seconds to start and its nodes to warm up."""
    with deployment(tmp_path_factory.mktemp("loopback"), nodes=2) as d:
        yield d


def test_two_supernodes_on_one_host_get_one_persistent_service_each(loopback, tmp_path):
    """Before: 8 service processes for 8 messages, summary `services: []`, and two SuperNodes on one
    host shared (and killed) one service. The store path (a shared disk here) carries the weights."""
    d, run_dir = loopback, tmp_path / "runs" / "r"
    mark = d.log_marks()
    p = d.run(run_config(STORE, run_dir, rounds=2), timeout_s=1800)
    summary = _complete(d, p, run_dir)
    _one_service_per_node(d, summary, rounds=2)
    logs = d.log("n0", since=mark) + d.log("n1", since=mark) + p.stdout + p.stderr
    assert "Traceback" not in logs and "ClientAppException" not in logs, logs[-4000:]
    # every message was served by a fork of the node's warm SuperExec, none by a new process
    assert logs.count("forked as pid") >= 2 * 2 + 3 and "Start `flwr-clientapp` process" not in logs
    assert all(proc.poll() is None for name, proc in d.procs.items())  # the nodes outlive the run
    for node in summary["nodes"].values():  # both CPU trainers share the host's cores
        assert "CPU trainer services on this host 2" in Path(node["service-log"]).read_text(), node
    rows = RunDir(run_dir).read_metrics()
    assert [r["round"] for r in rows] == [0, 1, 2] and not any("failed" in r for r in rows)


def test_flower_s_count_of_a_deployment_run_agrees_with_our_message_bytes(loopback, tmp_path):
    """Issue 38: Flower counts every object and head of every message a SuperNode pulls and
    pushes; ours (`fleet_bytes`, per call and shutdown) counts the same messages: within 5% each
    way. `python -m server_app.traffic` reads Flower's count of the run through `flwr ls` and
    records it in summary.json beside ours. The tiny recipe, 1 round, weights inline in the
    messages: the weights alone (what `bytes_down`/`bytes_up` count) miss the calls' records and
    the arrays' framing, and do not agree: the check can fail."""
    d, run_dir = loopback, tmp_path / "runs" / "r"
    p = d.run(run_config(INLINE, run_dir, rounds=1), timeout_s=1200)
    assert run_status(run_dir).returncode == 0, p.stdout[-3000:] + p.stderr[-2000:] + d.log("superlink")[-2000:]
    t = subprocess.run(
        [sys.executable, "-m", "server_app.traffic", str(run_dir), "--json"],
        env=d.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert t.returncode == 0, t.stdout + t.stderr
    rep = json.loads(t.stdout)
    summary = _summary(run_dir)
    flower = summary["flower_traffic"]
    assert flower["run_id"] == summary["run_id"] and flower["status"] == "finished:completed", flower
    print(json.dumps(rep["messages"], indent=1))
    for way, c in rep["messages"].items():
        assert abs(c["rel"]) <= TOLERANCE, (way, c)
    weights = run_weight_bytes(RunDir(run_dir).read_metrics())
    assert not agrees(compare(weights, flower)), compare(weights, flower)
    # every inline call carried its weights: the messages hold them and more
    assert all(m > w for m, w in zip(summary["message_bytes"].values(), weights.values(), strict=True))


@pytest.mark.slow
@needs_netns
def test_hosts_without_a_shared_disk_train_inline_models(tmp_path):
    """Each SuperNode in its own network and mount namespace (the server's run dir is an empty
    tmpfs there): a model under run.inline_max_mb travels in the messages and the run completes."""
    runs = tmp_path / "runs"
    with deployment(tmp_path, nodes=2, netns=True, no_shared=[runs]) as d:
        p = d.run(run_config(INLINE, runs / "r", rounds=2), timeout_s=1800)
        summary = _complete(d, p, runs / "r")
        _one_service_per_node(d, summary, rounds=2)
        assert {n["node-host"] for n in summary["nodes"].values()}  # where each node's logs are


@pytest.mark.slow
@needs_netns
def test_store_path_without_a_shared_disk_fails_naming_the_missing_disk(tmp_path):
    """Before: `WeightsError: .../scratch/init-actor: no manifest.json (nothing was exported there)`."""
    runs = tmp_path / "runs"
    with deployment(tmp_path, nodes=2, netns=True, no_shared=[runs]) as d:
        d.run(run_config(STORE, runs / "r", rounds=1), timeout_s=1200)
        status = run_status(runs / "r")
    assert status.returncode == 1, status.stdout
    error = _summary(runs / "r")["error"]
    assert "cannot see the run dir at" in error and "do not share a disk" in error, error
    assert "run.weight_store=http" in error and "\n" not in error


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls+auth"])
def test_store_path_through_the_weight_channel_without_a_shared_disk(tmp_path, tls):
    """Issue 14's must-show: separate network + mount namespaces, a model above the inline limit,
    3 rounds, one trainer service per node serving every message."""
    runs = tmp_path / "runs"
    with deployment(tmp_path, nodes=2, netns=True, no_shared=[runs], tls=tls, auth=tls) as d:
        # the store binds the server host's address (loopback would not reach the other hosts);
        # with TLS it serves the SuperLink's certificate and the nodes verify it with its CA
        store = {"run.weight_store_host": f'"{d.host}"'}
        if d.certs is not None:
            store.update(
                {
                    "run.weight_store_certfile": f'"{d.certs.cert}"',
                    "run.weight_store_keyfile": f'"{d.certs.key}"',
                    "run.weight_store_ca_file": f'"{d.certs.ca}"',
                }
            )
        p = d.run(run_config(HTTP, runs / "r", rounds=3, **store), timeout_s=2400)
        summary = _complete(d, p, runs / "r")
        _one_service_per_node(d, summary, rounds=3)
        assert f"weight store: serving {runs / 'r'} at http{'s' if tls else ''}://{d.host}:" in p.stdout + p.stderr


@pytest.mark.slow
@needs_netns
def test_tls_and_supernode_auth_across_hosts(tmp_path):
    """TLS with a self-signed CA (made here) and --enable-supernode-auth, the SuperLink bound to
    0.0.0.0 as the guide says: registered SuperNodes on other hosts train (store path: the hosts
    share the run dir's disk here); an unregistered one is refused. Before: the certificate did not
    name 127.0.0.1, the SuperLink's own SuperExec (it dials 127.0.0.1 under 0.0.0.0) failed TLS
    verification and exited, and the run stayed pending while `flwr run --stream` waited forever
    (the harness now fails at start naming it: `Deployment._require_superexec`)."""
    run_dir = tmp_path / "runs" / "r"
    with deployment(tmp_path, nodes=2, netns=True, tls=True, auth=True, bind="0.0.0.0") as d:
        stranger = d.start_node(2, registered=False, extra=["--max-retries", "2", "--max-wait-time", "20"])
        p = d.run(run_config(STORE, run_dir, rounds=2), timeout_s=1800)
        summary = _complete(d, p, run_dir)
        _one_service_per_node(d, summary, rounds=2)
        assert stranger.wait(timeout=120) != 0, d.log("n2")[-3000:]  # refused, gave up
        assert len(summary["nodes"]) == 2


def _kill_a_node_mid_round(tmp_path: Path, recipe: Path) -> tuple[dict, list[dict], list[int]]:
    """3 rounds on 2 SuperNodes; once round 1 is complete and round 2's fits run, SIGKILL node 1.
    Round 2's fits sleep 20 s first (`faults.straggler_*`), so the kill lands mid-message however
    fast a fit is. Returns the summary, the metrics rows and the dead node's trainer service pids."""
    run_dir = tmp_path / "runs" / "r"
    slow_round_2 = {  # a list travels as a TOML string, read as YAML
        "faults.straggler_clients": '"[0, 1, 2, 3]"',
        "faults.straggler_rounds": '"[2]"',
        "faults.straggler_s": 20,
    }
    with deployment(tmp_path, nodes=2) as d:
        run = d.submit(run_config(recipe, run_dir, rounds=3, **slow_round_2), tmp_path / "flwr-run.log")
        try:
            rd = RunDir(run_dir, total_rounds=3)
            deadline = time.monotonic() + 1800
            while (rd.last_complete_round() or 0) < 1 and run.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            assert rd.last_complete_round() == 1, (tmp_path / "flwr-run.log").read_text()[-4000:]
            time.sleep(3)  # round 2's fits are under way (asleep for 20 s)
            scopes = d.service_pids()
            owner = d.node_pid("n1")
            dead = [pid for scope, pids in scopes.items() if scope.startswith(f"node-{owner}-") for pid in pids]
            assert dead, scopes
            d.kill("n1")
            deadline = time.monotonic() + 10
            while not all(_gone(pid) for pid in dead) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert all(_gone(pid) for pid in dead), "the dead node's trainer kept running"
            run.wait(timeout=1800)
        finally:
            if run.poll() is None:
                run.kill()
            run.wait()
        status = run_status(run_dir)
        assert status.returncode == 0, status.stdout + (tmp_path / "flwr-run.log").read_text()[-4000:]
        return _summary(run_dir), rd.read_metrics(), dead


@pytest.mark.slow
def test_a_supernode_killed_mid_round_is_replaced_and_the_round_completes(tmp_path):
    """Default (all clients must reply): the lost node's client is re-dispatched to the other node."""
    summary, rows, _ = _kill_a_node_mid_round(tmp_path, STORE)
    failed = [f for r in rows for f in r.get("failed", [])]
    assert failed and all("NODE_UNAVAILABLE" in f["reason"] or "no reply" in f["reason"] for f in failed), rows
    round2 = next(r for r in rows if r["round"] == 2)
    assert round2["failed"] and not round2.get("dropped") and round2["train_num-examples"] > 0
    assert summary["final_round"] == 3


@pytest.mark.slow
def test_a_supernode_killed_mid_round_is_dropped_when_the_round_can_afford_it(tmp_path):
    """federation.min_clients_per_round=1: the round completes with the client that replied."""
    summary, rows, _ = _kill_a_node_mid_round(tmp_path, TOLERANT)
    round2 = next(r for r in rows if r["round"] == 2)
    assert len(round2["dropped"]) == 1 and round2["failed"][0]["client"] == round2["dropped"][0], round2
    assert summary["final_round"] == 3


# ---- the guide, verbatim ------------------------------------------------------------------------

GUIDE = ROOT / "docs" / "deployment.md"


NODE = "python -m client_app.node "  # the guide's SuperNode (with its warm SuperExec)


def guide_commands(section: int, prefix: str) -> list[str]:
    """The shell commands of docs/deployment.md's section `section` (its indented code blocks,
    `\\` continuations joined) that start with `prefix`."""
    text = GUIDE.read_text().split(f"\n## {section}. ", 1)[1].split("\n## ", 1)[0]
    lines = [line[4:] for line in text.splitlines() if line.startswith("    ") and not line.startswith("    -")]
    commands: list[str] = []
    pending = ""
    for line in lines:
        pending += line.strip() if pending else line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        commands.append(pending)
        pending = ""
    found = [c for c in commands if c.startswith(prefix)]
    assert found, f"docs/deployment.md section {section} has no command starting with {prefix!r}"
    return found


def guide_toml(section: int) -> str:
    text = GUIDE.read_text().split(f"\n## {section}. ", 1)[1].split("\n## ", 1)[0]
    return text.split("```toml\n", 1)[1].split("```", 1)[0]


def substitute(command: str, table: dict[str, str]) -> str:
    """The guide's command with only the documented substitutions (docs/deployment.md section 10)."""
    for guide, here in table.items():
        command = command.replace(guide, here)
    return command


def _sh(command: str, cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def _guide_deployment(tmp_path: Path, tls: bool) -> tuple[subprocess.CompletedProcess, Path]:
    """Sections 1, 2, 3, 5 and 8 of the guide as written, one machine each (network + mount
    namespaces, no shared disk), two SuperNodes; returns `flwr run`'s result and the run dir."""
    runs = tmp_path / "runs"
    run_dir = runs / "webshop-grpo"
    hosts = {h: tmp_path / "hosts" / h for h in ("link", "n0", "n1", "cli")}
    for d in hosts.values():
        d.mkdir(parents=True)
    with deployment(tmp_path, start=False, nodes=2, netns=True, no_shared=[runs]) as d:
        d.port = 9093  # the guide's: every host has its own network namespace
        d.env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION")  # the guide's flags must do
        table = {
            "server:9093": f"{d.host}:9093",
            "IP:10.0.0.10": f"IP:{d.host}",
            "/srv/runs/webshop-grpo": str(run_dir),
            "/etc/fl/ca.pem": str(hosts["cli"] / "ca.pem"),
            "rounds=70": f'recipe="{INLINE}" rounds=2',
        }
        export = guide_commands(1, "export ")[0]
        if tls:
            for cmd in guide_commands(5, "openssl "):
                _sh(substitute(cmd, table), hosts["link"], d.env)
            for h in ("n0", "n1", "cli"):
                shutil.copy(hosts["link"] / "ca.pem", hosts[h] / "ca.pem")  # the operator copies the CA
            link = guide_commands(5, "flower-superlink ")[0]
        else:
            link = guide_commands(1, "flower-superlink ")[0]
        d.start_shell("superlink", "link", f"{export} && {substitute(link, table)}", hosts["link"])
        d.wait_started()
        (d.home / "config.toml").write_text(substitute(guide_toml(5 if tls else 3), table))
        for i in range(2):
            node = {**table, "partition-id=0": f"partition-id={i}", "node0": f"node{i}"}
            n = hosts[f"n{i}"]
            if tls:
                keygen, register = guide_commands(5, "ssh-keygen ")[0], guide_commands(5, "flwr supernode register ")[0]
                _sh(substitute(keygen, node), n, d.env)
                shutil.copy(n / f"node{i}.pub", hosts["cli"])  # the operator registers its public key
                _sh(substitute(register, node), hosts["cli"], d.env)
                node_cmds = [guide_commands(5, NODE)[0]]
            else:
                node_cmds = [guide_commands(2, c)[0] for c in ("export ", NODE)]
            d.start_shell(f"n{i}", f"n{i}", "\n".join(substitute(c, node) for c in node_cmds), n)
        submit = substitute(guide_commands(3, "flwr run ")[0], table)
        p = subprocess.run(["bash", "-c", submit], cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=1800)
        status = substitute(guide_commands(8, "python -m server_app.status ")[0], table)
        done = subprocess.run(["bash", "-c", status], cwd=ROOT, env=d.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (
            done.stdout + p.stdout[-3000:] + p.stderr[-2000:] + "\n--- superlink\n" + d.log("superlink")[-3000:]
        )
        return p, run_dir


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls+auth"])
def test_the_guide_verbatim(tmp_path, tls):
    """docs/deployment.md's commands, copied from its code blocks and run with only the
    substitutions its section 10 lists (addresses, paths, the run's recipe and length): a
    SuperLink on 0.0.0.0 and two SuperNodes on hosts of their own without the server's disk,
    plain and with the guide's OpenSSL certificate + SuperNode authentication; the run completes
    (`python -m server_app.status` exits 0)."""
    p, run_dir = _guide_deployment(tmp_path, tls)
    summary = _summary(run_dir)
    assert summary["final_round"] == 2 and len(summary["nodes"]) == 2, summary
