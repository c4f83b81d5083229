"""The server trusts a reply only as far as its client's own upload (issue #37): every message
carries a weight-store credential minted for that call and node, and a reply that names any key
but its client's own upload of the round, or an entry that does not stay inside the run dir, is a
failed client, never averaged. A real `Run` (its real Weights, RunDir, aggregator; only Flower's
grid is absent: nothing here sends a message), real files, real Flower messages."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fl_app.calls import RECORD, EvalCall, FitCall, InitCall, Reply
from fl_app.channel import WeightsRef
from fl_app.channel.http import HttpWeightStore
from fl_app.channel.remote import WeightStoreRefused
from fl_app.channel.run_dir import DirStore
from fl_app.config import load_config
from fl_app.rundir import RunDir
from fl_app.weights import WeightsError, load_shards, save_shards
from server_app.app import Run, aggregate_train
from server_app.strategy import ClientFailure, RoundError, check_reply_keys

SHARD = 1 << 20


@pytest.fixture(autouse=True)
def task() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


def make_run(tmp_path: Path, **overrides) -> Run:
    cfg = load_config(
        overrides={
            "run.inline_max_mb": 0,
            "run.shard_max_mb": 1,
            "federation.clients_per_round": 4,
            "federation.min_clients_per_round": 1,
        }
        | overrides
    )
    rd = RunDir(tmp_path / "run", total_rounds=cfg.federation.rounds, members=cfg.weight_members())
    rd.path.mkdir(parents=True)
    context = Context(run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config={})
    return Run(None, context, cfg, rd, code="0" * 64)  # type: ignore[arg-type]  # no grid: nothing is sent


@pytest.fixture()
def run(tmp_path) -> Iterator[Run]:
    r = make_run(tmp_path)
    yield r
    r.w.close()


def upload(run: Run, key: str, value: float, root: Path | None = None) -> WeightsRef:
    """A client's upload of an all-`value` actor under `key` (in `root`, the run dir by default)."""
    m = DirStore(root or run.rd.path, SHARD).put(key, {"w": torch.full((4, 3), value)})
    return WeightsRef(inline=False, nbytes=m.tensor_bytes, key=key, manifest_sha256=m.sha256)


def reply(client: int, ref: WeightsRef) -> Message:
    content = RecordDict(
        {
            RECORD: ConfigRecord({RECORD: Reply(weights={"actor": ref}, client_id=client).model_dump_json()}),
            "metrics": MetricRecord({"num-examples": 8}),
        }
    )
    return Message(content=content, dst_node_id=0, message_type="train")


def round_1_global(run: Run) -> None:
    """Round 2 aggregates the updates from round 1's global model (its anomaly scores read it)."""
    DirStore(run.rd.path, SHARD).put("rounds/round-0001/actor", {"w": torch.zeros(4, 3)})


def own(client: int, r: int = 2) -> str:
    return f"rounds/round-{r:04d}/clients/client-{client:04d}/actor"


def averaged(run: Run, r: int) -> float:
    return float(load_shards(DirStore(run.rd.path, SHARD).manifest(f"rounds/round-{r:04d}/actor"))["w"][0, 0])


def test_a_reply_naming_any_key_but_its_own_upload_is_a_failed_client(run):
    """Was: the server averaged whatever key a reply named (another client's upload, a global
    entry, another round's)."""
    one, glob = upload(run, own(1), 1.0), upload(run, "rounds/round-0000/actor", 100.0)
    replies = {
        1: reply(1, one),
        2: reply(2, upload(run, own(2), 3.0)),
        5: reply(5, one),  # another client's upload
        6: reply(6, glob),  # a global entry
        7: reply(7, upload(run, own(7, r=1), 50.0)),  # its own upload, of another round
    }
    failures: list[ClientFailure] = []
    round_1_global(run)
    aggregate_train(run, 2, replies, failures)
    assert averaged(run, 2) == 2.0  # clients 1 and 2 only
    reasons = {f.client: f.reason for f in failures}
    assert sorted(reasons) == [5, 6, 7] and sorted(replies) == [1, 2]
    assert f"names '{own(1)}' for 'actor'; only its own upload '{own(5)}'" in reasons[5]
    assert "names 'rounds/round-0000/actor'" in reasons[6]
    assert f"names '{own(7, r=1)}'" in reasons[7] and "\n" not in reasons[7]


