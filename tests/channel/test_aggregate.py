"""FedAvg (invariants 1 and 2): weighted by example counts, fp32 throughout, identity for one
client, streaming == inline bit for bit, agrees with Flower's own aggregation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from torch.utils._python_dispatch import TorchDispatchMode

from fl_app.aggregate import NonFiniteWeightsError, fedavg_manifests, fedavg_states
from fl_app.weights import Manifest, WeightsError, load_shards, save_shards

SHARD = 5000  # bytes: several shards per small model


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),
        "layers.0.w": torch.randn(16, 16, generator=g),
        "layers.0.b": torch.randn(16, generator=g),
        "layers.1.w": torch.randn(16, 16, generator=g) * 1e-3,
        "head.weight": torch.randn(40, 16, generator=g),
        "position_ids": torch.arange(8),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _export(tmp_path: Path, states: list[dict[str, torch.Tensor]]) -> list[Manifest]:
    return [save_shards(s, tmp_path / f"client-{i}", SHARD) for i, s in enumerate(states)]


def test_fedavg_single_client_is_identity_bitwise(tmp_path):
    state = _model(0)
    # Values that arithmetic could disturb: -0.0, a denormal, the fp32 extremes, a bf16-unrepresentable value.
    state["specials"] = torch.tensor([-0.0, 1e-45, 3.4028235e38, -3.4028235e38, 1 + 2**-20])
    (m,) = _export(tmp_path, [state])
    out = fedavg_manifests([(m, 37.0)], tmp_path / "global", SHARD)
    assert out.sha256 == m.sha256  # the very same shard bytes
    streamed = load_shards(out.root)
    inline = fedavg_states([(state, 37.0)])
    for k in state:
        assert _bits(streamed[k]) == _bits(state[k]) == _bits(inline[k]), k
    # A client with all the weight is copied, not multiplied, even next to zero-weight clients.
    other = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    assert all(_bits(v) == _bits(state[k]) for k, v in fedavg_states([(state, 5), (other, 0)]).items())


def test_fedavg_weighted_by_num_examples(tmp_path):
    a = {"w": torch.zeros(6), "n": torch.arange(3)}
    b = {"w": torch.full((6,), 4.0), "n": torch.arange(3)}
    avg = fedavg_states([(a, 1), (b, 3)])
    assert torch.equal(avg["w"], torch.full((6,), 3.0))  # (0*1 + 4*3) / 4, exact
    assert torch.equal(avg["n"], torch.arange(3))  # integer buffers are carried, not averaged
    states, weights = [_model(s) for s in range(3)], [12, 30, 7]
    ms = _export(tmp_path, states)
    got = load_shards(fedavg_manifests(list(zip(ms, weights)), tmp_path / "g", SHARD).root)
    for k in states[0]:
        if not states[0][k].is_floating_point():
            continue
        ref = sum(s[k].double() * w for s, w in zip(states, weights)) / sum(weights)
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k].double(), ref, rtol=1e-6, atol=1e-7)
    # Scaling all counts does not change the result.
    again = fedavg_states([(s, w * 10) for s, w in zip(states, weights)])
    assert all(_bits(again[k]) == _bits(got[k]) for k in got)


def test_value_bf16_cannot_represent_survives(tmp_path):
    x = 1 + 2**-20  # fp32-exact; bf16 rounds it to 1.0
    assert torch.tensor(x).bfloat16().float().item() == 1.0
    a = {"w": torch.full((4,), x), "v": torch.full((3,), 1 + 2**-20)}
    b = {"w": torch.full((4,), x), "v": torch.full((3,), 1 + 3 * 2**-20)}
    ms = _export(tmp_path, [a, b])  # client export
    out = fedavg_manifests([(ms[0], 1), (ms[1], 3)], tmp_path / "global", SHARD)  # server
    back = load_shards(out.root)  # next round's client load
    assert back["w"].tolist() == [x] * 4
    assert back["v"].tolist() == [1 + 2.5 * 2**-20] * 3  # the mean itself needs fp32 precision
    assert (torch.tensor(1 + 2.5 * 2**-20).bfloat16().float() != back["v"][0]).item()


class _DtypeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


def test_aggregation_never_widens_to_float64(tmp_path):
    states = [_model(s) for s in range(3)]
    ms = _export(tmp_path, states)
    with _DtypeRecorder() as rec:
        out = fedavg_manifests([(m, w) for m, w in zip(ms, (3, 1, 2))], tmp_path / "g", SHARD)
        fedavg_states([(s, w) for s, w in zip(states, (3, 1, 2))])
    assert torch.float32 in rec.dtypes and torch.float64 not in rec.dtypes, rec.dtypes
    assert {t.dtype for t in out.tensors} == {"float32", "int64"}


_PEAK_CHILD = """
import json, sys
from pathlib import Path
from fl_app.aggregate import fedavg_manifests
from fl_app.weights import Manifest

