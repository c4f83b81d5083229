"""Compressed full updates (fl_app.quant, `federation.update: delta-int8 | delta-int4`, issue #38):
the codec's error bound per block and exact zeros, encode/decode bit for bit whatever the
piecing, every aggregator on decoded updates against its float64 definition and inline ==
streamed bit for bit, error feedback's telescoping sum, the residual rule, non-finite updates
refused naming the client, an update from another global model refused, and the recipe keys
checked at load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from robust_support import aggregate_reference

from envs.ports import bind_listener
from fl_app.aggregate import PIECE_BYTES, NonFiniteWeightsError
from fl_app.channel import Channel
from fl_app.channel.credentials import Issuer
from fl_app.channel.http import HttpWeightStore
from fl_app.channel.http_server import WeightStoreServer
from fl_app.channel.run_dir import DirStore
from fl_app.config import ConfigError, load_config
from fl_app.quant import LEVELS, Residuals, UpdateMeta, decode, encode, write_update
from fl_app.robust import Rule, aggregate_refs
from fl_app.server_opt import ServerOptimizer
from fl_app.weights import Manifest, WeightsError, load_shards, save_shards

SHARD = 20_000  # bytes: several shards per model, tensors spanning several pieces
MODES = ("delta-int8", "delta-int4")
AGGREGATORS = ("fedavg", "clipped", "trimmed_mean", "median")


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(PIECE_BYTES // 4 + 777, generator=g),  # two pieces, a partial last block
        "w": torch.randn(48, 33, generator=g),
        "b": torch.randn(5, generator=g),  # smaller than one block
        "ids": torch.arange(6),
    }


def _client(w: dict[str, torch.Tensor], seed: int, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {
        k: (v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()) for k, v in w.items()
    }


def _bits(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().numpy().tobytes() for t in state.values())


# ---- the codec --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [8, 64, 4096])
def test_each_value_is_within_half_a_scale_of_its_block_and_zeros_stay_exact(mode, block):
    g = torch.Generator().manual_seed(block)
    d = torch.randn(10 * block + 3, generator=g) * torch.logspace(-6, 3, 10 * block + 3)
    d[block : 2 * block] = 0.0  # an all-zero block
    d[3 * block + 1] = 0.0  # one zero in a live block: code 0, exactly 0 again
    rows, sent = encode(d, mode, block)
    assert rows.dtype == torch.uint8 and rows.shape == (11, 4 + (block if mode == "delta-int8" else block // 2))
    padded = torch.zeros(11 * block)
    padded[: d.numel()] = d
    absmax = padded.view(11, block).abs().amax(1)
    err = torch.zeros(11 * block)
    err[: d.numel()] = (d - sent).abs()
    bound = absmax / LEVELS[mode] / 2 * (1 + 1e-6) + 1e-45
    assert bool((err.view(11, block).amax(1) <= bound).all())
    assert bool((sent[block : 2 * block] == 0).all()) and float(sent[3 * block + 1]) == 0.0
    assert torch.equal(sent, decode(rows, mode, block)[: d.numel()])


@pytest.mark.parametrize("mode", MODES)
def test_encoding_is_bit_identical_twice_and_pieces_decode_as_the_whole(mode):
    d = torch.randn(3 * 4096 + 17, generator=torch.Generator().manual_seed(1))
    a, sa = encode(d, mode, 64)
    b, sb = encode(d.clone(), mode, 64)
    assert a.numpy().tobytes() == b.numpy().tobytes() and sa.numpy().tobytes() == sb.numpy().tobytes()
    flat = a.reshape(-1)
    row = a.shape[1]
    parts = [decode(flat[i * row * 10 : (i + 1) * row * 10], mode, 64) for i in range(-(-a.shape[0] // 10))]
    assert torch.cat(parts)[: d.numel()].numpy().tobytes() == sa.numpy().tobytes()


def test_non_finite_values_make_their_block_decode_non_finite():
    d = torch.zeros(256)
    d[70], d[200] = float("nan"), float("inf")
    rows, sent = encode(d, "delta-int8", 64)
    finite = torch.isfinite(sent).view(4, 64).all(1).tolist()
    assert finite == [True, False, True, False]


# ---- aggregation of decoded updates -----------------------------------------------------------
def _round(root: Path, mode: str, w: dict[str, torch.Tensor], xs: list[dict[str, torch.Tensor]], inline: bool):
    """Round 1 as server and clients play it: the global model saved, each client's update
    written from it (no residual) and put on the channel. Returns the global dir, the channel,
    the replies and what each client's update decodes to (its model as the server sees it)."""
    channel = Channel(
        DirStore(root, SHARD), cache_dir=root / "cache", inline_max_bytes=1 << 30 if inline else 0, shard_bytes=SHARD
    )
    base = save_shards(w, root / "global", SHARD)
    items, decoded = [], []
    for c, x in enumerate(xs):
        key = f"uploads/client-{c}"
        assert isinstance(channel.store, DirStore)
        m, _ = write_update(base, w, x, None, mode, 64, channel.store.path(key))
        ref, arrays = channel.put(m.root, key)
        assert bool(ref.update) and ref.inline == inline
        items.append((ref, arrays, float(3 + 2 * c)))
        decoded.append({k: (w[k] + encode(x[k] - w[k], mode, 64)[1] if w[k].is_floating_point() else x[k]) for k in w})
    return base.root, channel, items, decoded


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGREGATORS)
def test_every_aggregator_on_decoded_updates_matches_its_definition_inline_and_streamed_bit_for_bit(
    tmp_path, agg, mode
):
    w = _model(0)
    xs = [_client(w, c, scale=1e-2 * (1 + c)) for c in range(5)]
    rule = Rule(agg, trim_fraction=0.2, clip_multiple=1.5, update=mode)
    outs = {}
    for inline in (True, False):
        prev, ch, items, decoded = _round(tmp_path / str(inline), mode, w, xs, inline)
        m, scores = aggregate_refs(items, ch, tmp_path / f"out-{inline}", prev, rule)
        outs[inline] = load_shards(m.root)
        again, _ = aggregate_refs(items, ch, tmp_path / f"again-{inline}", prev, rule)
        assert again.sha256 == m.sha256
        assert len(scores.norm) == 5 and all(n > 0 for n in scores.norm)
    assert _bits(outs[True]) == _bits(outs[False])  # inline == streamed
    want = aggregate_reference(agg, w, decoded, [w_ for _, _, w_ in items], rule)
    for k, t in outs[True].items():
        if k in want:
            torch.testing.assert_close(t.double(), want[k], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(t, w[k])
    # the decoded updates are not the true ones: what the codec lost shows in the aggregate
    exact = aggregate_reference(agg, w, xs, [w_ for _, _, w_ in items], rule)
    assert any(not torch.allclose(outs[True][k].double(), exact[k], rtol=0, atol=1e-7) for k in exact)


def test_a_server_optimizer_steps_along_the_mean_of_decoded_updates(tmp_path):
    w = _model(0)
    xs = [_client(w, c) for c in range(3)]
    prev, ch, items, decoded = _round(tmp_path, "delta-int8", w, xs, inline=False)
    mean, _ = aggregate_refs(items, ch, tmp_path / "mean", prev, Rule(update="delta-int8"))
    opt = ServerOptimizer("fedavgm", lr=1.0, momentum=0.9)
    out = opt.step(prev, mean.root, None, tmp_path / "new", [tmp_path / "m"])
    avg = aggregate_reference("fedavg", w, decoded, [x for _, _, x in items], Rule())
    got = load_shards(out.root)
    torch.testing.assert_close(got["big"].double(), avg["big"], rtol=1e-5, atol=1e-6)  # m' = Delta at round 1


@pytest.mark.parametrize("inline", [True, False])
def test_a_non_finite_update_is_refused_naming_its_client(tmp_path, inline):
    w = _model(0)
    xs = [_client(w, c) for c in range(3)]
    xs[1]["w"][3, 4] = float("nan")
    prev, ch, items, _ = _round(tmp_path, "delta-int4", w, xs, inline)
    with pytest.raises(NonFiniteWeightsError) as e:
        aggregate_refs(items, ch, tmp_path / "out", prev, Rule(update="delta-int4"), names=["c0", "c1", "c2"])
    assert e.value.inputs == [1] and "c1" in str(e.value) and "'w'" in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("inline", [True, False])
def test_an_update_from_another_global_model_or_mode_is_refused(tmp_path, inline):
    w = _model(0)
    prev, ch, items, _ = _round(tmp_path, "delta-int8", w, [_client(w, 0), _client(w, 1)], inline)
    other = save_shards(_client(w, 7), tmp_path / "other-global", SHARD).root
    with pytest.raises(WeightsError, match="delta from global model"):
        aggregate_refs(items, ch, tmp_path / "out", other, Rule(update="delta-int8"))
    with pytest.raises(WeightsError, match="delta-int8 update of block 64, the recipe says delta-int4"):
        aggregate_refs(items, ch, tmp_path / "out", prev, Rule(update="delta-int4"))
    with pytest.raises(WeightsError, match="federation.update is full"):
        aggregate_refs(items, ch, tmp_path / "out", prev, Rule())


_PEAK_CHILD = """
import json, sys
from pathlib import Path
from fl_app.robust import Rule, aggregate_manifests
from fl_app.weights import Manifest

def status_kb(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

agg, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
w, *ups = [Manifest.from_dir(Path(p)) for p in sys.argv[4:]]
run = lambda d: aggregate_manifests([(m, 1.0) for m in ups], w, Path(d), shard, Rule(agg, update="delta-int8"))
run(out + "-warm-up")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status_kb("VmRSS")
run(out)
print(json.dumps({"peak_increase_bytes": (status_kb("VmHWM") - before) * 1024}))
"""


def test_decoding_updates_in_the_streaming_aggregators_holds_pieces_not_models(tmp_path):
    # 4 clients' int8 updates + w in 1 MiB shards, models of 8 and 32 MiB: holding the decoded
    # models would add 4 x 24 MiB from one size to the other; the walker decodes piece by piece
    g = torch.Generator().manual_seed(0)
    shard = 1 << 20
    peaks = {}
    for mib in (8, 32):
        w = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(mib)}
        base = save_shards(w, tmp_path / f"w{mib}", shard)
        dirs = [str(base.root)]
        for c in range(4):
            x = {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in w.items()}
            dirs.append(str(write_update(base, w, x, None, "delta-int8", 64, tmp_path / f"u{mib}-{c}")[0].root))
        for agg in ("fedavg", "median"):
            res = subprocess.run(
                [sys.executable, "-c", _PEAK_CHILD, agg, str(tmp_path / f"out-{agg}-{mib}"), str(shard), *dirs],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parents[2],
            )
            peaks[agg, mib] = json.loads(res.stdout.strip().splitlines()[-1])["peak_increase_bytes"]
    for agg in ("fedavg", "median"):
        small, large = peaks[agg, 8], peaks[agg, 32]
        # one held copy of the larger model's input would add 24 MiB; the margin takes the
        # allocator's per-thread arenas, which vary with the readers' scheduling on a loaded box
        assert large - small < 12 << 20, f"{agg}: peak RSS {small / 2**20:.1f} -> {large / 2**20:.1f} MiB"


