"""Realized environment heterogeneity: what the clients' variants actually differ by.

Pure measures over recorded variants (`env_variants.EnvVariant`) and engines built from them;
`realized_env_heterogeneity(cfg)` runs the ones that apply to a recipe's `env_partition` and
returns a JSON-able dict (for partition.json / summary.json); `format_report` renders it next
to the published figures (notes-fedagent-protocol.md §3). The engines are imported on use only.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

from partitions.env_variants import (
    POOLS,
    EnvPartition,
    EnvVariant,
    assign_variant,
    client_variant,
    engine_facts,
    spec_and_scene,
)
from partitions.uniform import client_shard

# Published figures to print next to ours (§3; the fidelity check for lookalikes).
PUBLISHED = {
    "assignment_N2": [54, 46],
    "assignment_N4": [21, 19, 33, 27],
    "assignment_N8": [11, 8, 15, 13, 10, 11, 18, 14],
    "catalog_jaccard_range": "[0.819 at env_div=0, 0.464 at env_div=1] (their docstring, real WebShop)",
    "served_goals_losing_target": "~29% (2026-07 audit of the published runs: the wrong-goal floor)",
    "bm25_weights_N4": "mean Jaccard@10 ~0.65, top-1 disagreement ~70% (real agent queries)",
    "lookalike_items": "colour 286, size 268, price+colour 286 of 415 targets; 9 of 748 purchases scored 1.0",
}


def jaccard(a: Iterable, b: Iterable) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)} if values else {}


def pairwise(sets: Sequence[Iterable], limit: int = 20_000) -> dict[str, float]:
    """Mean/min/max Jaccard over client pairs (the first `limit` pairs in order)."""
    frozen = [frozenset(s) for s in sets]
    return _summary([jaccard(a, b) for a, b in itertools.islice(itertools.combinations(frozen, 2), limit)])


def catalog_overlap(
    variants: Sequence[EnvVariant], target_ids: Sequence[str], product_ids: Sequence[str], limit: int = 20_000
) -> dict[str, Any]:
    """catalog_split: catalog sizes; pairwise Jaccard of the clients' catalogs; and of their kept
    distractors on the pair's common pool (the products neither client targets), which at
    env_div = 1 are independent keep_ratio subsets: Jaccard rho^2/(2 rho - rho^2), the docstring's
    value (its pools were near-identical: ~80 targets of 1000 products per client)."""
    catalogs = [frozenset(dict(v.engine)["catalog_keep"]) for v in variants]
    targets = [frozenset(target_ids[t] for t in v.tasks) for v in variants]
    everything = frozenset(product_ids)
    common = []
    for a, b in itertools.islice(itertools.combinations(range(len(variants)), 2), limit):
        pool = everything - targets[a] - targets[b]
        common.append(jaccard(catalogs[a] & pool, catalogs[b] & pool))
    rho = dict(variants[0].knobs)["keep_ratio"]
    return {
        "catalog_size": _summary([len(c) for c in catalogs]),
        "targets_per_client": _summary([len(t) for t in targets]),
        "catalog_jaccard": pairwise(catalogs, limit),
        "common_pool_distractor_jaccard": _summary(common),
        "independent_subsets_jaccard": rho * rho / (2 * rho - rho * rho),
    }


def search_agreement(
    search: Sequence[Callable[[str, int], Sequence[str]]], queries: Sequence[tuple[str, int]], k: int = 10
) -> dict[str, float]:
    """Over every pair of variants and every (query, task): mean Jaccard of the top-k result ids
    and the share whose top-1 differs (the published ~0.65 / ~70% for the BM25 weights)."""
    jacc, differ, n = 0.0, 0, 0
    for q, task in queries:
        results = [list(s(q, task))[:k] for s in search]
        for a, b in itertools.combinations(results, 2):
            jacc += jaccard(a, b)
            differ += a[:1] != b[:1]
            n += 1
    return {
        f"jaccard@{k}": jacc / n if n else float("nan"),
        "top1_disagreement": differ / n if n else float("nan"),
        "pairs": n,
    }


def lookalike_stats(env: Any, tasks: Sequence[int]) -> dict[str, Any]:
    """Lookalikes per target and what buying one instead of the target pays, over the goals of
    `tasks`: the best reward under any option choice (must be < 1), and the reward of the
    purchase that clicks the goal's values where the lookalike offers them."""
    from envs.shop.reward import purchase_reward, reward_upper_bound

    of = env.lookalike_of()
    per_target = Counter(of.values())
    goals = [env.goal(t) for t in tasks]
    targets = {g.asin for g in goals}
    best, clicked = [], []
    for fake, original in of.items():
        lookalike = env.product(fake)
        for g in (g for g in goals if g.asin == original):
            best.append(reward_upper_bound(lookalike, g).total)
            offered = {v: n for n, vals in lookalike.options.items() for v in vals}
            chosen = {offered[v]: v for v in g.goal_options.values() if v in offered}
            for name, vals in lookalike.options.items():
                chosen.setdefault(name, vals[0])
            clicked.append(purchase_reward(lookalike, g, chosen).total)
    return {
        "lookalikes": len(of),
        "targets": len(targets),
        "targets_with_lookalike": sum(1 for t in targets if per_target[t]),
        "lookalikes_per_target": statistics.fmean(per_target[t] for t in targets) if targets else 0.0,
        "purchases_scored": len(best),
        "best_reward": _summary(best),
        "clicked_reward": _summary(clicked),
    }


