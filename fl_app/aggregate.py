"""FedAvg in fp32: the example-count-weighted mean of client models (invariant 2).

Two entry points with one arithmetic, so they give identical bits:
- `fedavg_manifests` streams shard files: for each shard index it reads that shard from each
  client in turn (the next read overlaps the current accumulation), accumulates, and hands the
  result to a `ShardWriter`. Memory stays at a few shards, never N full models.
- `fedavg_states` averages in-memory state dicts (the inline transport path).

Per tensor, in client order: acc = x_0 * f_0, then acc += x_i * f_i (one fused multiply-add),
with f_i = w_i / sum(w) and all math in fp32: nothing is widened to float64, nothing narrowed.
A client whose factor is exactly 1 (a single client, or all others weigh 0) is copied, not
multiplied, so FedAvg over one client is the identity bit for bit. Zero-weight clients are
skipped. Non-floating buffers are not averaged: every client must hold the same values.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fl_app.weights import Manifest, ShardWriter, WeightsError, read_shard, same_layout


def weight_factors(weights: Sequence[float]) -> list[float]:
    """w_i / sum(w): the FedAvg factors; weights are example counts (>= 0, not all 0)."""
    if not weights:
        raise WeightsError("FedAvg needs at least one client")
    bad = [w for w in weights if not (w >= 0 and w != float("inf"))]
    total = float(sum(weights))
    if bad or total <= 0:
        raise WeightsError(f"FedAvg weights must be finite example counts >= 0 with a positive sum "
                           f"(got {list(weights)}); check the clients' num-examples metric")
    return [float(w) / total for w in weights]


def _accumulate(acc: torch.Tensor | None, x: torch.Tensor, factor: float, name: str,
                inplace_ok: bool) -> torch.Tensor:
    """Fold one client's tensor into the running sum (see module doc for the exact arithmetic)."""
    if not x.is_floating_point():
        if acc is not None and not torch.equal(acc, x):
            raise WeightsError(f"non-floating buffer {name!r} differs between clients; it cannot be "
                               "averaged: make every client export the same value (or drop it from the export)")
        if acc is None:
            return x if inplace_ok else x.clone()
        return acc
    if x.dtype != torch.float32:
        raise WeightsError(f"{name!r} is {x.dtype}; FedAvg accumulates fp32 only (invariant 1): "
                           "export fp32 master weights")
    if acc is None:
        if factor == 1.0:
            return x if inplace_ok else x.clone()
        return x.mul_(factor) if inplace_ok else x.mul(factor)
    if acc.shape != x.shape:
        raise WeightsError(f"{name!r} has shape {list(x.shape)} in one client and {list(acc.shape)} in "
                           "another: clients must export the same model")
    return acc.add_(x, alpha=factor)


def _fold(acc: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], factor: float) -> None:
    """Accumulate one client's freshly read shard into `acc` (its buffers may be reused in place)."""
    for name, x in tensors.items():
        acc[name] = _accumulate(acc.get(name), x, factor, name, inplace_ok=True)


def fedavg_states(inputs: Sequence[tuple[Mapping[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """FedAvg of in-memory state dicts (inputs are not modified). Same bits as `fedavg_manifests`."""
    factors = weight_factors([w for _, w in inputs])
    live = [(s, f) for (s, _), f in zip(inputs, factors) if f > 0]
    names = list(inputs[0][0].keys())
    for s, _ in inputs[1:]:
        if list(s.keys()) != names:
            raise WeightsError("client state dicts hold different tensor names/orders; "
                               "clients must export the same model")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        acc: torch.Tensor | None = None
        for state, f in live:
            acc = _accumulate(acc, state[name].detach().cpu(), f, name, inplace_ok=False)
        out[name] = acc
    return out


def fedavg_manifests(inputs: Sequence[tuple[Manifest | Path, float]], out_dir: Path,
                     max_shard_bytes: int, verify: bool = True) -> Manifest:
    """Streaming FedAvg of sharded client models into `out_dir` (manifest written last).

    Every input shard is size- and sha256-checked just before it is used; on any error no
    manifest is written, so the output never looks complete.
    """
    manifests = [m if isinstance(m, Manifest) else Manifest.from_dir(m) for m, _ in inputs]
    factors = weight_factors([w for _, w in inputs])
    if not same_layout(manifests):
        raise WeightsError("client manifests disagree on tensors or shard layout; every client must "
                           "export the same model with the same shard size (run.shard_max_mb)")
    live = [(m, f) for m, f in zip(manifests, factors) if f > 0]
    jobs = [(i, m, f) for i in range(len(manifests[0].shards)) for m, f in live]

    def read(job: tuple[int, Manifest, float]) -> dict[str, torch.Tensor]:
        return read_shard(job[1], job[0], verify)

    writer = ShardWriter(out_dir, max_shard_bytes)
    if not jobs:  # a model without tensors
        return writer.finish()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedavg-read") as pool:
        nxt = pool.submit(read, jobs[0])
        acc: dict[str, torch.Tensor] = {}
        for k, (shard, _, f) in enumerate(jobs):
            tensors = nxt.result()
            if k + 1 < len(jobs):
                nxt = pool.submit(read, jobs[k + 1])
            _fold(acc, tensors, f)
            del tensors  # the client's shard buffer is free before the next one arrives
            if k + 1 == len(jobs) or jobs[k + 1][0] != shard:  # shard done for every client
                writer.add_all(acc)
                acc = {}
                if max_shard_bytes == manifests[0].max_shard_bytes:
                    writer.flush()  # same bound => same boundaries; write now instead of holding it
    return writer.finish()