# ---- error feedback ---------------------------------------------------------------------------
def test_error_feedback_sends_the_true_deltas_up_to_the_last_residual(tmp_path):
    """Over k rounds, sum(sent) = sum(true deltas) - e_k: the point of error feedback. Without
    it the quantization errors add up."""
    w = _model(0)
    res = Residuals(tmp_path / "cache", tmp_path / "run")
    sent_sum = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in w.items() if v.is_floating_point()}
    true_sum = {k: torch.zeros_like(v) for k, v in sent_sum.items()}
    plain_err = {k: torch.zeros_like(v) for k, v in sent_sum.items()}
    for r in range(1, 7):
        base = save_shards(w, tmp_path / f"global-{r}", SHARD)
        x = _client(w, r, scale=1e-3)
        got, residual = res.read(0, "actor", r)
        assert got == r - 1 if r > 1 else got == 0 and residual is None
        m, new = write_update(base, w, x, residual, "delta-int4", 64, tmp_path / f"up-{r}")
        res.write(0, "actor", r, new, SHARD)
        meta = UpdateMeta.of(m, "up")
        up = load_shards(m.root)
        for k in sent_sum:
            sent = decode(up[k].reshape(-1), meta.mode, meta.block)[: w[k].numel()].view(w[k].shape)
            sent_sum[k] += sent.double()
            true_sum[k] += (x[k] - w[k]).double()
            plain_err[k] += (x[k] - w[k]).double() - encode(x[k] - w[k], "delta-int4", 64)[1].double()
        last = new
    for k in sent_sum:
        torch.testing.assert_close(sent_sum[k], true_sum[k] - last[k].double(), rtol=0, atol=1e-6)
    # without feedback the error of the sum is the sum of the errors: much larger
    gap = sum(float((true_sum[k] - sent_sum[k]).norm()) for k in sent_sum)
    assert sum(float(plain_err[k].norm()) for k in sent_sum) > 2 * gap


