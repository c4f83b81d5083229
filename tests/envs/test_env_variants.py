"""Environment heterogeneity (issue #19; docs/env-heterogeneity.md): per-client shop and ALFWorld
variants as pure, recorded functions of (client id, knobs), their engines, the tripwire and guards
that keep every served goal winnable (invariant 13), the recipes' explicit search pool
(invariant 14), and validation on the unperturbed engine."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from test_alfworld import alf_cache, small_params  # noqa: F401  (alf_cache: a fixture)
from test_shop_reward import _write_webshop_dir

from envs.base import task_order_fingerprint
from envs.registry import make_env
from envs.shop.lookalikes import ATTACKS, LookalikeError, attacked_options, check_lookalikes, make_lookalikes
from envs.shop.reward import option_matches, purchase_reward, reward_upper_bound
from envs.shop.world import WorldSpec, build_world
from fl_app.config import CONFIGS_DIR, ENV_PARTITIONS, ConfigError, EnvPartitionCfg, load_config
from partitions.env_realized import jaccard, realized_env_heterogeneity, search_agreement
from partitions.env_variants import (
    ENGINE_KEYS,
    POOLS,
    EnvPartition,
    EnvVariant,
    assign_variant,
    catalog_split,
    client_variant,
    engine_facts,
    env_disjoint,
)
from partitions.uniform import client_shard

ROOT = Path(__file__).resolve().parents[2]
SHOP = dict(num_products=150, num_goals=1000, val_size=64, search_return_n=50, seed=0)  # tiny-shop-grpo's
ENV_HET_RECIPES = sorted(
    p.relative_to(CONFIGS_DIR).with_suffix("").as_posix() for p in (CONFIGS_DIR / "env-het").glob("*.yaml")
)
KNOBS = {
    "catalog_split": {"env_div": 1.0, "keep_ratio": 0.7},
    "bm25_fields": {"num_variants": 8},
    "bm25_weights": {"num_variants": 8},
    "lookalike": {"num_variants": 4},
    "rank_wrapper": {"num_variants": 4},
}


@pytest.fixture(scope="module")
def base():
    return make_env("shop", **SHOP)


def shard(c: int, env) -> list[int]:
    return client_shard(c, 100, 100, range(env.val_size, env.num_tasks), 0)


def variant(name: str, c: int, env, **knobs) -> EnvVariant:
    return client_variant({"name": name, **(knobs or KNOBS[name])}, "shop", c, 100, shard(c, env), engine_facts(env))


def tiny(name: str, **knobs):
    knobs = knobs or KNOBS[name]
    return load_config(
        "tiny-shop-grpo", dotlist=[f"env_partition.name={name}", *(f"env_partition.{k}={v}" for k, v in knobs.items())]
    )


# --------------------------------------------------------------------------- the registry


def test_assignment_is_the_published_rule():
    """§3.0: RandomState(42 + client_id).randint(N); the derived counts over clients 0-99."""
    for n, counts in ((2, [54, 46]), (4, [21, 19, 33, 27]), (8, [11, 8, 15, 13, 10, 11, 18, 14])):
        got = np.bincount([assign_variant(c, n) for c in range(100)], minlength=n).tolist()
        assert got == counts, n
    assert [assign_variant(c, 4) for c in (21, 42, 84)] == [0, 2, 2]


def test_variant_bytes_are_the_same_in_another_process(base):
    """A variant is a pure function of its inputs: a fresh process (another hash seed) records
    byte-identical variants, hence equal content hashes, for every variant kind."""
    code = (
        "import json; from envs.registry import make_env; from test_env_variants import SHOP, KNOBS, variant;"
        "env = make_env('shop', **SHOP);"
        "print(json.dumps({k: [variant(k, c, env).to_dict() for c in (0, 7, 99)] for k in KNOBS}, sort_keys=True))"
    )
    env = {
        **os.environ,
        "PYTHONHASHSEED": "12345",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)]),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    here = {k: [variant(k, c, base).to_dict() for c in (0, 7, 99)] for k in KNOBS}
    assert out.stdout.strip() == json.dumps(here, sort_keys=True)
    hashes = {v["hash"] for vs in here.values() for v in vs}
    assert len(hashes) == 15  # every (kind, client) differs
    one = variant("rank_wrapper", 7, base)
    assert hash(one) == hash(variant("rank_wrapper", 7, base)) and EnvVariant.from_dict(one.to_dict()) == one


def test_variant_records_are_checked_where_they_are_used(base):
    """make_env refuses a variant whose content hash fails, one made for another env, and one
    that would silently override an env.params setting."""
    v = variant("rank_wrapper", 3, base).to_dict()
    tampered = {**v, "engine": {**v["engine"], "ranking": "bm25"}}
    with pytest.raises(ValueError, match="content hash"):
        make_env("shop", variant=tampered, **SHOP)
    with pytest.raises(ValueError, match="for environment 'shop'"):
        make_env("alfworld", variant=v)
    with pytest.raises(ValueError, match=r"sets \['ranking'\], which env.params also sets"):
        make_env("shop", variant=v, ranking="bm25", **SHOP)
    with pytest.raises(ValueError, match="not an intact"):
        EnvVariant.from_dict(tampered)


def test_config_knobs_are_validated_before_anything_starts():
    cfg = load_config("tiny-shop-grpo", dotlist=["env_partition.name=rank_wrapper", "env_partition.num_variants=4"])
    assert (cfg.env_partition.name, cfg.env_partition.num_variants, cfg.env_partition.seed) == ("rank_wrapper", 4, 42)
    bad = {
        ("env_partition.name=nope",): "env_partition.name",
        ("env_partition.name=rank_wrapper",): "needs env_partition.num_variants",
        ("env_partition.name=rank_wrapper", "env_partition.num_variants=5"): "exceeds the rank_wrapper pool",
        ("env_partition.name=catalog_split", "env_partition.env_div=1.0"): "needs env_partition.keep_ratio",
        ("env_partition.name=catalog_split", "env_partition.env_div=1.5", "env_partition.keep_ratio=0.7"): "env_div",
        ("env_partition.name=bm25_fields", "env_partition.num_variants=4", "env_partition.env_div=0.3"): "not read by",
        ("env_partition.keep_ratio=0.7",): "not read by env_partition.name=uniform",
        ("env_partition.fallback=shared",): "only apply to env_disjoint",
        ("env_partition.name=env_disjoint", "env_partition.env_div=0.5"): "for the alfworld environment",
        (
            "env_partition.name=lookalike",
            "env_partition.num_variants=2",
            "env.params.lookalike=price",
        ): "sets per client",
        ("env.params.variant={}",): "env.params.variant",
    }
    for dotlist, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("tiny-shop-grpo", dotlist=list(dotlist))


def test_shop_variants_need_an_explicit_search_pool(tmp_path):
    """Invariant 14 (field log 2026-07-23): an environment-heterogeneity recipe states its search
    pool; the default (50) stays the unmarked case's."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "env: {name: shop, params: {num_products: 150}}\n"
        "env_partition: {name: rank_wrapper, num_variants: 4}\nmodel: {tiny: {sft_shortcut: 0.5}}\n"
    )
    with pytest.raises(ConfigError, match="needs env.params.search_return_n set explicitly"):
        load_config(str(recipe))
    for recipe in ENV_HET_RECIPES:
        assert load_config(recipe).env.params["search_return_n"] == 200, recipe
    assert load_config("webshop-grpo-qwen2.5-1.5b").env.params["search_return_n"] == 50


