"""The env registry: engines by name, their params checked before an engine is built, and the
system prompt each engine's policy gets (env-specific prompt text lives with the engine)."""

from __future__ import annotations

import pytest

from envs.registry import env_names, make_env, system_prompt


def test_every_engine_has_its_own_system_prompt():
    prompts = {name: system_prompt(name) for name in env_names()}
    assert set(prompts) == {"shop", "alfworld"}
    assert len(set(prompts.values())) == len(prompts) and all(prompts.values())
    with pytest.raises(ValueError, match="unknown environment 'webshop'; known: alfworld, shop"):
        system_prompt("webshop")


def test_unknown_env_params_are_refused_naming_the_engine_params():
    with pytest.raises(
        ValueError,
        match=r"'shop' has no param\(s\) \['num_product'\]; its params are \["
        r"'num_products'",
    ):
        make_env("shop", num_product=30)
    with pytest.raises(ValueError, match=r"'alfworld' has no param\(s\) \['num_game'\].*'num_games'"):
        make_env("alfworld", num_game=12)
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("webshop")
