"""BM25 product search (bm25s) with the ranking variants environment-heterogeneity arms use.

Ties are broken by catalog position, so a query's result list is a pure function of the
index and the query. Only documents sharing at least one term with the query are returned
(like Lucene); hidden products (a filtered catalog) are dropped after scoring, so one index
serves every catalog filter built over the same products.

Ranking variants (FedAgent's rank wrappers, as the published ones behave with its top-200
pool: the WHOLE returned list is reordered, not a top-50 head):
  bm25            as scored
  shuffled_topk   the returned list in a seeded order (per query)
  inverted_topk   the returned list reversed: page 1 shows the least relevant hits
  partial_random  each search is, with probability 1/2, answered by n random shown products
                  instead (a coin per search of an episode: `random_results`)
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import threading
from collections.abc import Callable, Sequence

# bm25s runs a JAX op at import whenever JAX is installed (bm25s/selection.py). On a GPU image
# with jax[cuda] that makes JAX preallocate 75% of the GPU in EVERY process importing the shop
# (env service, trainer): measured on an H200, 108 GB gone, then the trainer's CUDA OOM. The shop
# is a CPU engine, so keep JAX on the CPU unless the user said otherwise (docs/offline-gpu.md).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import bm25s  # noqa: E402
import numpy as np

from envs.shop.schema import Product

INDEX_FIELDS = ("title", "description", "bullets", "options", "attributes", "category")
DEFAULT_FIELDS = ("title", "description", "bullets", "options")
RANKINGS = ("bm25", "shuffled_topk", "inverted_topk", "partial_random")
PARTIAL_RANDOM_P = 0.5  # published: half the queries get random products

_TOKEN = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an and are as at be by for from i in is it me of on or that the this to with "
    "want need looking find would like im i'm lower than price dollars".split()
)


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric runs minus stop words (no stemming)."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


def _field_texts(product: Product, field: str) -> list[str]:
    if field == "title":
        return [product.title]
    if field == "description":
        return [product.description]
    if field == "bullets":
        return list(product.bullets)
    if field == "options":
        return [v for values in product.options.values() for v in values]
    if field == "attributes":
        return list(product.attributes)
    if field == "category":
        return [product.product_category, product.query]
    raise ValueError(f"unknown index field {field!r}; choose from {INDEX_FIELDS}")


def document_text(product: Product, fields: Sequence[str]) -> str:
    """The text of `product` that the index sees, from the chosen fields."""
    return " ".join(s for f in fields for s in _field_texts(product, f))


class SearchIndex:
    """Immutable BM25 index over a product list; safe to share between threads.

    Token ids are assigned in first-seen order (not from a hash-ordered set), and each
    distinct field string is tokenized once: catalog text repeats a lot (bullets, options).
    """

    def __init__(
        self, products: Sequence[Product], fields: Sequence[str] = DEFAULT_FIELDS, k1: float = 1.2, b: float = 0.75
    ):
        vocab: dict[str, int] = {}
        memo: dict[str, list[int]] = {}

        def ids(text: str) -> list[int]:
            got = memo.get(text)
            if got is None:
                got = memo[text] = [vocab.setdefault(t, len(vocab)) for t in tokenize(text)]
            return got

        corpus = []
        for p in products:
            doc: list[int] = []
            for f in fields:
                for text in _field_texts(p, f):
                    doc += ids(text)
            corpus.append(doc)
        self._vocab = dict(vocab)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index((corpus, vocab), show_progress=False)
        self.size = len(products)
        self._searchers: dict[tuple, Callable[[str], tuple[int, ...]]] = {}
        self._searchers_lock = threading.Lock()

    def searcher(
        self, n: int, visible: np.ndarray | None = None, ranking: str = "bm25", seed: int = 0, cache_size: int = 4096
    ) -> Callable[[str], tuple[int, ...]]:
        """`search` with everything but the query fixed, memoized per query (LRU).

        A query's results are a pure function of the index and these arguments, so one cache
        serves every caller that fixes the same ones (all engines of a pool share it), and
        queries repeat: n rollouts of a GRPO group search for the same task, the oracle replays
        its query every episode. A search scores the whole catalog (~0.4 ms at 300 products).
        """
        key = (n, None if visible is None else visible.tobytes(), ranking, seed)
        with self._searchers_lock:
            memo = self._searchers.get(key)
            if memo is None:
                mask = None if visible is None else visible.copy()
                memo = self._searchers[key] = functools.lru_cache(maxsize=cache_size)(
                    lambda query: tuple(self.search(query, n, mask, ranking, seed))
                )
        return memo

    def search(
        self, query: str, n: int, visible: np.ndarray | None = None, ranking: str = "bm25", seed: int = 0
    ) -> list[int]:
        """Catalog positions of the top `n` matches for `query`, reordered by `ranking`."""
        terms = list(dict.fromkeys(self._vocab[t] for t in tokenize(query) if t in self._vocab))
        if not terms or n <= 0:
            return []
        scores = np.asarray(self._bm25.get_scores_from_ids(terms), dtype=np.float64)
        if visible is not None:
            scores = np.where(visible, scores, 0.0)
        hits = np.flatnonzero(scores > 0)
        top = hits[np.lexsort((hits, -scores[hits]))][:n].tolist()
        return rerank(top, ranking, query, seed)


def rerank(top: list[int], ranking: str, query: str, seed: int) -> list[int]:
    """Apply a ranking variant: as scored, seeded shuffle (per query), or reversed
    (partial_random reorders nothing here: its coin is per search, `random_results`)."""
    if ranking in ("bm25", "partial_random"):
        return top
    if ranking == "inverted_topk":
        return top[::-1]
    if ranking == "shuffled_topk":
        digest = hashlib.sha256(f"{seed}\0{query}".encode()).digest()
        random.Random(digest).shuffle(top)
        return top
    raise ValueError(f"unknown ranking {ranking!r}; choose from {RANKINGS}")


def random_results(shown: np.ndarray, n: int, seed: int, task: int, search_no: int) -> tuple[int, ...] | None:
    """partial_random's coin for the `search_no`-th search of an episode of `task`: None (keep
    the BM25 results) or n products drawn at random from the `shown` positions.

    The published wrapper drew from one RNG stream per client process, so a coin depended on
    everything the process had searched before; here it is a pure function of (wrapper seed,
    task, search number), with the same per-search probability: a retried search flips a fresh
    coin, and every rollout of a GRPO group meets the same coins.
    """
    digest = hashlib.sha256(f"partial_random\0{seed}\0{task}\0{search_no}".encode()).digest()
    rng = random.Random(digest)
    if rng.random() >= PARTIAL_RANDOM_P:
        return None
    return tuple(rng.sample(shown.tolist(), min(n, len(shown))))
