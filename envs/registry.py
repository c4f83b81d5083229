"""Name -> engine factory, and what the policy is told about each engine.

Engines are imported lazily so `shop` never pays for ALFWorld.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from envs.base import Env
from fl_app.hashing import content_hash

_ENGINES = {
    "shop": "envs.shop.env:ShopEnv",
    "alfworld": "envs.alfworld.env:AlfworldEnv",
}

# The chat's system message per engine (client_app/prompts.py builds the rest of the prompt).
# Env-specific text lives here, next to the engine, so prompt code never branches on the env.
# Tiny models are built (and cached) with this text: changing it needs a bump of
# CODE_VERSION in client_app/tiny_model.py, or cached builds keep the old prompt.
_SYSTEM_PROMPTS = {
    "shop": (
        "You are a shopping agent in a web shop. Reply with exactly one action, chosen from the admissible actions."
    ),
    "alfworld": (
        "You are a household agent in a text-based home (ALFWorld). Reply with exactly "
        "one action, chosen from the admissible actions."
    ),
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


def make_env(name: str, variant: Mapping[str, Any] | None = None, **params: Any) -> Env:
    """Build one engine instance. Unknown names and unknown params fail naming the known ones.

    `variant` is a client's environment variant as `partitions.env_variants` records it (its
    `to_dict()`, or that dict after a JSON round trip): its `engine` settings are added to
    `params` (a setting both give is an error, never an override) after its content hash is
    checked. Validation engines are always built without one (the unperturbed env).
    """
    if variant is not None:
        params = {**params, **variant_engine_params(name, variant, params)}
    cls = _engine_class(name)
    accepted = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"environment {name!r} has no param(s) {unknown}; its params are {accepted} (set them under env.params)"
        )
    return cls(**params)


def variant_engine_params(name: str, variant: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings of `variant`, checked: made for `name`, intact (content hash), and
    setting nothing `params` already sets."""
    body = {k: v for k, v in variant.items() if k != "hash"}
    if variant.get("hash") != content_hash(body):
        raise ValueError(
            f"env variant {variant.get('label', '?')!r} of client {variant.get('client_id', '?')} "
            "fails its content hash: it was edited or truncated on the way"
        )
    if variant.get("env") != name:
        raise ValueError(
            f"env variant {variant.get('label')!r} is for environment {variant.get('env')!r}, not {name!r}"
        )
    engine = dict(variant.get("engine") or {})
    clash = sorted(set(engine) & set(params))
    if clash:
        raise ValueError(
            f"env variant {variant.get('label')!r} sets {clash}, which env.params also sets; "
            "remove them from env.params (the variant decides them per client)"
        )
    return engine


def system_prompt(name: str) -> str:
    """The system message a policy acting in environment `name` gets every turn."""
    return _SYSTEM_PROMPTS[_known(name)]
