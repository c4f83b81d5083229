"""Lookalike products: copies of goal targets that attack one reward term (FedAgent Variant 4).

A lookalike shares its original's title, text, category, query and attributes, so search and
the type/attribute terms cannot tell them apart; it differs in what the attack changes:

  price         its price is above every goal ceiling of its original (the price term flips)
  color         its colour values are decoys no goal colour matches (an option term flips)
  size          its size values are decoys no goal size matches (an option term flips)
  price_color   both

Built like the goals are: from the goal targets of the world, in catalog order, one per target
the attack can flip, as a pure function of the catalog, the goals and the attack (keyed hashes,
no RNG stream), so every client with the same attack sees the same products. They join the
catalog after the goals are drawn (each next to its original: `place_lookalikes`) and never
become goals. `check_lookalikes` is the loader guard: a lookalike that could still earn 1.0 for
some goal of its original under ANY option choice, or that collides with a product or goal id,
refuses the build.

Deliberate differences from the published files (docs/env-heterogeneity.md): ids look like
every other product id (the published `LK_<TYPE>_<asin>` prefix is shown on the results page
and tells the agent which item is the trap); the price attack prices 1.1-1.5x above the highest
ceiling instead of $9999 (a tag no one would buy at); decoys never fall back to the original's
own values, never come from a value the fuzzy matcher equates with a goal value, and come from
the original's product type first (issue #19: 9 of 748 published-style lookalike purchases
scored 1.0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from envs.shop.reward import COLOR_SET, option_matches, reward_upper_bound
from envs.shop.schema import Goal, Product

ATTACKS = ("price", "color", "size", "price_color")
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


class LookalikeError(ValueError):
    """A lookalike would not be a trap (or collides with a real id): the build is refused."""


def _keyed(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(("lookalike", *parts)).encode()).digest()


def _unit(*parts: str) -> float:
    return int.from_bytes(_keyed(*parts)[:8], "big") / 2**64


def _is_color(name: str) -> bool:
    return "color" in name or "colour" in name


def _is_size(name: str) -> bool:
    return "size" in name


def attacked_options(product: Product, attack: str) -> list[str]:
    """The option names of `product` the attack replaces (empty for the price attack)."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown lookalike attack {attack!r}; choose from {ATTACKS}")
    wants = _is_size if attack == "size" else _is_color
    return [] if attack == "price" else [n for n in product.options if wants(n)]


def _matches_any(value: str, others: Sequence[str]) -> bool:
    return any(option_matches([value], [o]) for o in others)


def _decoys(
    src: Product, name: str, pools: dict[tuple[str, str], list[str]], by_name: dict[str, list[str]], attack: str
) -> tuple[str, ...]:
    """As many decoy values as the original offers under `name`, never one the matcher equates
    with a value the original offers: from its product type's values first, then the option
    name's values anywhere, then (colours) WebShop's colour words; a keyed pick within a tier."""
    own = src.options[name]
    tiers = [pools.get((src.query, name), []), by_name.get(name, []), list(COLOR_SET) if _is_color(name) else []]
    shown = list(dict.fromkeys(v for tier in tiers for v in tier))  # display order
    chosen: list[str] = []
    for tier in tiers:
        fresh = [v for v in dict.fromkeys(tier) if v not in chosen and not _matches_any(v, own)]
        fresh.sort(key=lambda v: _keyed(attack, src.asin, name, v))
        chosen += fresh[: len(own) - len(chosen)]
    return tuple(sorted(chosen, key=shown.index))


def _asin(src: Product, attack: str, taken: set[str]) -> str:
    for k in range(1000):
        digest = int.from_bytes(_keyed(attack, src.asin, str(k)), "big")
        code = "".join(_ALNUM[(digest >> (6 * i)) % len(_ALNUM)] for i in range(8))
        if f"B0{code}" not in taken:
            return f"B0{code}"
    raise LookalikeError(f"no free id for the {attack} lookalike of {src.asin}")


