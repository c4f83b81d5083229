"""Weights through Flower messages: inline ArrayRecord vs weight store, bit-identical both ways.

fl_app.transport holds no Flower type; the Flower edge wraps its inline states as
`ArrayRecord(state)` and unwraps them with `to_torch_state_dict()`, as these tests do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from fl_app.store import DirStore
from fl_app.transport import WeightsRef, fedavg_received, receive_weights, send_local, send_stored, send_weights
from fl_app.weights import WeightsError, load_shards, save_shards, state_nbytes

SHARD = 4000


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(30, 16, generator=g),
        "w": torch.randn(16, 16, generator=g),
        "b": torch.randn(16, generator=g),
        "special": torch.tensor([1 + 2**-20, -0.0, 1e-45, float("nan")]),
        "ids": torch.arange(5),
    }


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a
    )


def _over_the_wire(content: RecordDict) -> RecordDict:
    """Serialize a message's content with Flower's own protobuf serde and parse it back."""
    wire = recorddict_to_proto(content).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(wire)
    return recorddict_from_proto(proto)


def _ship(ref: WeightsRef, state: dict[str, torch.Tensor]) -> tuple[WeightsRef, dict[str, torch.Tensor]]:
    """Through Flower's wire the way the edge does it: ArrayRecord(state) out, to_torch_state_dict() in."""
    got = _over_the_wire(RecordDict({"arrays": ArrayRecord(state), "config": ConfigRecord(ref.to_config())}))
    return WeightsRef.from_config(got["config"]), dict(got["arrays"].to_torch_state_dict())


def test_arrayrecord_roundtrip_is_bitwise_through_flower_wire():
    state = _model(0)
    ref, arrays = _ship(WeightsRef(inline=True, nbytes=state_nbytes(state)), state)
    back = receive_weights(ref, arrays, store=None)
    assert _same_bits(state, back)
    assert back["embed"].dtype == torch.float32


def test_inline_and_store_transports_give_identical_bits(tmp_path):
    store = DirStore(tmp_path, SHARD)
    # Aggregation refuses NaN/Inf (issue #18), so the specials averaged here are finite.
    states = [{**_model(s), "special": torch.tensor([1 + 2**-20, -0.0, 1e-45, 3.0])} for s in (1, 2)]
    counts = [7, 3]
    received = {}
    for mode, threshold in (("inline", 1 << 30), ("store", 0)):
        replies = []
        for c, (state, n) in enumerate(zip(states, counts)):
            ref, arrays = _ship(*send_weights(state, store, f"{mode}/client-{c}", inline_max_bytes=threshold))
            assert ref.inline == (mode == "inline")
            assert _same_bits(receive_weights(ref, arrays, store, tmp_path / "cache"), state)
            replies.append((ref, arrays, n))
        received[mode] = fedavg_received(replies, store, tmp_path / f"global-{mode}", SHARD, tmp_path / "cache")
    assert received["inline"].sha256 == received["store"].sha256  # same shard bytes on disk
    assert _same_bits(load_shards(received["inline"].root), load_shards(received["store"].root))


def test_inline_threshold_picks_the_transport(tmp_path):
    store = DirStore(tmp_path, SHARD)
    state = _model(0)
    n = state_nbytes(state)
    ref, arrays = send_weights(state, store, "a", inline_max_bytes=n)
    assert ref.inline and len(arrays) == len(state) and not store.exists("a")
    ref, arrays = send_weights(state, store, "b", inline_max_bytes=n - 1)
    assert not ref.inline and len(arrays) == 0 and store.exists("b")
    assert ref.key == "b" and ref.manifest_sha256 == store.manifest("b").sha256 and ref.nbytes == n


def test_send_stored_global_inline_or_by_reference(tmp_path):
    store = DirStore(tmp_path, SHARD)
    state = _model(3)
    save_shards(state, store.path("rounds/round-0000/actor"), SHARD)
    ref, arrays = send_stored(store, "rounds/round-0000/actor", inline_max_bytes=1 << 20)
    assert ref.inline and _same_bits(arrays, state)
    ref, arrays = _ship(*send_stored(store, "rounds/round-0000/actor", inline_max_bytes=0))
    assert not ref.inline and _same_bits(receive_weights(ref, arrays, store, tmp_path / "cache"), state)


