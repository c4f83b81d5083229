"""Config: recipes + run-config overrides validate before anything starts (issue 4 part 2)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fl_app.config import RUN_CONFIG_KEYS, ConfigError, load_config, save_config

ROOT = Path(__file__).resolve().parent.parent


def test_default_recipe_is_the_published_federation_shape():
    cfg = load_config()
    f = cfg.federation
    assert (f.clients, f.clients_per_round, f.tasks_per_client) == (100, 2, 100)
    assert f.local_epochs == 2      # [tiny]: the paper's 3 is `--run-config local-epochs=3`
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
    cfg = load_config(overrides={"rounds": 70, "seed": 5, "clients-per-round": 3, "run-dir": "/tmp/x",
                                 "strategy": "fedprox", "proximal-mu": 0.02})
    assert cfg.federation.rounds == 70 and cfg.run.seed == 5 and cfg.federation.clients_per_round == 3
    assert cfg.federation.strategy == "fedprox" and cfg.federation.proximal_mu == 0.02
    assert cfg.resolved_run_dir() == Path("/tmp/x")


def test_empty_string_keeps_the_recipe_value():
    assert load_config(overrides={"rounds": "", "seed": ""}).federation.rounds == load_config().federation.rounds


def test_every_pyproject_run_config_key_is_mapped():
    """`flwr run . --run-config rounds=70` is accepted only if the key exists in pyproject."""
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    assert "rounds" in declared
    assert declared - {"recipe"} == set(RUN_CONFIG_KEYS)


def test_unknown_recipe_key_names_the_key():
    with pytest.raises(ConfigError, match=r"federation\.roundz: unknown key"):
        load_config(dotlist=["federation.roundz=3"])


def test_bad_value_names_the_key_and_value():
    with pytest.raises(ConfigError, match=r"federation\.clients_per_round"):
        load_config(overrides={"clients-per-round": 0})
    with pytest.raises(ConfigError, match=r"exceeds federation\.clients"):
        load_config(overrides={"clients": 2, "clients-per-round": 3})


def test_unknown_run_config_key_lists_known_ones():
    with pytest.raises(ConfigError, match="known keys"):
        load_config(overrides={"roundz": 3})


def test_unknown_recipe_lists_known_recipes():
    with pytest.raises(ConfigError, match="tiny-shop-grpo"):
        load_config("no-such-recipe")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides={"rounds": 4})
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg
