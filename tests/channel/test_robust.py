"""Robust aggregation and anomaly scores (fl_app.robust, issue #39): every aggregator against a
plain torch reference on multi-shard models, inline == streamed bit for bit, deterministic,
FedAvg's bits unchanged, scores against a reference, poisoned updates flagged and clean ones
not, non-finite uploads refused even where a trim would drop them, peak memory O(piece x
clients), and PPO's critic aggregated beside the actor."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from robust_support import aggregate_reference

from client_app.poison import noise_seed, poisoned, poisons
from fl_app.aggregate import NonFiniteWeightsError, fedavg_refs
from fl_app.calls import RECORD, Reply
from fl_app.channel import Channel, WeightsRef
from fl_app.channel.run_dir import DirStore
from fl_app.config import ConfigError, PoisonCfg, load_config
from fl_app.robust import NETWORK_MAX, RowVotes, Rule, aggregate_refs, sorting_network
from fl_app.weights import TensorInfo, WeightsError, load_shards, save_shards
from partitions.uniform import sample_clients, sampling_seed
from server_app.strategy import StreamingAggregator

SHARD = 20_000  # bytes: many shards per model, tensors spanning shards' pieces
AGGREGATORS = ("fedavg", "clipped", "trimmed_mean", "median")


def _net(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    return {k: v.detach().clone() for k, v in net.state_dict().items()} | {"ids": torch.arange(6)}


def _trained(w: dict[str, torch.Tensor], seed: int, steps: int = 4) -> dict[str, torch.Tensor]:
    """A client's real local training from `w`: a few Adam steps on its own samples of one shared
    regression task (as clients of one federation train on their own shards of one env)."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    net.load_state_dict({k: v for k, v in w.items() if k != "ids"})
    task = torch.Generator().manual_seed(1234)
    target = torch.randn(64, 64, generator=task) / 8
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g)
        loss = ((net(x) - x @ target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()} | {"ids": w["ids"].clone()}


def _channel(root: Path, inline: bool) -> Channel:
    return Channel(
        DirStore(root, SHARD), cache_dir=root / "cache", inline_max_bytes=1 << 30 if inline else 0, shard_bytes=SHARD
    )


def _items(root: Path, channel: Channel, states: list[dict[str, torch.Tensor]], weights: list[float]) -> list:
    """The round's replies as the server receives them: (ref, inline arrays, num-examples)."""
    out = []
    for c, (s, n) in enumerate(zip(states, weights)):
        key = f"uploads/{root.name}/client-{c}"
        assert isinstance(channel.store, DirStore)
        ref, arrays = channel.put(save_shards(s, channel.store.path(key), SHARD).root, key)
        out.append((ref, arrays, n))
    return out


def _bits(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().numpy().tobytes() for t in state.values())


@pytest.mark.parametrize("agg", AGGREGATORS)
def test_each_aggregator_matches_its_definition_inline_and_streamed_bit_for_bit(tmp_path, agg):
    w = _net(0)
    states = [_trained(w, s) for s in range(4)] + [_trained(w, 9, steps=40)]  # one large update to clip
    weights = [3.0, 5.0, 1.0, 9.0, 4.0]
    prev = save_shards(w, tmp_path / "global", SHARD).root
    rule = Rule(agg, trim_fraction=0.2, clip_multiple=1.5)
    for eta in (1.0, 1.5):
        outs = {}
        for inline in (True, False):
            ch = _channel(tmp_path / f"{inline}-{eta}", inline)
            items = _items(tmp_path / f"{inline}-{eta}", ch, states, weights)
            m, scores = aggregate_refs(items, ch, tmp_path / f"out-{inline}-{eta}", prev, rule, server_lr=eta)
            outs[inline] = load_shards(m.root)
            again, _ = aggregate_refs(items, ch, tmp_path / f"again-{inline}-{eta}", prev, rule, server_lr=eta)
            assert again.sha256 == m.sha256  # deterministic: the same inputs, the same bits
        assert _bits(outs[True]) == _bits(outs[False])  # inline == streamed
        want = aggregate_reference(agg, w, states, weights, rule, eta)
        for k, t in outs[True].items():
            assert t.dtype == w[k].dtype
            if k in want:
                torch.testing.assert_close(t.double(), want[k], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(t, w[k])  # carried, not averaged
    if agg == "clipped":  # the large update was clipped: the result differs from FedAvg's
        fedavg = aggregate_reference("fedavg", w, states, weights, rule, 1.0)
        assert not torch.allclose(outs[True]["0.weight"].double(), fedavg["0.weight"], atol=1e-6)


def test_the_sorting_network_sorts_every_input_of_up_to_12_values():
    for k in range(1, 13):  # the 0-1 principle: a network that sorts every 0/1 input sorts every input
        net = sorting_network(k)
        for bits in itertools.product((0, 1), repeat=k):
            v = list(bits)
            for a, b in net:
                v[a], v[b] = min(v[a], v[b]), max(v[a], v[b])
            assert v == sorted(v), (k, bits)
    assert len(sorting_network(4)) == 5  # the optimal network for 4


@pytest.mark.parametrize("k", [3, 4, 6, NETWORK_MAX + 1])
@pytest.mark.parametrize("agg", ["trimmed_mean", "median"])
def test_coordinate_wise_aggregators_match_torch_for_any_number_of_clients(tmp_path, k, agg):
    g = torch.Generator().manual_seed(k)
    w = {"a": torch.randn(3000, generator=g), "b": torch.randn(7, 5, generator=g)}
    states = [{n: t + torch.randn(t.shape, generator=g) * 0.1 for n, t in w.items()} for _ in range(k)]
    states[0]["a"][:10] = states[1]["a"][:10]  # ties
    prev = save_shards(w, tmp_path / "global", SHARD).root
    rule = Rule(agg, trim_fraction=0.34 if k < 6 else 0.2)
    ch = _channel(tmp_path, inline=True)
    m, _ = aggregate_refs(_items(tmp_path, ch, states, [1.0] * k), ch, tmp_path / "out", prev, rule)
    got, want = load_shards(m.root), aggregate_reference(agg, w, states, [1.0] * k, rule, 1.0)
    for n in w:
        torch.testing.assert_close(got[n].double(), want[n], rtol=1e-6, atol=1e-6)


def test_fedavg_through_the_scoring_pass_gives_fedavg_s_bits(tmp_path):
    w = _net(0)
    states, weights = [_trained(w, s) for s in range(3)], [12.0, 30.0, 7.0]
    prev = save_shards(w, tmp_path / "global", SHARD).root
    save_shards(_net(1), tmp_path / "before", SHARD)
    for inline in (True, False):
        for eta in (1.0, 0.7):
            ch = _channel(tmp_path / f"{inline}{eta}", inline)
            items = _items(tmp_path / f"{inline}{eta}", ch, states, weights)
            ours, _ = aggregate_refs(items, ch, tmp_path / f"r{inline}{eta}", prev, Rule(), server_lr=eta)
            theirs = fedavg_refs(items, ch, tmp_path / f"f{inline}{eta}", previous=prev, server_lr=eta)
            assert ours.sha256 == theirs.sha256
            # scored against the server's last step too (its origin read as one more input): the same bits
            stepped, scores = aggregate_refs(
                items, ch, tmp_path / f"s{inline}{eta}", prev, Rule(), server_lr=eta, before=prev.parent / "before"
            )
            assert stepped.sha256 == theirs.sha256 and None not in scores.step_z


def test_scores_match_a_torch_reference_and_zero_weight_clients_are_not_scored(tmp_path):
    w = _net(0)
    states, weights = [_trained(w, s) for s in range(4)], [2.0, 0.0, 3.0, 5.0]
    prev = save_shards(w, tmp_path / "global", SHARD).root
    ch = _channel(tmp_path, inline=False)
    earlier = _net(1)  # the server's last step ran from it to w
    before = save_shards(earlier, tmp_path / "before", SHARD).root
    items = _items(tmp_path, ch, states, weights)
    _, scores = aggregate_refs(items, ch, tmp_path / "out", prev, Rule(), before=before)
    live = [0, 2, 3]
    d = [torch.cat([(states[i][k].double() - w[k].double()).flatten() for k in w if k != "ids"]) for i in live]
    f = torch.tensor([weights[i] for i in live], dtype=torch.float64)
    mean = sum(fi * di for fi, di in zip(f / f.sum(), d))
    cos = torch.nn.functional.cosine_similarity
    assert len(scores.norm) == 3
    for j, dj in enumerate(d):
        assert scores.norm[j] == pytest.approx(float(dj.norm()), rel=1e-5)
        assert scores.cos_mean[j] == pytest.approx(float(cos(dj, mean, dim=0)), abs=1e-5)
        pairs = [float(cos(dj, dk, dim=0)) for k, dk in enumerate(d) if k != j]
        assert scores.cos_peers[j] == pytest.approx(statistics.median(pairs), abs=1e-5)
        assert scores.peer_z[j] == pytest.approx(max(map(abs, pairs)) * math.sqrt(d[0].numel()), rel=1e-4)
        assert scores.shrink_z[j] == pytest.approx(_shrink_z(states[live[j]], w), abs=1e-9)
        step = torch.cat([(w[k].double() - earlier[k].double()).flatten() for k in w if k != "ids"])
        assert scores.step_z[j] == pytest.approx(float(cos(dj, step, dim=0)) * math.sqrt(d[0].numel()), rel=1e-4)
        row = scores.row(live)[str(live[j])]["cos"]  # every pairwise cosine, by the peer's id
        assert list(row) == [str(c) for c in live if c != live[j]]
        assert list(row.values()) == pytest.approx(pairs, abs=1e-5)
    assert not any(scores.flagged)
    _, first = aggregate_refs(items, ch, tmp_path / "first", prev, Rule())  # round 1: no step before it
    assert first.step_z == [None] * 3 and all(r["step_z"] is None for r in first.row(live).values())
    assert first.peer_z == scores.peer_z


def test_an_update_along_the_server_s_last_step_is_not_unrelated_though_its_peers_are(tmp_path):
    """The unrelated rule reads the server's last step as one more reference: an update that
    carries it on is related to what the federation learnt even where no peer's update is (on
    the tiny default, late-round clean updates as unrelated to their 2-3 peers as noise are
    aligned with the last step; docs/architecture.md, "What the scores can tell apart")."""
    earlier = _net(0)
    w = _trained(earlier, 7)  # the server's last step: real training from `earlier`
    carried_on = {k: w[k] + 0.5 * (w[k] - earlier[k]) if w[k].is_floating_point() else w[k] for k in w}
    noise = [poisoned(w, _trained(w, s), PoisonCfg(kind="noise"), noise_seed(0, 2, s, "actor")) for s in (1, 2, 3)]
    prev = save_shards(w, tmp_path / "global", SHARD).root
    before = save_shards(earlier, tmp_path / "before", SHARD).root
    for inline in (True, False):
        root = tmp_path / str(inline)
        ch = _channel(root, inline)
        items = _items(root, ch, [carried_on, *noise], [8.0] * 4)
        _, alone = aggregate_refs(items, ch, root / "alone", prev, Rule())
        assert alone.flagged == [True] * 4  # no peer relates to it: by the peers alone, it looks like noise
        _, scores = aggregate_refs(items, ch, root / "out", prev, Rule(), before=before)
        assert scores.step_z[0] == pytest.approx(math.sqrt(sum(t.numel() for k, t in w.items() if k != "ids")))
        assert scores.flagged == [False, True, True, True], scores
        assert all(abs(z) < 5 for z in scores.step_z[1:])


def test_the_last_step_is_read_only_where_the_unrelated_rule_can_use_it(tmp_path):
    """Two clients, or the unrelated rule off: no rule would act on the step's score, so the
    round-before model (6.2 GB for a 1.5B model) is not read and `step_z` stays None. The
    round-before dir here does not exist, so a read would raise, as it does with three clients."""
    w = _net(0)
    states = [_trained(w, s) for s in range(3)]
    prev = save_shards(w, tmp_path / "global", SHARD).root
    missing = tmp_path / "no-such-round"
    for inline in (True, False):
        root = tmp_path / str(inline)
        ch = _channel(root, inline)
        items = _items(root, ch, states, [8.0] * 3)
        _, two = aggregate_refs(items[:2], ch, root / "two", prev, Rule(), before=missing)
        assert two.step_z == [None, None]
        _, off = aggregate_refs(items, ch, root / "off", prev, Rule(flag_unrelated_z=None), before=missing)
        assert off.step_z == [None] * 3
        with pytest.raises(WeightsError, match="no-such-round: no manifest.json"):
            aggregate_refs(items, ch, root / "three", prev, Rule(), before=missing)


def _shrink_z(x: dict[str, torch.Tensor], w: dict[str, torch.Tensor]) -> float:
    """`shrink_z` by its definition on whole tensors: each row of every matrix votes shrank/grew."""
    sums = [-torch.sign((x[k] - w[k]) * w[k]).flatten(0, -2).sum(1) for k in w if w[k].dim() >= 2]
    rows = torch.cat(sums)
    shrank, grew = int((rows > 0).sum()), int((rows < 0).sum())
    return (shrank - grew) / math.sqrt(shrank + grew)


def test_row_votes_are_the_whole_rows_votes_however_pieces_cut_the_rows():
    rnd = torch.Generator().manual_seed(0)
    for shape in [(7, 5), (3, 4, 6), (1, 9), (12, 1)]:
        n = math.prod(shape)
        signs = torch.randint(-1, 2, (3, n), generator=rnd).float()
        for cuts in [[], [1], [4, 5, 11], list(range(1, n))]:
            votes = RowVotes(3)
            for a, b in itertools.pairwise([0, *[c for c in cuts if c < n], n]):
                votes.add(TensorInfo("t", shape, "F32"), signs[:, a:b])
            rows = signs.view(3, -1, shape[-1]).sum(2)
            assert votes.shrank.tolist() == (rows < 0).sum(1).tolist(), (shape, cuts)
            assert votes.grew.tolist() == (rows > 0).sum(1).tolist(), (shape, cuts)
            assert not votes.open


VOCAB, USED, WIDTH = 512, 24, 32


def _lm(seed: int) -> dict[str, torch.Tensor]:
    """A tiny language model: token embeddings (a vocabulary of which a client's data uses few
    tokens), a mixing matrix and an output head over the tokens used."""
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(VOCAB, WIDTH, generator=g) * 0.02,
        "mix": torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5,
        "head": torch.randn(USED, WIDTH, generator=g) * 0.02,
    }


def _lm_trained(w: dict[str, torch.Tensor], seed: int, weight_decay: float = 0.01) -> dict[str, torch.Tensor]:
    """A client's local AdamW steps (decoupled weight decay, as the trainers') on next-token
    prediction over the tokens its data uses: the other embedding rows get no gradient, only
    the decay."""
    p = {k: v.clone().requires_grad_() for k, v in w.items()}
    opt = torch.optim.AdamW(p.values(), lr=1e-2, weight_decay=weight_decay)
    nxt = torch.randperm(USED, generator=torch.Generator().manual_seed(1234))  # the shared task
    g = torch.Generator().manual_seed(seed)
    for _ in range(10):
        x = torch.randint(0, USED, (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(torch.tanh(p["emb"][x] @ p["mix"]) @ p["head"].t(), nxt[x])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in p.items()}


@pytest.mark.parametrize("agg", ["fedavg", "median"])
def test_a_sign_flipped_update_is_flagged_by_its_rows_growing_and_no_clean_one(tmp_path, agg):
    w, rule = _lm(0), Rule(agg, flag_shrink_z=5.0)
    prev = save_shards(w, tmp_path / "global", SHARD).root
    for victim in range(4):
        states = [_lm_trained(w, 10 * victim + s) for s in range(4)]
        states[victim] = poisoned(w, states[victim], PoisonCfg(kind="sign_flip"), 0)
        ch = _channel(tmp_path / str(victim), inline=victim % 2 == 0)
        items = _items(tmp_path / str(victim), ch, states, [8.0] * 4)
        _, scores = aggregate_refs(items, ch, tmp_path / f"out{victim}", prev, rule)
        assert scores.flagged == [i == victim for i in range(4)], (victim, scores)
        assert all(z > 5 for i, z in enumerate(scores.shrink_z) if i != victim), scores.shrink_z
        _, off = aggregate_refs(items, ch, tmp_path / f"off{victim}", prev, Rule(agg))
        assert not any(off.flagged), (victim, off)  # only the row votes tell this flip apart
    ch = _channel(tmp_path / "alone", inline=True)
    _, one = aggregate_refs(_items(tmp_path / "alone", ch, states[3:], [8.0]), ch, tmp_path / "one", prev, rule)
    assert one.flagged == [True]  # victim 3's flip alone: the rule needs no peers
    undecayed = [_lm_trained(w, 100 + s, weight_decay=0.0) for s in range(4)]
    ch = _channel(tmp_path / "nowd", inline=True)
    items = _items(tmp_path / "nowd", ch, undecayed, [8.0] * 4)
    _, scores = aggregate_refs(items, ch, tmp_path / "nowd-out", prev, rule)
    # without decay only the trained rows vote, and learning grows them: why the rule is off unless a recipe sets it
    assert all(z < -5 for z in scores.shrink_z) and all(scores.flagged), scores.shrink_z


@pytest.mark.parametrize("kind", ["scale", "sign_flip", "noise"])
@pytest.mark.parametrize("agg", ["fedavg", "median"])
def test_a_poisoned_update_is_flagged_and_no_clean_one(tmp_path, kind, agg):
    w = _net(0)
    prev = save_shards(w, tmp_path / "global", SHARD).root
    poison = PoisonCfg(kind=kind)
    for victim in range(4):
        states = [_trained(w, 10 * victim + s) for s in range(4)]
        states[victim] = poisoned(w, states[victim], poison, noise_seed(0, 1, victim, "actor"))
        ch = _channel(tmp_path / str(victim), inline=True)
        items = _items(tmp_path / str(victim), ch, states, [8.0] * 4)
        _, scores = aggregate_refs(items, ch, tmp_path / f"out{victim}", prev, Rule(agg, flag_cosine_z=4.0))
        assert scores.flagged == [i == victim for i in range(4)], (kind, victim, scores)
        # the default rules: norm (x100) and unrelated-to-every-peer (noise); a flip is as related as a clean one
        _, default = aggregate_refs(items, ch, tmp_path / f"dflt{victim}", prev, Rule(agg))
        assert default.flagged == [kind != "sign_flip" and i == victim for i in range(4)], (kind, victim, default)
        _, norm_only = aggregate_refs(items, ch, tmp_path / f"norm{victim}", prev, Rule(agg, flag_unrelated_z=None))
        assert norm_only.flagged == [kind == "scale" and i == victim for i in range(4)], (kind, victim, norm_only)
    clean = [_trained(w, 100 + s) for s in range(4)]
    ch = _channel(tmp_path / "clean", inline=True)
    rule = Rule(agg, flag_cosine_z=4.0)
    _, scores = aggregate_refs(_items(tmp_path / "clean", ch, clean, [8.0] * 4), ch, tmp_path / "c", prev, rule)
    assert not any(scores.flagged), scores


@pytest.mark.parametrize("agg", AGGREGATORS)
def test_drop_flagged_aggregates_the_unflagged_clients_and_names_the_rest(tmp_path, agg):
    w = _net(0)
    prev = save_shards(w, tmp_path / "global", SHARD).root
    clean = [_trained(w, s) for s in range(4)]
    weights = [3.0, 5.0, 1.0, 9.0]
    rule = Rule(agg, drop_flagged=True)
    ch = _channel(tmp_path / "clean", inline=False)
    items = _items(tmp_path / "clean", ch, clean, weights)
    kept, scores = aggregate_refs(items, ch, tmp_path / "kept", prev, rule)
    plain, _ = aggregate_refs(items, ch, tmp_path / "plain", prev, Rule(agg))
    assert scores.excluded == [False] * 4 and kept.sha256 == plain.sha256  # nothing flagged: the same bits
    for kind, victim in (("scale", 1), ("noise", 2)):
        states = list(clean)
        states[victim] = poisoned(w, clean[victim], PoisonCfg(kind=kind), noise_seed(0, 1, victim, "actor"))
        root = tmp_path / kind
        ch = _channel(root, inline=kind == "noise")
        m, scores = aggregate_refs(_items(root, ch, states, weights), ch, root / "out", prev, rule)
        assert scores.flagged == scores.excluded == [i == victim for i in range(4)], (kind, scores)
        assert all(row["excluded"] == (c == str(victim)) for c, row in scores.row(range(4)).items())
        rest = [i for i in range(4) if i != victim]
        # the trim was there for the dropped client's values: the rest's plain mean (median: theirs)
        want = aggregate_reference(agg, w, [clean[i] for i in rest], [weights[i] for i in rest], rule)
        got = load_shards(m.root)
        for k, t in want.items():
            torch.testing.assert_close(got[k].double(), t, rtol=1e-5, atol=1e-6)
        if agg in ("fedavg", "median"):  # elementwise as a round of the rest alone: its bits (clipped's norms
            # are summed over pieces that the number of clients sizes)
            ch3 = _channel(root / "rest", inline=True)
            alone, _ = aggregate_refs(
                _items(root / "rest", ch3, [clean[i] for i in rest], [weights[i] for i in rest]),
                ch3,
                root / "alone",
                prev,
                Rule(agg),
            )
            assert alone.sha256 == m.sha256
    noise = [poisoned(w, clean[i], PoisonCfg(kind="noise"), noise_seed(0, 1, i, "actor")) for i in range(4)]
    ch = _channel(tmp_path / "all", inline=True)
    with pytest.raises(WeightsError, match=r"every client of the round was flagged \(input 0, .*drop_flagged"):
        aggregate_refs(_items(tmp_path / "all", ch, noise, weights), ch, tmp_path / "none", prev, rule)
    assert not (tmp_path / "none").exists()


def test_poisoned_updates_are_what_their_kind_says_and_reproducible():
    w = _net(0)
    x = _trained(w, 1)
    d = {k: x[k] - w[k] for k in w if k != "ids"}
    scaled = poisoned(w, x, PoisonCfg(kind="scale", factor=100.0), 0)
    flipped = poisoned(w, x, PoisonCfg(kind="sign_flip"), 0)
    noise = poisoned(w, x, PoisonCfg(kind="noise"), 7)
    for k in d:
        torch.testing.assert_close(scaled[k] - w[k], 100 * d[k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(flipped[k] - w[k], -d[k], rtol=1e-4, atol=1e-7)
    assert torch.equal(scaled["ids"], x["ids"])
    norm = lambda s: math.sqrt(sum(float(((s[k] - w[k]).double() ** 2).sum()) for k in d))  # noqa: E731
    assert norm(noise) == pytest.approx(norm(x), rel=1e-3)
    assert _bits(noise) == _bits(poisoned(w, x, PoisonCfg(kind="noise"), 7))  # seeded
    assert _bits(noise) != _bits(poisoned(w, x, PoisonCfg(kind="noise"), 8))


def test_the_round_s_first_sampled_client_poisons_unless_clients_are_listed():
    cfg = load_config("tiny-shop-grpo-4clients-poison-scale")
    seed = sampling_seed(cfg.run.seed, cfg.federation.sampling_seed)
    for r in (1, 2, 3):
        first = sample_clients(seed, r, cfg.federation.clients, cfg.federation.clients_per_round)[0]
        assert [c for c in range(cfg.federation.clients) if poisons(cfg, r, c)] == [first]
    listed = load_config("tiny-shop-grpo-4clients-poison-scale", overrides={"faults.poison.clients": "[5, 7]"})
    assert [c for c in range(100) if poisons(listed, 1, c)] == [5, 7]
    assert not any(poisons(load_config("tiny-shop-grpo-4clients"), 1, c) for c in range(100))


@pytest.mark.parametrize("agg", ["fedavg", "trimmed_mean", "median", "clipped"])
def test_a_non_finite_upload_is_refused_even_where_the_trim_would_drop_it(tmp_path, agg):
    w = _net(0)
    states = [_trained(w, s) for s in range(4)]
    states[2]["2.bias"][5] = float("nan")
    prev = save_shards(w, tmp_path / "global", SHARD).root
    for inline in (True, False):
        ch = _channel(tmp_path / str(inline), inline)
        out = tmp_path / f"out{inline}"
        with pytest.raises(NonFiniteWeightsError, match="client 2") as err:
            aggregate_refs(
                _items(tmp_path / str(inline), ch, states, [1.0] * 4),
                ch,
                out,
                prev,
                Rule(agg),
                names=[f"client {c}" for c in range(4)],
            )
        assert err.value.inputs == [2]
        assert not (out / "manifest.json").exists()


def _member_reply(cid: int, refs: dict[str, WeightsRef]) -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    reply = Reply(weights=refs, client_id=cid)
    content = RecordDict(
        {RECORD: ConfigRecord({RECORD: reply.model_dump_json()}), "metrics": MetricRecord({"num-examples": 8})}
    )
    return Message(content=content, dst_node_id=0, message_type="train")


def test_ppo_s_critic_is_aggregated_and_scored_beside_the_actor(tmp_path):
    members = {"actor": _net(0), "critic": _net(1)}
    store = DirStore(tmp_path, SHARD)
    ch = Channel(store, cache_dir=tmp_path / "cache", inline_max_bytes=0, shard_bytes=SHARD)
    own = lambda c: {m: f"rounds/round-0001/clients/client-{c:04d}/{m}" for m in members}  # noqa: E731
    previous = {m: save_shards(w, tmp_path / "rounds/round-0000" / m, SHARD).root for m, w in members.items()}
    sent: dict[str, list[dict[str, torch.Tensor]]] = {m: [] for m in members}
    replies = {}
    for c in range(4):
        refs = {}
        for m, w in members.items():
            x = _trained(w, 10 * c + len(m))
            if c == 3:
                x = poisoned(w, x, PoisonCfg(kind="sign_flip"), 0)
            sent[m].append(x)
            mf = store.put(own(c)[m], x)
            refs[m] = WeightsRef(inline=False, nbytes=mf.tensor_bytes, key=own(c)[m], manifest_sha256=mf.sha256)
        replies[c] = _member_reply(c, refs)
    agg = StreamingAggregator("fedavg", 0.0, rule=Rule("median", flag_cosine_z=4.0))
    out_dirs = {m: tmp_path / "rounds/round-0001" / m for m in members}
    manifests, _, scores = agg.aggregate_train(replies, ch, out_dirs, own, previous)
    for m, w in members.items():
        want = aggregate_reference("median", w, sent[m], [8.0] * 4, Rule("median"), 1.0)
        got = load_shards(manifests[m].root)
        for k in want:
            torch.testing.assert_close(got[k].double(), want[k], rtol=1e-5, atol=1e-6)
        assert [c for c, s in scores[m].items() if s["flagged"]] == ["3"], scores[m]


_PEAK_CHILD = """
import json, sys
from pathlib import Path
from fl_app.robust import Rule, _aggregate, _Round
from fl_app.weights import Manifest

def status_kb(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

agg, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
ms = [Manifest.from_dir(Path(p)) for p in sys.argv[4:]]  # the clients, then w
rnd = _Round([f"input {i}" for i in range(len(ms) + 1)], shard, manifests=list(enumerate(ms)))
rnd.before = (len(ms), ms[0])  # scored against a server step too: one more streamed input
_aggregate(rnd, [1.0] * (len(ms) - 1), Rule(agg), 1.0, Path(out + "-warm-up"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status_kb("VmRSS")
_aggregate(rnd, [1.0] * (len(ms) - 1), Rule(agg), 1.0, Path(out))
print(json.dumps({"peak_increase_bytes": (status_kb("VmHWM") - before) * 1024}))
"""


def _peak(tmp_path: Path, agg: str, dirs: list[str], shard: int) -> int:
    res = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, agg, str(tmp_path / agg), str(shard), *dirs[1:], dirs[0]],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_increase_bytes"]


def test_streaming_robust_aggregation_memory_does_not_grow_with_the_model(tmp_path):
    # 4 clients + w in 1 MiB shards, models of 8 and 32 MiB: holding the models would add 5 x the
    # size (+120 MiB from one size to the other); the passes hold a few pieces per input and a
    # k x piece stack, whatever the model's size.
    g = torch.Generator().manual_seed(0)
    shard = 1 << 20
    dirs: dict[int, list[str]] = {}
    for mib in (8, 32):
        dirs[mib] = []
        for c in range(5):
            state = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(mib)}
            dirs[mib].append(str(save_shards(state, tmp_path / f"c{mib}-{c}", shard).root))
            del state
    for agg in ("median", "clipped"):
        small, large = (_peak(tmp_path / f"{agg}{mib}", agg, dirs[mib], shard) for mib in (8, 32))
        # one held copy of the larger model's input would add 24 MiB; the margin takes the
        # allocator's per-thread arenas, which vary with the readers' scheduling on a loaded box
        assert large - small < 12 << 20, f"{agg}: peak RSS {small / 2**20:.1f} -> {large / 2**20:.1f} MiB"


def test_recipe_load_refuses_a_robust_aggregator_the_round_cannot_feed():
    base = {"federation.clients_per_round": 4}
    load_config("tiny-shop-grpo", overrides={**base, "federation.aggregator": "trimmed_mean"})  # 0.25 x 4 = 1
    with pytest.raises(ConfigError, match=r"trim_fraction=0.2 .*round of 4 clients.*trims none.*at least 0.25"):
        load_config(
            "tiny-shop-grpo",
            overrides={**base, "federation.aggregator": "trimmed_mean", "federation.trim_fraction": 0.2},
        )
    with pytest.raises(ConfigError, match="trims none"):  # the tolerated round is the one that counts
        load_config(
            "tiny-shop-grpo",
            overrides={**base, "federation.aggregator": "trimmed_mean", "federation.min_clients_per_round": 3},
        )
    with pytest.raises(ConfigError, match="drop_flagged drops what the peer rules flag.*3 or more"):
        load_config("tiny-shop-grpo", overrides={"federation.drop_flagged": True})
    load_config("tiny-shop-grpo", overrides={**base, "federation.drop_flagged": True})
    with pytest.raises(ConfigError, match="median over a round of 2 clients is their mean"):
        load_config("tiny-shop-grpo", overrides={"federation.aggregator": "median"})
    with pytest.raises(ConfigError, match="trim_fraction"):
        load_config("tiny-shop-grpo", overrides={"federation.trim_fraction": 0.5})
    with pytest.raises(ConfigError, match="faults.poison.clients is set but faults.poison.kind=none"):
        load_config("tiny-shop-grpo", overrides={"faults.poison.clients": "[3]"})


def test_recipe_load_refuses_the_shrink_flag_where_a_trained_member_has_no_weight_decay():
    signflip = load_config("tiny-shop-grpo-4clients-poison-signflip", overrides={"federation.flag_shrink_z": 5.0})
    assert signflip.federation.flag_shrink_z == 5.0 and load_config("tiny-shop-grpo").federation.flag_shrink_z is None
    for member in ("algo.weight_decay", "algo.critic.weight_decay"):
        with pytest.raises(ConfigError, match="flag_shrink_z reads the rows AdamW's weight decay shrinks"):
            load_config("tiny-shop-ppo", overrides={"federation.flag_shrink_z": 5.0, member: 0.0})
