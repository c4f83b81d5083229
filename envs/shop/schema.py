"""The shop's two record types. Synthetic catalogs and real WebShop files both map onto them,
so search, pages, reward and the oracle never care where a product came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

CATEGORY_SEP = "›"


@dataclass(frozen=True, eq=False)
class Product:
    """One product; field names follow WebShop's processed product (Title, BulletPoints, ...)."""

    asin: str
    title: str  # WebShop `name` / `Title`
    category: str  # e.g. "beauty"
    query: str  # the search query the product was found under
    product_category: str  # path, parts joined by " › "
    attributes: tuple[str, ...]  # WebShop `Attributes`
    bullets: tuple[str, ...]  # WebShop `BulletPoints`
    description: str
    options: dict[str, tuple[str, ...]]  # option name -> values this product offers
    pricing: tuple[float, ...]  # (price,) or (low, high)
    price: float  # the concrete price a purchase is scored at
    reviews: tuple[str, ...] = ()

    @cached_property  # rendered on every results and item page
    def price_tag(self) -> str:
        """Displayed price: "$x.xx" or "$lo to $hi" (WebShop's range form)."""
        if len(self.pricing) == 1:
            return f"${self.pricing[0]:.2f}"
        return f"${self.pricing[0]:.2f} to ${self.pricing[1]:.2f}"


@dataclass(frozen=True, eq=False)
class Goal:
    """One task: buy a product like `asin` with these attributes and option values under a
    price ceiling. `query`, `name`, `product_category` are copied from the target because the
    type reward compares the purchase against them (as WebShop's goal dicts do)."""

    asin: str
    instruction: str
    attributes: tuple[str, ...]
    goal_options: dict[str, str] = field(default_factory=dict)  # option name -> wanted value
    price_upper: float = 1_000_000.0
    category: str = ""
    query: str = ""
    name: str = ""
    product_category: str = ""

    @classmethod
    def for_target(
        cls, target: Product, instruction: str, attributes: tuple[str, ...], options: dict[str, str], ceiling: float
    ) -> Goal:
        """The goal of buying `target`, with what the type reward compares copied from it."""
        return cls(
            asin=target.asin,
            instruction=instruction,
            attributes=attributes,
            goal_options=options,
            price_upper=ceiling,
            category=target.category,
            query=target.query,
            name=target.title,
            product_category=target.product_category,
        )
