"""Shop reward (invariant 18): the oracle purchase scores exactly 1.0 for every goal, option
matching compares values with values, normalisers refuse non-str input, and partial
purchases lose exactly the terms they should."""

from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest

from envs.shop import vocab
from envs.shop.env import ShopEnv
from envs.shop.reward import (
    COLOR_SET,
    _lcs_len,
    normalize_color,
    normalize_text,
    option_matches,
    purchase_reward,
    ratio,
    reward_upper_bound,
    title_nouns,
    token_set_ratio,
    type_reward,
)
from envs.shop.schema import Goal, Product

TINY = dict(num_products=300, num_goals=1000, val_size=64, search_return_n=50, seed=0)


def _product(asin: str, title: str, category: str, query: str, product_category: str, **rest) -> Product:
    """A hand-made product; what a test does not name is empty, one price of 1.0."""
    empty = dict(attributes=(), bullets=(), description="", options={}, pricing=(1.0,), price=1.0)
    return Product(asin, title, category, query, product_category, **{**empty, **rest})


def _goal(name: str, query: str, product_category: str, **rest) -> Goal:
    """A hand-made goal for product B0 with no instruction or attributes unless a test names them."""
    fields = {"asin": "B0", "instruction": "", "attributes": ()} | rest
    return Goal(**fields, query=query, name=name, product_category=product_category)


def sweep_oracle(env: ShopEnv) -> tuple[list[int], list[float]]:
    """Play the oracle on every task; returns (failed tasks, steps per episode)."""
    failed, steps = [], []
    for task in range(env.num_tasks):
        env.reset(task)
        for n in range(1, 31):  # noqa: B007 (n, the steps taken, is read after the loop)
            _, reward, done, info = env.step(env.expert_action())
            if done:
                break
        steps.append(n)
        if not (done and reward == 1.0 and info["won"]):
            failed.append(task)
    return failed, steps


@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_scores_exactly_one_for_every_goal(seed):
    env = ShopEnv(**{**TINY, "seed": seed})
    failed, steps = sweep_oracle(env)
    assert failed == []
    assert 3 <= sum(steps) / len(steps) <= 6  # search, open, options, buy


def test_oracle_falls_back_when_the_instruction_query_misses():
    """With one hit per search the instruction rarely retrieves the target; the oracle's
    title fallback must still win every goal."""
    env = ShopEnv(**{**TINY, "search_return_n": 1})
    fallbacks = sum(not env.expert_query(t).startswith(env.goal(t).instruction[:12]) for t in range(env.num_tasks))
    assert fallbacks > 100
    assert sweep_oracle(env)[0] == []


def test_oracle_purchase_scores_one_by_the_reward_function_alone():
    """The same check without the page machinery: target, goal options, its own price."""
    env = ShopEnv(**TINY)
    for task in range(env.num_tasks):
        goal = env.goal(task)
        target = env.product(goal.asin)
        result = purchase_reward(target, goal, dict(goal.goal_options))
        assert result.total == 1.0 and result.won, (task, result)
        assert target.price <= goal.price_upper


@pytest.mark.parametrize("bad", [("color", "red"), None, 3, ["red"], b"red"])
def test_normalisers_raise_on_non_str(bad):
    with pytest.raises(TypeError):
        normalize_color(bad)
    with pytest.raises(TypeError):
        normalize_text(bad)
    with pytest.raises(TypeError):
        option_matches([bad], ["red"])
    with pytest.raises(TypeError):
        option_matches(["red"], [bad])


def test_option_matching_compares_values_to_values():
    """Field log 2026-07-25: clicked values vs (name, value) goal pairs scored perfect plays
    as misses whenever colour normalisation rewrote the clicked side only."""
    product = _product(
        "B0TEST0001",
        "Walker Boots",
        "fashion",
        "boots",
        "Clothing › Boots › Women",
        attributes=("rubber sole",),
        options={"color": ("r.brown2060", "fashion black girl01"), "size": ("6.5", "7")},
        pricing=(33.99,),
        price=33.99,
    )
    for color in product.options["color"]:
        goal = _goal(
            product.title,
            "boots",
            product.product_category,
            asin=product.asin,
            instruction="x",
            attributes=("rubber sole",),
            goal_options={"color": color, "size": "6.5"},
            price_upper=70.0,
        )
        result = purchase_reward(product, goal, {"color": color, "size": "6.5"})
        assert (result.option_hits, result.total) == (2, 1.0), color
    assert normalize_color("r.brown2060") == "brown"  # both sides are rewritten alike
    assert option_matches(["r.brown2060"], ["r.brown2060"]) == 1


def test_wrong_option_values_never_match():
    """Within every synthetic option pool, clicking a different value is a miss."""
    for types in vocab.CATEGORIES.values():
        for pt in types:
            values = [v for _, pool in pt.options for v in pool]
            assert len(set(values)) == len(values), pt.noun  # a click names one option
            for _, pool in pt.options:
                for have, want in itertools.permutations(pool, 2):
                    assert option_matches([have], [want]) == 0, (pt.noun, have, want)
            assert len(pt.attributes) >= 8, pt.noun