def test_config_table_matches_the_registry(base):
    """fl_app cannot import partitions: its knobs, pools and engine keys must agree with it."""
    assert list(EnvPartitionCfg.model_fields) == [f.name for f in fields(EnvPartition)]
    for name, (env, pool, keys) in ENV_PARTITIONS.items():
        assert keys == ENGINE_KEYS[name], name
        assert pool == (len(POOLS[name]) if name in POOLS else None), name
        if env == "shop":
            assert {k for k, _ in variant(name, 5, base).engine} == set(keys), name


@pytest.mark.parametrize("recipe", ENV_HET_RECIPES + ["tiny-shop-grpo-catalog-split", "tiny-shop-grpo-rank-wrapper"])
def test_env_het_recipes_validate_and_name_their_sources(recipe):
    cfg = load_config(recipe)
    assert cfg.env_partition.name != "uniform"
    if recipe.startswith("tiny"):  # same env.params: the same tiny model as the default
        assert cfg.env.params == load_config("tiny-shop-grpo").env.params
        return
    text = (CONFIGS_DIR / f"{recipe}.yaml").read_text()
    valued = [
        line
        for line in text.splitlines()
        if re.match(r"^\s*[\w.]+:\s*\S", line.split("#", 1)[0]) and not line.lstrip().startswith(("extends:", "name:"))
    ]
    missing = [line for line in valued if not re.search(r"#\s*\[(cfg|script|verl|code|doc|ours)\]", line)]
    assert not missing, missing


