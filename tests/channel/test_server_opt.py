"""Server optimizers (fl_app.server_opt): each step equals a plain torch computation on whole
tensors, bit for bit, over rounds that thread the moments; `sgd` stays the aggregation's own
fold; a step that cannot be computed exactly from verified inputs writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_app.aggregate import fedavg_manifests
from fl_app.config import FederationCfg
from fl_app.server_opt import ServerOptimizer
from fl_app.weights import Manifest, WeightsError, load_shards, same_layout, save_shards

SHARD = 100_000  # bytes: several shards per member; one tensor spans several 1 MiB pieces
# knobs that differ from each other and from the defaults, so a swapped knob shows
OPTIMIZERS = {
    "fedavgm": ServerOptimizer("fedavgm", lr=0.7, momentum=0.6),
    "fedadam": ServerOptimizer("fedadam", lr=0.03, beta1=0.8, beta2=0.95, tau=1e-2),
    "nesterov": ServerOptimizer("nesterov", lr=0.55, momentum=0.85),
}


def _members(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """An actor (a 300,001-float tensor crosses piece boundaries with a ragged tail) and a PPO
    critic, each with a non-floating buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "actor": {
            "embed": torch.randn(300_001, generator=g),
            "layers.0.w": torch.randn(64, 64, generator=g),
            "layers.0.b": torch.randn(64, generator=g) * 1e-3,
            "position_ids": torch.arange(8),
            "head": torch.randn(40_000, generator=g),
        },
        "critic": {
            "body.w": torch.randn(120_000, generator=g),
            "value_head.w": torch.randn(64, generator=g),
            "steps": torch.tensor([3, 1, 4]),
        },
    }


def _client(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in w.items()}


def _reference(name: str, opt: ServerOptimizer, w, avg, state):
    """The step on whole tensors, in plain torch, in the module doc's operation order."""
    if name == "fedavgm":
        (m,) = state
        d = avg - w
        m = m * opt.momentum + d
        return w + m * opt.lr, [m]
    if name == "fedadam":
        m, v = state
        d = avg - w
        m = m * opt.beta1 + d * (1 - opt.beta1)
        v = v * opt.beta2 + (d * d) * (1 - opt.beta2)
        return w + (m / (v.sqrt() + opt.tau)) * opt.lr, [m, v]
    (m,) = state
    g = w - avg
    m = m * opt.momentum + g
    return w - (g + m * opt.momentum) * opt.lr, [m]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_steps_as_plain_torch_over_three_rounds_bit_for_bit(tmp_path, name):
    """Three rounds of clients -> FedAvg mean -> step, every member (actor and critic) and every
    moment against the whole-tensor reference, the moments threaded from round to round (zeros
    before round 1); non-floating buffers are the clients', and zeros in the moments."""
    opt = OPTIMIZERS[name]
    ref = {m: dict(s) for m, s in _members(0).items()}
    ref_state = {m: [{k: torch.zeros_like(v) for k, v in s.items()} for _ in opt.moments] for m, s in ref.items()}
    glob = {m: save_shards(s, tmp_path / "r0" / m, SHARD).root for m, s in ref.items()}
    assert len(Manifest.from_dir(glob["actor"]).shards) >= 3
    state: dict[str, list[Path] | None] = dict.fromkeys(ref)
    for r in (1, 2, 3):
        for member in ref:
            clients = [_client(load_shards(glob[member]), 100 * r + c) for c in range(3)]
            ups = [save_shards(s, tmp_path / f"r{r}" / "up" / f"{member}-{c}", SHARD) for c, s in enumerate(clients)]
            mean = fedavg_manifests(
                [(u, n) for u, n in zip(ups, [5, 9, 2])], tmp_path / f"r{r}" / "mean" / member, SHARD
            )
            out, outs = tmp_path / f"r{r}" / member, [tmp_path / f"r{r}" / "opt" / member / m for m in opt.moments]
            got = opt.step(glob[member], mean.root, state[member], out, outs, member)
            avg = load_shards(mean.root)
            new_state = [load_shards(p) for p in outs]
            for k, w in ref[member].items():
                if not w.is_floating_point():
                    assert torch.equal(load_shards(out)[k], avg[k]) and all(not s[k].any() for s in new_state)
                    continue
                want_w, want_state = _reference(name, opt, w, avg[k], [s[k] for s in ref_state[member]])
                assert _bits(load_shards(out)[k]) == _bits(want_w), (r, member, k)
                for got_s, want_s in zip(new_state, want_state):
                    assert _bits(got_s[k]) == _bits(want_s), (r, member, k)
                ref[member][k] = want_w
                for s, want_s in zip(ref_state[member], want_state):
                    s[k] = want_s
            assert same_layout([got, *(Manifest.from_dir(p) for p in outs)])  # the moments: the member's layout
            glob[member], state[member] = out, outs
    # the steps moved the model away from plain FedAvg (the moments carry history)
    assert not torch.equal(
        load_shards(glob["actor"])["embed"], load_shards(tmp_path / "r3" / "mean" / "actor")["embed"]
    )


