"""Fault injection for the robustness experiments (`faults.poison`, issue #39): a poisoned
client replaces its update d = x - w by 100 d, -d, or Gaussian noise of d's norm, after its
trainer exported x and before the upload, so the server sees exactly what a malicious or broken
client would send. Seeded by (run.seed, round, client, member): reruns poison the same bits."""

from __future__ import annotations

import hashlib
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from fl_app.calls import Call, FitCall
from fl_app.config import Config, PoisonCfg
from fl_app.weights import load_shards, save_shards
from partitions.uniform import round_clients, sampling_seed


def poisons(cfg: Config, round_: int, client: int) -> bool:
    """Whether `client` poisons its round-`round_` update: a listed client, or (no list) the
    round's first sampled client."""
    p = cfg.faults.poison
    if p.kind == "none":
        return False
    if p.clients:
        return client in p.clients
    f = cfg.federation
    seed = sampling_seed(cfg.run.seed, f.sampling_seed)
    return round_clients(seed, round_, f.clients, f.clients_per_round, only_clients=f.only_clients)[0] == client


def noise_seed(seed: int, round_: int, client: int, member: str) -> int:
    digest = hashlib.sha256(f"poison/{seed}/{round_}/{client}/{member}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def poisoned(
    w: dict[str, torch.Tensor], x: dict[str, torch.Tensor], p: PoisonCfg, seed: int
) -> dict[str, torch.Tensor]:
    """The state a poisoned client sends instead of `x` (its export), `w` the round's global
    model: every floating tensor's update transformed (module doc); other tensors are kept."""
    floats = [k for k, t in x.items() if t.is_floating_point()]
    d = {k: x[k] - w[k] for k in floats}
    if p.kind == "scale":
        bad = {k: d[k] * p.factor for k in floats}
    elif p.kind == "sign_flip":
        bad = {k: -d[k] for k in floats}
    elif p.kind == "noise":
        g = torch.Generator().manual_seed(seed)
        z = {k: torch.randn(d[k].shape, generator=g) for k in floats}
        bad = {k: z[k] * (_norm(d) / _norm(z)) for k in floats}
    else:
        raise ValueError(f"faults.poison.kind={p.kind!r} poisons nothing")
    return {k: (w[k] + bad[k] if k in bad else t) for k, t in x.items()}


def _norm(state: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in state.values()))


def poison_fit(cfg: Config, call: Call, ins: Mapping[str, Path], outs: Mapping[str, Path]) -> None:
    """Rewrite a poisoned fit's exports (`outs`, member -> dir) as the poisoned updates from the
    round's global model (`ins`); nothing for a clean fit, an evaluation or `faults.poison.kind: none`."""
    if not isinstance(call, FitCall) or not poisons(cfg, call.round, call.client_id):
        return
    for member, out_dir in outs.items():
        w, x = load_shards(ins[member]), load_shards(out_dir)
        bad = poisoned(w, x, cfg.faults.poison, noise_seed(cfg.run.seed, call.round, call.client_id, member))
        shutil.rmtree(out_dir)
        save_shards(bad, out_dir, int(cfg.run.shard_max_mb * 2**20))