def expert_success(env: Any, tasks: Sequence[int], max_steps: int = 60, budget: int = 15) -> dict[str, float]:
    """Play the engine's expert on `tasks`: the share that ends with reward 1.0, and the share
    that does so within the rollout's step `budget`."""
    won = within = 0
    for t in tasks:
        env.reset(t)
        for n in range(1, max_steps + 1):  # noqa: B007 (n, the steps taken, is read after the loop)
            _, reward, done, _ = env.step(env.expert_action())
            if done:
                break
        if done and reward == 1.0:
            won += 1
            within += n <= budget
    return {
        "episodes": len(tasks),
        "success": won / len(tasks) if tasks else float("nan"),
        f"success_within_{budget}_steps": within / len(tasks) if tasks else float("nan"),
    }


def scene_overlap(
    variants: Sequence[EnvVariant], task_ids: Sequence[str], train_tasks: Sequence[int]
) -> dict[str, Any]:
    """env_disjoint: games and scenes per client, pairwise Jaccard of the clients' (spec, scene)
    sets and game sets, and the share of training games no client gets."""
    scenes = [{spec_and_scene(task_ids[t]) for t in v.tasks} for v in variants]
    covered = set().union(*(v.tasks for v in variants)) if variants else set()
    return {
        "games_per_client": _summary([len(v.tasks) for v in variants]),
        "scenes_per_client": _summary([len(s) for s in scenes]),
        "scene_jaccard": pairwise(scenes),
        "game_jaccard": pairwise([v.tasks for v in variants]),
        "training_games": len(train_tasks),
        "games_used_by_no_client": len(set(train_tasks) - covered),
    }


class _ShopSearch(Protocol):
    """The part of the shop engine (envs.shop.env) the search measures use; duck-typed, as
    nothing here imports the engines."""

    def expert_query(self, task: int | None = None) -> str: ...

    def search_ids(self, query: str, task: int = 0, search_no: int = 1) -> list[str]: ...


def variant_counts(variants: Sequence[EnvVariant], pool_size: int) -> list[int]:
    counts = Counter(v.index for v in variants)
    return [counts[i] for i in range(pool_size)]