def test_an_upload_dir_symlinked_out_of_the_run_dir_is_refused_not_averaged(run, tmp_path):
    """Was: DirStore followed client 2's upload dir, a symlink out of the run dir, and averaged what
    it found there: w = (1 + 42) / 2 = 21.5."""
    outside = tmp_path / "elsewhere"
    planted = upload(run, "actor", 42.0, root=outside)
    (run.rd.path / own(2)).parent.mkdir(parents=True)
    os.symlink(outside / "actor", run.rd.path / own(2))
    forged = planted.model_copy(update={"key": own(2)})  # its own key, pinning the planted bytes
    replies = {1: reply(1, upload(run, own(1), 1.0)), 2: reply(2, forged)}
    failures: list[ClientFailure] = []
    round_1_global(run)
    aggregate_train(run, 2, replies, failures)
    assert averaged(run, 2) == 1.0  # not 21.5
    assert [f.client for f in failures] == [2]
    assert "client 2's reply was refused" in failures[0].reason and "lies outside" in failures[0].reason
    with pytest.raises(WeightsError, match="lies outside"):
        DirStore(run.rd.path, SHARD).get(own(2))  # reading through the store is refused too
    new = save_shards({"w": torch.zeros(1)}, tmp_path / "new", SHARD)
    with pytest.raises(WeightsError, match="lies outside"):
        DirStore(run.rd.path, SHARD).publish(new.root, own(2))  # nor is anything written through it
    assert DirStore(outside, SHARD).manifest("actor").sha256 == planted.manifest_sha256


def test_a_round_that_cannot_afford_a_refused_client_fails_closed(tmp_path):
    run = make_run(tmp_path, **{"federation.min_clients_per_round": 2})
    replies = {1: reply(1, upload(run, own(1), 1.0)), 2: reply(2, upload(run, own(3), 3.0))}
    round_1_global(run)
    with pytest.raises(RoundError, match="client 2's upload was refused.*needs 2 of its clients"):
        aggregate_train(run, 2, replies, [])
    assert not (run.rd.path / "rounds/round-0002/actor/manifest.json").exists()


def _sent_call(msg: Message, kind: type) -> FitCall | EvalCall | InitCall:
    return kind.model_validate_json(str(msg.content.config_records[RECORD][RECORD]))


def test_every_message_carries_a_credential_scoped_to_its_call_and_node(tmp_path):
    run = make_run(tmp_path, **{"run.weight_store": "http"})
    try:
        assert run.w.issuer is not None and "weight_store_token" not in run.header
        g = upload(run, "rounds/round-0001/actor", 1.0)
        fit = FitCall(**run.header, round=2, client_id=3, local_epochs=1, seed=0, weights={"actor": g})
        sent = _sent_call(run.message(41, MessageType.TRAIN, fit), FitCall)
        grant = run.w.issuer.verify(sent.weight_store_token)
        assert (grant.run, grant.round, grant.client, grant.node) == (9, 2, 3, 41)
        assert grant.read == {"rounds/round-0001/actor"} and grant.write == {own(3)}
        timeout = run.cfg.federation.client_timeout_s
        assert timeout + 60 < grant.exp - time.time() <= timeout + 60 + 60 + 1  # the call's TTL + a margin
        init = run.w.issuer.verify(
            _sent_call(run.message(5, "query.init", InitCall(**run.header)), InitCall).weight_store_token
        )
        assert init.write == {"scratch/init-0000/actor"} and not init.read and init.client is None
        ev = EvalCall(**run.header, round=2, seed=0, weights={"actor": g})
        assert not run.w.issuer.verify(
            _sent_call(run.message(5, MessageType.EVALUATE, ev), EvalCall).weight_store_token
        ).write
        node = HttpWeightStore(sent.weight_store, sent.weight_store_token, max_shard_bytes=SHARD)
        local = save_shards({"w": torch.ones(2)}, tmp_path / "out", SHARD)
        node.publish(local.root, own(3))  # its own upload: accepted
        assert DirStore(run.rd.path, SHARD).exists(own(3))
        with pytest.raises(WeightStoreRefused, match="HTTP 403"):
            node.publish(local.root, own(4))
    finally:
        run.w.close()


