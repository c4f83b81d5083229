"""Environment heterogeneity: which environment variant each client trains in (FedAgent §3).

A client's variant is a pure, recorded function of (client id, the `env_partition` knobs, and
what the unperturbed engine serves: its product ids, each task's target, its task ids). It is
an `EnvVariant`: engine settings (`engine`, keyword arguments `envs.registry.make_env` adds to
`env.params`), the client's training tasks, and a content hash that is the same in every process.
Validation never uses one: it runs on the unperturbed engine, as published.

Variants (docs/env-heterogeneity.md has the constructions and the realized numbers):
  shop      catalog_split   each client's catalog: its targets + a kept share of the rest
            bm25_fields     which product fields the BM25 index sees (pool of 8)
            bm25_weights    BM25 (k1, b) (pool of 8)
            lookalike       lookalike products attacking one reward term (pool of 4)
            rank_wrapper    how the result list is reordered (pool of 4)
  alfworld  env_disjoint    which scenes' training games a client gets

Pool variants are assigned as published: `RandomState(seed + client_id).randint(N)` over the
first N pool entries, seed 42 by default (the published constant, whatever the run seed).

Nothing here imports the engines (or the Flower side): callers pass the engine's facts
(`engine_facts(env)`), so a variant can be computed, recorded and checked anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_app.hashing import content_hash

FORMAT = "fedagent-env-variant/1"
DEFAULT_SEED = 42  # published: RandomState(42 + client_id), whatever the run seed

# §3.2, in pool order. Fields map as: name/Title -> title, description -> description,
# BulletPoints -> bullets, features -> attributes (the shop has no separate features field).
BM25_FIELDS_POOL: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("full", ("title", "description", "attributes", "bullets")),
    ("name", ("title",)),
    ("desc", ("description",)),
    ("bullets", ("bullets",)),
    ("features", ("attributes",)),
    ("name+bullets", ("title", "bullets")),
    ("desc+features", ("description", "attributes")),
    ("desc+features+bullets", ("description", "attributes", "bullets")),
)
# §3.3, in pool order: (k1, b).
BM25_WEIGHTS_POOL: tuple[tuple[float, float], ...] = (
    (1.2, 0.75),
    (1.2, 0.0),
    (0.3, 0.75),
    (5.0, 0.75),
    (0.1, 0.75),
    (1.2, 1.0),
    (2.0, 0.5),
    (0.3, 0.0),
)
LOOKALIKE_POOL = ("price", "color", "size", "price_color")  # §3.4: v_price, v_color, ...
RANK_WRAPPER_POOL = ("bm25", "shuffled_topk", "inverted_topk", "partial_random")  # §3.5

POOLS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "bm25_fields": tuple((label, {"index_fields": list(f)}) for label, f in BM25_FIELDS_POOL),
    "bm25_weights": tuple((f"k1={k1},b={b}", {"bm25_k1": k1, "bm25_b": b}) for k1, b in BM25_WEIGHTS_POOL),
    "lookalike": tuple((f"v_{a}", {"lookalike": a}) for a in LOOKALIKE_POOL),
    "rank_wrapper": tuple(("v_bm25_default" if r == "bm25" else f"v_{r}", {"ranking": r}) for r in RANK_WRAPPER_POOL),
}
ENV_OF = {
    "uniform": None,
    "catalog_split": "shop",
    "bm25_fields": "shop",
    "bm25_weights": "shop",
    "lookalike": "shop",
    "rank_wrapper": "shop",
    "env_disjoint": "alfworld",
}
# engine keyword arguments each variant sets (a recipe may not set them in env.params)
ENGINE_KEYS = {
    "uniform": (),
    "catalog_split": ("catalog_keep", "protected_tasks"),
    "bm25_fields": ("index_fields",),
    "bm25_weights": ("bm25_k1", "bm25_b"),
    "lookalike": ("lookalike",),
    "rank_wrapper": ("ranking", "rank_seed"),
    "env_disjoint": ("only_tasks",),
}
FALLBACKS = ("skip", "shared", "trial-only")
# §3.6: two held-out scenes per room type (holdout_alfworld_v1, seed 99999)
HOLDOUT_SCENES = (15, 25, 213, 221, 319, 321, 416, 418)


@dataclass(frozen=True)
class EnvPartition:
    """The `env_partition` knobs (fl_app.config.EnvPartitionCfg validates them for a recipe)."""

    name: str = "uniform"
    num_variants: int | None = None
    env_div: float | None = None
    keep_ratio: float | None = None
    fallback: str = "skip"
    holdout: bool = False
    seed: int = DEFAULT_SEED

    @classmethod
    def of(cls, knobs: Mapping[str, Any]) -> EnvPartition:
        part = cls(**dict(knobs))
        part.check()
        return part

    def check(self) -> None:
        """The rules that need no recipe context (the config adds the cross-section ones)."""
        if self.name not in ENV_OF:
            raise ValueError(f"unknown env_partition {self.name!r}; choose from {sorted(ENV_OF)}")
        if self.name in POOLS:
            size = len(POOLS[self.name])
            if self.num_variants is None or not 1 <= self.num_variants <= size:
                raise ValueError(
                    f"env_partition {self.name} needs num_variants in [1, {size}] (its pool), got {self.num_variants}"
                )
        if self.name in ("catalog_split", "env_disjoint") and (self.env_div is None or not 0 <= self.env_div <= 1):
            raise ValueError(f"env_partition {self.name} needs env_div in [0, 1], got {self.env_div}")
        if self.name == "catalog_split" and (self.keep_ratio is None or not 0 < self.keep_ratio <= 1):
            raise ValueError(f"env_partition catalog_split needs keep_ratio in (0, 1], got {self.keep_ratio}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"env_partition fallback must be one of {FALLBACKS}, got {self.fallback!r}")


@dataclass(frozen=True)
class EnvVariant:
    """One client's environment variant: hashable, and its `content_hash` is process-stable."""

    env: str
    name: str
    client_id: int
    label: str  # pool entry, e.g. "v_inverted_topk"
    index: int  # pool index (-1: per-client, e.g. catalog_split)
    tasks: tuple[int, ...]  # the client's training tasks (served order)
    engine: tuple[tuple[str, Any], ...] = ()  # make_env keyword arguments, sorted by name
    knobs: tuple[tuple[str, Any], ...] = field(default=())

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "env": self.env,
            "name": self.name,
            "client_id": self.client_id,
            "label": self.label,
            "index": self.index,
            "tasks": list(self.tasks),
            "engine": {k: _jsonable(v) for k, v in self.engine},
            "knobs": dict(self.knobs),
        }

    @property
    def content_hash(self) -> str:
        return content_hash(self.body())

    def to_dict(self) -> dict[str, Any]:
        """The recorded form (partition.json, the env service's request): body + hash."""
        return {**self.body(), "hash": self.content_hash}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EnvVariant:
        body = {k: v for k, v in data.items() if k != "hash"}
        if body.get("format") != FORMAT or data.get("hash") != content_hash(body):
            raise ValueError(f"not an intact {FORMAT} record (format or content hash differs)")
        return cls(
            env=body["env"],
            name=body["name"],
            client_id=body["client_id"],
            label=body["label"],
            index=body["index"],
            tasks=tuple(body["tasks"]),
            engine=tuple(sorted((k, _frozen(v)) for k, v in body["engine"].items())),
            knobs=tuple(sorted(body["knobs"].items())),
        )


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def assign_variant(client_id: int, num_variants: int, seed: int = DEFAULT_SEED) -> int:
    """The published assignment: `RandomState(seed + client_id).randint(num_variants)`."""
    return int(np.random.RandomState(seed + client_id).randint(num_variants))