def status_kb(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

inputs = [(Manifest.from_dir(Path(p)), w) for p, w in zip(sys.argv[3:], (5, 2, 9))]
# Warm up once (the reader thread's malloc arena, torch's kernels and thread pool, lazy imports):
# one-time costs that vary by machine and venv (a fresh CI venv showed +8 MiB), not memory per model.
fedavg_manifests(inputs, Path(sys.argv[1] + "-warm-up"), int(sys.argv[2]))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status_kb("VmRSS")
fedavg_manifests(inputs, Path(sys.argv[1]), int(sys.argv[2]))
peak = (status_kb("VmHWM") - before) * 1024
# The measurement itself must see memory: the same window around 24 MiB of touched pages.
open("/proc/self/clear_refs", "w").write("5")
before = status_kb("VmRSS")
probe = bytearray(24 << 20)
print(json.dumps({"peak_increase_bytes": peak, "probe_bytes": (status_kb("VmHWM") - before) * 1024}))
"""


def test_streaming_fedavg_peak_memory_is_a_few_shards_not_models(tmp_path):
    # 3 clients x 32 MiB models in 1 MiB shards. Holding every model would add 96 MiB, one
    # float64 copy of a model 64 MiB; streaming holds a few pieces per client (<= 1 MiB each here).
    g = torch.Generator().manual_seed(0)
    shard, model_bytes = 1 << 20, 32 << 20
    dirs = []
    for c in range(3):
        state = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(model_bytes // (1 << 20))}
        dirs.append(str(save_shards(state, tmp_path / f"c{c}", shard).root))
        del state
    res = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(tmp_path / "g"), str(shard), *dirs],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    peak = got["peak_increase_bytes"]
    assert got["probe_bytes"] >= 24 << 20  # the peak-RSS window works
    assert peak < model_bytes // 2, f"aggregation raised peak RSS by {peak / 2**20:.1f} MiB"
    assert Manifest.from_dir(tmp_path / "g").tensor_bytes == model_bytes


def test_streaming_and_inline_fedavg_give_identical_bits(tmp_path):
    states, weights = [_model(s) for s in range(4)], [3, 5, 11, 1]
    ms = _export(tmp_path, states)
    snapshot = {k: v.clone() for k, v in states[0].items()}
    inline = fedavg_states(list(zip(states, weights)))
    streamed = load_shards(fedavg_manifests(list(zip(ms, weights)), tmp_path / "g", SHARD).root)
    assert list(inline) == list(streamed)
    assert all(_bits(inline[k]) == _bits(streamed[k]) for k in inline)
    assert all(torch.equal(states[0][k], snapshot[k]) for k in snapshot)  # inputs untouched


def test_fedavg_matches_flower_aggregate_arrayrecords():
    states, weights = [_model(s) for s in range(3)], [4, 9, 2]
    floats = [{k: v for k, v in s.items() if v.is_floating_point()} for s in states]
    records = [
        RecordDict({"arrays": ArrayRecord(s), "metrics": MetricRecord({"num-examples": w})})
        for s, w in zip(floats, weights)
    ]
    flower: ArrayRecord = aggregate_arrayrecords(records, "num-examples")
    ours = fedavg_states(list(zip(floats, weights)))
    assert list(flower.keys()) == list(ours)
    eps = float(np.finfo(np.float32).eps)
    for k, arr in flower.items():
        theirs = arr.numpy()
        assert theirs.dtype == np.float32 and ours[k].dtype == torch.float32
        # Equal within fp32 rounding: a few ulps of the magnitudes that were summed.
        scale = sum(abs(s[k].double().numpy()) * w for s, w in zip(floats, weights)) / sum(weights)
        assert np.all(np.abs(ours[k].double().numpy() - theirs) <= 3 * eps * scale), k


def test_fedavg_refuses_corrupt_client_shard_and_writes_no_manifest(tmp_path):
    ms = _export(tmp_path, [_model(0), _model(1)])
    victim = ms[1].shard_path(len(ms[1].shards) - 1)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=victim.name):
        fedavg_manifests([(ms[0], 1), (ms[1], 1)], tmp_path / "g", SHARD)
    with pytest.raises(WeightsError, match="no manifest.json"):
        Manifest.from_dir(tmp_path / "g")
    assert not (tmp_path / "g").exists()  # what it wrote before the digest mismatch was removed


def test_fedavg_refuses_clients_that_do_not_match(tmp_path):
    a, b = _model(0), _model(1)
    b["layers.0.b"] = torch.randn(17)
    with pytest.raises(WeightsError, match="shape"):
        fedavg_states([(a, 1), (b, 1)])
    m_a = save_shards(a, tmp_path / "a", SHARD)
    m_b = save_shards(_model(1), tmp_path / "b", SHARD * 2)
    with pytest.raises(WeightsError, match="shard layout"):
        fedavg_manifests([(m_a, 1), (m_b, 1)], tmp_path / "g", SHARD)
    c = _model(2)
    c["position_ids"] = torch.arange(8) + 1
    with pytest.raises(WeightsError, match="position_ids"):
        fedavg_states([(a, 1), (c, 1)])
    for bad in ([(a, -1), (c, 2)], [(a, 0)], []):
        with pytest.raises(WeightsError, match="FedAvg"):
            fedavg_states(bad)


def _poison(state: dict[str, torch.Tensor], name: str, value: float, at: int = 3) -> dict[str, torch.Tensor]:
    bad = {k: v.clone() for k, v in state.items()}
    bad[name].view(-1)[at] = value
    return bad


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_uploads_are_refused_naming_client_and_tensor_before_anything_is_written(tmp_path, value):
    states = [_model(0), _poison(_model(1), "layers.1.w", value), _model(2), _poison(_model(3), "head.weight", value)]
    states[3] = _poison(states[3], "embed.weight", value, at=0)
    weights, names = [3, 5, 2, 4], ["client 4", "client 7", "client 1", "client 9"]
    with pytest.raises(NonFiniteWeightsError) as inline:
        fedavg_states(list(zip(states, weights)), names=names)
    ms = _export(tmp_path, states)
    with pytest.raises(NonFiniteWeightsError) as streamed:
        fedavg_manifests(list(zip(ms, weights)), tmp_path / "g", SHARD, names=names)
    assert not (tmp_path / "g").exists()  # nothing published, nothing left half-written
    for e in (inline.value, streamed.value):
        assert isinstance(e, WeightsError)
        assert e.inputs == [1, 3]
        assert e.culprits[1] == [("layers.1.w", 1, 256)]
        assert sorted(e.culprits[3]) == [("embed.weight", 1, 640), ("head.weight", 1, 640)]
        msg = str(e)
        assert "client 7 (input 1): 'layers.1.w' (1 of 256 values)" in msg and "client 9 (input 3)" in msg
        assert "client 4" not in msg and "nothing was written" in msg
    # Without names the inputs are named by index; the round can be retried into the same dir.
    with pytest.raises(NonFiniteWeightsError, match=r"input 1 \(input 1\)"):
        fedavg_manifests(list(zip(ms, weights)), tmp_path / "g", SHARD)
    kept = [0, 2]
    out = fedavg_manifests([(ms[i], weights[i]) for i in kept], tmp_path / "g", SHARD)
    ref = fedavg_states([(states[i], weights[i]) for i in kept])
    assert all(_bits(v) == _bits(ref[k]) for k, v in load_shards(out.root).items())


def test_a_single_non_finite_client_is_refused_and_a_zero_weight_one_is_skipped(tmp_path):
    bad = _poison(_model(1), "layers.0.b", float("nan"))
    (m,) = _export(tmp_path, [bad])
    with pytest.raises(NonFiniteWeightsError, match="'layers.0.b'"):
        fedavg_manifests([(m, 1)], tmp_path / "g", SHARD)  # the identity copy is checked too
    with pytest.raises(NonFiniteWeightsError):
        fedavg_states([(bad, 1)])
    good = _model(0)
    got = fedavg_states([(good, 4), (bad, 0)])  # a zero-weight input does not contribute
    assert all(_bits(got[k]) == _bits(good[k]) for k in good)


def test_overflow_of_finite_inputs_is_refused_without_blaming_a_client(tmp_path):
    # The fp32 factors of 5/25, 9/25, 11/25 sum to just above 1: at the fp32 limit the mean rounds to inf.
    top = torch.full((8,), torch.finfo(torch.float32).max)
    with pytest.raises(NonFiniteWeightsError, match="overflowed fp32 although every input is finite") as e:
        fedavg_states([({"w": top}, 5), ({"w": top}, 9), ({"w": top}, 11)])
    assert e.value.inputs == []


def test_output_shard_bound_must_match_the_clients(tmp_path):
    ms = _export(tmp_path, [_model(0), _model(1)])
    with pytest.raises(WeightsError, match="run.shard_max_mb"):
        fedavg_manifests([(ms[0], 1), (ms[1], 1)], tmp_path / "g", SHARD * 2)


def test_v1_client_uploads_still_aggregate(tmp_path):
    v1 = Path(__file__).parents[1] / "fixtures" / "weights-v1"
    m = Manifest.from_dir(v1)
    out = fedavg_manifests([(m, 2), (v1, 3)], tmp_path / "g", m.max_shard_bytes)
    assert (out.version, out.hash) == (2, "blake3")
    state = load_shards(v1)
    ref = fedavg_states([(state, 2), (state, 3)])
    assert all(_bits(v) == _bits(ref[k]) for k, v in load_shards(out.root).items())
    assert _bits(
        load_shards(fedavg_manifests([(m, 1)], tmp_path / "one", m.max_shard_bytes).root)["layers.0.w"]
    ) == _bits(state["layers.0.w"])


def test_tensors_spanning_many_pieces_and_shards_stay_bit_identical_to_inline(tmp_path):
    # 1,000,003 floats (~4 MB) span several 1 MiB pieces with a ragged tail; a tiny shard bound
    # puts every tensor in its own shard.
    g = torch.Generator().manual_seed(5)
    states = [
        {
            "big": torch.randn(1_000_003, generator=g),
            "mid": torch.randn(3, 100_001, generator=g),
            "ids": torch.arange(7),
        }
        for _ in range(3)
    ]
    weights = [5, 1, 9]
    ms = [save_shards(s, tmp_path / f"c{i}", 1000) for i, s in enumerate(states)]
    assert len(ms[0].shards) == 3
    streamed = load_shards(fedavg_manifests(list(zip(ms, weights)), tmp_path / "g", 1000).root)
    inline = fedavg_states(list(zip(states, weights)))
    assert all(_bits(streamed[k]) == _bits(inline[k]) for k in inline)
    ref = sum(s["big"].double() * w for s, w in zip(states, weights)) / sum(weights)
    torch.testing.assert_close(streamed["big"].double(), ref, rtol=1e-6, atol=1e-6)


def test_server_lr_steps_from_the_global_model_and_one_is_fedavg_bit_for_bit(tmp_path):
    """federation.server_lr: w + eta * (avg - w) from the round's global model w, streaming ==
    inline bit for bit; eta = 1 never reads w and gives FedAvg's bits; a missing w fails."""
    states, weights, previous = [_model(s) for s in range(3)], [12, 30, 7], _model(9)
    ms, (prev_m,) = _export(tmp_path, states), _export(tmp_path / "prev", [previous])
    fedavg = fedavg_states(list(zip(states, weights)))
    one = fedavg_states(list(zip(states, weights)), previous=previous, server_lr=1.0)
    assert all(_bits(one[k]) == _bits(fedavg[k]) for k in fedavg)
    absent = tmp_path / "absent"  # at eta = 1 the streaming path does not even open it
    streamed_one = fedavg_manifests(list(zip(ms, weights)), tmp_path / "g1", SHARD, previous=absent, server_lr=1.0)
    assert streamed_one.sha256 == fedavg_manifests(list(zip(ms, weights)), tmp_path / "g0", SHARD).sha256
    for eta in (1.5, 0.5):
        inline = fedavg_states(list(zip(states, weights)), previous=previous, server_lr=eta)
        out = fedavg_manifests(list(zip(ms, weights)), tmp_path / f"g{eta}", SHARD, previous=prev_m, server_lr=eta)
        streamed = load_shards(out.root)
        for k in previous:
            assert _bits(inline[k]) == _bits(streamed[k]), k
            if not previous[k].is_floating_point():
                assert torch.equal(inline[k], previous[k])
                continue
            avg = sum(s[k].double() * w for s, w in zip(states, weights)) / sum(weights)
            want = previous[k].double() + eta * (avg - previous[k].double())
            assert inline[k].dtype == torch.float32
            torch.testing.assert_close(inline[k].double(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(WeightsError, match="pass it as `previous`"):
        fedavg_states(list(zip(states, weights)), server_lr=1.5)
    with pytest.raises(WeightsError, match="server_lr must be in"):
        fedavg_states(list(zip(states, weights)), previous=previous, server_lr=0.0)


def test_with_a_server_lr_a_nan_upload_still_names_its_client_and_a_broken_global_fails_closed(tmp_path):
    good, prev = _model(0), _model(1)
    bad = {k: v.clone() for k, v in good.items()}
    bad["layers.0.b"][3] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="client 5") as err:
        fedavg_states([(good, 1), (bad, 1)], names=["client 4", "client 5"], previous=prev, server_lr=1.5)
    assert err.value.inputs == [1]
    broken = {k: v.clone() for k, v in prev.items()}
    broken["head.weight"][0, 0] = float("inf")
    ms, (broken_m,) = _export(tmp_path, [good, good]), _export(tmp_path / "prev", [broken])
    with pytest.raises(WeightsError, match="the round's global model") as err2:
        fedavg_manifests([(m, 1) for m in ms], tmp_path / "g", SHARD, previous=broken_m, server_lr=1.5)
    assert not isinstance(err2.value, NonFiniteWeightsError)  # no client is dropped for it
    assert not (tmp_path / "g" / "manifest.json").exists()
    other_layout = save_shards(prev, tmp_path / "prev-big", 4 * SHARD)  # run.shard_max_mb changed on resume
    with pytest.raises(WeightsError, match="the round's global model .* differently"):
        fedavg_manifests([(m, 1) for m in ms], tmp_path / "g2", SHARD, previous=other_layout, server_lr=1.5)
