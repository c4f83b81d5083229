"""The immutable part of a shop: products, goals, search index. Built once per spec per
process and shared by every `ShopEnv` built with that spec (an env service builds a pool of
them; the default world takes ~0.1 s, a pool of 16 then costs nothing more)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from envs.shop.catalog import generate_catalog
from envs.shop.goals import synthesize_goals
from envs.shop.lookalikes import check_lookalikes, make_lookalikes, place_lookalikes
from envs.shop.schema import Goal, Product
from envs.shop.search import DEFAULT_FIELDS, SearchIndex


@dataclass(frozen=True)
class WorldSpec:
    """Every parameter that changes products, goals or the index (hashable cache key)."""

    num_products: int = 300
    num_goals: int = 1000
    seed: int = 0
    data_dir: str | None = None
    human_goals: bool = False
    lookalike: str = ""  # lookalike attack ("" = none; lookalikes.ATTACKS)
    index_fields: tuple[str, ...] = DEFAULT_FIELDS
    bm25_k1: float = 1.2
    bm25_b: float = 0.75


@dataclass(frozen=True, eq=False)
class World:
    spec: WorldSpec
    products: tuple[Product, ...]  # catalog order; a lookalike sits next to its original
    goals: tuple[Goal, ...]  # served task order
    position: dict[str, int]  # asin -> catalog position
    index: SearchIndex
    lookalike_of: dict[str, str]  # lookalike asin -> the asin of the product it copies


def build_world(spec: WorldSpec) -> World:
    """Build a world from scratch (no cache); a pure function of `spec`."""
    if spec.data_dir is None:
        products = generate_catalog(spec.num_products, spec.seed)
        goals = synthesize_goals(products, spec.num_goals, spec.seed)
    else:
        from envs.shop.webshop_data import load_goals, load_products

        products, ins = load_products(spec.data_dir, spec.seed)
        goals = load_goals(spec.data_dir, products, ins, spec.seed, spec.human_goals)
        goals = goals[: spec.num_goals]
        if not goals:
            raise ValueError(
                f"no goals could be built from {spec.data_dir}: no product in "
                "items_shuffle has an instruction in the instruction file"
            )
    lookalike_of: dict[str, str] = {}
    if spec.lookalike:  # after the goals: drawn from the finished goal list, never goals themselves
        fakes, lookalike_of = make_lookalikes(products, goals, spec.lookalike)
        check_lookalikes(products, goals, fakes, lookalike_of, spec.lookalike)
        products = place_lookalikes(products, fakes, lookalike_of, spec.lookalike)
    index = SearchIndex(products, spec.index_fields, spec.bm25_k1, spec.bm25_b)
    return World(
        spec=spec,
        products=tuple(products),
        goals=tuple(goals),
        position={p.asin: i for i, p in enumerate(products)},
        index=index,
        lookalike_of=lookalike_of,
    )


_lock = threading.Lock()
_worlds: dict[WorldSpec, World] = {}
_building: dict[WorldSpec, threading.Lock] = {}


def get_world(spec: WorldSpec) -> World:
    """The shared world for `spec`, built at most once per process even under thread races."""
    with _lock:
        world = _worlds.get(spec)
        if world is not None:
            return world
        spec_lock = _building.setdefault(spec, threading.Lock())
    with spec_lock:
        with _lock:
            world = _worlds.get(spec)
        if world is None:
            world = build_world(spec)
            with _lock:
                _worlds[spec] = world
                _building.pop(spec, None)
    return world
