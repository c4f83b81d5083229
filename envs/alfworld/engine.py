"""The one door to the real ALFWorld engine (alfworld 0.4.2 on textworld 1.7.0).

Everything that imports `alfworld` or `textworld` goes through here, for three reasons:

- Home hygiene: `import alfworld.info` creates `~/.cache/alfworld` unless `ALFWORLD_DATA` is set.
  `alfworld_module()` imports with `ALFWORLD_DATA` pointed at the system temp dir (it exists, so
  nothing is created; only alfworld's own download/generate scripts would read it) and restores
  the caller's environment afterwards, so nothing lands in the home directory and child
  processes never inherit a value we made up.
- Process-global state: TextWorld parses every grammar rule and query with module-level tatsu
  parsers (not thread-safe), and fast-downward's PDDL translator rewrites `sys.argv`, swaps
  `sys.stdout` and flips module-level options on every call. Every engine touch (construction,
  load, reset, step, planning) therefore holds `ENGINE_LOCK` (cf. the field log's 2026-07-21
  "_TW_LOCK over all reset/step engine touches"). Steps of different envs still interleave; each
  env's planner state lives in its own copy of libdownward.
- Speed without changing a byte of output: `_install_fast_paths()` memoises three pure functions
  of the engine (PDDL->SAS translation, the tatsu parses of grammar strings and of queries) and
  makes the grammar's per-symbol context copy shallow (it deep-copied the entity records on every
  symbol; nothing mutates them); docs/alfworld.md has the measured speed-up. A test plays the
  same episodes with the fast paths off (`FEDAGENT_ALFWORLD_FAST_PATHS=0`, in a subprocess) and
  compares every byte.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import pickle
import sys
import tempfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

ENGINE_LOCK = threading.RLock()

#: Translations kept in memory (compressed, ~160 KB per kitchen game and variant).
TRANSLATION_CACHE_BYTES = 256 << 20


def default_cache_dir() -> Path:
    """`$FEDAGENT_CACHE_DIR/alfworld`, else `~/.cache/fedagent-flower/alfworld`."""
    root = os.environ.get("FEDAGENT_CACHE_DIR")
    base = Path(root).expanduser() if root else Path("~/.cache/fedagent-flower").expanduser()
    return base / "alfworld"


def alfworld_module(name: str) -> ModuleType:
    """Import `name` (an `alfworld...` or `textworld...` module) without touching the home dir."""
    with ENGINE_LOCK:
        if "alfworld.info" not in sys.modules:
            saved = os.environ.get("ALFWORLD_DATA")
            os.environ["ALFWORLD_DATA"] = tempfile.gettempdir()
            try:
                importlib.import_module("alfworld.info")
            finally:
                if saved is None:
                    os.environ.pop("ALFWORLD_DATA", None)
                else:
                    os.environ["ALFWORLD_DATA"] = saved
        _install_fast_paths()
        return importlib.import_module(name)


# ------------------------------------------------------------------------------ fast paths


class _TranslationCache:
    """LRU of compressed `pddl2sas` results; each hit unpickles a private copy of the task."""

    def __init__(self, budget: int):
        self.budget, self.size, self.hits, self.misses = budget, 0, 0, 0
        self._items: OrderedDict[tuple, bytes] = OrderedDict()

    def get(self, key: tuple) -> Any | None:
        blob = self._items.get(key)
        if blob is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return pickle.loads(zlib.decompress(blob))

    def put(self, key: tuple, value: Any) -> None:
        blob = zlib.compress(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), 1)
        if key in self._items:
            return
        self._items[key] = blob
        self.size += len(blob)
        while self.size > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.size -= len(old)


translations = _TranslationCache(TRANSLATION_CACHE_BYTES)
_fast_paths_checked = False


def _install_fast_paths() -> None:
    global _fast_paths_checked
    if _fast_paths_checked:
        return
    _fast_paths_checked = True
    if os.environ.get("FEDAGENT_ALFWORLD_FAST_PATHS", "1") == "0":
        return
    import fast_downward
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    translate = fast_downward.pddl2sas

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        key = (domain, problem, bool(optimize))
        hit = translations.get(key)
        if hit is not None:
            return hit
        argv = sys.argv
        try:
            result = translate(domain, problem, verbose=verbose, optimize=optimize)
        finally:
            sys.argv = argv  # the translator overwrites it on every call
        translations.put(key, result)
        return result

    parse_symbols = functools.lru_cache(maxsize=4096)(textgen._parse_and_convert)

    def parse_and_convert(*args: Any, **kwargs: Any):
        # Callers attach contexts to the returned symbols: hand out copies, keep the original.
        return copy.deepcopy(parse_symbols(*args, **kwargs))

    # typed as a plain callable: lru_cache's stub wants Hashable arguments, which mypy denies classes
    parse_query: Callable[..., Any] = functools.lru_cache(maxsize=4096)(logic.Rule.parse_conjunctive_query.__func__)

    def copy_context(context: dict) -> dict:
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    fast_downward.pddl2sas = pddl2sas
    textgen._parse_and_convert = parse_and_convert
    textgen.copy_context = copy_context
    logic.Rule.parse_conjunctive_query = classmethod(lambda cls, expr: parse_query(cls, expr))


# ------------------------------------------------------------------------------ playing


class Frame(NamedTuple):
    """What the engine shows after a reset or a step."""

    feedback: str
    admissible: list[str]
    won: bool


class AlfredGame:
    """One engine instance: PddlEnv -> AlfredDemangler -> AlfredInfos, ALFWorld's text-mode stack.

    Holds its own copy of fast-downward's library, so one instance plays one episode at a
    time; reloading the game file that is already loaded is free.
    """

    def __init__(self) -> None:
        with ENGINE_LOCK:
            tw = alfworld_module("textworld")
            pddl = alfworld_module("textworld.envs.pddl")
            alfred = alfworld_module("alfworld.agents.environment.alfred_tw_env")
            infos = tw.EnvInfos(admissible_commands=True, won=True, extras=["gamefile"])
            self._pddl = pddl.PddlEnv(infos)
            self._env = alfred.AlfredInfos(alfred.AlfredDemangler(self._pddl, shuffle=False))
        self._loaded: str | None = None

    def reset(self, game: str | Path | dict) -> Frame:
        """Start a game (a game.tw-pddl path, or its content as a dict) from its initial state."""
        with ENGINE_LOCK:
            key = "<data>" if isinstance(game, dict) else str(game)
            if key == "<data>" or self._loaded != key:
                self._loaded = None
                self._env.load(game if key == "<data>" else key)
                self._loaded = key
            return self._frame(self._env.reset())

    def step(self, command: str) -> Frame:
        """Play one command (the engine answers "Nothing happens." to a non-admissible one)."""
        with ENGINE_LOCK:
            state, _score, _done = self._env.step(command)
            return self._frame(state)

    @property
    def walkthrough(self) -> list[str]:
        """The loaded game file's stored walkthrough (a winning command list from the start)."""
        return list(self._pddl.walkthrough or [])

    def replan(self) -> list[str]:
        """ALFWorld's planner on the loaded game as it is: the call `AlfredExpert(PLANNER)` makes
        (PddlEnv's `policy_commands`). Fast on small games only (planning.py); [] if no plan."""
        with ENGINE_LOCK:
            if self._loaded is None:
                raise RuntimeError("reset a game before planning")
            return list(self._pddl._pddl_state.replan(self._pddl._entity_infos))

    def plan(self) -> list[str]:
        """ALFWorld's planner from the current state, on ALFRED's task-relevant projection
        (`planning.py` says why); [] when it finds no plan."""
        from envs.alfworld.planning import plan_commands

        with ENGINE_LOCK:
            if self._loaded is None:
                raise RuntimeError("reset a game before planning")
            state = self._pddl._pddl_state
            return plan_commands(state, self._pddl._game_data, self._pddl._entity_infos)

    @staticmethod
    def _frame(state: Any) -> Frame:
        return Frame(state.feedback, list(state["admissible_commands"]), bool(state["won"]))
