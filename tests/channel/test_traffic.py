"""What a call's weights move, per transport (fl_app.accounting's bytes down and up): the arrays
of an inline ref; the shard files of a store entry, read from the shared run dir or downloaded
from and uploaded to the served HTTP store (a real uvicorn server, no mocks), where a node's
cached entry moves nothing."""

from __future__ import annotations

from pathlib import Path

from store_support import model
from test_store_http import SHARD, _cred, run_dir, served  # noqa: F401  (the served store's fixtures, used by name)

from fl_app.channel import Channel
from fl_app.channel.http import HttpWeightStore
from fl_app.channel.run_dir import DirStore
from fl_app.rundir import RunDir
from fl_app.weights import save_shards, state_nbytes

GLOBAL = "rounds/round-0000/actor"


def _state() -> dict:
    return {k: v for k, v in model(0).items() if v.is_floating_point()}  # fp32 only: it may travel inline


def _files(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def _channel(store, root: Path, inline_max: int) -> Channel:
    return Channel(store, cache_dir=root / "cache", inline_max_bytes=inline_max, shard_bytes=SHARD, run_dir=root)


def test_inline_moves_the_arrays_and_the_run_dir_moves_the_shard_files(tmp_path):
    rd = RunDir(tmp_path / "run")
    save_shards(_state(), rd.member_dir(0), SHARD)
    on_disk = _files(rd.member_dir(0))
    for inline_max, expect in ((1 << 30, state_nbytes(_state())), (0, on_disk)):
        ch = _channel(DirStore(rd.path, SHARD), rd.path, inline_max)
        ref, arrays = ch.put_entry(GLOBAL)
        assert ref.inline == bool(inline_max)
        assert ch.down_bytes(ref) == expect
        ch.get(ref, arrays, tmp_path / "scratch")
        up = save_shards(_state(), rd.client_dir(1, 3) / "actor", SHARD)
        assert ch.up_bytes(up.root) == expect == (up.tensor_bytes if inline_max else up.total_bytes)
        ch.put(up.root, rd.store_key(up.root))
    assert on_disk > state_nbytes(_state())  # the safetensors headers travel too


def test_the_served_store_counts_what_is_downloaded_and_uploaded(served, run_dir, tmp_path):  # noqa: F811
    rd = RunDir(run_dir)  # what the server serves
    save_shards(_state(), rd.member_dir(1), SHARD)
    key, up_key = "rounds/round-0001/actor", "rounds/round-0002/clients/client-0001/actor"
    ref, _ = _channel(DirStore(rd.path, SHARD), rd.path, 0).put_entry(key)
    node = tmp_path / "node"
    store = HttpWeightStore(served.url, _cred(served, read=[key], write=[up_key]), max_shard_bytes=SHARD)
    ch = _channel(store, node, 0)
    down = ch.down_bytes(ref)
    fetched = ch.get(ref, {}, node / "scratch")
    assert down == _files(fetched) == _files(rd.member_dir(1)) > 0
    assert ch.down_bytes(ref) == 0, "the node's cache holds it: nothing travels again"
    result = save_shards(_state(), node / "work" / "actor", SHARD)
    up = ch.up_bytes(result.root)
    ch.put(result.root, up_key)
    assert up == _files(rd.path / up_key) == result.total_bytes
