"""FedAvg and FedProx over *logical* clients, with streaming fp32 aggregation.

Both subclass Flower's strategies and keep their hyperparameters (FedProx's `proximal_mu` is
sent in every train config as `proximal-mu`, as Flower does), but change two things:

- Sampling picks logical client ids (a pure function of (seed, round), invariant 5) and maps
  them onto the connected nodes round-robin, so a simulation with a handful of SuperNodes (or
  one GPU lane) serves the published 100-client protocol, and a run with fewer nodes than
  asked never waits for nodes that will not come.
- Aggregation streams fp32 safetensors shards weighted by `num-examples` (fl_app.aggregate),
  instead of holding every client's full model in numpy, for every member the run federates:
  the actor, and for PPO the critic, with the same weights (invariant 7).

A message carries each member's weights under its own name: the ArrayRecord
`fl_app.transport.arrays_key(member)` and the `WeightsRef` config entries prefixed `member`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx

from fl_app.store import WeightStore
from fl_app.transport import WeightsRef, arrays_key, fedavg_received
from fl_app.weights import Manifest
from partitions.uniform import sample_clients


class RoundError(RuntimeError):
    """A round cannot be completed (a client failed, or replies are inconsistent)."""


class LogicalClientsMixin:
    """Shared by FedAvgAgent and FedProxAgent; see the module docstring."""

    def setup(self, *, seed: int, num_clients: int, per_round: int, shard_max_bytes: int,
              only_clients: list[int] | None = None) -> None:
        self.seed, self.num_clients, self.per_round = seed, num_clients, per_round
        self.shard_max_bytes = shard_max_bytes
        self.only_clients = list(only_clients or [])
        self.last_sampled: list[int] = []

    def sample(self, server_round: int) -> list[int]:
        """federation.only_clients when set (the local-only baseline), else a seeded draw."""
        if self.only_clients:
            return list(self.only_clients)
        return sample_clients(self.seed, server_round, self.num_clients, self.per_round)

    def configure_train(self, server_round: int, arrays: Mapping[str, ArrayRecord], config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One train message per sampled client; `arrays` maps RecordDict keys (one per member)
        to the global weights' ArrayRecords (empty when they travel through the store)."""
        nodes = sorted(grid.get_node_ids())
        if not nodes:
            raise RoundError("no SuperNode is connected; start at least one (in simulation: "
                             "--federation-config \"num-supernodes=2\")")
        self.last_sampled = self.sample(server_round)
        config["server-round"] = server_round
        if isinstance(self, FedProx):
            config["proximal-mu"] = float(self.proximal_mu)
        messages = []
        for k, cid in enumerate(self.last_sampled):
            per_client = ConfigRecord({**dict(config), "client-id": cid})
            messages.append(Message(content=RecordDict({**arrays, "config": per_client}),
                                    message_type=MessageType.TRAIN, dst_node_id=nodes[k % len(nodes)]))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message], store: WeightStore,
                        out_dirs: Mapping[str, Path]) -> tuple[dict[str, Manifest], MetricRecord]:
        """Fail closed on any failed or missing client, then average every member into its
        `out_dirs[member]` (fp32), all members with the same `num-examples` weights."""
        replies = list(replies)
        errors = [m.error.reason for m in replies if m.has_error()]
        if errors:
            raise RoundError(f"round {server_round}: {len(errors)} client fit(s) failed: " + " | ".join(errors))
        got = sorted(int(m.content["config"]["client-id"]) for m in replies)
        if got != sorted(self.last_sampled):
            raise RoundError(f"round {server_round}: replies from clients {got}, expected {sorted(self.last_sampled)}")
        replies.sort(key=lambda m: int(m.content["config"]["client-id"]))
        manifests = {}
        for member, out_dir in out_dirs.items():
            items = [(WeightsRef.from_config(m.content["config"], prefix=member),
                      m.content.get(arrays_key(member), ArrayRecord()),
                      float(m.content["metrics"]["num-examples"])) for m in replies]
            manifests[member] = fedavg_received(items, store, out_dir, self.shard_max_bytes)
        return manifests, _weighted_metrics([m.content["metrics"] for m in replies])


def _weighted_metrics(records: list[MetricRecord]) -> MetricRecord:
    """num-examples-weighted mean of every float metric; num-examples summed."""
    total = sum(float(r["num-examples"]) for r in records) or 1.0
    keys = sorted(set().union(*(set(r.keys()) for r in records)) - {"num-examples"})
    out = {k: sum(float(r[k]) * float(r["num-examples"]) for r in records if k in r) / total for k in keys}
    out["num-examples"] = int(total)
    return MetricRecord(out)


class FedAvgAgent(LogicalClientsMixin, FedAvg):
    """FedAvg over logical clients (fraction_evaluate=0: validation runs on a trainer lane)."""


class FedProxAgent(LogicalClientsMixin, FedProx):
    """FedProx over logical clients; the client applies mu to the policy only (invariant 4)."""


def make_strategy(name: str, proximal_mu: float) -> LogicalClientsMixin:
    common = dict(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=1, min_evaluate_nodes=1,
                  min_available_nodes=1)
    if name == "fedprox":
        return FedProxAgent(proximal_mu=proximal_mu, **common)
    return FedAvgAgent(**common)