def make_lookalikes(
    products: Sequence[Product], goals: Sequence[Goal], attack: str
) -> tuple[list[Product], dict[str, str]]:
    """The lookalikes of `attack` and a map lookalike id -> original id.

    Targets the attack cannot flip for every one of their goals are skipped: no finite price
    ceiling (price attacks), no colour/size option or no decoy left (option attacks), or an
    untouched option value that matches the attacked goal value.
    """
    if attack not in ATTACKS:
        raise ValueError(f"unknown lookalike attack {attack!r}; choose from {ATTACKS}")
    goals_of = _goals_by_target(goals)
    pools: dict[tuple[str, str], list[str]] = {}
    by_name: dict[str, list[str]] = {}
    for p in products:
        for name, values in p.options.items():
            for bucket in (pools.setdefault((p.query, name), []), by_name.setdefault(name, [])):
                bucket.extend(v for v in values if v not in bucket)
    taken = {p.asin for p in products}
    out: list[Product] = []
    origin: dict[str, str] = {}
    for src in products:
        if src.asin not in goals_of:
            continue
        changes: dict = {}
        if attack in ("price", "price_color"):
            top = max(g.price_upper for g in goals_of[src.asin])
            price = round(top * (1.1 + 0.4 * _unit(attack, src.asin, "price")), 2)
            changes.update(price=price, pricing=(price,))
        if attack != "price":
            names = attacked_options(src, attack)
            options = dict(src.options)
            for name in names:
                options[name] = _decoys(src, name, pools, by_name, attack)
            changes["options"] = options
        fake = replace(src, asin=_asin(src, attack, taken), **changes)
        if _failures(fake, src, goals_of[src.asin], attack):
            continue
        taken.add(fake.asin)
        out.append(fake)
        origin[fake.asin] = src.asin
    return out, origin


def place_lookalikes(
    products: Sequence[Product], lookalikes: Sequence[Product], origin: dict[str, str], attack: str
) -> list[Product]:
    """The catalog with each lookalike next to its original, before or after it by a keyed coin.

    Search breaks score ties by catalog position, and a price lookalike ties its original
    exactly: appended last, it would always rank right below the real item, a tell a policy
    could learn instead of reading prices and options.
    """
    before: dict[str, list[Product]] = {}
    after: dict[str, list[Product]] = {}
    for fake in lookalikes:
        side = before if _keyed(attack, fake.asin, "side")[0] & 1 else after
        side.setdefault(origin[fake.asin], []).append(fake)
    return [q for p in products for q in (*before.get(p.asin, ()), p, *after.get(p.asin, ()))]


def _goals_by_target(goals: Sequence[Goal]) -> dict[str, list[Goal]]:
    goals_of: dict[str, list[Goal]] = {}
    for g in goals:
        goals_of.setdefault(g.asin, []).append(g)
    return goals_of


def _failures(fake: Product, src: Product, goals: Sequence[Goal], attack: str) -> list[str]:
    """The goals of `src` for which buying `fake` keeps the attacked term or can earn 1.0 under
    some option choice (an empty list: the lookalike is a trap for every goal)."""
    names = attacked_options(src, attack)
    if attack != "price" and (not names or not all(fake.options.get(n) for n in names)):
        return [f"{src.asin} has no option the {attack} attack can replace with decoys"]
    offered = [v for values in fake.options.values() for v in values]
    bad = []
    for g in goals:
        best = reward_upper_bound(fake, g)
        keeps_price = attack in ("price", "price_color") and best.price_ok
        keeps_option = any(n in g.goal_options and _matches_any(g.goal_options[n], offered) for n in names)
        if best.total >= 1.0 or keeps_price or keeps_option:
            bad.append(f"{fake.asin} (copy of {src.asin}) for goal {g.instruction[:60]!r}")
    return bad


def check_lookalikes(
    products: Sequence[Product],
    goals: Sequence[Goal],
    lookalikes: Sequence[Product],
    origin: dict[str, str],
    attack: str,
) -> None:
    """The loader guard: raise `LookalikeError` unless every lookalike is a fresh id that is no
    goal's target and copies a catalog product, and buying it instead of its original loses the
    attacked term, hence the full reward, for every goal of the original under every option
    choice."""
    ids = {p.asin for p in products}
    fakes = [p.asin for p in lookalikes]
    if len(set(fakes)) != len(fakes) or ids & set(fakes):
        raise LookalikeError(f"{attack} lookalike ids collide with each other or with catalog ids")
    if {g.asin for g in goals} & set(fakes):
        raise LookalikeError(f"a {attack} lookalike is the target of a goal; lookalikes never become goals")
    goals_of = _goals_by_target(goals)
    by_id = {p.asin: p for p in products}
    bad = []
    for fake in lookalikes:
        src = by_id.get(origin.get(fake.asin, ""))
        if src is None:
            raise LookalikeError(f"lookalike {fake.asin} copies no catalog product")
        bad += _failures(fake, src, goals_of.get(src.asin, ()), attack)
    if bad:
        raise LookalikeError(
            f"{len(bad)} {attack} lookalike purchase(s) would keep the attacked term or earn 1.0, e.g. {bad[:3]}"
        )