def test_env_het_recipes_are_the_published_sweep():
    points = {
        (
            c.algo.name,
            c.env_partition.name,
            c.env_partition.num_variants,
            c.env_partition.env_div,
            c.env_partition.keep_ratio,
        )
        for c in map(load_config, ENV_HET_RECIPES)
    }
    grpo = (
        {("grpo", "catalog_split", None, d, 0.7) for d in (0.0, 0.3, 0.7, 1.0)}
        | {("grpo", k, n, None, None) for k in ("bm25_fields", "bm25_weights") for n in (4, 8)}
        | {("grpo", "lookalike", n, None, None) for n in (2, 4)}
        | {("grpo", "rank_wrapper", 4, None, None)}
    )
    ppo = {("ppo", "catalog_split", None, 1.0, 0.7)} | {
        ("ppo", k, 4, None, None) for k in ("bm25_fields", "bm25_weights", "lookalike", "rank_wrapper")
    }
    assert points == grpo | ppo


# --------------------------------------------------------------------------- catalog_split


def test_catalog_split_env_div_0_is_shared_and_1_independent_at_fixed_size(base):
    """Two clients with the same goals get the same catalog at env_div = 0 and different ones of
    the same size at env_div = 1; across clients, the kept distractors on a pair's common pool are
    nested at env_div = 0 (one shared draw) and independent keep_ratio subsets at env_div = 1
    (Jaccard rho^2/(2 rho - rho^2) = 0.538 at rho = 0.7)."""
    ids, targets = base.product_ids(), base.target_ids()
    mine = [targets[t] for t in shard(4, base)]
    same = {d: [catalog_split(ids, mine, c, d, 0.7) for c in (4, 9)] for d in (0.0, 1.0)}
    assert same[0.0][0] == same[0.0][1]
    assert same[1.0][0] != same[1.0][1] and len(same[1.0][0]) == len(same[1.0][1])
    common_j = []
    for a, b in itertools.combinations(range(30), 2):
        ta, tb = ({targets[t] for t in shard(c, base)} for c in (a, b))
        pool = set(ids) - ta - tb
        ka0, kb0 = (set(catalog_split(ids, sorted(t), c, 0.0, 0.7)) & pool for c, t in ((a, ta), (b, tb)))
        assert ka0 <= kb0 or kb0 <= ka0
        ka1, kb1 = (set(catalog_split(ids, sorted(t), c, 1.0, 0.7)) & pool for c, t in ((a, ta), (b, tb)))
        common_j.append(jaccard(ka1, kb1))
    assert abs(np.mean(common_j) - 0.7 * 0.7 / (2 * 0.7 - 0.49)) < 0.03


