"""FedAvg and FedProx over *logical* clients: a client sampler composed with a streaming fp32
aggregator. Neither is a Flower `Strategy`, on purpose.

Flower's `Strategy.start()` drives a round with the global model in RAM (an ArrayRecord in every
message, `aggregate_train` returning one, `evaluate_fn` receiving one). This server never holds
the model: round 0 is exported by a trainer lane, weights above `run.inline_max_mb` travel
through the weight store by manifest, aggregation streams fp32 shards from disk into the
checkpoint, and a round can lose and re-dispatch a client. Subclassing FedAvg/FedProx while
replacing every method Flower calls (as this module once did) only borrowed their names; so:

- `ClientSampler` picks each round's logical client ids (a pure function of (seed, round),
  invariant 5) and maps them onto the connected nodes round-robin, so a simulation with a
  handful of SuperNodes (or one GPU lane) serves the published 100-client protocol;
- `StreamingAggregator` is FedAvg (the num-examples-weighted mean, fl_app.aggregate) for every
  member the run federates (the actor, and for PPO the critic, with the same weights: invariant
  7), or the robust aggregator `federation.aggregator` names (fl_app.robust), and scores every
  client's update either way. FedProx is the same average: like Flower's FedProx, the strategy
  only sets `proximal_mu` in every fit call, and the client applies the term (to the policy
  only, invariant 4).

A reply (fl_app.calls.Reply) names each member's weights by a `WeightsRef`, with its inline
arrays under `fl_app.channel.arrays_key(member)`; the aggregator receives the refs. A reply may
name only its own client's upload keys of the round (`check_reply_keys`), and each entry it names
must resolve and load (a DirStore refuses a symlink out of the run dir): anything else is
`ClientRefused`, which the round loop treats as that client failing, never averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import Message

from fl_app.calls import RECORD, Reply
from fl_app.channel import Channel, arrays_key
from fl_app.channel.remote import WeightStoreUnreachable
from fl_app.outcomes import outcome_key
from fl_app.robust import FEDAVG, RoundScores, Rule, aggregate_refs
from fl_app.weights import Manifest, WeightsError
from partitions.uniform import round_clients
from server_app.packed import unpack


class RoundError(RuntimeError):
    """A round cannot be completed (too many clients failed, or replies are inconsistent)."""


@dataclass(frozen=True)
class ClientFailure:
    """One failed attempt of a logical client in a round (the metrics row lists them)."""

    client: int
    node: int
    reason: str  # one line (server_app.errors.one_line)

    def as_dict(self) -> dict[str, Any]:
        return {"client": self.client, "node": self.node, "reason": self.reason}


class ClientRefused(WeightsError):
    """A reply the server will not use, blamed on its client (`client`): the round drops that
    client like a failed one, or fails closed when it cannot afford to."""

    def __init__(self, client: int, reason: str) -> None:
        super().__init__(reason)
        self.client = client


def check_reply_keys(who: str, reply: Reply, own: Mapping[str, str]) -> None:
    """`reply` names exactly the members of `own` (member -> the one store key its sender may
    upload that member under), each inline or under that key: another client's upload, a global
    entry or another round's key is refused (WeightsError naming the key), as the store's
    credentials would refuse the write itself (a shared disk or object store has none)."""
    if set(reply.weights) != set(own):
        raise WeightsError(f"{who}'s reply carries {sorted(reply.weights)}, not the run's {sorted(own)}")
    for member, ref in sorted(reply.weights.items()):
        if ref.key != ("" if ref.inline else own[member]):
            raise WeightsError(
                f"{who}'s reply names {ref.key!r} for {member!r}; only its own upload {own[member]!r} "
                "(or inline arrays) is accepted"
            )


class ClientSampler:
    """Which logical clients train in a round, and on which node."""

    def __init__(
        self, *, seed: int, num_clients: int, per_round: int, over_select: int = 0, only_clients: Sequence[int] = ()
    ) -> None:
        self.seed, self.num_clients, self.per_round = seed, num_clients, per_round
        self.over_select, self.only_clients = over_select, list(only_clients)

    def sample(self, server_round: int) -> list[int]:
        """The round's clients in sample order (partitions.uniform.round_clients)."""
        return round_clients(
            self.seed, server_round, self.num_clients, self.per_round, self.over_select, self.only_clients
        )

    @staticmethod
    def assign(clients: Sequence[int], nodes: Sequence[int]) -> dict[int, int]:
        """client id -> node id, round-robin over the sorted nodes."""
        if not nodes:
            raise RoundError(
                'no SuperNode is connected; start at least one (in simulation: --federation-config "num-supernodes=2")'
            )
        order = sorted(nodes)
        return {cid: order[i % len(order)] for i, cid in enumerate(clients)}


