"""WebShop text-mode pages and the observation formatting the policy reads.

A raw page is its parts joined by " [SEP] ", always starting
"WebShop [SEP] Instruction: [SEP] <instruction>". The observation handed to the policy is
`format_observation(raw, instruction)`: the predecessor's federated formatting (field log
2026-07-22), which drops everything up to and including the instruction and single-quotes the
rest, so the search page reads "'Search'". Changing a byte here changes the recipe: the
rendering is locked by fixture tests (tests/fixtures/shop_*.txt).
"""

from __future__ import annotations

from collections.abc import Sequence

from envs.shop.schema import Product

SEP = " [SEP] "
SEARCH = "Search"
BACK_TO_SEARCH = "Back to Search"
NEXT = "Next >"
PREV = "< Prev"
BUY_NOW = "Buy Now"
DESCRIPTION = "Description"
FEATURES = "Features"
REVIEWS = "Reviews"
DETAIL_TABS = (DESCRIPTION, FEATURES, REVIEWS)
PAGE_SIZE = 10


def _page(instruction: str, parts: Sequence[str]) -> str:
    return SEP.join(["WebShop", "Instruction:", instruction, *parts])


def search_page(instruction: str) -> str:
    return _page(instruction, [SEARCH])


def results_page(instruction: str, hits: Sequence[Product], page: int, total: int) -> str:
    """One page of results: navigation, then asin, title, price of each hit."""
    parts = [BACK_TO_SEARCH, f"Page {page} (Total results: {total})"]
    if page > 1:
        parts.append(PREV)
    if page * PAGE_SIZE < total:
        parts.append(NEXT)
    for p in hits:
        parts += [p.asin, p.title, p.price_tag]
    return _page(instruction, parts)


def item_page(instruction: str, product: Product) -> str:
    """Options (name, then its values), title, price, detail tabs, Buy Now."""
    parts = [BACK_TO_SEARCH, PREV]
    for name, values in product.options.items():
        parts += [name, *values]
    parts += [product.title, f"Price: {product.price_tag}", *DETAIL_TABS, BUY_NOW]
    return _page(instruction, parts)


def detail_page(instruction: str, product: Product, tab: str) -> str:
    """The Description, Features (bullet points) or Reviews tab of an item."""
    body = {
        DESCRIPTION: [product.description],
        FEATURES: list(product.bullets),
        REVIEWS: list(product.reviews) or ["No reviews yet."],
    }[tab]
    return _page(instruction, [BACK_TO_SEARCH, PREV, *body])


def done_page(instruction: str, product: Product, reward: float) -> str:
    return _page(
        instruction,
        [
            "Thank you for shopping with us!",
            "Purchased",
            product.asin,
            product.title,
            "Your score (min 0.0, max 1.0)",
            f"{reward:.4f}",
        ],
    )


def format_observation(raw: str, instruction: str) -> str:
    """Parts after the instruction segment, each single-quoted, joined by ", ".

    Falls back to the raw text when the instruction is not a segment of the page, after one
    retry comparing stripped segments (so whitespace drift cannot silently disable it).
    """
    parts = raw.split(SEP)
    try:
        index = parts.index(instruction)
    except ValueError:
        stripped = [p.strip() for p in parts]
        if instruction.strip() not in stripped:
            return raw
        index = stripped.index(instruction.strip())
    return ", ".join(f"'{p}'" for p in parts[index + 1 :])
