"""Name -> engine factory. Engines are imported lazily so `shop` never pays for ALFWorld."""
from __future__ import annotations

import importlib
from typing import Any

from envs.base import Env

_ENGINES = {
    "shop": "envs.shop.env:ShopEnv",
    "alfworld": "envs.alfworld.env:AlfworldEnv",
}


def env_names() -> list[str]:
    return sorted(_ENGINES)


def make_env(name: str, **params: Any) -> Env:
    """Build one engine instance. Unknown names fail with the list of known ones."""
    if name not in _ENGINES:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(env_names())}")
    module, _, attr = _ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)(**params)