def engine_facts(env: Any) -> dict[str, list]:
    """What a variant is computed from, read from an UNPERTURBED engine (duck-typed: nothing
    here imports the engines): shop -> product ids and each task's target; alfworld -> task ids."""
    if env.name == "shop":
        return {"product_ids": env.product_ids(), "target_ids": env.target_ids()}
    return {"task_ids": env.task_ids()}


# --------------------------------------------------------------------------- catalog_split


def catalog_split(
    product_ids: Sequence[str],
    targets: Sequence[str],
    client_id: int,
    env_div: float,
    keep_ratio: float,
    seed: int = DEFAULT_SEED,
) -> tuple[str, ...]:
    """A client's catalog (§3.1, `_distractor_disjoint_partition_webshop_v5`, steps 3-6): its
    targets plus the round(keep_ratio * D) distractors with the smallest
    e = (1 - env_div) * u + env_div * v, u shared (RandomState(seed)), v private
    (RandomState(seed + 1000 * client_id)), one draw each per product in sorted id order.

    `targets` must be the targets of the goals the client actually trains on, in the served
    order (field log 2026-07-28); the engine's tripwire refuses a catalog that loses one.
    """
    ids = sorted(set(product_ids))
    wanted = set(targets)
    if not wanted <= set(ids):
        raise ValueError(f"{len(wanted - set(ids))} targets are not product ids of this catalog")
    u = np.random.RandomState(seed).random_sample(len(ids))
    v = np.random.RandomState(seed + 1000 * client_id).random_sample(len(ids))
    e = (1.0 - env_div) * u + env_div * v
    pool = [i for i, a in enumerate(ids) if a not in wanted]
    n_keep = int(round(keep_ratio * len(pool)))
    kept = sorted(pool, key=lambda i: (e[i], i))[:n_keep]
    return tuple(sorted(wanted | {ids[i] for i in kept}))


