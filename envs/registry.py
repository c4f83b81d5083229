"""Name -> engine factory, and what the policy is told about each engine.

Engines are imported lazily so `shop` never pays for ALFWorld.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from envs.base import Env

_ENGINES = {
    "shop": "envs.shop.env:ShopEnv",
    "alfworld": "envs.alfworld.env:AlfworldEnv",
}

# The chat's system message per engine (client_app/prompts.py builds the rest of the prompt).
# Env-specific text lives here, next to the engine, so prompt code never branches on the env.
# Tiny models are built (and cached) with this text: changing it needs a bump of
# CODE_VERSION in client_app/tiny_model.py, or cached builds keep the old prompt.
_SYSTEM_PROMPTS = {
    "shop": ("You are a shopping agent in a web shop. Reply with exactly one action, "
             "chosen from the admissible actions."),
    "alfworld": ("You are a household agent in a text-based home (ALFWorld). Reply with exactly "
                 "one action, chosen from the admissible actions."),
}


def env_names() -> list[str]:
    return sorted(_ENGINES)


def _known(name: str) -> str:
    if name not in _ENGINES:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(env_names())}")
    return name


def _engine_class(name: str) -> type:
    module, _, attr = _ENGINES[_known(name)].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_env(name: str, **params: Any) -> Env:
    """Build one engine instance. Unknown names and unknown params fail naming the known ones."""
    cls = _engine_class(name)
    accepted = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"environment {name!r} has no param(s) {unknown}; its params are "
                         f"{accepted} (set them under env.params)")
    return cls(**params)


def system_prompt(name: str) -> str:
    """The system message a policy acting in environment `name` gets every turn."""
    return _SYSTEM_PROMPTS[_known(name)]
