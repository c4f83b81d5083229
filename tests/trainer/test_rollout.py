"""The batched multi-turn rollout: seeded task draws (invariant 8), served task identity per GRPO
group (invariant 9), the windowed context (invariant 15), and the penalty's scope (invariant 10).
Real env service (uvicorn subprocess), real (random-weight) Qwen2 policy and tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from trainer_support import POOL_SIZE, SMALL_ENV_PARAMS, one_torch_thread, random_model_dir  # noqa: F401

from client_app import prompts
from client_app.rollout import (
    BatchedGenerator,
    EpisodeSpec,
    RolloutSettings,
    TrainRow,
    check_groups,
    derive_seed,
    draw_tasks,
    group_specs,
    outcome_shares,
    row_seed,
    run_episodes,
    training_rows,
    training_score,
)
from client_app.tiny_model import load_causal_lm
from envs.client import SyncEnvClient
from envs.registry import system_prompt
from envs.service import serve_in_subprocess

SHOP = system_prompt("shop")


@pytest.fixture(scope="module")
def env():
    with serve_in_subprocess("shop", POOL_SIZE, SMALL_ENV_PARAMS) as url, SyncEnvClient(url) as client:
        yield client


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_causal_lm(random_model_dir(tmp_path_factory.mktemp("models") / "policy"))


def test_row_seeds_pure_function():
    args = (7, 3, 12, 1, 5)
    assert row_seed(*args) == row_seed(*args)
    # every component matters
    for k in range(5):
        changed = list(args)
        changed[k] += 1
        assert row_seed(*changed) != row_seed(*args), k
    # pinned values: independent of the process, the machine and Python's salted hash()
    assert row_seed(*args) == 7947676143409073410
    assert draw_tasks(list(range(100, 200)), 8, seed=0, round=2, client=5, epoch=0) == [
        158,
        130,
        198,
        133,
        144,
        175,
        119,
        117,
    ]
    # draws: pure, fresh per epoch (invariant 8), no repeats within a draw, cycling when asked for more
    shard = list(range(100, 200))
    draw = draw_tasks(shard, 8, seed=0, round=2, client=5, epoch=0)
    assert draw == draw_tasks(shard, 8, seed=0, round=2, client=5, epoch=0)
    assert len(set(draw)) == 8 and set(draw) <= set(shard)
    epochs = [draw_tasks(shard, 8, 0, 2, 5, e) for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert draw_tasks(shard, 8, 0, 2, 6, 0) != draw and draw_tasks(shard, 8, 0, 3, 5, 0) != draw
    assert sorted(draw_tasks(shard[:5], 10, 0, 1, 1, 0)) == sorted(shard[:5] * 2)
    with pytest.raises(ValueError, match="shard is empty"):
        draw_tasks([], 1, 0, 1, 1, 0)


def test_group_task_id_verified(env, policy):
    model, tok = policy
    gen = BatchedGenerator(model, tok, max_new_tokens=4)
    settings = RolloutSettings(max_turns=1, history_length=2, max_prompt_tokens=384, system_prompt=SHOP)
    # the normal case: groups of one task each are served one task each
    episodes, _ = run_episodes(gen, env, group_specs([20, 21], 3), settings, 1.0, seed=1, max_sessions=POOL_SIZE)
    for g in (0, 1):
        ids = {e.task_id for e in episodes if e.spec.group == g}
        assert len(ids) == 1, ids
    assert episodes[0].task_id != episodes[3].task_id
    # a group whose rollouts land on different tasks fails loudly, naming the group, before any
    # token is generated, and its sessions are returned to the pool
    bad = [EpisodeSpec(20, 0), EpisodeSpec(20, 0), EpisodeSpec(30, 1), EpisodeSpec(31, 1)]
    with pytest.raises(RuntimeError, match="GRPO group 1 was served different tasks"):
        run_episodes(gen, env, bad, settings, 1.0, seed=1, max_sessions=POOL_SIZE)
    info = env.info()
    assert info["live_sessions"] == 0 and info["free"] == POOL_SIZE and info["conserved"]
    # the pure check on its own
    check_groups(episodes)
    episodes[1].task_id = "something-else"
    with pytest.raises(RuntimeError, match="group 0"):
        check_groups(episodes)


def test_windowed_context_equals_trained_context(env, policy):
    """Each training row holds exactly the (truncated) windowed prompt the policy generated from,
    rebuilt independently from the recorded episode; greedy decoding from it reproduces the reply."""
    model, tok = policy
    gen = BatchedGenerator(model, tok, max_new_tokens=8)
    max_prompt = 160  # short enough that history and then the prompt head get cut
    settings = RolloutSettings(max_turns=3, history_length=2, max_prompt_tokens=max_prompt, system_prompt=SHOP)
    # fewer sessions than episodes: finished sessions are reset with pending episodes mid-rollout
    episodes, stats = run_episodes(gen, env, group_specs([40, 41, 42], 2), settings, 0.0, seed=0, max_sessions=4)
    assert stats.steps == sum(len(e.turns) for e in episodes) and stats.tokens > 0
    rows = training_rows(episodes, invalid_action_penalty=0.1)
    assert len(rows) == stats.steps
    truncated = 0
    k = 0
    for e, ep in enumerate(episodes):
        history: list[tuple[str, str]] = []
        for turn in ep.turns:
            row = rows[k]
            k += 1
            assert row.episode == e and row.group == ep.spec.group
            msgs = prompts.build_messages(ep.instruction, history, turn.observation, turn.valid_actions, 2, SHOP)
            assert row.prompt_ids == prompts.prompt_ids(tok, msgs, max_prompt) == turn.prompt_ids
            assert row.response_ids == turn.response_ids
            truncated += len(prompts.prompt_ids(tok, msgs, 10**6)) > max_prompt
            history.append((turn.observation, turn.action))
    assert truncated > 0, "the test must exercise truncation"
    # greedy generation is a function of exactly the stored context
    for row in rows[::3]:
        again = gen.generate([row.prompt_ids], 0.0, [0])[0]
        assert again == row.response_ids


def test_training_penalty_scope(env, policy):
    """The invalid-action penalty lowers the TRAINING score only; the episode's reward (what
    validation reports) is the env's own return."""
    model, tok = policy
    gen = BatchedGenerator(model, tok, max_new_tokens=4)
    settings = RolloutSettings(max_turns=3, history_length=2, max_prompt_tokens=384, system_prompt=SHOP)
    episodes, _ = run_episodes(gen, env, group_specs([50, 51], 2), settings, 1.0, seed=3, max_sessions=POOL_SIZE)
    invalid = [e for e in episodes if e.invalid_actions]
    assert invalid, "needs episodes with invalid actions"
    for e in invalid:
        assert training_score(e, 0.25) == pytest.approx(e.reward - 0.25 * e.invalid_actions)
        assert training_score(e, 0.0) == e.reward
    rows = training_rows(episodes, 0.25)
    assert {r.score for r in rows if r.episode == episodes.index(invalid[0])} == {training_score(invalid[0], 0.25)}


