"""`python -m client_app.label_tasks`: real rollouts of a real (random-weight) policy through the
trainer's evaluate on a real env service, one label per training task, with provenance; and a
run refusing the result where it cannot be used (issue 15)."""

from __future__ import annotations

import json

import pytest
from trainer_support import SMALL_ENV_PARAMS, model_dir, one_torch_thread, small_config  # noqa: F401

from client_app.label_tasks import main as label_main
from client_app.label_tasks import weights_sha256
from client_app.tiny_model import load_causal_lm
from fl_app.config import save_config
from partitions.labels import LabelsError, load_labels, match_labels
from partitions.pool import build_pool
from partitions.registry import plan_partition


@pytest.fixture(scope="module")
def labelled(model_dir, tmp_path_factory):  # noqa: F811
    """Label the whole training pool of the small shop once (104 tasks, 3 turns each)."""
    out = tmp_path_factory.mktemp("labels")
    recipe = out / "recipe.yaml"
    save_config(small_config(model_dir), recipe)
    assert label_main(["--recipe", str(recipe), "--out", str(out / "labels.json"), "--seed", "5"]) == 0
    return recipe, out / "labels.json"


def test_labels_cover_the_pool_with_their_provenance(labelled, model_dir):  # noqa: F811
    _, path = labelled
    pool = build_pool("shop", SMALL_ENV_PARAMS)
    labels = load_labels(path)
    prov = labels.provenance
    assert set(labels.success) == set(pool.task_ids) and len(pool) == 104
    assert prov["env_fingerprint"] == pool.fingerprint and prov["rollout_mode"] == "windowed"
    assert (prov["temperature"], prov["seed"], prov["history_length"], prov["max_turns"]) == (0.4, 5, 2, 3)
    model, _ = load_causal_lm(model_dir)
    assert prov["weights_sha256"] == weights_sha256(dict(model.named_parameters()))  # the weights rolled out
    assert prov["successes"] == sum(labels.success.values()) and prov["date"][:2] == "20"
    assert match_labels(labels, pool, "windowed").misses == 0


def test_a_partial_labelling_is_refused_by_a_run(labelled, tmp_path):
    recipe, _ = labelled
    partial = tmp_path / "partial.json"
    assert label_main(["--recipe", str(recipe), "--out", str(partial), "--limit", "6"]) == 0
    body = json.loads(partial.read_text())
    assert len(body["labels"]) == 6 and body["provenance"]["tasks_labelled"] == 6
    with pytest.raises(LabelsError, match="98 misses"):
        match_labels(load_labels(partial), build_pool("shop", SMALL_ENV_PARAMS), "windowed")


def test_a_reference_that_solves_too_little_cannot_arm_hardness(labelled, model_dir):  # noqa: F811
    """A random policy solves (almost) nothing: quotas up to L easy tasks cannot be met, so the run fails closed."""
    _, path = labelled
    cfg = small_config(
        model_dir,
        partition={"name": "hardness", "params": {"xi_prime": 1}, "labels": str(path)},
        federation={"val_tasks": 8, "clients": 10, "tasks_per_client": 20},
    )
    assert sum(load_labels(path).success.values()) < 20  # a random policy: (almost) never wins
    with pytest.raises(ValueError, match="easy and .* hard tasks"):
        plan_partition(cfg, build_pool("shop", SMALL_ENV_PARAMS))
