"""What a partition realized, next to what its knob promises in closed form.

Realized (over the N clients of one plan):
  delta2_pref     tr Cov of the clients' category mixtures (population covariance);
  size_*          shard sizes;
  coverage        |union of shards| / |pool|;
  overlap         mean pairwise |S_i & S_j| and mean pairwise Jaccard;
  rho_*           per-client success rate under the labels (easy / size), delta2_hard = Var(rho).
Closed forms (notes §2): preference omega (1 - ||pi||^2) (and its multinomial-sampling version
(1 - ||pi||^2)(omega + (1 - omega)/|X_i|), what a finite shard can show); coverage's Beta size
std (high - low) sqrt(mu (1 - mu)/(xi + 1)) before rescaling; hardness mu(1 - mu)/(xi' + 1) with
mu = floor(L/2)/L; and for every arm the IID reference (1 - ||p||^2)/L (|pool| - L)/(|pool| - 1)
that a uniform shard of L tasks shows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fl_app.config import Config
from partitions.preference import effective_counts, marginal
from partitions.registry import PartitionPlan
from partitions.sizing import beta_mean, overlap_ratio


def _membership(plan: PartitionPlan) -> np.ndarray:
    """clients x pool 0/1 matrix (float32, for the pairwise products)."""
    pos = {t: k for k, t in enumerate(plan.pool.indices)}
    m = np.zeros((len(plan.shards), len(plan.pool)), dtype=np.float32)
    for c, shard in enumerate(plan.shards):
        m[c, [pos[t] for t in shard]] = 1.0
    return m


def client_rows(plan: PartitionPlan) -> list[dict[str, Any]]:
    """Per client: size, category histogram, easy/hard counts under the labels."""
    cat = dict(zip(plan.pool.indices, plan.pool.categories))
    names = plan.pool.category_names()
    rows = []
    for c, shard in enumerate(plan.shards):
        hist = dict.fromkeys(names, 0)
        for t in shard:
            hist[cat[t]] += 1
        row: dict[str, Any] = {"client": c, "size": len(shard), "categories": hist}
        if plan.match is not None:
            easy = sum(t in plan.match.easy for t in shard)
            row.update(easy=easy, hard=len(shard) - easy)
        rows.append(row)
    return rows


def realized(plan: PartitionPlan, rows: list[dict[str, Any]]) -> dict[str, float]:
    names = plan.pool.category_names()
    sizes = np.array([r["size"] for r in rows], dtype=float)
    mix = np.array([[r["categories"][c] for c in names] for r in rows], dtype=float) / sizes[:, None]
    m = _membership(plan)
    inter = m @ m.T
    iu = np.triu_indices(len(rows), k=1)
    union = sizes[:, None] + sizes[None, :] - inter
    out = {
        "delta2_pref": float(np.trace(np.atleast_2d(np.cov(mix.T, bias=True)))) if len(names) > 1 else 0.0,
        "size_mean": float(sizes.mean()),
        "size_std": float(sizes.std()),
        "size_min": float(sizes.min()),
        "size_max": float(sizes.max()),
        "coverage": float((m.sum(0) > 0).mean()),
        "mean_pairwise_overlap": float(inter[iu].mean()) if len(iu[0]) else 0.0,
        "mean_pairwise_jaccard": float((inter[iu] / union[iu]).mean()) if len(iu[0]) else 0.0,
    }
    if plan.match is not None:
        rho = np.array([r["easy"] for r in rows], dtype=float) / sizes
        out.update(
            rho_mean=float(rho.mean()),
            rho_std=float(rho.std()),
            rho_min=float(rho.min()),
            rho_max=float(rho.max()),
            delta2_hard=float(rho.var()),
        )
    return out


def closed_forms(plan: PartitionPlan, cfg: Config) -> dict[str, Any]:
    f, p = cfg.federation, cfg.partition.params
    n_pool, size = len(plan.pool), f.tasks_per_client
    frac = np.array(list(plan.pool.category_counts().values()), dtype=float) / n_pool
    iid = (1 - (frac**2).sum()) / size * (n_pool - size) / max(n_pool - 1, 1)  # finite-population correction
    out: dict[str, Any] = {"delta2_pref_iid": float(iid)}
    if plan.name == "preference":
        assert p.omega is not None
        counts = effective_counts(plan.pool, p.downsample_category, p.downsample_ratio)
        pi = marginal(counts)
        spread = float(1 - (pi**2).sum())
        out.update(
            pi={c: float(v) for c, v in zip(counts, pi)},
            one_minus_pi2=spread,
            delta2_pref=p.omega * spread,
            delta2_pref_multinomial=spread * (p.omega + (1 - p.omega) / size),
        )
    elif plan.name == "coverage":
        assert p.xi is not None and p.center is not None and p.high is not None
        mu = beta_mean(size, p.center, p.high)
        var = mu * (1 - mu) / (p.xi + 1)
        out.update(
            beta_mu=mu,
            beta_var=var,
            size_std=(p.high - size) * math.sqrt(var),
            size_mean=round(overlap_ratio(f.clients, n_pool, size, p.center, p.high) * n_pool) / f.clients,
            overlap_r=overlap_ratio(f.clients, n_pool, size, p.center, p.high),
        )
    elif plan.name == "hardness":
        assert p.xi_prime is not None
        mu = (size // 2) / size
        out.update(rho_mean=mu, delta2_hard=mu * (1 - mu) / (p.xi_prime + 1))
    return out
