"""Coverage partition: Beta-sized, overlapping client pools (notes §2.2).

One global allocation from `default_rng(seed)` (published: seed 42): sizes between |X_i| and
`high` around `center`, summing exactly to round(r |pool|), then every pool task placed into
floor(r) or ceil(r) distinct clients by `assign_with_overlap`. The knob xi is the Beta
concentration: 256 gives near-equal pools, 1 extreme ones (published sizes 426-587 vs 123-1000).
Note the mean pool is `center` (500), not |X_i|: |X_i| is only the lower bound.
"""

from __future__ import annotations

import numpy as np

from partitions.pool import TaskPool
from partitions.sizing import assign_with_overlap, client_sizes


def coverage_shards(
    pool: TaskPool, num_clients: int, low: int, center: int, high: int, xi: float, seed: int
) -> list[list[int]]:
    """Every client's shard (served indices, ascending)."""
    if high > len(pool):
        raise ValueError(
            f"partition.params.high={high} exceeds the training pool ({len(pool)} tasks): a client "
            f"cannot hold more distinct tasks than the pool; set partition.params.high <= {len(pool)}"
        )
    rng = np.random.default_rng(seed)
    sizes = client_sizes(num_clients, low, center, high, xi, len(pool), rng)
    idx = np.asarray(pool.indices)
    return [idx[s].tolist() for s in assign_with_overlap(len(pool), sizes, rng)]