def _goal_for(env: ShopEnv) -> tuple[Goal, Product]:
    task = next(t for t in range(env.num_tasks) if len(env.goal(t).goal_options) == 2 and env.goal(t).price_upper < 1e6)
    goal = env.goal(task)
    return goal, env.product(goal.asin)


def test_partial_purchases_lose_exactly_their_terms():
    env = ShopEnv(**TINY)
    goal, target = _goal_for(env)
    denom = len(goal.attributes) + 2 + 1
    one_option = dict(list(goal.goal_options.items())[:1])
    assert purchase_reward(target, goal, one_option).total == pytest.approx((denom - 1) / denom)
    assert purchase_reward(target, goal, {}).total == pytest.approx((denom - 2) / denom)
    pricey = replace(target, price=goal.price_upper + 0.01)
    result = purchase_reward(pricey, goal, goal.goal_options)
    assert not result.price_ok and result.total == pytest.approx((denom - 1) / denom)
    assert (
        purchase_reward(replace(target, price=goal.price_upper), goal, goal.goal_options).total == 1.0
    )  # ceiling is inclusive


def test_wrong_product_type_is_scaled_down():
    env = ShopEnv(**TINY)
    goal, target = _goal_for(env)
    other_category = next(p for p in env._world.products if p.category != target.category)
    assert type_reward(target, goal) == 1.0
    assert type_reward(other_category, goal) < 1.0
    unrelated = replace(other_category, title="Zzz Qqq")
    assert type_reward(unrelated, goal) == 0.0
    same_type = next(p for p in env._world.products if p.query == target.query and p.asin != target.asin)
    assert type_reward(same_type, goal) == 1.0  # query match keeps r_type


def test_type_reward_levels_follow_webshop_rules():
    base = _product("B0", "Lumo Argan Shampoo Bottle", "beauty", "shampoo", "A › B › C")
    goal = _goal("Lumo Argan Shampoo Bottle Pump", "shampoo", "A › B › C")
    other = dict(query="lamp", product_category="X › Y › Z")
    assert type_reward(replace(base, **other, title="Lumo Argan Shampoo Bottle"), goal) == 1.0
    assert type_reward(replace(base, **other, title="Zed Shampoo Wand"), goal) == 0.5  # 1/5
    assert type_reward(replace(base, title="Zed Shampoo Wand"), goal) == 1.0  # query match
    assert type_reward(replace(base, **other, title="Zed Wand Light"), goal) == 0.0
    long_goal = replace(
        goal,
        name="one two three four five six seven eight nine ten eleven "
        "twelve thirteen fourteen fifteen sixteen seventeen eighteen "
        "nineteen twenty shampoo",
    )
    assert type_reward(replace(base, **other, title="Shampoo"), long_goal) == 0.1
    assert title_nouns("Sulfate Free Shampoo for the Dry Hair") == {"sulfate", "free", "shampoo", "dry", "hair"}


def test_colour_vocabulary_is_webshops_102_words():
    """Issue #19 (a): WebShop's whole colour list, in its order. With the 63-word list both
    "dark grey" and "light grey" read as "grey" and matched; in WebShop "dark grey" reads as
    "dark" (the first contained word alphabetically) and does not."""
    assert len(COLOR_SET) == len(set(COLOR_SET)) == 102 and list(COLOR_SET) == sorted(COLOR_SET)
    assert {"dark", "light", "natural", "steel", "camo"} <= set(COLOR_SET)
    assert normalize_color("dark grey") == "dark" and normalize_color("light grey") == "grey"
    assert option_matches(["dark grey"], ["light grey"]) == 0
    assert normalize_color("navy blue") == "blue" and option_matches(["navy blue"], ["royal blue"]) == 1


def test_title_noun_proxy_ignores_function_words_only():
    """Issue #19 (b): spaCy tags Title-Case adjectives in titles ("Free", "High") as proper
    nouns, so WebShop's title score counts them; the old list dropped them and scored a wrong
    product that shares them with the goal's title 0 where WebShop scores 1."""
    goal = _goal("Vexa Sulfate Free Shampoo", "shampoo", "Beauty › Hair Care › Shampoo")
    bars = _product(
        "B1", "Kalo Gluten Free Protein Bars", "grocery", "protein bars", "Grocery › Snacks › Nutrition Bars"
    )
    assert title_nouns(goal.name) & title_nouns(bars.title) == {"free"}
    assert type_reward(bars, goal) == 1.0  # 1/4 > 0.2, WebShop's rule
    assert title_nouns("High Speed Cable Set for the TV") == {"high", "speed", "cable", "set"}  # "tv": 2 letters
    assert not title_nouns("a an and or the of for with in on to by from at as is it this that these your our you")


def test_reward_upper_bound_bounds_every_option_choice():
    """`reward_upper_bound` (the lookalike guard's bound) is >= every purchase's reward and is
    reached by the target with the goal's own options."""
    env = ShopEnv(**TINY)
    for task in range(0, 1000, 37):
        goal = env.goal(task)
        for product in (env.product(goal.asin), env._world.products[task % 300]):
            bound = reward_upper_bound(product, goal)
            for combo in itertools.product(*product.options.values()):
                chosen = dict(zip(product.options, combo))
                assert purchase_reward(product, goal, chosen).total <= bound.total + 1e-12
        assert reward_upper_bound(env.product(goal.asin), goal).total == 1.0