def test_sampling_is_seeded_per_row(policy):
    """A row's sample depends on its seed only: not on the global RNG, not on its batch."""
    model, tok = policy
    gen = BatchedGenerator(model, tok, max_new_tokens=8)
    p = prompts.prompt_ids(
        tok, prompts.build_messages("buy a mug", [], "Search", ["search[<your query>]"], 2, SHOP), 384
    )
    q = prompts.prompt_ids(
        tok,
        prompts.build_messages("buy a red lamp under 30 dollars", [], "Search", ["search[<your query>]"], 2, SHOP),
        384,
    )
    seeds = [derive_seed("x", i) for i in range(4)]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = gen.generate([p] * 4, 1.0, seeds)
    assert torch.equal(torch.random.get_rng_state(), before), "generation must not move the global RNG"
    assert len(set(map(tuple, a))) > 1, "different seeds must sample differently"
    assert gen.generate([p] * 4, 1.0, seeds) == a
    # the same (prompt, seed) alone, or in another batch, in another position, samples the same
    assert gen.generate([p], 1.0, seeds[2:3])[0] == a[2]
    assert gen.generate([q, q[:-5], p], 1.0, [7, 8, seeds[1]])[2] == a[1]
    grouped = BatchedGenerator(model, tok, max_new_tokens=8, max_padding=0.1)
    assert grouped.generate([q[:40], p, q], 1.0, [5, seeds[3], 6])[1] == a[3]
    # greedy: batching does not change a row either
    assert gen.generate([p, p[:-3]], 0.0, [0, 0])[0] == gen.generate([p], 0.0, [0])[0]
    with pytest.raises(ValueError, match="one seed per prompt"):
        gen.generate([p, p], 1.0, [1])