# --------------------------------------------------------------------------- env_disjoint


def spec_and_scene(task_id: str) -> tuple[str, int]:
    """ALFRED's (spec, scene) of a task id `<split>/<type>-<object>-<mrecep>-<recep>-<scene>/<trial>`:
    the spec is the task folder without its last dash-separated field, the scene that field."""
    parts = task_id.split("/")
    folder = parts[1] if len(parts) >= 3 else parts[0]
    spec, _, scene = folder.rpartition("-")
    if not spec or not scene.isdigit():
        raise ValueError(f"{task_id!r} is not an ALFWorld task id (<split>/<task folder>-<scene>/<trial>)")
    return spec, int(scene)


def _spec_hash(spec: str) -> int:
    """Process-stable 31-bit hash (sha256), as published; Python's hash() is salted per process."""
    return int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "big") & 0x7FFFFFFF


def env_disjoint(
    task_ids: Sequence[str],
    train_tasks: Sequence[int],
    client_id: int,
    num_clients: int,
    env_div: float,
    fallback: str = "skip",
    holdout: bool = False,
    seed: int = DEFAULT_SEED,
) -> tuple[int, ...]:
    """A client's ALFWorld training tasks (§3.6, `_env_disjoint_partition_alfworld`): training
    games grouped by spec; holdout scenes dropped first; for a spec with n >= 2 scenes the client
    keeps the n_pc = min(n, max(1, ceil(n / N * (1 + env_div)))) scenes with the smallest
    e = (1 - env_div) * u + env_div * v, u from RandomState(seed + h), v from
    RandomState(seed + 1000 * client_id + (h & 0xffff)), h the spec's hash; a spec with one scene
    follows `fallback`: skip (no client gets it), shared (every client gets it), trial-only (the
    same rule over its trials instead of its scenes; our reading of the published knob).
    Ignores |X_i|, as published.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    groups: dict[str, dict[int, list[int]]] = {}
    for t in sorted(set(train_tasks)):
        spec, scene = spec_and_scene(task_ids[t])
        if holdout and scene in HOLDOUT_SCENES:
            continue
        groups.setdefault(spec, {}).setdefault(scene, []).append(t)
    chosen: list[int] = []
    for spec in sorted(groups):
        scenes = groups[spec]
        if len(scenes) >= 2:
            units = [scenes[s] for s in sorted(scenes)]
        elif fallback == "skip":
            continue
        elif fallback == "shared":
            chosen += next(iter(scenes.values()))
            continue
        else:
            units = [[t] for t in next(iter(scenes.values()))]
        n, h = len(units), _spec_hash(spec)
        n_pc = min(n, max(1, math.ceil(n / num_clients * (1 + env_div))))
        u = np.random.RandomState(seed + h).random_sample(n)
        v = np.random.RandomState(seed + 1000 * client_id + (h & 0xFFFF)).random_sample(n)
        e = (1.0 - env_div) * u + env_div * v
        for k in sorted(range(n), key=lambda k: (e[k], k))[:n_pc]:
            chosen += units[k]
    return tuple(sorted(chosen))


# --------------------------------------------------------------------------- the registry


def client_variant(
    part: EnvPartition | Mapping[str, Any],
    env: str,
    client_id: int,
    num_clients: int,
    shard: Sequence[int],
    facts: Mapping[str, Sequence],
    val_size: int = 0,
) -> EnvVariant:
    """Client `client_id`'s variant. `shard` is its training tasks under the task partition
    (uniform for every environment variant, as published); `facts` is `engine_facts` of the
    unperturbed engine; `val_size` its validation split (env_disjoint draws from the rest)."""
    part = part if isinstance(part, EnvPartition) else EnvPartition.of(part)
    part.check()
    if ENV_OF[part.name] not in (None, env):
        raise ValueError(f"env_partition {part.name} is for the {ENV_OF[part.name]} environment, not {env}")
    if not 0 <= client_id < num_clients:
        raise ValueError(f"client_id {client_id} outside [0, {num_clients})")
    knobs = tuple(sorted(vars(part).items()))
    tasks = tuple(sorted(set(shard)))
    if part.name == "uniform":
        return EnvVariant(env, part.name, client_id, "uniform", -1, tasks, (), knobs)
    if part.name == "catalog_split":
        # part.check() above rejects a catalog_split without env_div and keep_ratio
        assert part.env_div is not None and part.keep_ratio is not None
        targets = [facts["target_ids"][t] for t in tasks]
        keep = catalog_split(facts["product_ids"], targets, client_id, part.env_div, part.keep_ratio, part.seed)
        engine = {"catalog_keep": keep, "protected_tasks": tasks}
        return _variant(env, part, client_id, f"catalog_split/client{client_id}", -1, tasks, engine, knobs)
    if part.name == "env_disjoint":
        assert part.env_div is not None  # part.check() above rejects an env_disjoint without env_div
        ids = facts["task_ids"]
        mine = env_disjoint(
            ids, range(val_size, len(ids)), client_id, num_clients, part.env_div, part.fallback, part.holdout, part.seed
        )
        if not mine:
            raise ValueError(
                f"env_disjoint gives client {client_id} no training game (fallback={part.fallback!r}: "
                f"every spec with games has one scene); use fallback shared or trial-only, or more games"
            )
        engine = {"only_tasks": tuple(ids[t] for t in mine)}
        return _variant(env, part, client_id, f"env_disjoint/client{client_id}", -1, mine, engine, knobs)
    # every other name is a POOLS entry, and part.check() above rejects one without num_variants
    assert part.num_variants is not None
    index = assign_variant(client_id, part.num_variants, part.seed)
    label, settings = POOLS[part.name][index]
    if part.name == "rank_wrapper":  # published: wrapper seed 42 + client_id
        settings = {**settings, "rank_seed": part.seed + client_id}
    return _variant(env, part, client_id, label, index, tasks, settings, knobs)


def _variant(
    env: str,
    part: EnvPartition,
    client_id: int,
    label: str,
    index: int,
    tasks: tuple[int, ...],
    engine: Mapping[str, Any],
    knobs: tuple,
) -> EnvVariant:
    return EnvVariant(
        env, part.name, client_id, label, index, tasks, tuple(sorted((k, _frozen(v)) for k, v in engine.items())), knobs
    )


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m partitions.env_variants",
        description="A recipe's environment variants and their realized heterogeneity.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="realized env heterogeneity of a recipe (docs/env-heterogeneity.md)")
    rep.add_argument("recipe")
    rep.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. env_partition.env_div=0.3")
    rep.add_argument("--clients", type=int, default=None, help="measure only the first K clients")
    rep.add_argument("--queries", type=int, default=200, help="fixed query set size (search agreement)")
    args = ap.parse_args(argv)
    from partitions.env_realized import recipe_report  # imports the engines: CLI only

    print(recipe_report(args.recipe, args.overrides, clients=args.clients, queries=args.queries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