def test_sgd_is_the_aggregations_own_fold_and_each_optimizer_resolves_its_published_defaults():
    """The default is `sgd`: no optimizer object, the fold's server_lr as before (1 = FedAvg bit for
    bit, tests/channel/test_aggregate.py); the others fill FedOpt's and DiLoCo's defaults."""
    fed = FederationCfg()
    assert fed.server_optimizer == "sgd" and ServerOptimizer.from_config(fed) is None and fed.fold_lr() == 1.0
    assert FederationCfg(server_lr=1.5).fold_lr() == 1.5
    assert ServerOptimizer.from_config(FederationCfg(server_optimizer="fedavgm")) == ServerOptimizer(
        "fedavgm", lr=1.0, momentum=0.9
    )
    adam = FederationCfg(server_optimizer="fedadam", server_lr=0.01)
    assert adam.fold_lr() == 1.0  # the aggregation writes the plain mean, the optimizer steps from it
    assert ServerOptimizer.from_config(adam) == ServerOptimizer("fedadam", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)
    assert ServerOptimizer.from_config(FederationCfg(server_optimizer="nesterov")) == ServerOptimizer(
        "nesterov", lr=0.7, momentum=0.9
    )


def test_fedavgm_without_momentum_is_the_sgd_step_to_rounding(tmp_path):
    """beta = 0 leaves w + eta (avg - w): the sgd fold's value, by another operation order."""
    members, eta = _members(1), 1.5
    w, clients = members["actor"], [_client(members["actor"], s) for s in (1, 2)]
    ups = [save_shards(c, tmp_path / f"c{i}", SHARD) for i, c in enumerate(clients)]
    prev = save_shards(w, tmp_path / "w", SHARD)
    sgd = load_shards(
        fedavg_manifests([(u, 1) for u in ups], tmp_path / "sgd", SHARD, previous=prev, server_lr=eta).root
    )
    mean = fedavg_manifests([(u, 1) for u in ups], tmp_path / "mean", SHARD)
    opt = ServerOptimizer("fedavgm", lr=eta, momentum=0.0)
    got = load_shards(opt.step(prev.root, mean.root, None, tmp_path / "out", [tmp_path / "m"]).root)
    for k in w:
        torch.testing.assert_close(got[k], sgd[k], rtol=1e-6, atol=1e-6)


def _setup(tmp_path: Path, w: dict[str, torch.Tensor], avg: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    return save_shards(w, tmp_path / "w", SHARD).root, save_shards(avg, tmp_path / "avg", SHARD).root


def _nothing_in(*dirs: Path) -> bool:
    return not any((d / "manifest.json").exists() for d in dirs)


def test_a_step_that_overflows_writes_nothing_and_names_the_tensor(tmp_path):
    w = _members(2)["actor"]
    avg = {k: v.clone() for k, v in w.items()}
    w["head"][7], avg["head"][7] = 3e38, -3e38  # Delta = -6e38: beyond fp32
    opt = OPTIMIZERS["fedadam"]
    outs = [tmp_path / "m", tmp_path / "v"]
    with pytest.raises(WeightsError, match="overflowed fp32 in actor tensor 'head'"):
        opt.step(*_setup(tmp_path, w, avg), None, tmp_path / "out", outs)
    assert _nothing_in(tmp_path / "out", *outs)


def test_corrupt_or_foreign_moments_are_refused_and_nothing_is_written(tmp_path):
    w = _members(3)["actor"]
    prev, mean = _setup(tmp_path, w, _client(w, 4))
    opt = OPTIMIZERS["nesterov"]
    opt.step(prev, mean, None, tmp_path / "g1", [tmp_path / "m1"])
    shard = tmp_path / "m1" / Manifest.from_dir(tmp_path / "m1").shards[-1].file
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # one flipped bit in the moment's last tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="is corrupt"):
        opt.step(tmp_path / "g1", mean, [tmp_path / "m1"], tmp_path / "g2", [tmp_path / "m2"])
    assert _nothing_in(tmp_path / "g2", tmp_path / "m2")
    other = save_shards(w, tmp_path / "other-layout", 4 * SHARD).root  # run.shard_max_mb changed on resume
    with pytest.raises(WeightsError, match="does not lay its tensors out"):
        opt.step(prev, mean, [other], tmp_path / "g3", [tmp_path / "m3"])
    with pytest.raises(WeightsError, match="keeps moments"):
        opt.step(prev, mean, None, tmp_path / "g4", [tmp_path / "m4", tmp_path / "v4"])
