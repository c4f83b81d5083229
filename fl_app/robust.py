"""Robust aggregation and per-client anomaly scores (issue #39), streamed as FedAvg is.

Every aggregator reads the round's global model w beside the clients' uploads x_i and sees
their updates d_i = x_i - w (at round 1, w is the initial export). Per member:

- `fedavg`: FedAvg itself (`fl_app.aggregate.fold_with`, the same factors in the same order),
  so its bits are FedAvg's; w only adds the scores.
- `clipped`: w + sum_i f_i * min(1, C / ||d_i||) * d_i with C = clip_multiple x the round's
  median update norm. The norms come from a first, read-only pass; the second pass is FedAvg's
  fold with those factors (w's factor is what the clipped clients give up).
- `trimmed_mean` / `median`: coordinate-wise over the clients' values x_i, unweighted as the
  literature defines them (Yin et al. 2018): sort each coordinate's k values, drop the b lowest
  and b highest, average the rest in sorted order; the median is the trim b = (k - 1) // 2 (for
  an even k the mean of the two middle values). A piece's k values are stacked and sorted by a
  sorting network (torch.sort beyond 16 clients): O(piece x k) memory.

A server learning rate eta composes with each: w + eta * (agg - w), as for FedAvg.
Compressed updates (fl_app.quant) enter every aggregator as the clients' models they decode to,
x_i = w + deQ(q_i): streamed piece by piece (`fl_app.aggregate.walk_shard`), or inline decoded
whole with the same bits; each upload must be in the recipe's mode and block (`Rule.check_upload`)
and a delta from this round's w.

Scores: per piece, the deltas' Gram matrix G_ij += d_i . d_j (fp32 per piece, summed over
pieces in float64; scores only, the weights never leave fp32) and each update's row votes
(`shrink_z`, below). From the Gram, with no second pass:
the update norm ||d_i|| = sqrt(G_ii), the cosine to the round's (num-examples weighted) mean
update, the median of the cosines to the other clients (`cos_peers`) and `peer_z`, the largest
|cosine| to another client times sqrt(n), n the member's parameters. Flags (the first three need
3 or more clients):
- *norm*: ||d_i|| above `flag_norm_ratio` x the round's median norm (a scaled update);
- *unrelated* (on by default): `peer_z`, and from round 2 |`step_z`| (the cosine to the server's
  last step w - w_before, x sqrt(n), read in the same pass), both below `flag_unrelated_z`. A
  random direction's cosine to a fixed update is ~N(0, 1/n), so an update that is neither
  aligned nor opposed to any peer, nor to what the federation learnt last round, by more than
  chance allows carries nothing the others learnt (noise in place of an update). On
  the tiny default the clean updates' `peer_z` was 8.8 or more and noise of an update's norm
  reached 2.7 (docs/architecture.md, "What the scores can tell apart"). It needs a member of at
  least (4 z)^2 parameters (400 at z = 5): on fewer, even a perfectly aligned update's z is
  small, and the rule does not apply;
- *direction* (off unless a recipe sets `flag_cosine_z`): `cos_peers` below `flag_cosine_z` /
  sqrt(n), for models whose clean updates are measured to agree. Off by default because clean
  updates need not agree: on the tiny default clean updates point as often away from their
  peers as a sign-flipped one does, so no bound on the signed cosines tells a flip from a clean
  update there (same section);
- *shrink* (off unless a recipe sets `flag_shrink_z`): `shrink_z` below -`flag_shrink_z`. Each
  row of every matrix votes shrank or grew (`RowVotes`); a flip grows the rows its clean update
  shrank. It reads one update and w, no peer: a poisoned peer cannot move it, and it applies
  with any number of clients. Off by default, and no recipe sets it: on the tiny default 59 of
  60 clean updates (3 seeds) scored 12.3 or more, but one, whose gradient moved every token's
  row, grew them (-29.3), so it was flagged and its flip would not be (docs/architecture.md,
  "Telling a sign flip apart"). Where training grows the rows that vote (tests/channel/
  test_robust.py's model without weight decay), every clean update would be flagged.
Flags are recorded; with `drop_flagged` they also act: a read-only first pass scores the round,
and the aggregator then runs over the unflagged clients alone (the trim first spent on those
dropped whole: one dropped of four, trimmed one per side, leaves the plain mean of three).
The cosine to the mean is recorded, not used to flag: a x100 update is most of the mean itself.
`cos_peers` is robust to one bad client of 3 or more: a clean client's median runs over at
least two values, most of them clean. The Gram's diagonal is also the non-finite check: a
NaN/Inf update makes it non-finite before any output is written, also where a trim would drop
the bad value.

All arithmetic is deterministic: the same inputs give the same bits (one torch thread, fixed
piece order, fixed sorted-order sums).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fl_app.aggregate import (
    PIECE_BYTES,
    PREVIOUS,
    NonFinitePiece,
    _fold,
    _labels,
    combine_states,
    fold_with,
    replies_inline,
    server_step_factors,
    step_from_manifest,
    stream_manifests,
    weight_factors,
)
from fl_app.channel import Channel, WeightsRef
from fl_app.config import COMPRESSED, Aggregator, FederationCfg, Update
from fl_app.quant import UpdateMeta, check_update, decode_tensor, is_update
from fl_app.weights import Manifest, TensorInfo, WeightsError, all_finite, dtype_name, load_shards, save_shards

PEERS_TO_FLAG = 3  # an update is judged against its peers only where it has at least two


@dataclass(frozen=True)
class Rule:
    """How a round aggregates and flags (the federation section's keys, fl_app.config)."""

    aggregator: Aggregator = "fedavg"
    trim_fraction: float = 0.25
    clip_multiple: float = 1.0
    flag_norm_ratio: float = 3.0
    flag_cosine_z: float | None = None
    flag_unrelated_z: float | None = 5.0
    flag_shrink_z: float | None = None
    drop_flagged: bool = False
    update: Update = "full"  # what clients upload (fl_app.quant: the COMPRESSED modes)
    block: int = 64

    @classmethod
    def of(cls, f: FederationCfg) -> Rule:
        """The recipe's rule (its federation section)."""
        return cls(
            f.aggregator,
            f.trim_fraction,
            f.clip_multiple,
            f.flag_norm_ratio,
            f.flag_cosine_z,
            f.flag_unrelated_z,
            f.flag_shrink_z,
            f.drop_flagged,
            f.update,
            f.quant.block,
        )

    def reads_step(self, clients: int) -> bool:
        """Whether a round of `clients` live updates reads the server's last step: only the unrelated
        rule uses it, and no peer rule flags under PEERS_TO_FLAG clients (a 1.5B model's step
        is one more 6.2 GB read a round, for a score nothing would act on)."""
        return clients >= PEERS_TO_FLAG and self.flag_unrelated_z is not None

    def check_upload(self, ref: WeightsRef, label: str) -> UpdateMeta | None:
        """The metadata of an upload in the recipe's `update` mode (None: full weights); an upload
        in another mode is refused (fail closed: it would be averaged as the wrong thing)."""
        if self.update not in COMPRESSED:  # fp32 weights: full models, or lora's adapters
            if ref.update:
                raise WeightsError(f"{label} uploaded a compressed update, but federation.update is {self.update}")
            return None
        if not ref.update:
            raise WeightsError(f"{label} uploaded full weights, but federation.update is {self.update}")
        meta = UpdateMeta.parse(ref.update, label)
        if (meta.mode, meta.block) != (self.update, self.block):
            raise WeightsError(
                f"{label} uploaded a {meta.mode} update of block {meta.block}, the recipe says {self.update} of "
                f"block {self.block} (federation.update, federation.quant.block); server and clients must share "
                "the recipe"
            )
        return meta

    def trim(self, k: int) -> int:
        """Values dropped from each side of a coordinate's k sorted values."""
        if self.aggregator == "median":
            return (k - 1) // 2
        b = math.floor(self.trim_fraction * k)
        if b < 1 or k - 2 * b < 1:
            raise WeightsError(
                f"trimmed_mean over {k} clients with federation.trim_fraction={self.trim_fraction} trims "
                f"{b} per side; it needs 1 <= trim_fraction x clients < clients / 2"
            )
        return b


FEDAVG = Rule()  # the default: FedAvg, scored
BEFORE = "the global model a round earlier"  # the step score's input, in errors


@dataclass(frozen=True)
class Scores:
    """One member's anomaly scores, per live client in input order."""

    norm: list[float]
    cos_mean: list[float]
    cos_peers: list[float | None]
    peer_z: list[float | None]  # the largest |cosine| to another client, x sqrt(parameters)
    shrink_z: list[float]  # the rows' sign test: (shrank - grew) / sqrt(shrank + grew), `RowVotes`
    flagged: list[bool]
    cos: list[list[float]]  # cos[i][j]: client i's update against client j's (i != j)
    excluded: list[bool] | None = None  # `drop_flagged`: left out of the aggregate (None: nothing was dropped)
    step_z: list[float | None] | None = None  # cos to the server's last step x sqrt(parameters); None at round 1

    def row(self, ids: Sequence[int]) -> dict[str, dict[str, Any]]:
        """client id -> its scores, as the round's metrics row holds them; `cos` gives every
        pairwise cosine, so a flag rule can be tried on a finished run's rows."""
        rows = {
            str(c): {
                "norm": n,
                "cos_mean": m,
                "cos_peers": p,
                "peer_z": z,
                "shrink_z": sz,
                "flagged": f,
                "cos": {str(ids[j]): v for j, v in enumerate(row) if j != i},
            }
            for i, (c, n, m, p, z, sz, f, row) in enumerate(
                zip(
                    ids,
                    self.norm,
                    self.cos_mean,
                    self.cos_peers,
                    self.peer_z,
                    self.shrink_z,
                    self.flagged,
                    self.cos,
                    strict=True,
                )
            )
        }
        for c, out in zip(ids, self.excluded or ()):
            rows[str(c)]["excluded"] = out
        for c, z in zip(ids, self.step_z or ()):
            rows[str(c)]["step_z"] = z
        return rows


RoundScores = dict[str, dict[str, dict[str, Any]]]  # member -> client id -> `Scores.row`


def _cos(dot: float, a: float, b: float) -> float:
    return dot / (a * b) if a > 0 and b > 0 else 0.0


UNRELATED_POWER = 4.0  # the unrelated rule needs sqrt(n) >= 4 z: its cosine bound z / sqrt(n) at most 0.25


def scores_from_gram(
    gram: np.ndarray,
    factors: Sequence[float],
    rule: Rule,
    numel: int,
    shrink_z: Sequence[float],
    to_step: np.ndarray | None = None,
    step_sq: float = 0.0,
) -> Scores:
    """Norms, cosines and flags from the updates' Gram matrix over `numel` coordinates, the
    updates' row votes `shrink_z` and, where the round had a previous server step s, their dot
    products with it (`to_step`) and its squared norm (module doc)."""
    k = len(factors)
    norm = [math.sqrt(max(float(gram[i, i]), 0.0)) for i in range(k)]
    f = np.asarray(factors, dtype=np.float64)
    to_mean = gram @ f
    mean_norm = math.sqrt(max(float(f @ to_mean), 0.0))
    cos_mean = [_cos(float(to_mean[i]), norm[i], mean_norm) for i in range(k)]
    cos = [[_cos(float(gram[i, j]), norm[i], norm[j]) for j in range(k)] for i in range(k)]
    cos_peers: list[float | None] = [
        statistics.median(cos[i][j] for j in range(k) if j != i) if k > 1 else None for i in range(k)
    ]
    root_n = math.sqrt(max(numel, 1))
    peer_z: list[float | None] = [
        max(abs(cos[i][j]) for j in range(k) if j != i) * root_n if k > 1 else None for i in range(k)
    ]
    step_norm = math.sqrt(max(step_sq, 0.0))
    step_z: list[float | None] = (
        [_cos(float(to_step[i]), norm[i], step_norm) * root_n for i in range(k)]
        if to_step is not None and step_norm > 0
        else [None] * k
    )
    median_norm = statistics.median(norm)

    def flag(n: float, p: float | None, z: float | None, shrink: float, step: float | None) -> bool:
        if rule.flag_shrink_z is not None and shrink < -rule.flag_shrink_z:  # one update's own evidence: no peer
            return True
        if k < PEERS_TO_FLAG or p is None or z is None:
            return False
        if n > rule.flag_norm_ratio * median_norm:
            return True
        unrelated = rule.flag_unrelated_z
        related = z if step is None else max(z, abs(step))
        if unrelated is not None and root_n >= UNRELATED_POWER * unrelated and related < unrelated:
            return True
        return rule.flag_cosine_z is not None and p * root_n < rule.flag_cosine_z

    flagged = [flag(*x) for x in zip(norm, cos_peers, peer_z, shrink_z, step_z, strict=True)]
    return Scores(norm, cos_mean, cos_peers, peer_z, list(shrink_z), flagged, cos, step_z=step_z)


class RowVotes:
    """Per client, the rows of every matrix its update shrank and those it grew: a row votes by
    the sign of sum_j sign(d_j w_j) over its coordinates (below 0: most moved toward 0), fed
    piece by piece in each tensor's order. On the tiny default most rows are token embeddings a
    round barely uses, and AdamW's decoupled decay moves each of their coordinates by -c w_j,
    so a clean update's rows mostly shrink and a sign-flipped one's grow (without the decay
    they shrank less, and not always). One vote a row, not a count of coordinates: the few
    rows a client's gradient moves far (the tokens it used) mostly grow, and counted coordinate
    by coordinate they can cancel the shrinking rest (docs/architecture.md, "Telling a sign
    flip apart")."""

    def __init__(self, k: int) -> None:
        self.shrank = np.zeros(k, dtype=np.int64)
        self.grew = np.zeros(k, dtype=np.int64)
        self.open: dict[str, tuple[int, torch.Tensor]] = {}  # tensor -> (coordinates of its open row, their sums)

    def add(self, info: TensorInfo, signs: torch.Tensor) -> None:
        """One piece of `info`'s tensor: `signs` is k x n, sign(d w) per coordinate."""
        if len(info.shape) < 2:
            return
        width, n = info.shape[-1], signs.shape[1]
        seen, acc = self.open.pop(info.name, (0, torch.zeros(signs.shape[0], dtype=signs.dtype)))
        i = min(width - seen, n) if seen else 0
        if i:
            acc = acc + signs[:, :i].sum(1)
            seen += i
        if seen == width:
            self._vote(acc[:, None])
            seen = 0
        rows = (n - i) // width
        if rows:
            self._vote(signs[:, i : i + rows * width].reshape(signs.shape[0], rows, width).sum(2))
        rest = signs[:, i + rows * width :]
        if rest.shape[1]:
            acc = (acc if seen else torch.zeros_like(acc)) + rest.sum(1)
            seen += rest.shape[1]
        if seen:
            self.open[info.name] = (seen, acc)

    def _vote(self, sums: torch.Tensor) -> None:
        self.shrank += (sums < 0).sum(1).numpy()
        self.grew += (sums > 0).sum(1).numpy()

    def z(self) -> list[float]:
        """Per client, (shrank - grew) / sqrt(shrank + grew): ~N(0, 1) for rows unrelated to their
        values, large and positive where a clean update shrinks its rows (0 without a voting row)."""
        votes = self.shrank + self.grew
        return [float(s - g) / math.sqrt(v) if v else 0.0 for s, g, v in zip(self.shrank, self.grew, votes)]


class _Pass:
    """The combine of one pass over (live clients..., w[, w_before]): the Gram of the updates
    (`gram`), their row votes (`rows`) and, with the global model a round earlier as the last
    input (`step`), each update's dot product with the server's last step w - w_before and that
    step's squared norm; and the output piece from `rule_fn` when the pass writes."""

    def __init__(self, k: int, gram: bool, rule_fn: RuleFn | None, step: bool = False) -> None:
        self.k, self.rule_fn = k, rule_fn
        self.gram = np.zeros((k, k), dtype=np.float64) if gram else None
        self.to_step = np.zeros(k, dtype=np.float64) if step else None
        self.step_sq = 0.0
        self.rows = RowVotes(k)
        self.numel = 0  # floating coordinates seen
        self.scratch = torch.empty(0)

    def stack(self, n: int) -> torch.Tensor:
        """A k x n fp32 scratch matrix, reused across pieces (O(piece x clients))."""
        if self.scratch.numel() < self.k * n:
            self.scratch = torch.empty(self.k * max(n, PIECE_BYTES // 4))
        return self.scratch[: self.k * n].view(self.k, n)

    def __call__(self, info: TensorInfo, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        *clients, w = ins[:-1] if self.to_step is not None else ins
        name = info.name
        if not w.is_floating_point():  # carried, not averaged: every client holds the same values
            for acc in outs:
                for i, x in enumerate(clients):
                    _fold(acc, x, 1.0, i == 0, name)
            return
        if self.gram is not None:
            d = self.stack(w.numel())
            for i, x in enumerate(clients):
                torch.sub(x, w, out=d[i])
            g = torch.mm(d, d.t())
            if not bool(torch.isfinite(g).all()):
                raise NonFinitePiece(repr(name))
            self.gram += g.numpy()
            self.numel += w.numel()
            if self.to_step is not None:
                s = w - ins[-1]
                self.to_step += torch.mv(d, s).numpy()
                self.step_sq += float(torch.dot(s, s))
            self.rows.add(info, d.mul_(w).sign_())  # the scratch is done with d
        if outs and self.rule_fn is not None:
            (acc,) = outs
            self.rule_fn(self, acc, clients, w, info)


class RuleFn(Protocol):
    """Writes one output piece from the clients' pieces and w's (the pass lends its scratch);
    raises NonFinitePiece when the piece is not finite."""

    def __call__(
        self, p: _Pass, acc: torch.Tensor, clients: list[torch.Tensor], w: torch.Tensor, info: TensorInfo
    ) -> None:
        """Write `acc`."""


class _Fold:
    """FedAvg's fold over the clients (and w, when its factor is not 0)."""

    def __init__(self, client_factors: Sequence[float], w_factor: float) -> None:
        self.with_w = w_factor != 0
        self.fold = fold_with([*client_factors, *([w_factor] if self.with_w else [])])

    def __call__(
        self, p: _Pass, acc: torch.Tensor, clients: list[torch.Tensor], w: torch.Tensor, info: TensorInfo
    ) -> None:
        self.fold(info, [*clients, *([w] if self.with_w else [])], [acc])


NETWORK_MAX = 16  # up to this many clients a sorting network beats torch.sort (x10 at k = 4, measured)


def sorting_network(k: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort for k values: compare-exchange pairs (i < j), in order.
    Built for the next power of two and cut to k (the missing values are +inf: their comparators
    are no-ops)."""
    out, size, p = [], 1 << max(k - 1, 0).bit_length(), 1
    while p < size:
        step = p
        while step >= 1:
            for j in range(step % p, size - step, 2 * step):
                for i in range(min(step, size - j - step)):
                    a, b = i + j, i + j + step
                    if a // (2 * p) == b // (2 * p) and b < k:
                        out.append((a, b))
            step //= 2
        p *= 2
    return out


class _Trimmed:
    """Coordinate-wise trimmed mean (b per side) of the clients' values, then the server step.
    The k values of each coordinate are sorted by a sorting network (two elementwise passes per
    comparator, no index tensor) up to `NETWORK_MAX` clients, by torch.sort beyond."""

    def __init__(self, k: int, b: int, server_lr: float) -> None:
        self.k, self.b, self.server_lr = k, b, server_lr
        self.network = sorting_network(k) if k <= NETWORK_MAX else None
        self.spare = torch.empty(0)
        self.order = torch.empty(0, dtype=torch.int64)

    def __call__(
        self, p: _Pass, acc: torch.Tensor, clients: list[torch.Tensor], w: torch.Tensor, info: TensorInfo
    ) -> None:
        n = w.numel()
        stack = p.stack(n)  # the Gram is done with it
        for i, x in enumerate(clients):
            stack[i].copy_(x)
        rows = self._sorted(stack, n)
        keep = rows[self.b : self.k - self.b]
        acc.copy_(keep[0])
        for row in keep[1:]:
            acc.add_(row)
        if len(keep) > 1:
            acc.div_(len(keep))
        if self.server_lr != 1.0:
            acc.mul_(self.server_lr).add_(w, alpha=1.0 - self.server_lr)
        if not all_finite(acc):
            raise NonFinitePiece(repr(info.name))

    def _sorted(self, stack: torch.Tensor, n: int) -> list[torch.Tensor]:
        """The rows of `stack` sorted per coordinate, lowest first (rows may be spare buffers)."""
        if self.network is None:
            if self.order.numel() < self.k * n:
                self.order = torch.empty(self.k * max(n, PIECE_BYTES // 4), dtype=torch.int64)
            values = torch.empty_like(stack)
            torch.sort(stack, dim=0, out=(values, self.order[: self.k * n].view(self.k, n)))
            return list(values)
        if self.spare.numel() < n:
            self.spare = torch.empty(max(n, PIECE_BYTES // 4))
        rows, spare = list(stack), self.spare[:n]
        for a, b in self.network:
            torch.minimum(rows[a], rows[b], out=spare)
            torch.maximum(rows[a], rows[b], out=rows[b])
            rows[a], spare = spare, rows[a]
        return rows


@dataclass
class _Round:
    """One member's live clients and the round's global model (last), in memory or as manifests,
    and the global model a round earlier (`before`, the origin of the server's last step) where
    there is one."""

    labels: list[str]
    shard_bytes: int
    states: list[tuple[int, Mapping[str, torch.Tensor]]] | None = None
    manifests: list[tuple[int, Manifest]] | None = None
    before: tuple[int, Any] | None = None

    def run(self, p: _Pass, out_dir: Path | None) -> Manifest | None:
        """One pass of `p` (`before` last where `p` scores against the server's step); writes
        `out_dir` unless it is None."""
        out_dirs = [] if out_dir is None else [out_dir]
        extra = [self.before] if p.to_step is not None and self.before is not None else []
        if self.states is not None:
            states = combine_states([*self.states, *extra], self.labels, p, len(out_dirs))
            outs = [save_shards(o, d, self.shard_bytes) for o, d in zip(states, out_dirs)]
        else:
            assert self.manifests is not None
            outs = stream_manifests([*self.manifests, *extra], self.labels, p, out_dirs, self.shard_bytes)
        return outs[0] if outs else None

    def client_labels(self) -> list[str]:
        """The live clients' labels, in input order."""
        entries: list[tuple[int, Any]] = self.states if self.states is not None else self.manifests or []
        return [self.labels[i] for i, _ in entries[:-1]]

    def only(self, keep: Sequence[int]) -> _Round:
        """This round over its live clients at positions `keep` (w stays last)."""

        def pick(xs: list[tuple[int, Any]] | None) -> list[tuple[int, Any]] | None:
            return None if xs is None else [*(xs[i] for i in keep), xs[-1]]

        return _Round(self.labels, self.shard_bytes, pick(self.states), pick(self.manifests))


def aggregate_refs(
    items: Sequence[tuple[WeightsRef, Mapping[str, torch.Tensor], float]],
    channel: Channel,
    out_dir: Path,
    previous: Path,
    rule: Rule,
    names: Sequence[str] | None = None,
    server_lr: float = 1.0,
    before: Path | None = None,
) -> tuple[Manifest, Scores]:
    """One member of a round's replies (ref, inline state, num-examples) aggregated by `rule`
    into the fresh weights dir `out_dir`, stepping from `previous` (the round's global weights
    dir) with server learning rate `server_lr`, and the live clients' scores (zero-weight
    clients are skipped: neither read nor scored), against the server's last step too where
    `before` (the global weights dir a round earlier) is given. NaN/Inf uploads raise
    NonFiniteWeightsError naming them; nothing is written."""
    weights, labels = [w for _, _, w in items], _labels(names, len(items))
    metas = [rule.check_upload(r, label) for (r, _, _), label in zip(items, labels)]
    if not replies_inline(items):
        ms = [(channel.manifest(r), w) for (r, _, _), w in zip(items, weights)]
        for (m, _), (r, _, _), label in zip(ms, items, labels):
            if m.update != r.update:
                raise WeightsError(f"{label}: the store entry's update metadata is not its reply's; re-upload it")
        return aggregate_manifests(ms, previous, out_dir, channel.shard_bytes, rule, server_lr, names, before)
    live = [i for i, f in enumerate(weight_factors(weights)) if f != 0]
    w = load_shards(previous)
    states = [
        _model_of(channel.state(r, a), meta, w, previous, label) for (r, a, _), meta, label in zip(items, metas, labels)
    ]
    rnd = _Round([*labels, PREVIOUS, BEFORE], channel.shard_bytes)
    rnd.states = [*((i, states[i]) for i in live), (len(items), w)]
    if before is not None and rule.reads_step(len(live)):
        rnd.before = (len(items) + 1, load_shards(before))
    return _aggregate(rnd, [weights[i] for i in live], rule, server_lr, out_dir)


def _model_of(
    state: Mapping[str, torch.Tensor],
    meta: UpdateMeta | None,
    w: Mapping[str, torch.Tensor],
    previous: Path,
    label: str,
) -> Mapping[str, torch.Tensor]:
    """An inline upload as its client's model: full weights as they are, a compressed update
    decoded onto the round's global model `w` (the bits `walk_shard` decodes piece by piece)."""
    if meta is None:
        return state
    base = Manifest.from_dir(previous)
    check_update(meta, {k: TensorInfo(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in state.items()}, base, label)
    return {t.name: decode_tensor(meta, t, state[t.name], w[t.name]) for t in base.tensors}


def aggregate_manifests(
    inputs: Sequence[tuple[Manifest, float]],
    previous: Manifest | Path,
    out_dir: Path,
    shard_bytes: int,
    rule: Rule,
    server_lr: float = 1.0,
    names: Sequence[str] | None = None,
    before: Path | None = None,
) -> tuple[Manifest, Scores]:
    """`aggregate_refs` over sharded uploads (manifest, num-examples), streamed from disk."""
    weights = [w for _, w in inputs]
    live = [i for i, f in enumerate(weight_factors(weights)) if f != 0]
    if is_update(inputs[live[0]][0]):  # deltas from it: `stream_manifests` checks each against it
        w = previous if isinstance(previous, Manifest) else Manifest.from_dir(previous)
    else:
        w = step_from_manifest(previous, inputs[live[0]][0], "the aggregator and the anomaly scores read it")
    rnd = _Round([*_labels(names, len(inputs)), PREVIOUS, BEFORE], shard_bytes)
    rnd.manifests = [*((i, inputs[i][0]) for i in live), (len(inputs), w)]
    if before is not None and rule.reads_step(len(live)):
        rnd.before = (len(inputs) + 1, step_from_manifest(before, w, "the unrelated rule's step score reads it"))
    return _aggregate(rnd, [weights[i] for i in live], rule, server_lr, out_dir)


def _aggregate(rnd: _Round, weights: list[float], rule: Rule, eta: float, out_dir: Path) -> tuple[Manifest, Scores]:
    """The rule's pass(es) over one member's live clients (their num-examples `weights`): one pass
    that writes the aggregate and scores beside it, or, for `clipped` (which needs the norms) and
    `drop_flagged` (which needs the flags), a read-only scoring pass and a second that writes."""
    k, factors = len(weights), weight_factors(weights)
    trim = rule.trim(k) if rule.aggregator in ("trimmed_mean", "median") else 0
    step = rnd.before is not None
    if rule.aggregator != "clipped" and not rule.drop_flagged:
        one = _Pass(k, gram=True, rule_fn=_writer(rule, weights, [], trim, eta), step=step)
        out = rnd.run(one, out_dir)
        assert out is not None and one.gram is not None
        return out, scores_from_gram(one.gram, factors, rule, one.numel, one.rows.z(), one.to_step, one.step_sq)
    first = _Pass(k, gram=True, rule_fn=None, step=step)
    rnd.run(first, None)
    assert first.gram is not None
    scores = scores_from_gram(first.gram, factors, rule, first.numel, first.rows.z(), first.to_step, first.step_sq)
    keep = list(range(k))
    if rule.drop_flagged:
        keep = [i for i, f in enumerate(scores.flagged) if not f]
        if not keep:
            raise WeightsError(
                f"every client of the round was flagged ({', '.join(rnd.client_labels())}): "
                "federation.drop_flagged leaves nothing to aggregate; see the round's update_scores"
            )
        scores = replace(scores, excluded=list(scores.flagged))
        # the trim is there for the bad values; the ones dropped whole have spent that much of it
        trim = (len(keep) - 1) // 2 if rule.aggregator == "median" else max(0, trim - (k - len(keep)))
    writer = _writer(rule, [weights[i] for i in keep], [scores.norm[i] for i in keep], trim, eta)
    out = rnd.only(keep).run(_Pass(len(keep), gram=False, rule_fn=writer), out_dir)
    assert out is not None
    return out, scores


def _writer(rule: Rule, weights: list[float], norms: list[float], trim: int, eta: float) -> RuleFn:
    """The pass's output for these clients (their num-examples weights and update norms; `trim`
    values per side for the coordinate-wise rules) with server learning rate `eta`."""
    if rule.aggregator == "fedavg":
        return _Fold(*server_step_factors(weights, eta, has_previous=True))
    if rule.aggregator == "clipped":
        factors, bound = weight_factors(weights), rule.clip_multiple * statistics.median(norms)
        kept = [min(1.0, bound / n) if n > 0 else 1.0 for n in norms]
        w_factor = eta * sum(f * (1.0 - s) for f, s in zip(factors, kept)) + (1.0 - eta)
        return _Fold([eta * f * s for f, s in zip(factors, kept)], w_factor)
    return _Trimmed(len(weights), trim, eta)


def flagged_clients(scores: RoundScores, key: str = "flagged") -> list[int]:
    """The clients any member's scores flag (member -> client id -> scores, as `Scores.row`), or
    mark with another boolean `key` (`excluded`)."""
    return sorted({int(c) for rows in scores.values() for c, row in rows.items() if row.get(key)})
