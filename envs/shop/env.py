"""`ShopEnv`: a WebShop-compatible shopping episode over a shared `World`.

Pages: search -> results (10 per page) -> item (options, tabs, Buy Now) -> done.
Actions: `search[<query>]` on the search page, `click[<button>]` elsewhere; click arguments
are matched case-insensitively and listed lower-case, as WebShop does. An action that is not
valid in the current state changes nothing (same observation, reward 0, valid_action False).
The episode ends at Buy Now with WebShop's reward; the step budget belongs to the rollout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from envs.shop import pages
from envs.shop.goals import price_clause
from envs.shop.lookalikes import ATTACKS
from envs.shop.reward import Reward, purchase_outcome, purchase_reward
from envs.shop.schema import Goal, Product
from envs.shop.search import DEFAULT_FIELDS, RANKINGS, random_results
from envs.shop.world import World, WorldSpec, get_world

SEARCH_MARKER = "search[<your query>]"  # the valid-action entry for the search bar
_ACTION = re.compile(r"\s*(search|click)\s*\[(.*)\]\s*", re.IGNORECASE | re.DOTALL)
_REWARD_TERMS = tuple(f.name for f in fields(Reward))


class ShopEnv:
    """One shop episode at a time; `reset(seed)` plays task `seed % num_tasks`.

    Heterogeneity hooks (defaults = the unmodified shop; docs/env-heterogeneity.md):
      catalog_keep     product ids search may show (None: all). Shown exactly as given: the
                       engine adds nothing, so a filter computed from the wrong goals is caught.
      protected_tasks  with catalog_keep (required then): the tasks the engine must serve. It
                       refuses to build unless every one keeps its target reachable (shown and
                       retrieved by a query), the catalog_split tripwire (invariant 13).
                       Resetting to any task whose target is filtered out raises ValueError.
      ranking          "bm25" | "shuffled_topk" | "inverted_topk" | "partial_random" (search.py).
      rank_seed        seed of the shuffled/partial_random wrappers (None: `seed`).
      index_fields, bm25_k1, bm25_b   what the BM25 index sees and how it weighs it.
      lookalike        "" or a lookalike attack: "price" | "color" | "size" | "price_color"
                       (lookalikes.py; same text as a goal target, the attacked term flipped).
    """

    name = "shop"

    def __init__(
        self,
        num_products: int = 300,
        num_goals: int = 1000,
        val_size: int = 64,
        search_return_n: int = 50,
        seed: int = 0,
        data_dir: str | None = None,
        human_goals: bool = False,
        catalog_keep: Sequence[str] | None = None,
        protected_tasks: Sequence[int] | None = None,
        ranking: str = "bm25",
        rank_seed: int | None = None,
        index_fields: Sequence[str] = DEFAULT_FIELDS,
        bm25_k1: float = 1.2,
        bm25_b: float = 0.75,
        lookalike: str = "",
    ):
        if ranking not in RANKINGS:
            raise ValueError(f"unknown ranking {ranking!r}; choose from {RANKINGS}")
        if search_return_n < 1:
            raise ValueError(f"search_return_n must be >= 1, got {search_return_n}")
        if lookalike and lookalike not in ATTACKS:
            raise ValueError(f'unknown lookalike attack {lookalike!r}; choose from {ATTACKS} (or "")')
        self._world: World = get_world(
            WorldSpec(
                num_products=num_products,
                num_goals=num_goals,
                seed=seed,
                data_dir=None if data_dir is None else str(data_dir),
                human_goals=human_goals,
                lookalike=lookalike,
                index_fields=tuple(index_fields),
                bm25_k1=bm25_k1,
                bm25_b=bm25_b,
            )
        )
        if not 0 <= val_size <= self.num_tasks:
            raise ValueError(f"val_size={val_size} must lie in [0, num_tasks={self.num_tasks}]")
        self._val_size = val_size
        self._visible = self._visible_mask(catalog_keep)
        self._shown = np.flatnonzero(self._visible)
        self._ranking, self._n = ranking, search_return_n
        self._rank_seed = seed if rank_seed is None else rank_seed
        # partial_random's coins are per search (_results_for); its searcher is plain BM25
        scored = "bm25" if ranking == "partial_random" else ranking
        self._search = self._world.index.searcher(
            search_return_n, self._visible, scored, self._rank_seed if scored == "shuffled_topk" else 0
        )
        self._task = -1
        self._goal: Goal | None = None
        self._item: Product | None = None
        self._reward: Reward | None = None
        self._obs: str | None = None  # the current page, rendered once (_page_changed)
        self._clicks: dict[str, tuple[str, Any]] | None = None
        if catalog_keep is not None:
            self._tripwire(protected_tasks)

    # -- task addressing ---------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return len(self._world.goals)

    @property
    def val_size(self) -> int:
        return self._val_size

    def task_ids(self) -> list[str]:
        return [self._task_id(i) for i in range(self.num_tasks)]

    def task_categories(self) -> list[str]:
        return [g.category for g in self._world.goals]

    def _task_id(self, index: int) -> str:
        return f"{index:06d}-{self._world.goals[index].asin}"

    def goal(self, task: int) -> Goal:
        return self._world.goals[task % self.num_tasks]

    def product(self, asin: str) -> Product:
        return self._world.products[self._world.position[asin]]

    def product_ids(self) -> list[str]:
        """Every product id in the world, in catalog order (before any catalog filter)."""
        return [p.asin for p in self._world.products]

    def winnable(self, task: int) -> bool:
        """True when the target of `task` is in the shown catalog."""
        return bool(self._visible[self._world.position[self.goal(task).asin]])

    def reachable(self, task: int) -> bool:
        """True when the target of `task` is shown and one of the expert's queries retrieves it."""
        return self.winnable(task) and self._world.position[self.goal(task).asin] in self._search(
            self.expert_query(task)
        )

    def target_ids(self) -> list[str]:
        """The target product id of every task, in served order (what catalog filters protect)."""
        return [g.asin for g in self._world.goals]

    def lookalike_of(self) -> dict[str, str]:
        """Lookalike product id -> the id of the goal target it copies (empty without `lookalike`)."""
        return dict(self._world.lookalike_of)

    def _visible_mask(self, keep: Sequence[str] | None) -> np.ndarray:
        products = self._world.products
        if keep is None:
            return np.ones(len(products), dtype=bool)
        unknown = [a for a in keep if a not in self._world.position]
        if unknown:
            raise ValueError(
                f"catalog_keep names {len(unknown)} unknown product ids, e.g. "
                f"{unknown[:3]}; take ids from ShopEnv.product_ids()"
            )
        mask = np.zeros(len(products), dtype=bool)
        mask[[self._world.position[a] for a in keep]] = True
        return mask

    def _tripwire(self, protected: Sequence[int] | None) -> None:
        """Refuse to serve a filtered catalog that loses a protected task's target (invariant 13;
        field log 2026-07-28: a floor derived from another goal order than the served one)."""
        if protected is None:
            raise ValueError(
                "catalog_keep needs protected_tasks: the tasks this engine serves, whose "
                "targets the filter must keep (a client's training shard)"
            )
        lost = [t for t in protected if not self.reachable(t % self.num_tasks)]
        if lost:
            raise ValueError(
                f"refusing to serve: {len(lost)} of {len(protected)} protected tasks lost their target "
                f"product from this catalog, e.g. {[self._task_id(t % self.num_tasks) for t in lost[:3]]}; "
                "the filter was computed from other goals than the ones this engine serves in this order"
            )

    # -- episode -----------------------------------------------------------------------------
    def reset(self, seed: int) -> tuple[str, dict]:
        self._task = seed % self.num_tasks
        if not self.winnable(self._task):
            raise ValueError(
                f"task {self._task} ({self._task_id(self._task)}) has its target filtered "
                "out of this catalog: this engine does not serve it (see protected_tasks)"
            )
        self._goal = self._world.goals[self._task]
        self._tid = self._task_id(self._task)
        self._state = "search"
        self._results: tuple[int, ...] = ()
        self._page_no = 1
        self._item = None
        self._tab = ""
        self._chosen: dict[str, str] = {}
        self._reward = None
        self._searches = 0
        self._page_changed()
        return self.observation, self._info()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._goal is None:
            raise RuntimeError("call reset(seed) before step()")
        valid = self._apply(action) if self._state != "done" else False
        done = self._state == "done"
        reward = self._reward.total if (done and valid and self._reward is not None) else 0.0
        info = self._info()
        info["valid_action"] = valid
        if done and self._reward is not None:  # a plain dict: JSON-safe
            info["reward_terms"] = {name: getattr(self._reward, name) for name in _REWARD_TERMS}
            info["outcome"] = purchase_outcome(self._reward, self._current_goal)
        return self.observation, reward, done, info

    def _info(self) -> dict[str, Any]:
        return {
            "task_id": self._tid,
            "task_index": self._task,
            "instruction": self._current_goal.instruction,
            "valid_actions": self.valid_actions(),
            "won": self._reward is not None and self._reward.won,
        }

    # -- pages -------------------------------------------------------------------------------
    @property
    def raw_observation(self) -> str:
        """The WebShop text-mode page, instruction included."""
        instruction = self._current_goal.instruction
        if self._state == "search":
            return pages.search_page(instruction)
        if self._state == "results":
            return pages.results_page(instruction, self._page_products(), self._page_no, len(self._results))
        if self._state == "item":
            return pages.item_page(instruction, self._current_item)
        if self._state == "detail":
            return pages.detail_page(instruction, self._current_item, self._tab)
        if self._reward is None:
            raise RuntimeError(f"shop state {self._state!r} without a purchase")
        return pages.done_page(instruction, self._current_item, self._reward.total)

    @property
    def _current_goal(self) -> Goal:
        if self._goal is None:
            raise RuntimeError("call reset(seed) first: no episode is running")
        return self._goal

    @property
    def _current_item(self) -> Product:
        if self._item is None:
            raise RuntimeError(f"shop state {self._state!r} without an open item")
        return self._item

    @property
    def observation(self) -> str:
        """What the policy reads: the formatted page (see `pages.format_observation`)."""
        if self._obs is None:
            self._obs = pages.format_observation(self.raw_observation, self._current_goal.instruction)
        return self._obs

    def _page_changed(self) -> None:
        """Forget the current page's rendering and buttons. Both are functions of the page
        state alone, which only a valid action changes, so they are built once per page
        rather than on every step and every call of `valid_actions` / `_apply`."""
        self._obs = None
        self._clicks = None

    def _page_products(self) -> list[Product]:
        start = (self._page_no - 1) * pages.PAGE_SIZE
        return [self._world.products[i] for i in self._results[start : start + pages.PAGE_SIZE]]

    def _clickables(self) -> dict[str, tuple[str, Any]]:
        """Lower-cased button text -> (kind, payload) for the current page."""
        if self._clicks is None:
            self._clicks = self._build_clickables()
        return self._clicks

    def _build_clickables(self) -> dict[str, tuple[str, Any]]:
        clicks: dict[str, tuple[str, Any]]
        if self._state == "results":
            clicks = {pages.BACK_TO_SEARCH: ("search", None)}
            if self._page_no > 1:
                clicks[pages.PREV] = ("page", self._page_no - 1)
            if self._page_no * pages.PAGE_SIZE < len(self._results):
                clicks[pages.NEXT] = ("page", self._page_no + 1)
            for p in self._page_products():
                clicks[p.asin] = ("item", p)
        elif self._state == "item":
            clicks = {pages.BACK_TO_SEARCH: ("search", None), pages.PREV: ("results", None)}
            for name, values in self._current_item.options.items():
                for value in values:
                    clicks.setdefault(value.lower(), ("option", (name, value)))
            for tab in pages.DETAIL_TABS:
                clicks[tab] = ("tab", tab)
            clicks[pages.BUY_NOW] = ("buy", None)
        elif self._state == "detail":
            clicks = {pages.BACK_TO_SEARCH: ("search", None), pages.PREV: ("return", None)}
        else:
            clicks = {}
        return {k.lower(): v for k, v in clicks.items()}

    def valid_actions(self) -> list[str]:
        if self._state == "search":
            return [SEARCH_MARKER]
        return [f"click[{text}]" for text in self._clickables()]

    def _apply(self, action: str) -> bool:
        """Advance the state for a valid action; False (state untouched) otherwise."""
        kind = self._transition(action)
        if kind is not None and kind != "option":  # choosing an option leaves the page as is
            self._page_changed()
        return kind is not None

    def _transition(self, action: str) -> str | None:
        """Apply a valid action and return its kind ("query" for a search); None if invalid."""
        match = _ACTION.fullmatch(action) if isinstance(action, str) else None
        if match is None:
            return None
        verb, arg = match.group(1).lower(), match.group(2).strip().lower()
        if verb == "search":
            if self._state != "search" or not arg:
                return None
            self._searches += 1
            self._results = self._results_for(arg, self._task, self._searches)
            self._state, self._page_no = "results", 1
            return "query"
        click = self._clickables().get(arg)
        if click is None:
            return None
        kind, payload = click
        if kind == "search":
            self._state, self._results = "search", ()
        elif kind == "page":
            self._page_no = payload
        elif kind == "item":
            self._state, self._item, self._chosen = "item", payload, {}
        elif kind == "results":
            self._state = "results"
        elif kind == "return":  # from a detail tab: options stay chosen
            self._state = "item"
        elif kind == "option":
            name, value = payload
            self._chosen[name] = value
        elif kind == "tab":
            self._state, self._tab = "detail", payload
        elif kind == "buy":
            self._reward = purchase_reward(self._current_item, self._current_goal, self._chosen)
            self._state = "done"
        return kind

    def _results_for(self, query: str, task: int, search_no: int) -> tuple[int, ...]:
        """Catalog positions the `search_no`-th search of an episode of `task` shows for `query`."""
        if self._ranking == "partial_random":
            drawn = random_results(self._shown, self._n, self._rank_seed, task, search_no)
            if drawn is not None:
                return drawn
        return self._search(query)

    def search_ids(self, query: str, task: int = 0, search_no: int = 1) -> list[str]:
        """The product ids, in shown order, that the `search_no`-th search for `query` in an
        episode of `task` returns (to measure how variants differ, without playing pages)."""
        return [self._world.products[i].asin for i in self._results_for(query.lower(), task, search_no)]

    # -- oracle ------------------------------------------------------------------------------
    def expert_query(self, task: int | None = None) -> str:
        """A query whose results contain the target of `task` (default: the current task).

        First the instruction without its price clause (what a policy can also write; it
        finds the target on page 1 for every default goal), then the target's title, then
        longer title-based fallbacks. Returns the title if nothing retrieves the target.
        """
        goal = self._current_goal if task is None else self.goal(task)
        target = self.product(goal.asin)
        position = self._world.position[goal.asin]
        clause = price_clause(goal.price_upper)
        wish = goal.instruction[: -len(clause)] if clause and goal.instruction.endswith(clause) else goal.instruction
        candidates = (
            wish,
            target.title,
            f"{target.title} {target.description}",
            " ".join((target.title, *target.bullets)),
        )
        for query in candidates:
            if position in self._search(query.lower()):
                return query.lower()
        return target.title.lower()

    def expert_action(self) -> str:
        """The oracle's next action: search the target, page to it, open it, click every goal
        option it offers, buy. "" once the episode is over."""
        goal = self._goal
        if goal is None or self._state == "done":
            return ""
        target = self._world.position[goal.asin]
        if self._state == "search":
            return f"search[{self.expert_query()}]"
        if self._state == "results":
            if target not in self._results:
                return f"click[{pages.BACK_TO_SEARCH.lower()}]"
            page = self._results.index(target) // pages.PAGE_SIZE + 1
            if page == self._page_no:
                return f"click[{goal.asin.lower()}]"
            return f"click[{(pages.NEXT if page > self._page_no else pages.PREV).lower()}]"
        if self._state == "detail" or self._current_item.asin != goal.asin:
            return f"click[{pages.PREV.lower()}]"
        clicks = self._clickables()
        for name, want in goal.goal_options.items():
            if self._chosen.get(name) != want and clicks.get(want.lower()) == ("option", (name, want)):
                return f"click[{want.lower()}]"
        return f"click[{pages.BUY_NOW.lower()}]"