def test_token_set_ratio_matches_hand_computed_values():
    assert token_set_ratio("Red", "red!") == 100
    assert token_set_ratio("x-small", "small") == 100  # subset: WebShop's leniency
    assert token_set_ratio("brown", "brown2060 color r") == ratio("brown", "brown2060 color r") == 45
    assert token_set_ratio("", "red") == 0
    rng = random.Random(0)
    for _ in range(300):  # bit-parallel LCS == DP LCS
        a = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 12)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
        assert _lcs_len(a, b) == table[-1][-1]


# -- real WebShop files -----------------------------------------------------------------------
def _write_webshop_dir(root: Path) -> None:
    """A 3-product directory in the published WebShop file formats."""
    items = [
        {
            "asin": "B000000001",
            "name": "Acme Gluten Free Vanilla Cake Mix",
            "category": "grocery",
            "query": "cake mix",
            "product_category": "Grocery › Baking › Cake Mix",
            "full_description": "Tasty cake mix.",
            "small_description": ["Gluten free", "Easy"],
            "pricing": "$12.99",
            "customization_options": {
                "Size": [{"value": "Pack of 2", "image": None}, {"value": "Pack of 6", "image": None}],
                "Flavor Name": [{"value": "Vanilla/Lemon", "image": None}, {"value": "Chocolate", "image": None}],
            },
            "reviews": [{"title": "ok", "score": 4, "body": "Nice mix"}],
        },
        {
            "asin": "B000000002",
            "name": "Acme Wool Socks",
            "category": "fashion",
            "query": "socks",
            "product_category": "Clothing › Socks › Men",
            "full_description": "Warm socks.",
            "small_description": "Merino wool",
            "pricing": "$8.00 - $15.00",
            "customization_options": None,
            "reviews": [],
        },
        {
            "asin": "B000000001",
            "name": "duplicate asin",
            "category": "x",
            "query": "x",
            "product_category": "x",
            "pricing": "",
        },
    ]
    ins = {
        "B000000001": {
            "attributes": ["gluten free", "vanilla"],
            "instruction": "i need a gluten free cake mix.",
            "instruction_attributes": ["gluten free"],
        },
        "B000000002": {"attributes": ["wool"]},
    }
    human = {
        "B000000001": [
            {
                "instruction": "gluten free vanilla cake mix, pack of 6",
                "instruction_attributes": ["gluten free"],
                "instruction_options": ["pack of 6"],
            },
            {"instruction": "no attributes", "instruction_attributes": [], "instruction_options": []},
        ]
    }
    (root / "items_shuffle_1000.json").write_text(json.dumps(items))
    (root / "items_ins_v2_1000.json").write_text(json.dumps(ins))
    (root / "items_human_ins.json").write_text(json.dumps(human))


def test_webshop_files_map_to_schema(tmp_path):
    _write_webshop_dir(tmp_path)
    env = ShopEnv(data_dir=str(tmp_path), num_goals=1000, val_size=1)
    cake, socks = env.product("B000000001"), env.product("B000000002")
    assert len(env.product_ids()) == 2  # duplicate asin dropped
    assert cake.options == {"size": ("pack of 2", "pack of 6"), "flavor name": ("vanilla | lemon", "chocolate")}
    assert cake.attributes == ("gluten free", "vanilla") and cake.reviews == ("Nice mix",)
    assert cake.bullets == ("Gluten free", "Easy") and socks.bullets == ("Merino wool",)
    assert socks.pricing == (8.0, 15.0) and 8.0 <= socks.price <= 15.0
    assert env.num_tasks == 4  # 2 sizes x 2 flavours
    assert all(
        g.asin == "B000000001" and g.instruction.startswith("i need a gluten free cake mix with ")
        for g in map(env.goal, range(4))
    )
    failed, _ = sweep_oracle(env)
    assert failed == []
    human = ShopEnv(data_dir=str(tmp_path), human_goals=True, val_size=0)
    assert human.num_tasks == 1  # the attribute-less one skipped
    assert human.goal(0).goal_options == {"size": "pack of 6"}
    assert sweep_oracle(human)[0] == []


def test_missing_webshop_files_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="items_shuffle"):
        ShopEnv(data_dir=str(tmp_path))


@pytest.mark.realdata
def test_real_webshop_data_oracle_sweep():
    """Point WEBSHOP_DATA at a directory with the real WebShop json files."""
    data = os.environ.get("WEBSHOP_DATA")
    if not data or not Path(data, "items_ins_v2_1000.json").exists() and not Path(data, "items_ins_v2.json").exists():
        pytest.skip("WEBSHOP_DATA does not point at WebShop data files")
    env = ShopEnv(data_dir=data, num_goals=10_000, val_size=500, search_return_n=50)
    assert env.num_tasks > 500
    failed, _ = sweep_oracle(env)
    assert len(failed) / env.num_tasks < 0.01, failed[:20]