def test_catalog_split_tripwire_fires_on_the_published_bug(base):
    """Invariant 13 / field log 2026-07-28: a catalog whose target floor comes from another goal
    order than the one served (the published pre-shuffle order) loses served targets, and the
    variant engine refuses to build; the catalog from the served order builds and keeps every
    served goal winnable."""
    good = variant("catalog_split", 11, base)
    assert make_env("shop", variant=good.to_dict(), **SHOP).num_tasks == base.num_tasks
    served = list(good.tasks)
    other_order = list(range(base.num_tasks))
    np.random.RandomState(0).shuffle(other_order)  # the unshuffled/other order
    wrong_targets = [base.target_ids()[other_order[t]] for t in served]
    keep = catalog_split(base.product_ids(), wrong_targets, 11, 1.0, 0.7)
    lost = sum(base.target_ids()[t] not in keep for t in served)
    assert lost > 0
    bad = EnvVariant(**{**good.__dict__, "engine": (("catalog_keep", keep), ("protected_tasks", tuple(served)))})
    with pytest.raises(ValueError, match=f"refusing to serve: {lost} of {len(served)} protected tasks lost"):
        make_env("shop", variant=bad.to_dict(), **SHOP)


def test_expert_wins_every_training_goal_of_every_client_under_every_variant():
    """The must-show (catalog_split env_div = 1.0, 100 clients) and the same sweep for every shop
    variant at its largest published pool: the expert, who ignores lookalikes and pages past
    wrappers, ends every one of each client's 100 training goals with reward 1.0."""
    for name, knobs in KNOBS.items():
        realized = realized_env_heterogeneity(tiny(name, **knobs), queries=20)
        for label, pooled in realized["expert"].items():
            assert pooled["success"] == 1.0 and pooled["clients_below_1"] == 0, (name, label, pooled)
        assert sum(p["clients"] for p in realized["expert"].values()) == 100, name
        assert sum(p["episodes"] for p in realized["expert"].values()) == 100 * 100, name


# --------------------------------------------------------------------------- lookalikes


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_lookalike_loses_the_term_it_attacks(attack):
    """Issue #19 (c): for EVERY lookalike, every goal of its original and EVERY choice of its
    options, the purchase scores < 1 with the attacked term lost (price: price_ok False; colour
    and size: the goal's value of that option never matched), and the bound the guard uses holds."""
    env = make_env("shop", **SHOP, lookalike=attack)
    of = env.lookalike_of()
    assert len(of) >= 40
    goals_of: dict[str, list] = {}
    for t in range(env.num_tasks):
        goals_of.setdefault(env.goal(t).asin, []).append(env.goal(t))
    checked = 0
    for fake_id, original_id in of.items():
        fake, original = env.product(fake_id), env.product(original_id)
        assert (fake.title, fake.description, fake.bullets, fake.attributes) == (
            original.title,
            original.description,
            original.bullets,
            original.attributes,
        )
        names = attacked_options(original, attack)
        for goal in goals_of[original_id]:
            bound = reward_upper_bound(fake, goal).total
            for combo in itertools.product(*fake.options.values()):
                chosen = dict(zip(fake.options, combo))
                r = purchase_reward(fake, goal, chosen)
                assert r.total < 1.0 and r.total <= bound + 1e-12
                if attack in ("price", "price_color"):
                    assert not r.price_ok
                for name in names:
                    assert option_matches(list(chosen.values()), [goal.goal_options[name]]) == 0
                checked += 1
    assert checked > 100


def test_lookalike_guard_refuses_what_is_no_trap():
    """The loader guard (field log 2026-07-28 `load_products`, our analogues): it can fire."""
    world = build_world(WorldSpec(num_products=150, num_goals=1000, seed=0))
    products, goals = list(world.products), list(world.goals)
    fakes, origin = make_lookalikes(products, goals, "color")
    check_lookalikes(products, goals, fakes, origin, "color")
    src = products[world.position[origin[fakes[0].asin]]]
    cases = {
        "keep the attacked term": replace(fakes[0], options=src.options),  # the published fallback
        "collide": replace(fakes[0], asin=products[1].asin),
        "copies no catalog product": replace(fakes[0], asin="B0NOTAREAL"),
    }
    for message, bad in cases.items():
        bad_origin = {**origin, bad.asin: origin[fakes[0].asin]} if message != "copies no catalog product" else origin
        with pytest.raises(LookalikeError, match=message):
            check_lookalikes(products, goals, [bad, *fakes[1:]], bad_origin, "color")
    price_fakes, price_origin = make_lookalikes(products, goals, "price")
    original = products[world.position[price_origin[price_fakes[0].asin]]]
    cheap = replace(price_fakes[0], price=original.price, pricing=original.pricing)  # under the ceiling
    with pytest.raises(LookalikeError, match="keep the attacked term"):
        check_lookalikes(products, goals, [cheap], price_origin, "price")


