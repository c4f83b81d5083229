"""Seeded synthetic catalog (lookalike products are built in lookalikes.py).

All random draws for the whole catalog come from one local numpy Generator in a few array
calls; the per-product Python loop only assembles strings. 50k products take about a second.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from envs.shop import vocab
from envs.shop.schema import Product

_ALNUM = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))
_TYPES = [(cat, pt) for cat, types in vocab.CATEGORIES.items() for pt in types]
_MAX_ATTRS = max(len(pt.attributes) for _, pt in _TYPES)
_MAX_OPTS = max(len(pt.options) for _, pt in _TYPES)
_MAX_VALUES = max(len(vals) for _, pt in _TYPES for _, vals in pt.options)
_TRAILING = ("for ", "with ")  # attribute phrases that read after the noun in a title


def _codes(rng: np.random.Generator, n: int, prefix: str, taken: set[str]) -> list[str]:
    """n distinct ids `prefix` + 8 uppercase alphanumerics, none in `taken`."""
    out: list[str] = []
    seen = set(taken)
    while len(out) < n:
        chars = _ALNUM[rng.integers(len(_ALNUM), size=(n - len(out), 8))]
        for code in np.char.add(prefix, chars.view("<U8").ravel()).tolist():
            if code not in seen:
                seen.add(code)
                out.append(code)
    return out


def _names(rng: np.random.Generator, n: int) -> list[str]:
    """n capitalised two-syllable pseudo-words (brands, product lines)."""
    syl = np.array(vocab.SYLLABLES)
    pairs = syl[rng.integers(len(syl), size=(n, 2))]
    return [(a + b).capitalize() for a, b in pairs.tolist()]


def _dollars(x: float) -> float:
    """Round to a shelf price ending in .99."""
    return max(math.floor(x), 1) - 0.01


@functools.lru_cache(maxsize=None)
def _bullet(template: int, attr: str, noun: str) -> str:
    """Bullet text; a small finite set, so cached across products."""
    return vocab.BULLET_TEMPLATES[template].format(attr=attr, noun=noun).capitalize()


def generate_catalog(num_products: int, seed: int) -> list[Product]:
    """`num_products` synthetic products; a pure function of (num_products, seed)."""
    if num_products < 1:
        raise ValueError(f"num_products must be >= 1, got {num_products}")
    rng = np.random.default_rng([seed, 0x5C47])
    n = num_products
    brands = _names(rng, 80)
    lines = _names(rng, 400)
    asins = _codes(rng, n, "B0", set())
    t_idx = rng.integers(len(_TYPES), size=n)
    brand_idx = rng.integers(len(brands), size=n)
    line_idx = rng.integers(len(lines), size=n)
    attr_order = np.argsort(rng.random((n, _MAX_ATTRS)), axis=1).tolist()
    n_attrs = rng.integers(3, 6, size=n).tolist()
    n_title_attrs = rng.integers(1, 3, size=n).tolist()
    value_order = np.argsort(rng.random((n, _MAX_OPTS, _MAX_VALUES)), axis=2).tolist()
    n_values = rng.integers(2, 6, size=(n, _MAX_OPTS)).tolist()
    keep_opt = (rng.random((n, _MAX_OPTS)) < 0.85).tolist()
    no_opts = (rng.random(n) < 0.15).tolist()
    price_u = rng.random(n).tolist()
    ranged = (rng.random(n) < 0.25).tolist()
    spread = rng.uniform(1.15, 1.8, size=n).tolist()
    pick_u = rng.random(n).tolist()
    bullet_tpl = rng.integers(len(vocab.BULLET_TEMPLATES), size=(n, 5)).tolist()
    desc_tpl = rng.integers(len(vocab.DESCRIPTION_TEMPLATES), size=n).tolist()
    review_idx = rng.integers(len(vocab.REVIEWS), size=(n, 2)).tolist()
    n_reviews = rng.integers(0, 3, size=n).tolist()

    products = []
    for i in range(n):
        category, pt = _TYPES[t_idx[i]]
        brand, line = brands[brand_idx[i]], lines[line_idx[i]]
        attrs = tuple(pt.attributes[j] for j in attr_order[i] if j < len(pt.attributes))[: n_attrs[i]]
        in_title = attrs[: n_title_attrs[i]]
        before = " ".join(a.title() for a in in_title if not a.startswith(_TRAILING))
        after = ", ".join(a for a in in_title if a.startswith(_TRAILING))
        title = " ".join(w for w in (brand, line, before, pt.noun.title()) if w)
        if after:
            title += f", {after}"
        options: dict[str, tuple[str, ...]] = {}
        if not no_opts[i]:
            for s, (name, pool) in enumerate(pt.options):
                if keep_opt[i][s] or not options and s == len(pt.options) - 1:
                    subset = [j for j in value_order[i][s] if j < len(pool)][: n_values[i][s]]
                    chosen = sorted(subset)  # a random subset, shown in pool order
                    options[name] = tuple(pool[j] for j in chosen)
        lo, hi = pt.price
        base = _dollars(math.exp(math.log(lo) + price_u[i] * (math.log(hi) - math.log(lo))) + 1)
        if ranged[i]:
            top = _dollars(base * spread[i] + 1)
            pricing: tuple[float, ...] = (base, top)
            price = round(base + pick_u[i] * (top - base), 2)
        else:
            pricing = (base,)
            price = base
        bullets = tuple(_bullet(bullet_tpl[i][k], a, pt.noun) for k, a in enumerate(attrs))
        description = vocab.DESCRIPTION_TEMPLATES[desc_tpl[i]].format(
            brand=brand, line=line, noun=pt.noun, a0=attrs[0], a1=attrs[1]
        )
        reviews = tuple(vocab.REVIEWS[r] for r in review_idx[i][: n_reviews[i]])
        products.append(
            Product(
                asin=asins[i],
                title=title,
                category=category,
                query=pt.query,
                product_category=pt.path,
                attributes=attrs,
                bullets=bullets,
                description=description,
                options=options,
                pricing=pricing,
                price=price,
                reviews=reviews,
            )
        )
    return products
