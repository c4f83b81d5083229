"""The Flower edge reads replies through typed accessors: metrics must be numbers, the mean is
num-examples weighted, and sizes left unset by a recipe are read only once validation filled them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fl_app.calls import RECORD, Reply
from fl_app.config import ConfigError, load_config, resolved
from server_app.strategy import metrics_of, reply_of, weighted_metrics


@pytest.fixture
def task() -> Iterator[None]:
    """A ServerApp's task identity, which Flower needs to build a Message (as a run sets it)."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _reply(metrics: dict, reply: Reply | None = None) -> Message:
    done = (reply or Reply(client_id=7)).model_dump_json()
    content = RecordDict({"metrics": MetricRecord(metrics), RECORD: ConfigRecord({RECORD: done})})
    return Message(content=content, dst_node_id=1, message_type="train")


def test_metrics_of_gives_floats_and_refuses_a_list_metric(task):
    assert metrics_of(_reply({"num-examples": 64, "reward": 0.5})) == {"num-examples": 64.0, "reward": 0.5}
    with pytest.raises(TypeError, match="metric 'curve' of a reply is a list"):
        metrics_of(_reply({"num-examples": 64, "curve": [0.1, 0.2]}))
    assert reply_of(_reply({}, Reply(client_id=7, lane="0"))) == Reply(client_id=7, lane="0")


def test_weighted_metrics_weight_by_examples_and_sum_them():
    """A metric a reply lacks (a fit that took no step has no kl) averages over the replies that
    carry it; an outcome share a reply lacks counts as 0 there (no episode ended so)."""
    out = weighted_metrics(
        [
            {"num-examples": 1.0, "reward": 1.0, "train_outcome_won": 1.0},
            {"num-examples": 3.0, "reward": 0.0, "kl": 2.0},
        ]
    )
    assert out == {"reward": 0.25, "kl": 2.0, "train_outcome_won": 0.25, "num-examples": 4}


def test_sizes_are_resolved_by_validation_and_refused_before_it():
    cfg = load_config("tiny-shop-grpo")
    assert resolved(cfg.algo.group_size, "algo.group_size") == 8
    assert resolved(cfg.algo.critic.micro_batch_size, "algo.critic.micro_batch_size") == cfg.algo.micro_batch_size
    with pytest.raises(ConfigError, match="algo.group_size is unset: validate the config"):
        resolved(None, "algo.group_size")
