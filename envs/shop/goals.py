"""Synthetic goals, drawn from products the way WebShop's synthetic goals are.

A goal names a target product's type and some of its attributes, one value for every option
the target offers, and (usually) a price ceiling picked from the $10 grid above the target's
price. The pool order is a pure function of the seed: one local `random.Random`, no global
RNG, so instances built concurrently serve identical task orders.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from envs.shop import vocab
from envs.shop.schema import Goal, Product

PRICE_GRID = tuple(10.0 * i for i in range(1, 100))  # WebShop's PRICE_RANGE
NO_CEILING = 1_000_000.0


def price_ceiling(price: float, rng: random.Random) -> float:
    """WebShop's rule: the larger of two draws among the 4 grid prices above `price`."""
    above = [p for p in PRICE_GRID if p > price][:4]
    if len(above) < 2:
        return NO_CEILING
    return max(rng.sample(above, 2))


def price_clause(ceiling: float) -> str:
    return "" if ceiling >= NO_CEILING else f", and price lower than {ceiling:.2f} dollars"


def options_clause(goal_options: dict[str, str]) -> str:
    """WebShop's option text: " with size: m, and color: red"."""
    if not goal_options:
        return ""
    return " with " + ", and ".join(f"{k}: {v}" for k, v in goal_options.items())


def _describe(noun: str, attributes: Sequence[str]) -> str:
    """ "a sulfate free, vegan shampoo for dry hair" from the noun and attribute phrases."""
    trailing = [a for a in attributes if a.startswith(("for ", "with "))]
    leading = ", ".join(a for a in attributes if a not in trailing)
    head = f"{leading} {noun}" if leading else noun
    article = "an" if head[0] in "aeiou" else "a"
    return " ".join([article, head, *trailing])


def synthesize_goals(products: Sequence[Product], num_goals: int, seed: int) -> list[Goal]:
    """`num_goals` goals in served order. Targets cycle through seeded permutations of the
    catalog so every product is a target about equally often."""
    if num_goals < 1:
        raise ValueError(f"num_goals must be >= 1, got {num_goals}")
    rng = random.Random(f"shop-goals/{seed}")
    goals: list[Goal] = []
    order: list[int] = []
    while len(goals) < num_goals:
        if not order:
            order = list(range(len(products)))
            rng.shuffle(order)
        target = products[order.pop()]
        k = rng.randint(1, min(3, len(target.attributes))) if target.attributes else 0
        picked = set(rng.sample(range(len(target.attributes)), k))
        attributes = tuple(a for j, a in enumerate(target.attributes) if j in picked)
        goal_options = {name: rng.choice(values) for name, values in target.options.items()}
        ceiling = price_ceiling(target.price, rng)
        opener = rng.choice(vocab.OPENERS)
        text = f"{opener} {_describe(target.query, attributes)}{options_clause(goal_options)}{price_clause(ceiling)}"
        goals.append(Goal.for_target(target, text, attributes, goal_options, ceiling))
    return goals