def test_weights_ref_survives_a_configrecord_and_names_missing_keys():
    ref = WeightsRef(inline=False, nbytes=6_200_000_000, key="rounds/round-0003/actor", manifest_sha256="ab" * 32)
    got = _over_the_wire(RecordDict({"c": ConfigRecord({**ref.to_config("actor"), "server-round": 3})}))
    assert WeightsRef.from_config(got["c"], "actor") == ref
    with pytest.raises(WeightsError, match="critic-inline"):
        WeightsRef.from_config(got["c"], "critic")


def test_replaced_store_entry_is_refused(tmp_path):
    store = DirStore(tmp_path, SHARD)
    ref, arrays = send_weights(_model(0), store, "clients/client-0001/actor", inline_max_bytes=0)
    store.delete("clients/client-0001/actor")
    store.put("clients/client-0001/actor", _model(9))  # e.g. a re-run wrote the same key
    with pytest.raises(WeightsError, match="not the one the sender wrote"):
        receive_weights(ref, arrays, store, tmp_path / "cache")
    with pytest.raises(WeightsError, match="not the one the sender wrote"):
        fedavg_received([(ref, arrays, 1)], store, tmp_path / "g", SHARD, tmp_path / "cache")


def test_non_fp32_cannot_ride_inline_and_mixed_replies_are_refused(tmp_path):
    store = DirStore(tmp_path, SHARD)
    with pytest.raises(WeightsError, match="fp32"):
        send_weights({"w": torch.ones(3, dtype=torch.bfloat16)}, store, "bf16", inline_max_bytes=1 << 20)
    a = send_weights(_model(0), store, "a", inline_max_bytes=1 << 20)
    b = send_weights(_model(1), store, "b", inline_max_bytes=0)
    with pytest.raises(WeightsError, match="inline_max_mb"):
        fedavg_received([(*a, 1), (*b, 1)], store, tmp_path / "g", SHARD)


def test_a_string_is_not_a_bool_for_inline():
    """ "false" used to mean inline (bool("false") is True)."""
    ref = WeightsRef(inline=False, nbytes=8, key="k", manifest_sha256="ab" * 32).to_config("actor")
    with pytest.raises(WeightsError, match="not a bool"):
        WeightsRef.from_config({**ref, "actor-inline": "false"}, "actor")


def test_fl_app_imports_no_flower():
    """Issue 17: Flower types stay at the Flower edge (server_app/, client_app/)."""
    code = (
        "import importlib, pkgutil, sys, fl_app\n"
        "for m in pkgutil.iter_modules(fl_app.__path__):\n"
        "    importlib.import_module('fl_app.' + m.name)\n"
        "print(sorted(k for k in sys.modules if k == 'flwr' or k.startswith('flwr.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_send_local_inline_deletes_the_dir_and_by_reference_publishes_it(tmp_path):
    store = DirStore(tmp_path / "store", SHARD)
    state = _model(4)
    small = save_shards(state, store.path("clients/c0/actor"), SHARD).root
    ref, arrays = send_local(store, small, "clients/c0/actor", inline_max_bytes=1 << 20)
    assert ref.inline and _same_bits(arrays, state) and not small.exists()
    at_key = save_shards(state, store.path("clients/c1/actor"), SHARD).root  # DirStore: written in place
    ref, arrays = send_local(store, at_key, "clients/c1/actor", inline_max_bytes=0)
    assert not ref.inline and arrays == {} and ref.manifest_sha256 == store.manifest("clients/c1/actor").sha256
    elsewhere = save_shards(state, tmp_path / "staged" / "actor", SHARD).root  # staged elsewhere: moved in
    ref, _ = send_local(store, elsewhere, "clients/c2/actor", inline_max_bytes=0)
    assert not elsewhere.exists() and _same_bits(receive_weights(ref, {}, store, tmp_path / "cache"), state)
