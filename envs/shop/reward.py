"""WebShop's purchase reward, without spaCy.

    r = r_type * (attribute hits + option hits + 1[price <= price_upper])
               / (n_goal_attributes + n_goal_options + 1)

Option matching compares purchased VALUES with goal VALUES (never (name, value) pairs), and
both sides pass through the same normalisers. The normalisers raise TypeError on anything but
`str`: the predecessor's engine compared values with tuples, `normalize_color` silently passed
the tuples through, and 6.8% of its goals could never score 1.0 (field log 2026-07-25).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from envs.shop.schema import CATEGORY_SEP, Goal, Product

# WebShop's colour vocabulary, all 102 words (web_agent_site/engine/normalize.py), in its
# alphabetical order: the first word contained in a value wins, so "navy blue" -> "blue", and
# "dark grey" -> "dark" but "light grey" -> "grey" (a mismatch, as in WebShop). Until 2026-12 the
# shop had 63 of them, so e.g. "dark grey" for "light grey" matched here and not in WebShop.
COLOR_SET = (
    "alabaster",
    "apricot",
    "aqua",
    "ash",
    "asphalt",
    "azure",
    "banana",
    "beige",
    "black",
    "blue",
    "blush",
    "bordeaux",
    "bronze",
    "brown",
    "burgundy",
    "camel",
    "camo",
    "caramel",
    "champagne",
    "charcoal",
    "cheetah",
    "chestnut",
    "chocolate",
    "christmas",
    "coffee",
    "cognac",
    "copper",
    "coral",
    "cranberry",
    "cream",
    "crystal",
    "dark",
    "denim",
    "eggplant",
    "elephant",
    "espresso",
    "fuchsia",
    "gold",
    "granite",
    "grape",
    "graphite",
    "grass",
    "gray",
    "green",
    "grey",
    "heather",
    "indigo",
    "ivory",
    "ivy",
    "khaki",
    "lavender",
    "lemon",
    "leopard",
    "light",
    "lilac",
    "lime",
    "magenta",
    "maroon",
    "mauve",
    "merlot",
    "midnight",
    "mint",
    "mocha",
    "multicolor",
    "mushroom",
    "mustard",
    "natural",
    "navy",
    "nude",
    "olive",
    "orange",
    "peach",
    "pewter",
    "pink",
    "plum",
    "purple",
    "rainbow",
    "red",
    "rose",
    "royal",
    "rust",
    "sand",
    "sapphire",
    "seashell",
    "silver",
    "skull",
    "slate",
    "steel",
    "stone",
    "stonewash",
    "sunflower",
    "tan",
    "taupe",
    "teal",
    "tiger",
    "turquoise",
    "violet",
    "walnut",
    "wheat",
    "white",
    "wine",
    "yellow",
)

MATCH_THRESHOLD = 85  # WebShop: fuzzy token-set ratio must exceed this


def _require_str(value: object, who: str) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"{who} expects str, got {type(value).__name__}: {value!r}; pass the option VALUE, not a (name, value) pair"
        )
    return value


def normalize_text(text: str) -> str:
    """Lower-case, non-alphanumerics to spaces, whitespace collapsed (fuzzywuzzy's processing)."""
    return " ".join(re.sub(r"\W", " ", _require_str(text, "normalize_text").lower()).split())


def normalize_color(value: str) -> str:
    """Map a value containing a known colour word to that word; other values pass unchanged."""
    value = _require_str(value, "normalize_color")
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def _lcs_len(a: str, b: str) -> int:
    """Longest common subsequence length, bit-parallel (one big-int op per char of b)."""
    if not a or not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def ratio(a: str, b: str) -> int:
    """Indel similarity in [0, 100], rounded like fuzzywuzzy; 0 when either side is empty."""
    if not a or not b:
        return 0
    return int(round(200.0 * _lcs_len(a, b) / (len(a) + len(b))))


def token_set_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's token_set_ratio: compare sorted shared tokens with each side's extras.

    Memoized (a pure function of two strings): every purchase compares goal attributes and
    options drawn from one small vocabulary, and the bit-parallel LCS was most of a buy's cost.
    """
    return _token_set_ratio(_require_str(a, "normalize_text"), _require_str(b, "normalize_text"))


@functools.lru_cache(maxsize=1 << 16)
def _token_set_ratio(a: str, b: str) -> int:
    ta, tb = set(normalize_text(a).split()), set(normalize_text(b).split())
    if not ta or not tb:
        return 0
    common = " ".join(sorted(ta & tb))
    with_a = (common + " " + " ".join(sorted(ta - tb))).strip()
    with_b = (common + " " + " ".join(sorted(tb - ta))).strip()
    return max(ratio(common, with_a), ratio(common, with_b), ratio(with_a, with_b))


def option_matches(purchased: list[str], wanted: list[str]) -> int:
    """How many wanted option values some purchased value matches (both lists of str)."""
    bought = [normalize_color(normalize_text(v)) for v in purchased]
    hits = 0
    for want in (normalize_color(normalize_text(v)) for v in wanted):
        if any(token_set_ratio(have, want) > MATCH_THRESHOLD for have in bought):
            hits += 1
    return hits


def attribute_matches(product: Product, goal_attributes: tuple[str, ...]) -> int:
    """Goal attributes the product has: fuzzy against its attributes, else a text substring."""
    text = " ".join((product.title, *product.bullets, product.description)).lower()
    hits = 0
    for want in goal_attributes:
        if any(token_set_ratio(have, want) > MATCH_THRESHOLD for have in product.attributes):
            hits += 1
        elif want.lower() in text:
            hits += 1
    return hits


# Words the title noun proxy ignores: function words only (articles, prepositions,
# conjunctions, pronouns, determiners, "is"). WebShop keeps spaCy's NOUN/PROPN tokens, and spaCy
# tags Title-Case adjectives in product titles ("Free", "High", "Lightweight", "Set") as proper
# nouns, so they count there. An earlier list here also dropped ~45 such adjectives and nouns:
# scoring 18,882 default-shop purchases with this reward and WebShop's get_reward (issue #19)
# agreed on 96.9%, and that list caused 585 of the disagreements (all wrong-product purchases);
# keeping only function words raised agreement to 99.5%, no target purchase changing. The
# remaining 0.5%: words spaCy tags as verbs or adjectives (e.g. "Built") still count as nouns
# here (docs/shop.md, "Reward").
_NOT_NOUNS = frozenset(
    """
a an and or the of for with in on to by from at as is it this that these your our you
""".split()
)


def title_nouns(title: str) -> frozenset[str]:
    """Noun proxy for a title: alphabetic tokens of 3+ letters that are not in `_NOT_NOUNS`."""
    return _title_nouns(_require_str(title, "title_nouns"))


@functools.lru_cache(maxsize=1 << 14)  # titles repeat: one per product and goal
def _title_nouns(title: str) -> frozenset[str]:
    return frozenset(t for t in re.findall(r"[a-z]+", title.lower()) if len(t) > 2 and t not in _NOT_NOUNS)


def type_reward(product: Product, goal: Goal) -> float:
    """WebShop's r_type in {0, 0.1, 0.5, 1}: query / category-path / title-noun agreement."""
    query_match = product.query == goal.query
    have = {p.strip() for p in product.product_category.split(CATEGORY_SEP)}
    want = {p.strip() for p in goal.product_category.split(CATEGORY_SEP)}
    category_match = len(have & want) >= 2
    wanted_nouns = title_nouns(goal.name)
    if wanted_nouns:
        title_score = len(title_nouns(product.title) & wanted_nouns) / len(wanted_nouns)
    else:
        title_score = 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


@dataclass(frozen=True)
class Reward:
    total: float
    r_type: float
    attribute_hits: int
    option_hits: int
    price_ok: bool

    @property
    def won(self) -> bool:
        return self.total == 1.0


def purchase_outcome(reward: Reward, goal: Goal) -> str:
    """How a purchase ended, by the first reward term it missed in the order a shopper checks:
    the kind of product (type and attributes), then the price, then the options. A purchase
    that misses none scores 1.0, so `wrong_options` is all that is left after the first three."""
    if reward.won:
        return "won"
    if reward.r_type < 1.0 or reward.attribute_hits < len(goal.attributes):
        return "wrong_product"
    if not reward.price_ok:
        return "over_budget"
    return "wrong_options"


def purchase_reward(product: Product, goal: Goal, chosen: Mapping[str, str]) -> Reward:
    """Score buying `product` at its price with `chosen` (option name -> clicked value)."""
    return _score(product, goal, option_matches(list(chosen.values()), list(goal.goal_options.values())))


def reward_upper_bound(product: Product, goal: Goal) -> Reward:
    """The most buying `product` can score for `goal` under ANY choice of its option values.

    A goal value counts as hit when some value the product offers (under any option name:
    matching compares values, never names) matches it. That is an upper bound: two goal values
    that only values of one option match cannot both be clicked.
    """
    offered = [v for values in product.options.values() for v in values]
    return _score(product, goal, sum(option_matches(offered, [want]) for want in goal.goal_options.values()))


def _score(product: Product, goal: Goal, opt_hits: int) -> Reward:
    r_type = type_reward(product, goal)
    attr_hits = attribute_matches(product, goal.attributes)
    price_ok = product.price <= goal.price_upper
    denom = len(goal.attributes) + len(goal.goal_options) + 1
    total = r_type * (attr_hits + opt_hits + int(price_ok)) / denom
    return Reward(total=total, r_type=r_type, attribute_hits=attr_hits, option_hits=opt_hits, price_ok=price_ok)
