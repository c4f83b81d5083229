"""Observation rendering is part of the recipe (invariant 17): locked byte for byte.

The fixtures were generated once from the tiny default shop (configs/tiny-shop-grpo.yaml) with
SHOP_WRITE_FIXTURES=1 and are committed; a diff here means the policy's input changed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from envs.base import task_order_fingerprint
from envs.shop import pages
from envs.shop.env import ShopEnv

FIXTURES = Path(__file__).parents[1] / "fixtures"
TINY = dict(num_products=300, num_goals=1000, val_size=64, search_return_n=50, seed=0)
WRITE = os.environ.get("SHOP_WRITE_FIXTURES") == "1"


def _scripted_actions(env: ShopEnv, task: int) -> list[str]:
    """The episode the fixture records: a natural search, paging both ways, an invalid
    action, a detail tab, then the oracle to the purchase."""
    env.reset(task)
    query = env.goal(task).instruction.split(", and price")[0]
    script = [f"search[{query}]", "click[next >]", "click[< prev]", "click[no such button]"]
    for action in script:
        env.step(action)
    actions = list(script)
    while True:
        action = env.expert_action()
        if env.raw_observation.split(pages.SEP)[-1] == pages.BUY_NOW and "click[features]" not in actions:
            action = "click[features]"
        actions.append(action)
        if env.step(action)[2]:
            return actions


def _transcript(env: ShopEnv, task: int, actions: list[str]) -> str:
    obs, info = env.reset(task)
    lines = [
        f"RESET\t{task}",
        f"RAW\t{env.raw_observation}",
        f"OBS\t{obs}",
        f"VALID\t{json.dumps(info['valid_actions'])}",
    ]
    for action in actions:
        obs, reward, done, info = env.step(action)
        lines += [
            f"ACTION\t{action}",
            f"RAW\t{env.raw_observation}",
            f"OBS\t{obs}",
            f"VALID\t{json.dumps(info['valid_actions'])}",
            f"STEP\treward={reward!r} done={done} valid_action={info['valid_action']} won={info['won']}",
        ]
    return "\n".join(lines) + "\n"


def _catalog_snapshot(env: ShopEnv) -> str:
    world = env._world
    lines = [f"FINGERPRINT\t{task_order_fingerprint(env)}"]
    lines += [f"PRODUCT\t{json.dumps(asdict(p), sort_keys=True)}" for p in world.products[:3]]
    lines += [f"GOAL\t{json.dumps(asdict(g), sort_keys=True)}" for g in world.goals[:5]]
    return "\n".join(lines) + "\n"


def _check(name: str, text: str) -> None:
    path = FIXTURES / name
    if WRITE:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(text.encode())
    assert path.read_bytes() == text.encode(), f"{name} changed; see the diff above"


@pytest.mark.parametrize("task", [5, 64])
def test_observation_rendering_bytes(task):
    env = ShopEnv(**TINY)
    name = f"shop_episode_task{task}.txt"
    if WRITE:
        actions = _scripted_actions(env, task)
    else:
        actions = [
            line.split("\t", 1)[1] for line in (FIXTURES / name).read_text().splitlines() if line.startswith("ACTION\t")
        ]
    _check(name, _transcript(env, task, actions))


def test_catalog_and_goal_order_bytes():
    _check("shop_catalog_seed0.txt", _catalog_snapshot(ShopEnv(**TINY)))


def test_fixture_episode_covers_every_page_kind():
    text = (FIXTURES / "shop_episode_task5.txt").read_text()
    for marker in (
        "'Search'",
        "'Next >'",
        "'< Prev'",
        "'Buy Now'",
        "'Thank you for shopping",
        "valid_action=False",
        "won=True",
    ):
        assert marker in text, marker


def test_search_page_formats_to_quoted_search():
    env = ShopEnv(**TINY)
    obs, info = env.reset(0)
    assert obs == "'Search'"
    assert env.raw_observation == f"WebShop [SEP] Instruction: [SEP] {info['instruction']} [SEP] Search"


def test_format_observation_drops_prefix_and_quotes_every_part():
    raw = "WebShop [SEP] Instruction: [SEP] buy a hat [SEP] Back to Search [SEP] B0X [SEP] A Hat [SEP] $1.99"
    assert pages.format_observation(raw, "buy a hat") == "'Back to Search', 'B0X', 'A Hat', '$1.99'"


def test_format_observation_falls_back_to_raw_without_instruction():
    raw = "WebShop [SEP] Instruction: [SEP] buy a hat [SEP] Search"
    assert pages.format_observation(raw, "buy a scarf") == raw


def test_format_observation_retries_with_stripped_segments():
    raw = "WebShop [SEP] Instruction: [SEP]  buy a hat  [SEP] Search"
    assert pages.format_observation(raw, "buy a hat ") == "'Search'"


def test_results_page_lists_asin_title_price_only():
    env = ShopEnv(**TINY)
    env.reset(3)
    obs, _, _, info = env.step(env.expert_action())
    raw_parts = env.raw_observation.split(pages.SEP)
    page = raw_parts[raw_parts.index("Back to Search") :]
    hits = [p for p in page if p.startswith("B0") and p.upper() == p]
    assert 1 <= len(hits) <= pages.PAGE_SIZE
    for asin in hits:
        product = env.product(asin)
        at = page.index(asin)
        assert page[at + 1 : at + 3] == [product.title, product.price_tag]