def test_an_init_reply_must_name_the_init_export_key(run):
    keys = run.w.upload_keys(InitCall(**run.header))
    assert keys == {"actor": "scratch/init-0000/actor"}
    ok = Reply(weights={"actor": WeightsRef(inline=False, nbytes=4, key=keys["actor"], manifest_sha256="0" * 64)})
    check_reply_keys("the init lane", ok, keys)
    planted = Reply(
        weights={"actor": WeightsRef(inline=False, nbytes=4, key="rounds/round-0000/actor", manifest_sha256="0" * 64)}
    )
    with pytest.raises(WeightsError, match="the init lane's reply names 'rounds/round-0000/actor'"):
        check_reply_keys("the init lane", planted, keys)
    inline_with_key = Reply(weights={"actor": WeightsRef(inline=True, nbytes=4, key=keys["actor"])})
    with pytest.raises(WeightsError, match="or inline arrays"):
        check_reply_keys("the init lane", inline_with_key, keys)


def test_a_late_upload_of_a_dropped_client_is_removed_once_its_round_is_complete(run):
    """A straggler's upload that lands after its round closed is removed when its late answer is
    discarded (`Run._late_upload`), but not while its round is still open (a re-dispatched attempt
    of the same client may be writing there; the round's `drop_client_uploads` removes it)."""
    late = upload(run, own(7), 7.0)
    assert late.key == own(7)
    run._late_upload(2, 7)
    assert (run.rd.path / own(7)).is_dir()  # round 2 is not complete yet
    for r in range(3):
        save_shards({"w": torch.ones(2)}, run.rd.member_dir(r), SHARD)
        run.rd.complete_round(r, {})
    run.rd.drop_client_uploads(2)
    upload(run, own(7), 7.0)  # the straggler writes after the round completed
    run._late_upload(2, 7)
    assert not (run.rd.path / own(7)).exists() and run.rd.is_complete(2)


def test_a_robust_aggregate_is_what_the_server_optimizer_steps_along_and_it_is_still_scored(tmp_path):
    """With `server_optimizer` other than sgd, the aggregator (here the median) writes its
    aggregate at server_lr 1 into the round's mean dir, the optimizer steps from the global model
    along it, and the updates are scored as always. Clients of 1, 2, 3 and 100 (all-equal
    tensors) from a global of 0: the median 2.5, FedAvgM's first step at lr 2 is 2 x 2.5 (the mean
    would give 2 x 26.5); client 4's x40 update is flagged (the cosine bound is lowered below 1:
    the four updates of a 12-parameter model point the same way)."""
    cfg = {"federation.aggregator": "median", "federation.min_clients_per_round": 3, "federation.flag_cosine_z": 0.5}
    run = make_run(tmp_path, **cfg, **{"federation.server_optimizer": "fedavgm", "federation.server_lr": 2.0})
    try:
        DirStore(run.rd.path, SHARD).put("rounds/round-0000/actor", {"w": torch.zeros(4, 3)})
        replies = {c: reply(c, upload(run, own(c, r=1), v)) for c, v in {1: 1.0, 2: 2.0, 3: 3.0, 4: 100.0}.items()}
        manifests, _, scores = aggregate_train(run, 1, replies, [])
        assert float(load_shards(manifests["actor"].root)["w"][0, 0]) == averaged(run, 1) == 5.0
        moment = load_shards(run.rd.opt_state_dir(1, "fedavgm/actor/m"))["w"]
        assert torch.equal(moment, torch.full((4, 3), 2.5))
        assert not run.rd.mean_dir(1, "actor").exists()  # scratch, gone once stepped
        assert sorted(scores["actor"]) == ["1", "2", "3", "4"]
        assert [c for c, s in scores["actor"].items() if s["flagged"]] == ["4"]
    finally:
        run.w.close()
