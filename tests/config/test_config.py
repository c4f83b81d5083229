"""Config: recipes + run-config overrides validate before anything starts (issue 4 part 2)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fl_app.config import (
    RUN_CONFIG_ALIASES,
    ConfigError,
    config_doc,
    load_config,
    run_config_keys,
    run_config_toml,
    save_config,
)

ROOT = Path(__file__).resolve().parents[2]


def test_default_recipe_is_the_published_federation_shape():
    cfg = load_config()
    f = cfg.federation
    assert (f.clients, f.clients_per_round, f.tasks_per_client) == (100, 2, 100)
    assert f.local_epochs == 2  # [tiny]: the paper's 3 is `--run-config local-epochs=3`
    assert (cfg.algo.tasks_per_step, cfg.algo.group_size) == (8, 8)


def test_alfworld_recipe_keeps_the_paper_step_budget():
    cfg = load_config("tiny-alfworld-grpo")
    assert cfg.env.name == "alfworld" and cfg.env.max_turns == 50 and cfg.model.path == "tiny"


def test_shop_only_shortcut_habit_is_refused_for_other_envs():
    """Invariant 28: a requested SFT habit that the env cannot demonstrate is an error, not a no-op."""
    with pytest.raises(ConfigError, match=r"model\.tiny\.sft_shortcut"):
        load_config("tiny-alfworld-grpo", dotlist=["model.tiny.sft_shortcut=0.5"])
    assert load_config("tiny-alfworld-grpo").model.tiny.sft_shortcut == 0
    load_config("tiny-alfworld-grpo", dotlist=["model.tiny.sft_shortcut=0.5", "model.path=/models/any"])


def test_run_config_overrides_map_onto_recipe_keys():
    cfg = load_config(
        overrides={
            "rounds": 70,
            "seed": 5,
            "clients-per-round": 3,
            "run-dir": "/tmp/x",
            "strategy": "fedprox",
            "proximal-mu": 0.02,
        }
    )
    assert cfg.federation.rounds == 70 and cfg.run.seed == 5 and cfg.federation.clients_per_round == 3
    assert cfg.federation.strategy == "fedprox" and cfg.federation.proximal_mu == 0.02
    assert cfg.resolved_run_dir() == Path("/tmp/x")


def test_empty_string_keeps_the_recipe_value():
    assert load_config(overrides={"rounds": "", "seed": ""}).federation.rounds == load_config().federation.rounds


def test_the_install_command_a_missing_flower_prints_is_pyproject_s_pin():
    """`require_flwr`'s fix names the Flower pyproject pins (read from the installed metadata), so
    a user who follows it gets the version the app was verified with, not the newest."""
    from fl_app.host import flwr_requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert flwr_requirement() == next(d for d in deps if d.startswith("flwr")) == "flwr[simulation]==1.42.0"


def test_pyproject_declares_every_recipe_key_as_a_run_config_key():
    """Flower accepts `--run-config k=v` only for keys declared in pyproject (issue #14 item 3:
    every recipe key reachable, not just a handful): the section is the generated one."""
    from flwr.common.config import flatten_dict

    text = (ROOT / "pyproject.toml").read_text()
    assert run_config_toml() in text, "pyproject is stale: paste `python -m fl_app.config --run-config-keys`"
    declared = set(flatten_dict(tomllib.loads(text)["tool"]["flwr"]["app"]["config"]))
    assert declared == {"recipe", *RUN_CONFIG_ALIASES, *run_config_keys()}
    assert {"algo.lr", "algo.critic.lr", "env.params", "model.tiny.sft_noise", "rounds"} <= declared


def test_docs_config_md_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == config_doc(), (
        "regenerate it: python -m fl_app.config --doc > docs/config.md"
    )


def test_dotted_run_config_keys_reach_nested_recipe_keys():
    cfg = load_config(
        overrides={
            "algo.lr": 3e-4,
            "algo.critic.lr": 2e-5,
            "model.tiny.sft_noise": 0.2,
            "backend": "builtin",
            "federation.only_clients": "[5, 9]",
            "env.params": "{val_size: 40}",
        }
    )
    assert cfg.algo.lr == 3e-4 and cfg.algo.critic.lr == 2e-5 and cfg.model.tiny.sft_noise == 0.2
    assert cfg.federation.only_clients == [5, 9]
    base = load_config().env.params
    assert cfg.env.params == {**base, "val_size": 40}  # a mapping updates the recipe's


def test_unknown_dotted_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"did you mean.*algo\.lr"):
        load_config(overrides={"algo.lrr": 1e-4})


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("proximal-mu", float("inf"), "proximal_mu"),
        ("algo.lr", float("nan"), "algo.lr"),
        ("rounds", True, "boolean"),
        ("algo.mini_batch_size", False, "boolean"),
        ("run-dir", "/", "not a dedicated directory"),
        ("run-dir", "~", "not a dedicated directory"),
        ("run-dir", "/tmp", "not a dedicated directory"),
    ],
)
def test_bad_run_config_values_are_refused(key, value, match):
    """Issue #18 item 8: inf, nan, booleans for numbers and run dirs such as / or the home dir."""
    with pytest.raises(ConfigError, match=match):
        load_config(overrides={key: value})