class _Scripted:
    """A policy that replies with a fixed script of actions per task (keyed by the task text in
    its prompt): the rollout loop and the env service are the real ones, only the choices are set."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.eos_ids = {tokenizer.eos_token_id}

    def generate(self, contexts, temperature, seeds):
        texts = [self.tokenizer.decode(c) for c in contexts]
        return [
            prompts.response_ids(self.tokenizer, self.scripts[t.rsplit("Task: ", 1)[1].split("\n", 1)[0]].pop(0))
            for t in texts
        ]


def test_each_episode_records_how_it_ended(env, policy):
    """The env names why a finished episode did not win (shop: by the first reward term the
    purchase missed) and the rollout names the rest: the episode's outcome, per-outcome metric
    fractions, and the warm start's breakdown all read the same label."""
    from client_app.sft import SHORTCUT_ACTION
    from client_app.warm_start import outcome_breakdown
    from envs.registry import make_env

    _, tok = policy
    shop = make_env("shop", **SMALL_ENV_PARAMS)
    tasks = [t for t in range(16, 60) if shop.goal(t).goal_options][:4]

    def play(task: int, pick=lambda expert, valid: expert) -> list[str]:
        shop.reset(task)
        actions = []
        while expert := shop.expert_action():
            actions.append(pick(expert, shop.valid_actions()))
            shop.step(actions[-1])
        return actions

    won = play(tasks[0])
    hasty = play(tasks[1], lambda e, v: SHORTCUT_ACTION if SHORTCUT_ACTION in v else e)  # the buy-now habit
    search = play(tasks[2])[0]
    shop.reset(tasks[2])
    shop.step(search)
    target = f"click[{shop.goal(tasks[2]).asin.lower()}]"
    other = [a for a in shop.valid_actions() if a.startswith("click[b") and a != target][-1]
    wrong_kind = [search, other, SHORTCUT_ACTION]  # another product, bought as is
    turns = max(len(won), len(hasty), len(wrong_kind))
    stuck = ["click[nonsense]"] * turns  # never a valid action: out of turns
    scripts = dict(zip((shop.goal(t).instruction for t in tasks), (won, hasty, wrong_kind, stuck)))
    assert len(scripts) == 4, "the scripted tasks need distinct instructions"
    settings = RolloutSettings(max_turns=turns, history_length=2, max_prompt_tokens=2048, system_prompt=SHOP)
    episodes, _ = run_episodes(
        _Scripted(tok, scripts), env, group_specs(tasks, 1), settings, 1.0, seed=0, max_sessions=POOL_SIZE
    )

    assert [e.outcome for e in episodes] == ["won", "wrong_options", "wrong_product", "timeout"]
    assert [e.won for e in episodes] == [True, False, False, False]
    assert outcome_shares(episodes, "val_") == {
        "val_outcome_timeout": 0.25,
        "val_outcome_won": 0.25,
        "val_outcome_wrong_options": 0.25,
        "val_outcome_wrong_product": 0.25,
    }
    out = outcome_breakdown(episodes)
    assert out["outcomes"] == {"timeout": 1, "won": 1, "wrong_options": 1, "wrong_product": 1}
    assert out["success"] == 0.25 and out["episodes_with_invalid_action"] == 1


