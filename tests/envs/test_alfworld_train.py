"""ALFWorld with the tiny model and the builtin trainer (issue 5): the tiny build imitates
ALFWorld's expert under ALFWorld's own system prompt, and centralized GRPO runs end to end
(tiny build, env service with ALFWorld sessions, rollouts, update, validation) on the small
pinned game set. The recorded run on the default set is in docs/alfworld.md."""

from __future__ import annotations

import json

from test_alfworld import alf_cache, small_params  # noqa: F401
from trainer_support import one_torch_thread  # noqa: F401

from client_app.tiny_model import collect_demonstrations, whole_tokens
from client_app.train_central import main
from envs.registry import make_env, system_prompt
from fl_app.config import EnvCfg


def test_demonstrations_replay_the_expert_under_the_alfworld_prompt(alf_cache):
    env_cfg = EnvCfg(name="alfworld", params=small_params(alf_cache), max_turns=20)
    env = make_env(env_cfg.name, **env_cfg.params)
    demos = collect_demonstrations(env_cfg, 2, episodes=3, noise=0.0, seed=0)
    assert {d.messages[0]["content"] for d in demos} == {system_prompt("alfworld")}
    assert system_prompt("alfworld") != system_prompt("shop")
    assert all(d.task >= env.val_size for d in demos)  # never a validation game
    assert whole_tokens(env) == []  # no opaque ids to keep whole
    # each noise-free episode (a turn without history starts one) replays to a win
    starts = [i for i, d in enumerate(demos) if len(d.messages) == 2] + [len(demos)]
    assert len(starts) == 4
    for a, b in zip(starts, starts[1:]):
        env.reset(demos[a].task)
        for d in demos[a:b]:
            _obs, reward, done, info = env.step(d.action)
            assert info["valid_action"], d.action
        assert done and reward == 1.0 and info["won"]


def test_one_grpo_iteration_on_alfworld_end_to_end(alf_cache, tmp_path):
    """The recipe as a user runs it, scaled to seconds: the tiny model is built from ALFWorld's
    expert, then one GRPO iteration and two validations run through the real env service."""
    params = small_params(alf_cache)
    out = tmp_path / "central"
    rc = main(
        [
            "--recipe",
            "tiny-alfworld-grpo",
            "--iterations",
            "1",
            "--eval-every",
            "1",
            "--tasks",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
            *[f"env.params.{k}={v}" for k, v in params.items()],
            "env.pool_size=4",
            "env.max_turns=4",
            "rollout.max_prompt_tokens=384",
            f"model.tiny.cache_dir={tmp_path / 'models'}",
            "model.tiny.hidden_size=32",
            "model.tiny.layers=1",
            "model.tiny.heads=2",
            "model.tiny.vocab_size=300",
            "model.tiny.sft_episodes=2",
            "model.tiny.sft_epochs=1",
            "algo.tasks_per_step=2",
            "algo.group_size=2",
            "algo.mini_batch_size=8",
            "algo.micro_batch_size=8",
            "federation.val_tasks=2",
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if "val_success" in x]
    train = [x for x in lines if "train_success" in x]
    assert [x["iteration"] for x in val] == [0, 1] and [x["iteration"] for x in train] == [1]
    assert all(1 <= x["val_turns"] <= 4 for x in val)
    assert train[0]["rows"] > 0 and train[0]["optimizer_steps"] >= 1 and 1 <= train[0]["train_turns"] <= 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_tasks"] == 2 and summary["val_tasks"] == 2
    built = [json.loads(p.read_text()) for p in (tmp_path / "models").glob("*/tiny_model.json")]
    assert len(built) == 1 and built[0]["env"]["name"] == "alfworld" and built[0]["demonstrations"] > 0
    assert "name: alfworld" in (out / "config.yaml").read_text()
