"""The env services a lane trains its clients' environment variants on (issue 19).

A lane serves many logical clients in turn. Under an `env_partition` other than `uniform` each
client trains on its own variant of the environment (a catalog split, a ranking, lookalike
products, its own ALFWorld scenes: partitions/env_variants.py), while validation always uses the
lane's unperturbed env service. Each variant gets an env service of its own, built from the
variant record (content-hashed) and started on first use; the last `keep` stay warm for the
clients that come back (a lane trains the same few clients in a row when they are re-sampled)
and older ones are stopped. A service is keyed by the variant's content hash, which covers the
client id, so one client's variant is never served to another, and the trainer checks the
service's `/info` names the hash it asked for before any episode is played (`loop.RLTrainer`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from envs.base import Env
from envs.registry import make_env
from envs.service import serve_in_subprocess
from fl_app.config import Config
from partitions.env_variants import EnvPartition, EnvVariant, client_variant, engine_facts

log = logging.getLogger("fedagent.service")

KEEP = 3  # warm variant services per lane: ~1 pool of engines each (a shop pool is ~tens of MB)


@dataclass(frozen=True)
class ClientEnv:
    """Where one client's fit plays: the env service URL and the tasks it may draw from."""

    url: str
    tasks: list[int]
    variant: EnvVariant


class VariantEnvServices:
    """Per-client variant env services of one lane, started lazily, at most `keep` alive."""

    def __init__(self, cfg: Config, keep: int = KEEP, base: Env | None = None) -> None:
        """`base`: the unperturbed engine, when the caller has built one already (the lane has)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.cfg, self.keep = cfg, keep
        self.partition = EnvPartition.of(cfg.env_partition.model_dump())
        self.partition.check()
        base = base if base is not None else make_env(cfg.env.name, **cfg.env.params)
        self.facts, self.val_size = engine_facts(base), base.val_size
        self._live: OrderedDict[str, tuple[str, contextlib.ExitStack]] = OrderedDict()
        self.started = 0

    def variant(self, client_id: int, shard: Sequence[int]) -> EnvVariant:
        """Client `client_id`'s variant: a pure function of (client, shard, env, knobs), the one the
        server records in partition.json."""
        return client_variant(
            self.partition, self.cfg.env.name, client_id, self.cfg.federation.clients, shard, self.facts, self.val_size
        )

    def for_client(self, client_id: int, shard: Sequence[int]) -> ClientEnv:
        """Client `client_id`'s variant (its task shard `shard`) and a service serving it."""
        variant = self.variant(client_id, shard)
        key = variant.content_hash
        if key in self._live:
            self._live.move_to_end(key)
        else:
            while len(self._live) >= self.keep:
                _, (_, stack) = self._live.popitem(last=False)
                stack.close()
            self._live[key] = self._start(variant)
        url = self._live[key][0]
        # env_disjoint narrows the client's games (its engine refuses the others); every other
        # variant keeps the task shard and its order
        tasks = list(variant.tasks) if self.partition.name == "env_disjoint" else list(shard)
        return ClientEnv(url, tasks, variant)

    def _start(self, variant: EnvVariant) -> tuple[str, contextlib.ExitStack]:
        env = self.cfg.env
        stack = contextlib.ExitStack()
        try:
            url = stack.enter_context(
                serve_in_subprocess(env.name, env.pool_size, env.params, variant=variant.to_dict())
            )
        except BaseException:
            stack.close()
            raise
        self.started += 1
        log.info(
            "env variant %s of client %d (%s): service %s",
            variant.label,
            variant.client_id,
            variant.content_hash[:12],
            url,
        )
        return url, stack

    def close(self) -> None:
        """Stop every variant service this lane started."""
        while self._live:
            _, (_, stack) = self._live.popitem()
            stack.close()