def test_a_token_budget_that_cannot_hold_the_longest_row_is_refused():
    """The budget must hold rollout.max_prompt_tokens + max_response_tokens (verl asserts it
    mid-fit otherwise); the error names the minimum."""
    with pytest.raises(ConfigError, match=r"micro_batch_tokens=500 cannot hold.*at least 544"):
        load_config("tiny-shop-grpo", dotlist=["algo.micro_batch_tokens=500"])
    assert load_config("tiny-shop-grpo", dotlist=["algo.micro_batch_tokens=544"]).algo.micro_batch_tokens == 544


def test_filtering_uniform_groups_is_refused_where_there_are_no_groups_to_compare():
    with pytest.raises(ConfigError, match=r"filter_uniform_groups=true filters GRPO groups.*'ppo'"):
        load_config("tiny-shop-grpo", dotlist=["algo.name=ppo", "algo.filter_uniform_groups=true"])
    with pytest.raises(ConfigError, match=r"needs groups of two or more.*group_size=1"):
        load_config("tiny-shop-grpo", dotlist=["algo.group_size=1", "algo.filter_uniform_groups=true"])
    assert load_config("tiny-shop-grpo", dotlist=["algo.filter_uniform_groups=true"]).algo.filter_uniform_groups


def test_a_server_optimizer_takes_only_its_own_knobs_and_fedadam_needs_a_learning_rate():
    """Fail closed at recipe load: another optimizer's knob would silently do nothing, and
    fedadam has no learning rate that suits every task (FedOpt tunes it)."""
    with pytest.raises(ConfigError, match=r"server_beta2 is a knob of server_optimizer fedadam.*'nesterov'"):
        load_config("tiny-shop-grpo", dotlist=["federation.server_optimizer=nesterov", "federation.server_beta2=0.9"])
    with pytest.raises(ConfigError, match=r"server_momentum is a knob of server_optimizer fedavgm / nesterov"):
        load_config("tiny-shop-grpo", dotlist=["federation.server_momentum=0.5"])
    with pytest.raises(ConfigError, match=r"fedadam needs federation.server_lr"):
        load_config("tiny-shop-grpo", dotlist=["federation.server_optimizer=fedadam"])
    fed = load_config("tiny-shop-grpo", dotlist=["federation.server_optimizer=nesterov"]).federation
    assert (fed.server_lr, fed.server_momentum, fed.server_beta1) == (0.7, 0.9, None)  # DiLoCo's
    assert load_config("tiny-shop-grpo").federation.server_lr == 1.0  # sgd: FedAvg


def test_lora_runs_on_both_engines_and_its_knobs_need_it():
    """Fail closed at recipe load: adapter knobs under `update: full` would silently do nothing."""
    assert load_config("tiny-shop-grpo-lora", dotlist=["backend=verl"]).federation.update == "lora"
    with pytest.raises(ConfigError, match=r"federation.lora sets adapter keys.*update='full'"):
        load_config("tiny-shop-grpo", dotlist=["federation.lora.rank=4"])
    cfg = load_config("tiny-shop-grpo", dotlist=["federation.update=lora", "federation.lora.rank=2"])
    assert (cfg.federation.update, cfg.federation.lora.rank) == ("lora", 2)
    assert load_config("tiny-shop-grpo").federation.update == "full"  # the default: today's bits


def test_a_whole_config_rule_error_does_not_dump_the_config():
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"clients": 2, "clients-per-round": 3})
    assert "exceeds federation.clients" in str(err.value) and "'federation':" not in str(err.value)


