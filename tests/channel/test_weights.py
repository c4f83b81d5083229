"""fp32 safetensors shards + manifest: bit-exact round trips, bounded shards, integrity checks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file

from fl_app.channel.run_dir import DirStore
from fl_app.weights import (
    MANIFEST_NAME,
    Manifest,
    ShardWriter,
    WeightsError,
    load_shards,
    read_shard,
    save_shards,
    state_nbytes,
    verify_shards,
)

V1_FIXTURE = Path(__file__).parents[1] / "fixtures" / "weights-v1"


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),  # 8 KiB
        "layers.0.w": torch.randn(32, 32, generator=g),  # 4 KiB
        "layers.0.b": torch.randn(32, generator=g),
        "layers.1.w": torch.randn(32, 32, generator=g),
        "scale": torch.tensor(1.0 + 2.0**-20),  # 0-dim
        "position_ids": torch.arange(16, dtype=torch.int64),  # integer buffer
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if list(a) != list(b):
        return False
    return all(
        x.dtype == y.dtype and x.shape == y.shape and x.numpy().tobytes() == y.numpy().tobytes()
        for x, y in zip(a.values(), b.values())
    )


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
    assert on_disk["format"] == "fedagent-weights" and on_disk["version"] == 2 and on_disk["hash"] == "blake3"
    assert on_disk["total_bytes"] == sum((tmp_path / "w" / s.file).stat().st_size for s in manifest.shards)
    first = on_disk["shards"][0]
    assert set(first) == {"file", "digest", "bytes", "tensors"}
    assert first["tensors"][0] == {"name": "embed.weight", "shape": [64, 32], "dtype": "float32"}
    for shard in on_disk["shards"]:  # hashed while written: the digest of the bytes on disk
        assert shard["digest"] == blake3.blake3((tmp_path / "w" / shard["file"]).read_bytes()).hexdigest()
    again = Manifest.from_dir(tmp_path / "w")
    assert again.to_json() == manifest.to_json() and again.sha256 == manifest.sha256
    assert manifest.sha256 == hashlib.sha256((tmp_path / "w" / MANIFEST_NAME).read_bytes()).hexdigest()


def _v1_state() -> dict[str, torch.Tensor]:
    """What tests/fixtures/weights-v1 holds: written by the v1 code (sha256 manifests, safetensors.save_file)."""
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(24, 8, generator=g),
        "layers.0.w": torch.randn(8, 8, generator=g),
        "layers.0.b": torch.randn(8, generator=g),
        "scale": torch.tensor(1.0 + 2.0**-20),
        "position_ids": torch.arange(6, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_v1_sha256_manifests_still_read_verify_and_keep_their_digest(tmp_path):
    m = Manifest.from_dir(V1_FIXTURE)
    assert (m.version, m.hash) == (1, "sha256")
    # The manifest's own digest (pinned in messages and COMPLETE markers) is unchanged for v1 dirs.
    assert m.sha256 == hashlib.sha256((V1_FIXTURE / MANIFEST_NAME).read_bytes()).hexdigest()
    assert m.to_json() == (V1_FIXTURE / MANIFEST_NAME).read_text()
    verify_shards(m)
    assert _bits_equal(load_shards(V1_FIXTURE), _v1_state())
    shutil.copytree(V1_FIXTURE, tmp_path / "v1")
    victim = tmp_path / "v1" / m.shards[1].file
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x04
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupt: sha256"):
        load_shards(tmp_path / "v1")


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
    assert manifest.shards[1].file in str(e.value) and "corrupt: blake3" in str(e.value)
    assert "re-export" in str(e.value).lower()
    with pytest.raises(WeightsError, match="corrupt"):
        verify_shards(manifest)
    victim.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(WeightsError, match="truncated"):
        load_shards(tmp_path / "w")


def test_shards_read_in_parallel_on_a_many_core_host_give_the_same_state_and_refuse_corruption(tmp_path, monkeypatch):
    """A 16-core host reads shards at once (`read_workers`: two shards wait for each other at a
    barrier, which only concurrent reads pass); the state and its order are those of reading one
    shard after another, and a corrupt shard is still refused by name."""
    import threading

    import fl_app.weights as weights

    manifest = save_shards(_state(), tmp_path / "w", max_shard_bytes=6000)
    assert len(manifest.shards) >= 3
    monkeypatch.setattr(weights, "usable_cores", lambda: 2)
    one_by_one = load_shards(tmp_path / "w")
    monkeypatch.setattr(weights, "usable_cores", lambda: 16)
    assert weights.read_workers(len(manifest.shards)) == min(4, len(manifest.shards)) > 1
    met = threading.Barrier(2, timeout=10)
    read_shard = weights.read_shard

    def meeting(m, i, verify=True, alloc=None):  # type: ignore[no-untyped-def]
        if i < 2:
            met.wait()  # raises BrokenBarrierError unless shards 0 and 1 are read at the same time
        return read_shard(m, i, verify, alloc)

    monkeypatch.setattr(weights, "read_shard", meeting)
    assert _bits_equal(load_shards(tmp_path / "w"), one_by_one) and list(one_by_one) == list(_state())
    monkeypatch.setattr(weights, "read_shard", read_shard)
    victim = tmp_path / "w" / manifest.shards[-1].file
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"{manifest.shards[-1].file}.*corrupt"):
        load_shards(tmp_path / "w")


def test_staged_tensors_write_the_same_bytes_as_host_memory_through_a_wrapping_ring(tmp_path, monkeypatch):
    """A GPU lane's export path: chunks copied into a ring of 4 reused host buffers, each reused
    only once its previous chunk was hashed and written. Driven here with CPU tensors and 4 KiB
    chunks, so the ring wraps dozens of times inside one tensor and across shards, and every
    write lags 1 ms (a buffer reused before its chunk is written is then certain to corrupt
    it): the shards are byte for byte those written from the tensors' own memory (the
    contract's CUDA kinds check the same on a GPU)."""
    import time

    import fl_app.weights as weights

    state = {**_state(), "big": torch.randn(300, 100, generator=torch.Generator().manual_seed(1))}  # 117 KiB
    direct = save_shards(state, tmp_path / "direct", max_shard_bytes=64 << 10)
    monkeypatch.setattr(weights, "IO_CHUNK", 4096)
    monkeypatch.setattr(weights, "_staged", lambda t: True)
    append = weights.ShardWriter._append

    def slow_append(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.001)
        return append(self, *args)

    monkeypatch.setattr(weights.ShardWriter, "_append", slow_append)
    staged = save_shards(state, tmp_path / "staged", max_shard_bytes=64 << 10)
    assert staged.sha256 == direct.sha256 and len(staged.shards) >= 2
    assert _bits_equal(load_shards(tmp_path / "staged"), state)


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


