"""Map the real WebShop data files onto the shop schema (never downloaded by the project).

Reads from a directory:
  items_shuffle[_1000].json   products: asin, name|Title, category, query, product_category,
                              full_description|Description, small_description|BulletPoints,
                              customization_options|options, pricing, reviews|Reviews
  items_ins_v2[_1000].json    asin -> {attributes, instruction, instruction_attributes}
  items_human_ins.json        asin -> [{instruction, instruction_attributes,
                                         instruction_options}]   (only with human_goals=True)
When both "X_1000.json" and "X.json" exist the 1000-product files are used (WebShop's
use_small, which every FedAgent config set). Goals follow WebShop: synthetic goals are one per
product with an instruction per combination of its option values; human goals are the
annotated instructions that name at least one attribute. Prices and ceilings are seeded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

from envs.shop.goals import options_clause, price_ceiling, price_clause
from envs.shop.reward import normalize_text
from envs.shop.schema import Goal, Product

DEFAULT_PRICE = 100.0  # WebShop's price for a product without pricing


def _pick(data_dir: Path, stem: str) -> Path:
    small, full = data_dir / f"{stem}_1000.json", data_dir / f"{stem}.json"
    for path in (small, full):
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{data_dir} has neither {small.name} nor {full.name}; point env.params.data_dir at a WebShop data directory"
    )


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value.strip() else ()
    return tuple(str(v) for v in value if v is not None and str(v).strip())


def _review_text(review: Any) -> str:
    if isinstance(review, dict):
        return str(review.get("body") or review.get("text") or review.get("title") or "")
    return str(review)


def _options(raw: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """customization_options {name: [{value, image}]} (or processed {name: [str]}) -> schema."""
    source = raw.get("options") or raw.get("customization_options") or {}
    options: dict[str, tuple[str, ...]] = {}
    for name, contents in source.items():
        if not contents:
            continue
        values = []
        for item in contents:
            value = item.get("value") if isinstance(item, dict) else item
            if value is None:
                continue
            value = str(value).strip().replace("/", " | ").lower()
            if value and value not in values:
                values.append(value)
        if values:
            options[str(name).lower()] = tuple(values)
    return options


def _pricing(value: Any) -> tuple[float, ...]:
    """ "$12.99", "$10.99 - $20.99", or a list of numbers/strings -> (price,) or (low, high)."""
    if isinstance(value, (int, float)):
        return (float(value),)
    text = " ".join(str(v) for v in value) if isinstance(value, list) else str(value or "")
    numbers = [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", text)]
    return tuple(numbers[:2]) if numbers else (DEFAULT_PRICE,)


def _seeded_price(pricing: tuple[float, ...], asin: str, seed: int) -> float:
    """A range-priced product sells at a price drawn in its range, keyed by (seed, asin)."""
    if len(pricing) == 1:
        return pricing[0]
    rng = random.Random(hashlib.sha256(f"{seed}\0{asin}".encode()).digest())
    return round(rng.uniform(*pricing), 2)


def load_products(data_dir: str | Path, seed: int) -> tuple[list[Product], dict[str, dict]]:
    """Products (deduplicated by asin, file order) and the instruction file keyed by asin."""
    data_dir = Path(data_dir)
    items = json.loads(_pick(data_dir, "items_shuffle").read_text())
    ins = json.loads(_pick(data_dir, "items_ins_v2").read_text())
    products, seen = [], set()
    for raw in items:
        asin = raw.get("asin")
        if not asin or asin in seen:
            continue
        seen.add(asin)
        pricing = _pricing(raw.get("pricing"))
        attributes = _strings((ins.get(asin) or {}).get("attributes") or raw.get("Attributes"))
        products.append(
            Product(
                asin=asin,
                title=str(raw.get("Title") or raw.get("name") or ""),
                category=str(raw.get("category") or "").lower().strip(),
                query=str(raw.get("query") or "").lower().strip(),
                product_category=str(raw.get("product_category") or ""),
                attributes=attributes,
                bullets=_strings(raw.get("BulletPoints") or raw.get("small_description")),
                description=str(raw.get("Description") or raw.get("full_description") or ""),
                options=_options(raw),
                pricing=pricing,
                price=_seeded_price(pricing, asin, seed),
                reviews=tuple(t for t in map(_review_text, raw.get("Reviews") or raw.get("reviews") or []) if t),
            )
        )
    return products, ins


def _named_options(values: Any, product: Product) -> dict[str, str]:
    """Human goals list option VALUES; name each by the target option that offers it."""
    if isinstance(values, dict):
        return {str(k).lower(): str(v).lower() for k, v in values.items()}
    named: dict[str, str] = {}
    for k, value in enumerate(_strings(values)):
        value = value.strip().lower()
        name = next(
            (n for n, vals in product.options.items() if normalize_text(value) in map(normalize_text, vals)),
            f"option {k + 1}",
        )
        named.setdefault(name, value)
    return named


def _goal(
    product: Product,
    text: str,
    attributes: tuple[str, ...],
    options: dict[str, str],
    rng: random.Random,
    mention_options: bool,
) -> Goal:
    """WebShop's goal dict; synthetic instructions get the option clause appended, human
    ones already word their options."""
    ceiling = price_ceiling(product.price, rng)
    clause = options_clause(options) if mention_options else ""
    return Goal.for_target(product, text.strip(".") + clause + price_clause(ceiling), attributes, options, ceiling)


def load_goals(
    data_dir: str | Path, products: list[Product], ins: dict[str, dict], seed: int, human_goals: bool = False
) -> list[Goal]:
    """All goals the files define, in a seeded shuffled order."""
    rng = random.Random(f"shop-real-goals/{seed}")
    goals: list[Goal] = []
    if human_goals:
        path = _pick(Path(data_dir), "items_human_ins")
        human = json.loads(path.read_text())
        for product in products:
            for entry in human.get(product.asin) or []:
                attributes = _strings(entry.get("instruction_attributes"))
                if not attributes:
                    continue
                options = _named_options(entry.get("instruction_options"), product)
                goals.append(
                    _goal(product, str(entry.get("instruction", "")), attributes, options, rng, mention_options=False)
                )
    else:
        for product in products:
            entry = ins.get(product.asin) or {}
            if not entry.get("instruction"):
                continue
            attributes = _strings(entry.get("instruction_attributes"))
            names = sorted(product.options)
            for combo in itertools.product(*(product.options[n] for n in names)):
                goals.append(
                    _goal(
                        product,
                        str(entry["instruction"]),
                        attributes,
                        dict(zip(names, combo)),
                        rng,
                        mention_options=True,
                    )
                )
    rng.shuffle(goals)
    return goals
