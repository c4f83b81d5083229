"""Issue 19, served where the client runs: a client's fits play on an env service that serves
its own env variant (built from the content-hashed record, checked by the trainer before any
episode), a lane alternating between clients never serves one client's variant to another,
and validation stays on the unperturbed env. Real env services (uvicorn subprocesses) and a
real trainer with a random tiny policy."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import psutil
import pytest
from trainer_support import SMALL_ENV_PARAMS, model_dir, one_torch_thread, small_config  # noqa: F401

from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from client_app.variant_envs import VariantEnvServices
from envs.base import task_order_fingerprint
from envs.client import SyncEnvClient
from envs.registry import make_env
from envs.service import serve_in_subprocess
from fl_app.calls import EvalCall, FitCall
from fl_app.config import Config, load_config
from partitions.pool import build_pool
from partitions.registry import plan_partition
from partitions.report import write_partition_report

CLIENTS, TASKS_PER_CLIENT = 8, 20


def het_config(model_dir: Path, name: str, **knobs) -> Config:  # noqa: F811
    return small_config(
        model_dir,
        env_partition={"name": name, **knobs},
        federation={"clients": CLIENTS, "tasks_per_client": TASKS_PER_CLIENT, "val_tasks": 8},
    )


def shard(c: int) -> list[int]:
    base = make_env("shop", **SMALL_ENV_PARAMS)
    return list(range(base.val_size + 3 * c, base.val_size + 3 * c + TASKS_PER_CLIENT))


def first_search(url: str, task: int) -> str:
    """The observation after the expert's first action (a search) on `task`, through the service."""
    with SyncEnvClient(url) as env:
        env.create_many(["probe"])
        try:
            env.reset_batch([("probe", task)])
            action = env.expert("probe")
            assert action.startswith("search["), action
            return env.step_batch([("probe", action)])[0]["observation"]
        finally:
            env.close_many(["probe"])


def first_search_in_process(variant: dict | None, task: int) -> str:
    env = make_env("shop", variant=variant, **SMALL_ENV_PARAMS)
    env.reset(task)
    return env.step(env.expert_action())[0]


def test_a_variant_service_serves_exactly_the_engine_its_record_builds(model_dir):  # noqa: F811
    """rank_wrapper N = 4: the client whose variant inverts the ranking sees, through its service,
    the page the in-process engine built from its record shows, not the unperturbed page."""
    services = VariantEnvServices(het_config(model_dir, "rank_wrapper", num_variants=4))
    try:
        inverted = next(
            c for c in range(CLIENTS) if services.for_client(c, shard(c)).variant.label.startswith("v_inverted")
        )
        served = services.for_client(inverted, shard(inverted))
        task = served.tasks[0]
        with SyncEnvClient(served.url) as env:
            info = env.info()
        assert info["variant"]["hash"] == served.variant.content_hash
        assert info["variant"]["client_id"] == inverted
        page = first_search(served.url, task)
        assert page == first_search_in_process(served.variant.to_dict(), task)
        assert page != first_search_in_process(None, task)
    finally:
        services.close()


def test_a_lane_alternating_clients_never_serves_one_clients_variant_to_another(model_dir):  # noqa: F811
    """catalog_split env_div = 1 (every client its own catalog): clients 0 and 1 in alternation on
    one lane each get the service of their own variant; with room for one service the other's is
    stopped (its process gone) and started again when its client returns."""
    cfg = het_config(model_dir, "catalog_split", env_div=1.0, keep_ratio=0.7)
    services = VariantEnvServices(cfg, keep=1)
    try:
        seen = []
        for c in (0, 1, 0):
            env = services.for_client(c, shard(c))
            with SyncEnvClient(env.url) as client:
                info = client.info()
            assert info["variant"] == {"hash": env.variant.content_hash, "label": env.variant.label, "client_id": c}
            keep = set(dict(env.variant.engine)["catalog_keep"])
            assert len(keep) < SMALL_ENV_PARAMS["num_products"]
            seen.append((env.url, info["pid"], keep))
        assert services.started == 3
        assert seen[0][2] == seen[2][2] != seen[1][2]  # client 0 gets its catalog back
        assert not psutil.pid_exists(seen[0][1]) and not psutil.pid_exists(seen[1][1])  # evicted = stopped
    finally:
        services.close()
    assert not psutil.pid_exists(seen[2][1])


