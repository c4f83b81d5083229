"""server_app.packed: inline weights cross Flower as one Array (3 objects a message, not 2 per
tensor), bit for bit, and a record this app did not pack is refused."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from server_app.packed import NotPacked, pack, unpack


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(8, 6, generator=g) for i in range(26)}
    state["special"] = torch.tensor([1 + 2**-20, -0.0, 1e-45, float("inf"), float("nan")])
    state["codes"] = torch.arange(7, dtype=torch.uint8)  # a compressed update's tensors travel too
    state["scalar"] = torch.tensor(3.5)
    return state


def test_a_packed_state_crosses_flowers_wire_bit_for_bit():
    state = _state()
    wire = recorddict_from_proto(recorddict_to_proto(RecordDict({"arrays": pack(state)})))
    back = unpack(wire["arrays"])
    assert list(back) == list(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert back[k].reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()


def test_a_packed_state_is_three_flower_objects_whatever_its_tensor_count():
    state = _state()
    assert len(get_all_nested_objects(pack(state))) == 3
    assert len(get_all_nested_objects(ArrayRecord(state))) == 1 + 2 * len(state)  # Flower's per-tensor way


def test_no_state_is_an_empty_record_both_ways():
    assert not pack({}) and unpack(pack({})) == {} and unpack(None) == {}


def test_a_record_this_app_did_not_pack_is_refused():
    with pytest.raises(NotPacked, match="other code than this run's app"):
        unpack(ArrayRecord({"w": torch.ones(2)}))