def test_a_redone_round_reads_the_residual_its_first_attempt_read_and_old_ones_are_pruned(tmp_path):
    res = Residuals(tmp_path / "cache", tmp_path / "run")
    for r in (2, 5, 7):
        res.write(3, "critic", r, {"x": torch.full((3,), float(r))}, SHARD)
    assert [p.name for p in sorted(res._dir(3, "critic").iterdir())] == ["round-5", "round-7"]
    rnd, e = res.read(3, "critic", 7)  # round 7 redone after a kill: round 5's, as the first time
    assert rnd == 5 and e is not None and float(e["x"][0]) == 5.0
    assert res.read(3, "critic", 8)[0] == 7
    assert res.read(4, "critic", 8) == (0, None)  # another client: none, zeros
    assert Residuals(tmp_path / "cache", tmp_path / "other-run").read(3, "critic", 8) == (0, None)
    res.write(3, "critic", 6, {"x": torch.zeros(3)}, SHARD)  # resumed from an earlier round: 7 is a dead future
    assert [p.name for p in sorted(res._dir(3, "critic").iterdir())] == ["round-5", "round-6"]


def test_an_update_manifest_round_trips_and_names_its_base(tmp_path):
    w = _model(0)
    base = save_shards(w, tmp_path / "g", SHARD)
    m, _ = write_update(base, w, _client(w, 0), None, "delta-int8", 64, tmp_path / "u")
    again = Manifest.from_dir(tmp_path / "u")
    assert again.sha256 == m.sha256 == Manifest.from_json(again.to_json()).sha256
    meta = UpdateMeta.of(again, "u")
    assert meta.base == base.sha256 and meta.shapes["w"] == [48, 33] and meta.block == 64
    assert m.total_bytes < base.total_bytes / 3.5
    assert not base.update and '"update"' not in base.to_json()  # full weights: today's manifest bytes


