"""The weight channel: put(local dir) -> ref, get(ref) -> local dir, inline in the Flower
message or through the store, bit-identical both ways; and the typed call as one record.

fl_app holds no Flower type; the Flower edge packs an inline state into one Array
(`server_app.packed.pack`) and unpacks it (`unpack`), and a call as one ConfigRecord of its JSON,
as these tests do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from pydantic import ValidationError
from store_support import model, same_bits

from fl_app.aggregate import fedavg_refs
from fl_app.calls import RECORD, EvalCall, FitCall
from fl_app.channel import Channel, WeightsRef, write_disk_probe
from fl_app.channel.run_dir import DirStore
from fl_app.weights import WeightsError, load_shards, save_shards, state_nbytes
from server_app.packed import pack, unpack

SHARD = 4000


def _over_the_wire(content: RecordDict) -> RecordDict:
    """Serialize a message's content with Flower's own protobuf serde and parse it back."""
    wire = recorddict_to_proto(content).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(wire)
    return recorddict_from_proto(proto)


def _channel(root: Path, inline_max_bytes: int, **kw) -> Channel:
    return Channel(
        DirStore(root, SHARD), cache_dir=root / "cache", inline_max_bytes=inline_max_bytes, shard_bytes=SHARD, **kw
    )


def _put_state(channel: Channel, state: dict[str, torch.Tensor], key: str) -> tuple[WeightsRef, dict]:
    """What a node ships after a fit: the dir it wrote, put under `key`."""
    assert isinstance(channel.store, DirStore)
    return channel.put(save_shards(state, channel.store.path(key), SHARD).root, key)


def _ship(ref: WeightsRef, state: dict[str, torch.Tensor]) -> tuple[WeightsRef, dict[str, torch.Tensor]]:
    """Through Flower's wire the way the edge does it: the call's JSON as one record, the arrays
    packed into one Array out and unpacked in."""
    call = EvalCall(seed=0, weights={"actor": ref})
    content = RecordDict({"arrays": pack(state), RECORD: ConfigRecord({RECORD: call.model_dump_json()})})
    got = _over_the_wire(content)
    back = EvalCall.model_validate_json(str(got[RECORD][RECORD]))
    return back.weights["actor"], unpack(got["arrays"])


def test_arrayrecord_roundtrip_is_bitwise_through_flower_wire(tmp_path):
    state = model(0)
    ref, arrays = _ship(WeightsRef(inline=True, nbytes=state_nbytes(state)), state)
    back = _channel(tmp_path, 1 << 30).state(ref, arrays)
    assert same_bits(state, back)
    assert back["embed"].dtype == torch.float32


def test_inline_and_store_transports_give_identical_bits(tmp_path):
    # Aggregation refuses NaN/Inf, so the specials averaged here are finite.
    states = [{**model(s), "special": torch.tensor([1 + 2**-20, -0.0, 1e-45, 3.0])} for s in (1, 2)]
    counts = [7, 3]
    received = {}
    for mode, threshold in (("inline", 1 << 30), ("store", 0)):
        channel = _channel(tmp_path, threshold)
        replies = []
        for c, (state, n) in enumerate(zip(states, counts)):
            ref, arrays = _ship(*_put_state(channel, state, f"{mode}/client-{c}"))
            assert ref.inline == (mode == "inline")
            assert same_bits(channel.state(ref, arrays), state)
            assert same_bits(load_shards(channel.get(ref, arrays, tmp_path / f"got-{mode}-{c}")), state)
            replies.append((ref, arrays, n))
        received[mode] = fedavg_refs(replies, channel, tmp_path / f"global-{mode}")
    assert received["inline"].sha256 == received["store"].sha256  # same shard bytes on disk
    assert same_bits(load_shards(received["inline"].root), load_shards(received["store"].root))


def test_inline_threshold_picks_the_transport(tmp_path):
    state = model(0)
    n = state_nbytes(state)
    ref, arrays = _put_state(_channel(tmp_path, n), state, "a")
    assert ref.inline and len(arrays) == len(state) and not (tmp_path / "a").exists()
    channel = _channel(tmp_path, n - 1)
    ref, arrays = _put_state(channel, state, "b")
    assert not ref.inline and len(arrays) == 0 and channel.store.exists("b")
    assert ref.key == "b" and ref.manifest_sha256 == channel.store.manifest("b").sha256 and ref.nbytes == n


def test_put_entry_ships_the_global_inline_or_by_reference(tmp_path):
    state = model(3)
    save_shards(state, tmp_path / "rounds/round-0000/actor", SHARD)
    ref, arrays = _channel(tmp_path, 1 << 20).put_entry("rounds/round-0000/actor")
    assert ref.inline and same_bits(arrays, state)
    channel = _channel(tmp_path, 0)
    ref, arrays = _ship(*channel.put_entry("rounds/round-0000/actor"))
    assert not ref.inline and same_bits(channel.state(ref, arrays), state)
    assert channel.get(ref, arrays, tmp_path / "unused") == tmp_path / "rounds/round-0000/actor"  # read in place


def test_a_call_travels_as_one_record_and_is_validated_once_by_its_type():
    ref = WeightsRef(inline=False, nbytes=6_200_000_000, key="rounds/round-0003/actor", manifest_sha256="ab" * 32)
    call = FitCall(run_id=7, round=3, client_id=41, local_epochs=3, seed=0, proximal_mu=0.01, weights={"actor": ref})
    got = _over_the_wire(RecordDict({RECORD: ConfigRecord({RECORD: call.model_dump_json()})}))
    assert list(got[RECORD]) == [RECORD]  # one record, one key: the call
    assert FitCall.model_validate_json(str(got[RECORD][RECORD])) == call
    for bad in ({"local_epochs": 0}, {"proximal_mu": -1.0}, {"client_id": -1}, {"seed": 2**63}, {"epochs": 3}):
        with pytest.raises(ValidationError):
            FitCall.model_validate({**call.model_dump(), **bad})


def test_replaced_store_entry_is_refused(tmp_path):
    channel = _channel(tmp_path, 0)
    ref, arrays = _put_state(channel, model(0), "clients/client-0001/actor")
    channel.store.delete("clients/client-0001/actor")
    channel.store.put("clients/client-0001/actor", model(9))  # e.g. a re-run wrote the same key
    with pytest.raises(WeightsError, match="not the one the sender wrote"):
        channel.state(ref, arrays)
    with pytest.raises(WeightsError, match="not the one the sender wrote"):
        fedavg_refs([(ref, arrays, 1)], channel, tmp_path / "g")


def test_non_fp32_cannot_ride_inline_and_mixed_replies_are_refused(tmp_path):
    inline, by_ref = _channel(tmp_path, 1 << 20), _channel(tmp_path, 0)
    with pytest.raises(WeightsError, match="fp32"):
        _put_state(inline, {"w": torch.ones(3, dtype=torch.bfloat16)}, "bf16")
    a = _put_state(inline, model(0), "a")
    b = _put_state(by_ref, model(1), "b")
    with pytest.raises(WeightsError, match="inline_max_mb"):
        fedavg_refs([(*a, 1), (*b, 1)], by_ref, tmp_path / "g")


def test_a_string_is_not_a_bool_for_inline():
    """ "false" must never mean inline (bool("false") is True)."""
    with pytest.raises(ValidationError, match="inline"):
        WeightsRef.model_validate({"inline": "false", "nbytes": 8, "key": "k", "manifest_sha256": "ab" * 32})


def test_a_node_without_the_run_dir_is_told_before_any_transfer(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_disk_probe(run_dir)
    node = _channel(run_dir, 0, run_dir=run_dir, run_dir_token="not-the-server-s", node="node 7")
    with pytest.raises(WeightsError, match="node 7 cannot see the run dir"):
        _put_state(node, model(0), "clients/c0/actor")
    ref = WeightsRef(inline=False, nbytes=8, key="rounds/round-0000/actor", manifest_sha256="ab" * 32)
    with pytest.raises(WeightsError, match="weight_store=http"):
        node.get(ref, {}, tmp_path / "unused")


def test_fl_app_imports_no_flower():
    """Flower types stay at the Flower edge (server_app/, client_app/)."""
    code = (
        "import importlib, pkgutil, sys, fl_app\n"
        "for m in pkgutil.walk_packages(fl_app.__path__, 'fl_app.'):\n"
        "    importlib.import_module(m.name)\n"
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


def test_put_inline_deletes_the_dir_and_by_reference_publishes_it(tmp_path):
    state = model(4)
    inline, by_ref = _channel(tmp_path / "store", 1 << 20), _channel(tmp_path / "store", 0)
    small = save_shards(state, tmp_path / "store/clients/c0/actor", SHARD).root
    ref, arrays = inline.put(small, "clients/c0/actor")
    assert ref.inline and same_bits(arrays, state) and not small.exists()
    at_key = save_shards(state, tmp_path / "store/clients/c1/actor", SHARD).root  # DirStore: written in place
    ref, arrays = by_ref.put(at_key, "clients/c1/actor")
    assert not ref.inline and arrays == {} and ref.manifest_sha256 == by_ref.store.manifest("clients/c1/actor").sha256
    elsewhere = save_shards(state, tmp_path / "staged" / "actor", SHARD).root  # staged elsewhere: moved in
    ref, _ = by_ref.put(elsewhere, "clients/c2/actor")
    assert not elsewhere.exists() and same_bits(by_ref.state(ref, {}), state)