def test_tied_and_odd_dtypes_lay_out_aligned_and_durable_false_still_publishes_last(tmp_path):
    w = torch.randn(5, 3)
    state = {
        "mask": torch.tensor([True, False, True]),
        "w": w,
        "tied": w,
        "ids": torch.arange(3, dtype=torch.int64),
        "h": torch.tensor([1, 2, 3], dtype=torch.int16),
        "zero": torch.zeros(0, 2),
    }
    m = save_shards(state, tmp_path / "w", 1 << 20, durable=False)
    assert (tmp_path / "w" / MANIFEST_NAME).is_file()
    assert [t.name for t in m.tensors] == list(state)  # the manifest keeps the state's order
    assert _bits_equal(load_shards(tmp_path / "w"), state)
    lib = load_file(str(tmp_path / "w" / m.shards[0].file))
    assert _bits_equal({k: lib[k] for k in state}, state)


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    state = {"a": torch.ones(2000), "b": torch.ones(3, dtype=torch.complex64)}  # complex: shards cannot hold it
    with pytest.raises(WeightsError, match="complex64"):
        save_shards(state, tmp_path / "w", 4000, allow_non_fp32=True)
    assert not (tmp_path / "w").exists()  # the first shard was written, then removed with the dir
    (tmp_path / "kept").mkdir()
    with pytest.raises(WeightsError):
        save_shards(state, tmp_path / "kept", 4000, allow_non_fp32=True)
    assert (tmp_path / "kept").is_dir() and not any((tmp_path / "kept").iterdir())  # a dir it did not make stays
    writer = ShardWriter(tmp_path / "w2", 4000)
    writer.add("a", torch.ones(2000))
    writer.flush()
    writer.abort()
    assert not (tmp_path / "w2").exists()