def test_broken_empty_and_env_reading_recipes_are_config_errors(tmp_path, monkeypatch):
    broken = tmp_path / "broken.yaml"
    broken.write_text("federation:\n  rounds: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(broken))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(str(empty))
    monkeypatch.setenv("FEDAGENT_SECRET", "leak")
    envy = tmp_path / "envy.yaml"
    envy.write_text("extends: tiny-shop-grpo\nrun:\n  name: ${oc.env:FEDAGENT_SECRET}\n")
    with pytest.raises(ConfigError, match="resolver"):
        load_config(str(envy))
    with pytest.raises(ConfigError, match="resolver"):
        load_config(dotlist=["run.name=${oc.env:FEDAGENT_SECRET}"])
    interp = tmp_path / "interp.yaml"
    interp.write_text("extends: tiny-shop-grpo\nrun:\n  name: x-${federation.rounds}\n")
    assert load_config(str(interp)).run.name == f"x-{load_config().federation.rounds}"


def test_unknown_recipe_key_names_the_key():
    with pytest.raises(ConfigError, match=r"federation\.roundz: unknown key"):
        load_config(dotlist=["federation.roundz=3"])


def test_bad_value_names_the_key_and_value():
    with pytest.raises(ConfigError, match=r"federation\.clients_per_round"):
        load_config(overrides={"clients-per-round": 0})
    with pytest.raises(ConfigError, match=r"exceeds federation\.clients"):
        load_config(overrides={"clients": 2, "clients-per-round": 3})


def test_unknown_run_config_key_is_refused_with_suggestions():
    with pytest.raises(ConfigError, match=r"'roundz' is not a recipe key; did you mean \['rounds'"):
        load_config(overrides={"roundz": 3})


def test_unknown_recipe_lists_known_recipes():
    with pytest.raises(ConfigError, match="tiny-shop-grpo"):
        load_config("no-such-recipe")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides={"rounds": 4})
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"run.weight_store": "nas"}, "none of ''"),
        ({"run.weight_store": "http://10.0.0.1:9400"}, "the built-in store is `http`"),
        ({"run.weight_store": "file://relative/dir"}, "file:///absolute/path"),
        ({"run.weight_store_url": "https://10.0.0.1:9400"}, "set run.weight_store=http"),
        ({"run.weight_store": "http", "run.weight_store_certfile": "/etc/c.pem"}, "go together"),
        ({"run.weight_store": "http", "run.weight_store_host": "0.0.0.0"}, "set run.weight_store_url"),
        ({"run.weight_store": "http", "run.weight_store_url": "10.0.0.1:9400"}, "must be an http"),
    ],
)
def test_a_weight_store_nobody_could_open_is_refused_before_anything_starts(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_the_weight_store_ca_file_is_node_local():
    """Each node names its own CA path: it must not change the recipe digest nodes check."""
    from fl_app.config import recipe_sha256

    a = load_config(overrides={"run.weight_store": "http", "run.weight_store_ca_file": "/a/ca.pem"})
    b = load_config(overrides={"run.weight_store": "http", "run.weight_store_ca_file": "/b/ca.pem"})
    assert recipe_sha256(a) == recipe_sha256(b) != recipe_sha256(load_config())


SLOW_1 = ["faults.straggler_clients=[1]", "faults.straggler_s=5"]


@pytest.mark.parametrize(
    "dotlist,match",
    [
        (["federation.over_select=-1"], "over_select"),
        (["federation.clients=4", "federation.clients_per_round=2", "federation.over_select=3"], "exceeds federation"),
        (["federation.clients_per_round=1", "federation.only_clients=[3]", "federation.over_select=1"], "drop one"),
        (["federation.round_deadline_s=0"], "round_deadline_s"),
        (["federation.round_deadline_s=600", "federation.client_timeout_s=600"], "not shorter than"),
        (["federation.round_deadline_s=30"], "can drop no straggler"),
        (["faults.straggler_clients=[1]"], "go together"),
        (["faults.straggler_s=5"], "go together"),
        (["faults.straggler_rounds=[1]"], "needs faults.straggler_clients"),
        ([*SLOW_1, "faults.straggler_rounds=[0]"], "count from 1"),
        (["federation.clients=4", "faults.straggler_clients=[4]", "faults.straggler_s=5"], r"outside \[0, 4\)"),
        (["federation.rounds=2", *SLOW_1, "faults.straggler_rounds=[3]"], "after federation.rounds=2"),
    ],
)
def test_over_selection_deadlines_and_stragglers_that_cannot_be_armed_are_refused(dotlist, match):
    """Issue 39: a deadline that can drop nobody or never fires, more clients than exist, a
    straggler without a sleep: each is a config error naming the keys, before anything starts."""
    with pytest.raises(ConfigError, match=match):
        load_config("tiny-shop-grpo", dotlist=dotlist)


def test_a_deadline_armed_by_over_selection_or_a_tolerance_loads():
    for extra in ("federation.over_select=1", "federation.min_clients_per_round=1"):
        cfg = load_config("tiny-shop-grpo", dotlist=["federation.round_deadline_s=30", extra])
        assert cfg.federation.round_deadline_s == 30
    cfg = load_config("tiny-shop-grpo", dotlist=[*SLOW_1, "faults.straggler_rounds=[2]"])
    assert [cfg.faults.straggles(c, r) for c, r in ((1, 2), (1, 1), (0, 2))] == [5.0, 0.0, 0.0]
