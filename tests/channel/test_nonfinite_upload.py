"""A client's NaN/Inf upload never reaches a checkpoint (issue #18 item 3): the server's
aggregator refuses it naming the client and member, writes nothing, and the round loop maps the
refusal to that client (dropped when the round can afford it, else the round fails closed).
Real Flower messages, real streaming aggregation; nothing mocked."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fl_app.aggregate import NonFiniteWeightsError
from fl_app.calls import RECORD, Reply
from fl_app.channel import Channel, WeightsRef, arrays_key
from fl_app.channel.run_dir import DirStore
from fl_app.weights import WeightsError, save_shards
from server_app.app import _blamed
from server_app.packed import pack
from server_app.strategy import StreamingAggregator

SHARD = 1 << 20


def _reply(cid: int, state: dict[str, torch.Tensor]) -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    reply = Reply(weights={"actor": WeightsRef(inline=True, nbytes=nbytes)}, client_id=cid)
    content = RecordDict(
        {
            arrays_key("actor"): pack(state),
            RECORD: ConfigRecord({RECORD: reply.model_dump_json()}),
            "metrics": MetricRecord({"num-examples": 8}),
        }
    )
    return Message(content=content, dst_node_id=0, message_type="train")


def _own(client: int) -> dict[str, str]:
    return {"actor": f"rounds/round-0001/clients/client-{client:04d}/actor"}


def test_a_nan_upload_is_refused_naming_its_client_and_nothing_is_written(tmp_path):
    good = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
    bad = {"w": torch.ones(4, 3), "b": torch.tensor([0.0, float("nan"), float("inf")])}
    replies = {3: _reply(3, good), 7: _reply(7, bad), 9: _reply(9, good)}
    out = tmp_path / "rounds" / "round-0001" / "actor"
    previous = {"actor": save_shards(good, tmp_path / "rounds" / "round-0000" / "actor", SHARD).root}
    agg = StreamingAggregator("fedavg", 0.0)
    channel = Channel(
        DirStore(tmp_path, SHARD), cache_dir=tmp_path / "cache", inline_max_bytes=SHARD, shard_bytes=SHARD
    )
    with pytest.raises(NonFiniteWeightsError, match=r"client 7 \(actor\)") as err:
        agg.aggregate_train(replies, channel, {"actor": out}, _own, previous)
    assert err.value.inputs == [1] and _blamed(err.value, [3, 7, 9]) == 7  # the round loop drops client 7
    assert not (out / "manifest.json").exists() and not any(out.glob("*.safetensors"))
    manifests, _, scores = agg.aggregate_train({3: replies[3], 9: replies[9]}, channel, {"actor": out}, _own, previous)
    assert manifests["actor"].tensor_bytes == 4 * 15  # the others still average
    assert sorted(scores["actor"]) == ["3", "9"]  # every member's updates are scored
    assert _blamed(WeightsError("a corrupt shard"), [3, 9]) is None  # other errors are not a client's
