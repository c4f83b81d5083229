"""fp32 safetensors shards + manifest: bit-exact round trips, bounded shards, integrity checks."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fl_app.store import DirStore
from fl_app.weights import (MANIFEST_NAME, Manifest, WeightsError, load_shards, read_shard, save_shards,
                            state_nbytes)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),          # 8 KiB
        "layers.0.w": torch.randn(32, 32, generator=g),            # 4 KiB
        "layers.0.b": torch.randn(32, generator=g),
        "layers.1.w": torch.randn(32, 32, generator=g),
        "scale": torch.tensor(1.0 + 2.0 ** -20),                   # 0-dim
        "position_ids": torch.arange(16, dtype=torch.int64),       # integer buffer
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if list(a) != list(b):
        return False
    return all(x.dtype == y.dtype and x.shape == y.shape and x.numpy().tobytes() == y.numpy().tobytes()
               for x, y in zip(a.values(), b.values()))


def test_roundtrip_is_bitwise_and_keeps_order(tmp_path):
    state = _state()
    state["nan_and_neg_zero"] = torch.tensor([float("nan"), -0.0, 1e-45, float("inf")])
    manifest = save_shards(state, tmp_path / "w", max_shard_bytes=6000)
    loaded = load_shards(tmp_path / "w")
    assert _bits_equal(state, loaded)
    assert manifest.tensor_bytes == state_nbytes(state)
    assert [t.name for t in manifest.tensors] == list(state)


def test_shards_are_bounded_and_an_oversized_tensor_sits_alone(tmp_path):
    manifest = save_shards(_state(), tmp_path / "w", max_shard_bytes=6000)
    for shard in manifest.shards:
        payload = sum(t.nbytes for t in shard.tensors)
        assert payload <= 6000 or len(shard.tensors) == 1
    assert [t.name for t in manifest.shards[0].tensors] == ["embed.weight"]  # 8 KiB > bound: alone
    assert len(manifest.shards) >= 3
    files = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert files == sorted([s.file for s in manifest.shards] + [MANIFEST_NAME])


def test_shard_layout_and_bytes_are_deterministic(tmp_path):
    a = save_shards(_state(), tmp_path / "a", max_shard_bytes=6000)
    b = save_shards(_state(), tmp_path / "b", max_shard_bytes=6000)
    assert a.to_json() == b.to_json() and a.sha256 == b.sha256


def test_manifest_records_files_hashes_sizes_and_roundtrips(tmp_path):
    manifest = save_shards(_state(), tmp_path / "w", max_shard_bytes=6000)
    on_disk = json.loads((tmp_path / "w" / MANIFEST_NAME).read_text())
    assert on_disk["format"] == "fedagent-weights" and on_disk["version"] == 1
    assert on_disk["total_bytes"] == sum((tmp_path / "w" / s.file).stat().st_size for s in manifest.shards)
    first = on_disk["shards"][0]
    assert set(first) == {"file", "sha256", "bytes", "tensors"}
    assert first["tensors"][0] == {"name": "embed.weight", "shape": [64, 32], "dtype": "float32"}
    again = Manifest.from_dir(tmp_path / "w")
    assert again.to_json() == manifest.to_json() and again.sha256 == manifest.sha256


def test_shards_are_standard_safetensors(tmp_path):
    state = _state()
    manifest = save_shards(state, tmp_path / "w", max_shard_bytes=6000)
    for i, shard in enumerate(manifest.shards):
        lib = load_file(str(tmp_path / "w" / shard.file))
        ours = read_shard(manifest, i)
        assert _bits_equal({k: lib[k] for k in ours}, ours)


def test_non_fp32_floating_tensors_are_refused(tmp_path):
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        with pytest.raises(WeightsError, match="fp32 end to end") as e:
            save_shards({"ok": torch.ones(2), "w": torch.ones(2, dtype=dtype)}, tmp_path / str(dtype), 1 << 20)
        assert "w (" in str(e.value)
        assert not (tmp_path / str(dtype)).exists()
    m = save_shards({"w": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "ok", 1 << 20, allow_non_fp32=True)
    assert m.tensors[0].dtype == "bfloat16"


def test_tied_weights_are_saved(tmp_path):
    w = torch.randn(8, 4)
    loaded = load_shards(save_shards({"embed": w, "lm_head": w}, tmp_path / "w", 1 << 20).root)
    assert torch.equal(loaded["embed"], w) and torch.equal(loaded["lm_head"], w)


def test_corrupt_shard_is_refused_naming_the_shard_and_the_fix(tmp_path):
    manifest = save_shards(_state(), tmp_path / "w", max_shard_bytes=6000)
    victim = tmp_path / "w" / manifest.shards[1].file
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the tensor data, same size
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError) as e:
        load_shards(tmp_path / "w")
    assert manifest.shards[1].file in str(e.value) and "sha256" in str(e.value)
    assert "re-export" in str(e.value).lower()
    victim.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(WeightsError, match="truncated"):
        load_shards(tmp_path / "w")


def test_directory_without_manifest_is_incomplete(tmp_path):
    save_shards(_state(), tmp_path / "w", max_shard_bytes=6000)
    (tmp_path / "w" / MANIFEST_NAME).unlink()  # what a write that died before its last step leaves
    with pytest.raises(WeightsError, match="incomplete"):
        load_shards(tmp_path / "w")
    with pytest.raises(WeightsError, match="not empty"):
        save_shards(_state(), tmp_path / "w", max_shard_bytes=6000)


def test_dir_store_put_get_exists_delete(tmp_path):
    store = DirStore(tmp_path, max_shard_bytes=6000)
    key = "rounds/round-0001/clients/client-0003/actor"
    assert not store.exists(key)
    manifest = store.put(key, _state())
    assert store.exists(key) and store.manifest(key).sha256 == manifest.sha256
    assert _bits_equal(store.get(key), _state())
    with pytest.raises(WeightsError, match="not empty"):
        store.put(key, _state())  # entries are immutable
    with pytest.raises(WeightsError, match="not a single weights entry"):
        store.delete("rounds/round-0001")
    store.delete(key)
    assert not store.exists(key) and not store.path(key).exists()
    for bad in ("../x", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(WeightsError, match="bad weight-store key"):
            store.path(bad)
