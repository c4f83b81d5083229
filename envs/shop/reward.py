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

# First substring hit in this order wins, as in WebShop (so "navy blue" -> "blue").
COLOR_SET = (
    "alabaster", "apricot", "aqua", "ash", "azure", "beige", "black", "blue", "blush", "bronze",
    "brown", "burgundy", "camel", "caramel", "champagne", "charcoal", "chocolate", "copper",
    "coral", "cream", "denim", "fuchsia", "gold", "graphite", "gray", "green", "grey", "indigo",
    "ivory", "khaki", "lavender", "lemon", "lilac", "lime", "magenta", "maroon", "mauve", "mint",
    "mocha", "multicolor", "mustard", "navy", "nude", "olive", "orange", "peach", "pink", "plum",
    "purple", "red", "rose", "rust", "sand", "silver", "slate", "tan", "taupe", "teal",
    "turquoise", "violet", "white", "wine", "yellow",
)

MATCH_THRESHOLD = 85  # WebShop: fuzzy token-set ratio must exceed this


def _require_str(value: object, who: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{who} expects str, got {type(value).__name__}: {value!r}; pass the "
                        "option VALUE, not a (name, value) pair")
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


# Words a title noun proxy ignores: function words and frequent product adjectives. spaCy's
# NOUN/PROPN tagging is what WebShop uses; this list is the documented stand-in (docs/shop.md).
_NOT_NOUNS = frozenset("""
a an and or the of for with in on to by from at as is it this that these your our you pack
count set new free long lasting natural organic premium soft high low fast quick light
lightweight heavy duty extra super ultra best great small large big mini portable adjustable
waterproof breathable durable compact dark clear slim non anti multi dual double single
""".split())


def title_nouns(title: str) -> frozenset[str]:
    """Noun proxy for a title: alphabetic tokens of 3+ letters that are not in `_NOT_NOUNS`."""
    return _title_nouns(_require_str(title, "title_nouns"))


@functools.lru_cache(maxsize=1 << 14)   # titles repeat: one per product and goal
def _title_nouns(title: str) -> frozenset[str]:
    return frozenset(t for t in re.findall(r"[a-z]+", title.lower())
                     if len(t) > 2 and t not in _NOT_NOUNS)


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


def purchase_reward(product: Product, goal: Goal, chosen: Mapping[str, str]) -> Reward:
    """Score buying `product` at its price with `chosen` (option name -> clicked value)."""
    r_type = type_reward(product, goal)
    attr_hits = attribute_matches(product, goal.attributes)
    opt_hits = option_matches(list(chosen.values()), list(goal.goal_options.values()))
    price_ok = product.price <= goal.price_upper
    denom = len(goal.attributes) + len(goal.goal_options) + 1
    total = r_type * (attr_hits + opt_hits + int(price_ok)) / denom
    return Reward(total=total, r_type=r_type, attribute_hits=attr_hits, option_hits=opt_hits,
                  price_ok=price_ok)