def test_a_purchase_is_named_by_the_first_reward_term_it_missed():
    from envs.shop.reward import Reward, purchase_outcome
    from envs.shop.schema import Goal

    goal = Goal(asin="b000000001", instruction="buy it", attributes=("a", "b"), goal_options={"color": "red"})
    full = Reward(total=1.0, r_type=1.0, attribute_hits=2, option_hits=1, price_ok=True)
    assert purchase_outcome(full, goal) == "won"
    cases = {
        "wrong_product": [{"r_type": 0.5}, {"attribute_hits": 1}, {"r_type": 0.5, "price_ok": False, "option_hits": 0}],
        "over_budget": [{"price_ok": False}, {"price_ok": False, "option_hits": 0}],
        "wrong_options": [{"option_hits": 0}],
    }
    for outcome, changes in cases.items():
        for change in changes:
            assert purchase_outcome(replace(full, total=0.75, **change), goal) == outcome, change


def test_a_fits_step_metrics_average_over_the_iterations_that_took_a_step():
    """With algo.filter_uniform_groups an iteration can train no row: its loss and gradient norm
    do not exist and must not count as zeros; a step metric missing where steps were taken is a bug."""
    from client_app.trainer.loop import _merged

    stepped = {"rows": 16.0, "optimizer_steps": 1.0, "pg_loss": 0.25, "grad_norm": 2.0, "train_success": 0.5}
    idle = {"rows": 0.0, "optimizer_steps": 0.0, "train_success": 0.0}
    merged = _merged([stepped, idle])
    assert merged == {"rows": 16.0, "optimizer_steps": 1.0, "pg_loss": 0.25, "grad_norm": 2.0, "train_success": 0.25}
    with pytest.raises(KeyError, match="pg_loss"):
        _merged([stepped, {**idle, "optimizer_steps": 1.0}])


def test_uniform_groups_are_those_whose_episodes_all_scored_the_same():
    from client_app.trainer.advantages import uniform_groups

    def row(group: int, episode: int, score: float) -> TrainRow:
        return TrainRow([1], [2], [1], score, group, episode)

    rows = [
        row(0, 0, 1.0), row(0, 0, 1.0), row(0, 1, 1.0),  # two episodes (one of two turns), equal
        row(1, 2, 0.0), row(1, 3, -0.1),  # an invalid action's penalty tells them apart
        row(2, 4, 0.0),  # a group of one: its score is its advantage (verl), never filtered
        row(3, 5, 0.0), row(3, 6, 0.0), row(3, 7, 0.0),
    ]  # fmt: skip
    assert uniform_groups(rows) == ({0, 3}, 4)


def test_a_fit_averages_outcome_shares_over_iterations_that_lack_some_labels():
    from client_app.rollout import _outcome
    from client_app.trainer.loop import _merged

    first = {
        "rows": 3.0,
        "rollout_s": 1.0,
        "train_success": 0.5,
        "train_outcome_won": 0.5,
        "train_outcome_timeout": 0.5,
    }
    second = {"rows": 5.0, "rollout_s": 2.0, "train_success": 0.0, "train_outcome_timeout": 1.0}
    merged = _merged([first, second])
    assert merged == {
        "rows": 8.0,
        "rollout_s": 3.0,
        "train_success": 0.25,
        "train_outcome_timeout": 0.75,
        "train_outcome_won": 0.25,
    }
    assert merged["train_outcome_won"] == merged["train_success"]
    with pytest.raises(KeyError):  # any other metric must be in every iteration
        _merged([first, {k: v for k, v in second.items() if k != "rows"}])
    with pytest.raises(RuntimeError, match=r"without info\['outcome'\].*envs/base.py"):
        _outcome({"won": False}, "ro-1")