def _rewrite_manifest(d: Path, edit) -> None:
    doc = json.loads((d / MANIFEST_NAME).read_text())
    edit(doc)
    (d / MANIFEST_NAME).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "name", ["/abs/shard.safetensors", "../outside.safetensors", "sub/shard.safetensors", "..", "", "a\\b"]
)
def test_manifest_shard_files_must_be_plain_names(tmp_path, name):
    save_shards(_state(), tmp_path / "w", 6000)
    _rewrite_manifest(tmp_path / "w", lambda d: d["shards"][0].update(file=name))
    with pytest.raises(WeightsError, match="not a plain file name"):
        Manifest.from_dir(tmp_path / "w")


def test_shards_outside_the_weights_dir_are_never_read_even_with_a_matching_digest(tmp_path):
    # The attacker's copy outside the dir is byte-identical to the real shard (digest and size
    # match): only the path rule can refuse it. The v1 code read it (absolute `file`, symlink).
    m = save_shards(_state(), tmp_path / "w", 6000)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(tmp_path / "w" / m.shards[0].file, outside / "evil.safetensors")
    raw = (tmp_path / "w" / MANIFEST_NAME).read_text()
    (tmp_path / "w" / MANIFEST_NAME).write_text(raw.replace(m.shards[0].file, str(outside / "evil.safetensors")))
    with pytest.raises(WeightsError, match="plain file name"):
        load_shards(tmp_path / "w")
    (tmp_path / "w" / MANIFEST_NAME).write_text(raw)
    os.replace(tmp_path / "w" / m.shards[0].file, tmp_path / "moved")
    os.symlink(outside / "evil.safetensors", tmp_path / "w" / m.shards[0].file)
    with pytest.raises(WeightsError, match="outside"):
        load_shards(tmp_path / "w")
    with pytest.raises(WeightsError, match="outside"):
        verify_shards(Manifest.from_dir(tmp_path / "w"))


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a fedagent-weights"),
        (
            '{"format": "fedagent-weights", "version": 2, "hash": "md5", "max_shard_bytes": 1, "shards": []}',
            "unknown hash",
        ),
        ('{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": 10}', "missing 'shards'"),
        (
            '{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": "10", "shards": []}',
            "'max_shard_bytes' is str",
        ),
        (
            '{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": 10, "shards": [3]}',
            "missing 'file'",
        ),
        (
            '{"format": "fedagent-weights", "version": 1, "max_shard_bytes": 10, '
            '"shards": [{"file": "a", "sha256": "x",'
            ' "bytes": 1, "tensors": []}]}',
            "not a 64-digit hex digest",
        ),
        (
            '{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": 10, '
            '"shards": [{"file": "a",'
            ' "digest": "'
            + "0" * 64
            + '", "bytes": 8, "tensors": [{"name": "w", "shape": [2, "x"], "dtype": "float32"}]}]}',
            "not a tensor layout",
        ),
        (
            '{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": 10, '
            '"shards": [{"file": "a",'
            ' "digest": "'
            + "0" * 64
            + '", "bytes": 8, "tensors": [{"name": "w", "shape": [2], "dtype": "__class__"}]}]}',
            "not a tensor layout",
        ),
        (
            '{"format": "fedagent-weights", "version": 2, "hash": "blake3", "max_shard_bytes": 10, "total_bytes": 5,'
            ' "shards": []}',
            "does not add up",
        ),
    ],
)
def test_malformed_manifests_raise_weights_errors_naming_the_file(tmp_path, text, match):
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(WeightsError, match=match) as e:
        Manifest.from_dir(tmp_path)
    assert str(tmp_path / MANIFEST_NAME) in str(e.value)


def test_a_disk_full_mid_shard_is_a_weights_error_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import fl_app.weights as weights_module

    real_write, calls = os.write, []

    def write_until_full(fd, data):  # fault injection: the disk fills after two writes
        calls.append(len(data))
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(weights_module.os, "write", write_until_full)
    big = {"w": torch.randn(3 * weights_module.IO_CHUNK // 4)}
    with pytest.raises(WeightsError, match="No space left on device.*free disk space"):
        save_shards(big, tmp_path / "w", 1 << 30)
    assert not (tmp_path / "w").exists()