def test_an_update_travels_through_the_served_store_with_its_metadata(tmp_path):
    """A node publishes its update over HTTP (issue #14's store): the server's copy is the same
    entry, metadata included (its manifest digest pins it)."""
    w = _model(0)
    run = tmp_path / "run"
    base = DirStore(run, SHARD).put("rounds/round-0000/actor", w)
    server = WeightStoreServer(run, Issuer(run_id=7), bind_listener("127.0.0.1", None)).start()
    try:
        key = "rounds/round-0001/clients/client-0000/actor"
        token = server.issuer.mint(round=1, client=0, node=1, read=[], write=[key], ttl_s=600)
        up, _ = write_update(base, w, _client(w, 0), None, "delta-int8", 64, tmp_path / "up")
        assert HttpWeightStore(server.url, token, max_shard_bytes=SHARD).publish(up.root, key).sha256 == up.sha256
    finally:
        server.stop()
    there = DirStore(run, SHARD).manifest(key)
    assert there.sha256 == up.sha256 and UpdateMeta.of(there, key) == UpdateMeta.of(up, "up")


# ---- the recipe -------------------------------------------------------------------------------
def test_a_typo_in_the_update_mode_or_a_bad_block_is_refused_at_load():
    with pytest.raises(ConfigError, match="full.*delta-int8.*delta-int4"):
        load_config("tiny-shop-grpo", overrides={"federation.update": "int8"})
    with pytest.raises(ConfigError, match="power of two"):
        load_config("tiny-shop-grpo", overrides={"federation.update": "delta-int8", "federation.quant.block": 48})
    with pytest.raises(ConfigError, match="poison with federation.update: full"):
        load_config("tiny-shop-grpo", overrides={"federation.update": "delta-int4", "faults.poison.kind": "scale"})
    cfg = load_config("tiny-shop-grpo", overrides={"federation.update": "delta-int4", "federation.quant.block": 128})
    assert (Rule.of(cfg.federation).update, Rule.of(cfg.federation).block) == ("delta-int4", 128)