def test_lookalikes_never_change_or_become_goals(tmp_path):
    """The goal list and its order are the same with every attack (synthetic goals, and real
    WebShop files with synthetic and human goals), and no goal targets a lookalike."""
    _write_webshop_dir(tmp_path)
    for params in (
        SHOP,
        dict(data_dir=str(tmp_path), val_size=0),
        dict(data_dir=str(tmp_path), val_size=0, human_goals=True),
    ):
        plain = make_env("shop", **params)
        for attack in ATTACKS:
            env = make_env("shop", **params, lookalike=attack)
            assert env.task_ids() == plain.task_ids()
            assert not set(env.target_ids()) & set(env.lookalike_of())
            assert all(fake not in plain.product_ids() for fake in env.lookalike_of())


# --------------------------------------------------------------------------- rank wrappers


def test_rank_wrappers_order_as_specified(base):
    """§3.5 as the published wrappers behave with a 200-hit pool: inverted shows the whole
    returned list reversed (page 1 = the least relevant hits), shuffled permutes the whole list
    (items from beyond the first 50 reach page 1), partial_random answers about half of the
    searches with n random shown products, a fresh coin per search of an episode."""
    params = {**SHOP, "search_return_n": 200}
    plain = make_env("shop", **params)
    query = max((plain.expert_query(t) for t in range(64, 164)), key=lambda q: len(plain.search_ids(q)))
    scored = plain.search_ids(query)
    assert len(scored) > 60
    inverted = make_env("shop", **params, ranking="inverted_topk", rank_seed=44)
    assert inverted.search_ids(query) == scored[::-1]
    shuffled = make_env("shop", **params, ranking="shuffled_topk", rank_seed=44)
    got = shuffled.search_ids(query)
    assert sorted(got) == sorted(scored) and set(got[:10]) & set(scored[50:])
    assert (
        got
        == shuffled.search_ids(query)
        != make_env("shop", **params, ranking="shuffled_topk", rank_seed=45).search_ids(query)
    )
    partial = make_env("shop", **params, ranking="partial_random", rank_seed=44)
    first = [partial.search_ids(plain.expert_query(t), task=t) for t in range(64, 464)]
    replaced = [r != plain.search_ids(plain.expert_query(t)) for t, r in zip(range(64, 464), first)]
    assert 0.42 < np.mean(replaced) < 0.58
    assert all(len(r) == min(200, 150) for r, rep in zip(first, replaced) if rep)
    t = 64 + replaced.index(True)
    retries = [partial.search_ids(query, task=t, search_no=k) for k in range(1, 9)]
    assert retries[0] == partial.search_ids(query, task=t, search_no=1)  # reproducible
    assert any(r == plain.search_ids(query) for r in retries)  # a retry can get BM25


def test_search_agreement_measures_variant_disagreement(base):
    same = search_agreement([base.search_ids, base.search_ids], [("shampoo", 100), ("lipstick red", 101)])
    assert same == {"jaccard@10": 1.0, "top1_disagreement": 0.0, "pairs": 2}
    inverted = make_env("shop", **SHOP, ranking="inverted_topk")
    other = search_agreement([base.search_ids, inverted.search_ids], [(base.expert_query(t), t) for t in range(64, 84)])
    assert other["top1_disagreement"] > 0.9 and other["jaccard@10"] < 0.5