class StreamingAggregator:
    """FedAvg (or FedProx: the same average, plus `proximal_mu` in every fit call) of every
    member, streamed shard by shard into the round's checkpoint; with a server learning rate
    eta != 1, the step w + eta * (avg - w) from the round's global model w instead. `rule`
    picks a robust aggregator in place of the mean and the flag thresholds (fl_app.robust);
    every member's updates are scored whatever the aggregator."""

    def __init__(self, name: str, proximal_mu: float, server_lr: float = 1.0, rule: Rule = FEDAVG) -> None:
        if name not in ("fedavg", "fedprox"):
            raise ValueError(f"unknown strategy {name!r}; use fedavg or fedprox")
        self.name, self.proximal_mu = name, proximal_mu
        self.server_lr, self.rule = server_lr, rule

    @property
    def fit_mu(self) -> float:
        """The `proximal_mu` of every fit call (Flower's FedProx sends the same value): 0 for FedAvg."""
        return self.proximal_mu if self.name == "fedprox" else 0.0

    def aggregate_train(
        self,
        replies: Mapping[int, Message],
        channel: Channel,
        out_dirs: Mapping[str, Path],
        upload_keys: Callable[[int], Mapping[str, str]],
        previous_dirs: Mapping[str, Path],
        before_dirs: Mapping[str, Path] | None = None,
    ) -> tuple[dict[str, Manifest], dict[str, float], RoundScores]:
        """Aggregate every member of `replies` (client id -> its successful reply, in client order)
        into its `out_dirs[member]`, all members with the same `num-examples` weights;
        `upload_keys(client)` is member -> the key that client may upload under (anything else
        is `ClientRefused`); `previous_dirs` hold the round's global model (the updates' origin),
        `before_dirs` the one a round earlier, where there is one (the server's last step, which
        the scores read).
        Returns the manifests, the weighted train metrics and per member the clients' anomaly
        scores (member -> client id -> `fl_app.robust.Scores.row`)."""
        done = {c: accepted_reply(c, m, channel, upload_keys(c)) for c, m in replies.items()}
        metrics = [metrics_of(m) for m in replies.values()]
        manifests: dict[str, Manifest] = {}
        scores: RoundScores = {}
        for member, out_dir in out_dirs.items():
            items = [
                (done[c].weights[member], inline_state(m, member), x["num-examples"])
                for (c, m), x in zip(replies.items(), metrics)
            ]
            names = [f"client {c} ({member})" for c in replies]
            manifests[member], got = aggregate_refs(
                items,
                channel,
                out_dir,
                previous_dirs[member],
                self.rule,
                names,
                self.server_lr,
                (before_dirs or {}).get(member),
            )
            scored = [c for (c, _), (_, _, w) in zip(replies.items(), items) if w > 0]  # zero-weight: not read
            scores[member] = got.row(scored)
        return manifests, weighted_metrics(metrics), scores


def accepted_reply(client: int, msg: Message, channel: Channel, own: Mapping[str, str]) -> Reply:
    """Client `client`'s reply, once it names only its own upload keys and every entry it names
    resolves (for a remote store: is fetched and verified into the server's cache, where the
    average reads it for free); else `ClientRefused` with a one-line reason. A store that does
    not answer is the server's problem, not the client's: that error passes through."""
    reply = reply_of(msg)
    try:
        check_reply_keys(f"client {client}", reply, own)
        for ref in reply.weights.values():
            if not ref.inline:
                channel.manifest(ref)
    except WeightStoreUnreachable:
        raise
    except WeightsError as e:
        raise ClientRefused(client, f"client {client}'s reply was refused: {e}") from e
    return reply


def inline_state(msg: Message, member: str) -> dict[str, torch.Tensor]:
    """The inline weights of `member` a message carries (empty when they travel by reference)."""
    return unpack(msg.content.array_records.get(arrays_key(member)))


def reply_of(msg: Message) -> Reply:
    """A node's typed reply (fl_app.calls.Reply)."""
    return Reply.model_validate_json(str(msg.content.config_records[RECORD][RECORD]))


def metrics_of(msg: Message) -> dict[str, float]:
    """A reply's metric record as floats: our replies carry numbers only, so a list is refused."""
    out = {}
    for k, v in msg.content.metric_records["metrics"].items():
        if not isinstance(v, int | float):
            raise TypeError(f"metric {k!r} of a reply is a {type(v).__name__}, not a number")
        out[k] = float(v)
    return out


def weighted_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """num-examples-weighted mean of every metric over the replies that carry it, num-examples
    summed. An outcome share a reply lacks is 0 there (no episode ended so); any other metric a
    reply lacks does not exist there (a fit that took no step has no loss), so it does not count."""
    total = sum(r["num-examples"] for r in records) or 1.0
    keys = sorted(set().union(*(set(r) for r in records)) - {"num-examples"})
    out = {}
    for k in keys:
        weight = total if outcome_key("", "") in k else sum(r["num-examples"] for r in records if k in r) or 1.0
        out[k] = sum(r[k] * r["num-examples"] for r in records if k in r) / weight
    out["num-examples"] = int(total)
    return out