def test_warm_variant_services_are_reused_by_their_own_client(model_dir):  # noqa: F811
    services = VariantEnvServices(het_config(model_dir, "rank_wrapper", num_variants=4), keep=2)
    try:
        urls = [services.for_client(c, shard(c)).url for c in (3, 3, 5, 3)]
        assert urls[0] == urls[1] == urls[3] != urls[2] and services.started == 2
    finally:
        services.close()


def test_fits_play_on_the_clients_variant_and_validation_on_the_plain_env(model_dir):  # noqa: F811
    """A real trainer: a fit names its variant's service and plays there; a fit handed another
    client's service is refused before any episode; evaluate uses the trainer's own
    (unperturbed) service, whose fingerprint is the uniform env's."""
    cfg = het_config(model_dir, "rank_wrapper", num_variants=4)
    services = VariantEnvServices(cfg)
    with serve_in_subprocess("shop", cfg.env.pool_size, cfg.env.params) as plain_url:
        trainer = make_trainer(cfg, plain_url)
        try:
            a, b = next(
                (x, y)
                for x in range(CLIENTS)
                for y in range(CLIENTS)
                if services.for_client(x, shard(x)).variant.label != services.for_client(y, shard(y)).variant.label
            )
            env_a, env_b = services.for_client(a, shard(a)), services.for_client(b, shard(b))
            call, tasks = (
                FitCall(round=1, client_id=a, local_epochs=1, seed=0),
                ClientTasks(env_a.tasks, env_url=env_a.url, env_variant=env_a.variant.content_hash),
            )
            result = trainer.fit(call, tasks)
            assert result.num_examples == cfg.algo.tasks_per_step * cfg.algo.group_size
            with pytest.raises(RuntimeError, match="refusing to train on another env"):
                trainer.fit(call, dataclasses.replace(tasks, env_url=env_b.url))
            with pytest.raises(ValueError, match="without env_url"):
                trainer.fit(call, dataclasses.replace(tasks, env_url=""))
            assert trainer.evaluate(EvalCall(seed=0), list(range(4))).num_examples == 4
            with SyncEnvClient(plain_url) as plain:
                info = plain.info()
            assert info["variant"] is None
            assert info["fingerprint"] == task_order_fingerprint(make_env("shop", **SMALL_ENV_PARAMS))
        finally:
            trainer.close()
            services.close()


def test_a_tampered_variant_record_fails_the_service_start_naming_the_cause(model_dir):  # noqa: F811
    services = VariantEnvServices(het_config(model_dir, "rank_wrapper", num_variants=4))
    record = services.for_client(0, shard(0)).variant.to_dict()
    services.close()
    record["engine"] = {**record["engine"], "rank_seed": 7}
    before = set(Path(tempfile.gettempdir()).glob("env-variant-*.json"))
    with pytest.raises(Exception, match="content hash"):
        with serve_in_subprocess("shop", 2, SMALL_ENV_PARAMS, variant=record):
            pass
    assert set(Path(tempfile.gettempdir()).glob("env-variant-*.json")) <= before, "the record's file is removed"


def test_partition_json_records_the_variant_each_lane_serves(tmp_path):
    """The server's record (partition.json, before any lane starts) names, for every client, the
    variant whose hash the lane's service will report; summary.json keeps the headline only."""
    cfg = load_config("tiny-shop-grpo-rank-wrapper")
    headline = write_partition_report(tmp_path, cfg, log=lambda _: None)
    record = json.loads((tmp_path / "partition.json").read_text())["env_partition"]
    lane = VariantEnvServices(cfg)
    plan = plan_partition(cfg, build_pool(cfg.env.name, cfg.env.params))
    assert len(record["variant_hashes"]) == cfg.federation.clients
    for c in range(cfg.federation.clients):
        v = lane.variant(c, plan.shard(c))
        assert record["variant_hashes"][str(c)] == v.content_hash and record["variant_of_client"][str(c)] == v.label
    assert sum(record["variant_counts"]) == cfg.federation.clients
    assert "variant_hashes" not in headline["env_partition"] and headline["env_partition"]["variant_counts"]