# --------------------------------------------------------------------------- validation


def test_validation_engine_is_untouched_by_variants(base):
    """Validation runs on the unperturbed engine: every variant serves the same task order (same
    fingerprint as the uniform engine) and building variants changes nothing the unperturbed
    engine shows."""

    def shown(env) -> tuple:
        return task_order_fingerprint(env), env.product_ids(), [env.search_ids(env.expert_query(t)) for t in range(64)]

    before = shown(base)
    for name in KNOBS:
        for c in (0, 1, 2, 3, 5):
            engine = make_env("shop", variant=variant(name, c, base).to_dict(), **SHOP)
            assert task_order_fingerprint(engine) == before[0], name
    assert shown(make_env("shop", **SHOP)) == before


# --------------------------------------------------------------------------- ALFWorld env_disjoint


def _alf_ids(specs: dict[str, int], trials: int = 1) -> list[str]:
    """Synthetic ALFWorld task ids: each spec in `specs[spec]` scenes, `trials` trials each."""
    return [f"train/{spec}-{100 + k}/trial_{j}" for spec, n in specs.items() for k in range(n) for j in range(trials)]


def test_env_disjoint_splits_scenes_per_spec():
    ids = _alf_ids(
        {"pick_and_place_simple-Apple-None-Fridge": 10, "pick_heat_then_place_in_recep-Egg-None-Plate": 1}, trials=2
    )
    train = range(len(ids))

    def scenes(tasks) -> set[str]:
        return {ids[t].split("/")[1] for t in tasks}

    at0 = [env_disjoint(ids, train, c, 5, 0.0) for c in range(5)]
    assert all(a == at0[0] for a in at0) and len(scenes(at0[0])) == 2  # ceil(10/5 * 1) scenes, shared
    at1 = [env_disjoint(ids, train, c, 5, 1.0) for c in range(5)]
    assert all(len(scenes(a)) == 4 for a in at1) and len({frozenset(a) for a in at1}) > 1  # ceil(10/5 * 2)
    single = {t for t in train if "Egg" in ids[t]}
    assert not single & set(at1[0])  # skip (published default)
    assert single <= set(env_disjoint(ids, train, 0, 5, 1.0, fallback="shared"))
    trial_only = [set(env_disjoint(ids, train, c, 5, 1.0, fallback="trial-only")) & single for c in range(5)]
    assert all(len(t) == 1 for t in trial_only)  # one of its 2 trials each
    held = _alf_ids({"pick_and_place_simple-Apple-None-Fridge": 1}) + [
        "train/pick_and_place_simple-Apple-None-Fridge-15/t"
    ]  # scene 15 is held out
    assert env_disjoint(held, range(2), 0, 1, 1.0, holdout=True) == ()
    assert env_disjoint(held, range(2), 0, 1, 1.0) == (0, 1)


def test_env_disjoint_engine_serves_only_its_games(alf_cache):  # noqa: F811
    params = small_params(alf_cache)
    plain = make_env("alfworld", **params)
    part = {"name": "env_disjoint", "env_div": 1.0, "fallback": "shared"}
    v = client_variant(part, "alfworld", 3, 10, [], engine_facts(plain), plain.val_size)
    assert v.tasks and all(t >= plain.val_size for t in v.tasks)
    engine = make_env("alfworld", variant=v.to_dict(), **params)
    assert task_order_fingerprint(engine) == task_order_fingerprint(plain)
    engine.reset(v.tasks[0])
    other = next(t for t in range(plain.num_tasks) if t not in v.tasks)
    with pytest.raises(ValueError, match="not one of this engine's only_tasks"):
        engine.reset(other)
    with pytest.raises(ValueError, match="only_tasks must name training games"):
        make_env("alfworld", **params, only_tasks=[plain.task_ids()[0]])  # a validation game
    with pytest.raises(ValueError, match="no training game"):
        client_variant({**part, "fallback": "skip"}, "alfworld", 3, 10, [], engine_facts(plain), plain.val_size)