def realized_env_heterogeneity(
    cfg: Any,
    clients: int | None = None,
    queries: int = 200,
    expert: bool = True,
    shard_of: Callable[[int], Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The realized heterogeneity of `cfg` (a fl_app.config.Config) over its first `clients`
    clients (all by default): variants, their hashes and the measures of its env_partition.
    Search agreement uses a fixed query set: the expert's query (the instruction without its
    price clause) of the first `queries` training tasks; `expert` plays the expert on every
    measured client's training tasks under its variant. `shard_of`: each client's training tasks
    (default: the uniform split, as the published env variants use; a run passes its plan's)."""
    from envs.registry import make_env

    part = EnvPartition.of(cfg.env_partition.model_dump())
    env_name, params, f = cfg.env.name, dict(cfg.env.params), cfg.federation
    base = make_env(env_name, **params)
    train = list(range(base.val_size, base.num_tasks))
    facts = engine_facts(base)

    def variant(c: int) -> EnvVariant:
        shard = shard_of(c) if shard_of else client_shard(c, f.clients, f.tasks_per_client, train, cfg.run.seed)
        return client_variant(part, env_name, c, f.clients, shard, facts, base.val_size)

    n = f.clients if clients is None else min(clients, f.clients)
    variants = [variant(c) for c in range(n)]
    out: dict[str, Any] = {
        "env_partition": vars(part),
        "clients_measured": n,
        "variant_hashes": {v.client_id: v.content_hash for v in variants},
        "variant_of_client": {v.client_id: v.label for v in variants},
    }
    if part.name in POOLS:
        num_variants = part.num_variants
        assert num_variants is not None  # EnvPartition.of checked it: every POOLS partition needs num_variants
        labels = [label for label, _ in POOLS[part.name][:num_variants]]
        out["variant_labels"], out["variant_counts"] = labels, variant_counts(variants, num_variants)
        # one engine per pool entry, as the first client assigned to it sees it
        first = {
            i: next(c for c in itertools.count() if assign_variant(c, num_variants, part.seed) == i)
            for i in range(num_variants)
        }
        engines = {i: make_env(env_name, variant=variant(c).to_dict(), **params) for i, c in first.items()}
        # POOLS partitions are shop-only (ENV_OF; client_variant rejects another env), so these are shop engines
        qs = [(cast(_ShopSearch, base).expert_query(t), t) for t in train[:queries]]
        out["search_agreement"] = search_agreement([cast(_ShopSearch, e).search_ids for e in engines.values()], qs)
        if part.name == "lookalike":
            out["lookalikes"] = {labels[i]: lookalike_stats(e, train) for i, e in engines.items()}
    elif part.name == "catalog_split":
        out["catalog"] = catalog_overlap(variants, facts["target_ids"], facts["product_ids"])
    elif part.name == "env_disjoint":
        out["scenes"] = scene_overlap(variants, facts["task_ids"], train)
    if expert and env_name == "shop":
        played = [(v, expert_success(make_env(env_name, variant=v.to_dict(), **params), v.tasks)) for v in variants]
        out["expert"] = (
            {
                label: _pooled([w for v, w in played if v.label == label])
                for label in dict.fromkeys(v.label if v.index >= 0 else "all clients" for v in variants)
            }
            if part.name in POOLS
            else {"all clients": _pooled([w for _, w in played])}
        )
    return out


def _pooled(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-client expert results pooled: episodes, success over all of them, clients below 1.0."""
    episodes = sum(r["episodes"] for r in results)
    keys = [k for k in results[0] if k.startswith("success")]
    return {
        "clients": len(results),
        "episodes": episodes,
        **{k: sum(r[k] * r["episodes"] for r in results) / episodes for k in keys},
        "clients_below_1": sum(r["success"] < 1.0 for r in results),
    }


def format_report(realized: dict[str, Any]) -> str:
    """Markdown lines: each realized figure, the published one beside it where there is one."""
    part = realized["env_partition"]
    lines = [f"env_partition: {part}", f"clients measured: {realized['clients_measured']}"]
    if "variant_counts" in realized:
        ref = PUBLISHED.get(f"assignment_N{part['num_variants']}", "-")
        lines.append(f"variant counts {realized['variant_labels']}: {realized['variant_counts']} (published: {ref})")
    if "search_agreement" in realized:
        s = realized["search_agreement"]
        ref = PUBLISHED["bm25_weights_N4"] if part["name"] == "bm25_weights" else "-"
        lines.append(
            f"search across variants: Jaccard@10 {s['jaccard@10']:.3f}, top-1 disagreement "
            f"{s['top1_disagreement']:.1%} over {s['pairs']} (query, pair)s (published: {ref})"
        )
    if "catalog" in realized:
        c = realized["catalog"]
        lines.append(
            f"catalog size {_fmt(c['catalog_size'])} with {_fmt(c['targets_per_client'])} targets; pairwise "
            f"catalog Jaccard {_fmt(c['catalog_jaccard'])} (published: {PUBLISHED['catalog_jaccard_range']})"
        )
        lines.append(
            f"pairwise Jaccard of the kept distractors on the pair's common pool "
            f"{_fmt(c['common_pool_distractor_jaccard'])}; independent subsets rho^2/(2 rho - rho^2) = "
            f"{c['independent_subsets_jaccard']:.3f}"
        )
    for label, stats in realized.get("lookalikes", {}).items():
        lines.append(
            f"{label}: {stats['lookalikes']} lookalikes for "
            f"{stats['targets_with_lookalike']}/{stats['targets']} "
            f"targets ({stats['lookalikes_per_target']:.2f} per target); buying one instead: best "
            f"{_fmt(stats['best_reward'])}, clicking the goal's values {_fmt(stats['clicked_reward'])} "
            f"over {stats['purchases_scored']} (published: {PUBLISHED['lookalike_items']})"
        )
    if "scenes" in realized:
        s = realized["scenes"]
        lines.append(
            f"games per client {_fmt(s['games_per_client'])}, "
            f"scenes per client {_fmt(s['scenes_per_client'])}; "
            f"pairwise scene Jaccard {_fmt(s['scene_jaccard'])}, game Jaccard {_fmt(s['game_jaccard'])}; "
            f"{s['games_used_by_no_client']} of {s['training_games']} training games used by no client"
        )
    expert = realized.get("expert")
    if expert:
        lines.append(f"expert on every client's training goals: {expert}")
        if part["name"] == "catalog_split":
            lines.append(
                f"served goals losing their target: 0 by the tripwire (published: "
                f"{PUBLISHED['served_goals_losing_target']})"
            )
    return "\n".join(f"- {line}" for line in lines)


def _fmt(s: dict[str, float]) -> str:
    return f"mean {s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]" if s else "-"


def recipe_report(recipe: str, overrides: Sequence[str] = (), clients: int | None = None, queries: int = 200) -> str:
    from fl_app.config import load_config

    cfg = load_config(recipe, dotlist=list(overrides))
    return format_report(realized_env_heterogeneity(cfg, clients=clients, queries=queries))
