"""The fsspec weight store against a real S3 emulator (moto's server, a subprocess stopped by PID)
and a file:// directory (issue #14 item 2)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_support import model, same_bits

from envs.ports import choose_free_port
from fl_app.channel.object_store import FsspecWeightStore
from fl_app.channel.open import open_store
from fl_app.channel.remote import WeightStoreUnreachable
from fl_app.channel.run_dir import DirStore
from fl_app.weights import WeightsError, load_shards, save_shards

SHARD = 8 << 10
KEY = "rounds/round-0000/actor"


def s3fs() -> Any:
    """The test extra's s3fs, imported by the tests that need it: the GPU wheel sets leave it out,
    and there the file:// tests (here and in test_weight_channel_run.py) still run."""
    return pytest.importorskip("s3fs", reason="the test extra's s3fs (GPU wheel sets leave it out)")


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """storage_options for a fresh moto S3 server on a private-band loopback port, bucket 'weights'."""
    filesystem = s3fs().S3FileSystem
    port = choose_free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.1)
        opts = {
            "key": "testing",
            "secret": "testing",
            "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"},
        }
        filesystem(**opts).mkdir("weights")
        yield opts
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _store(s3: dict[str, Any], prefix: str, **kw: Any) -> FsspecWeightStore:
    return FsspecWeightStore(f"s3://weights/{prefix}", max_shard_bytes=SHARD, storage_options=s3, **kw)


def test_s3_round_trip_server_to_nodes_and_back(s3, tmp_path):
    """invariant 1 through S3: the server publishes its round, two nodes fetch it bit for bit and
    publish their results, which the server fetches back."""
    server = _store(s3, "run-a")
    global_dir = save_shards(model(0), tmp_path / "run" / KEY, SHARD)
    assert server.publish(global_dir.root, KEY).sha256 == global_dir.sha256
    for i in range(2):
        node = _store(s3, "run-a", node=f"n{i}")
        got = node.fetch(KEY, global_dir.sha256, tmp_path / f"cache-{i}")
        assert same_bits(load_shards(got), model(0))
        out = save_shards(model(10 + i), tmp_path / f"out-{i}", SHARD)
        node.publish(out.root, f"rounds/round-0001/clients/client-{i:04d}/actor")
    for i in range(2):
        key = f"rounds/round-0001/clients/client-{i:04d}/actor"
        pin = server.manifest(key).sha256
        assert same_bits(load_shards(server.fetch(key, pin, tmp_path / "server-cache")), model(10 + i))
    assert same_bits(server.get(KEY), model(0))


def test_s3_entries_are_immutable_and_appear_only_with_their_manifest(s3, tmp_path):
    store = _store(s3, "run-b")
    first = save_shards(model(1), tmp_path / "a", SHARD)
    store.publish(first.root, KEY)
    assert store.publish(first.root, KEY).sha256 == first.sha256  # the same bytes: a no-op
    with pytest.raises(WeightsError, match="immutable"):
        store.publish(save_shards(model(2), tmp_path / "b", SHARD).root, KEY)
    fs = s3fs().S3FileSystem(**s3)
    fs.rm("weights/run-b/rounds/round-0000/actor/manifest.json")  # shards without a manifest
    assert not store.exists(KEY)
    with pytest.raises(WeightsError, match="no complete entry"):
        store.fetch(KEY, first.sha256, tmp_path / "cache")


def test_s3_a_corrupt_or_partial_download_is_redone_and_verified(s3, tmp_path):
    store = _store(s3, "run-c")
    m = store.put(KEY, model(3))
    slot_dir = tmp_path / "cache" / f"{m.sha256}.partial" / ".incoming"
    slot_dir.mkdir(parents=True)
    first = m.shards[0]
    (slot_dir / first.file).write_bytes(b"\0" * (first.bytes // 2))  # a cut-off download left garbage
    got = store.fetch(KEY, m.sha256, tmp_path / "cache")
    assert same_bits(load_shards(got), model(3))
    fs = s3fs().S3FileSystem(**s3)
    path = f"weights/run-c/{KEY}/{m.shards[1].file}"
    data = bytearray(fs.cat_file(path))
    data[-2] ^= 0x40
    fs.pipe_file(path, bytes(data))  # the store's copy rots
    with pytest.raises(WeightsError, match="corrupt"):
        store.fetch(KEY, m.sha256, tmp_path / "other-cache")
    assert not (tmp_path / "other-cache" / m.sha256).exists()


def test_s3_delete_and_unreachable_endpoint(s3, tmp_path):
    store = _store(s3, "run-d")
    store.put("scratch/x", model(4))
    with pytest.raises(WeightsError, match="not a single weights entry"):
        store.delete("scratch")
    store.delete("scratch/x")
    assert not store.exists("scratch/x")
    dead = {
        **s3,
        "client_kwargs": {**s3["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{choose_free_port()}"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    with pytest.raises(WeightStoreUnreachable, match="node n9: cannot reach the weight store at s3://weights/run-d"):
        FsspecWeightStore("s3://weights/run-d", max_shard_bytes=SHARD, storage_options=dead, node="n9").exists(KEY)


def test_file_urls_through_fsspec_and_open_store(tmp_path):
    shared = tmp_path / "shared"
    store = FsspecWeightStore(f"file://{shared}", max_shard_bytes=SHARD)
    m = store.put(KEY, model(5))
    assert same_bits(DirStore(shared, SHARD).get(KEY), model(5))  # same layout as a DirStore
    got = store.fetch(KEY, m.sha256, tmp_path / "cache")
    assert got.root != shared / KEY and same_bits(load_shards(got), model(5))
    # open_store reads a shared disk in place: a DirStore, whose fetch is the entry's own dir
    opened = open_store(f"file://{shared}", run_dir=tmp_path / "run", max_shard_bytes=SHARD)
    assert isinstance(opened, DirStore) and opened.fetch(KEY, m.sha256, tmp_path / "c2").root == shared / KEY


def test_open_store_opens_an_s3_url_as_an_fsspec_store(tmp_path):
    s3fs()  # fsspec resolves the s3 protocol through it
    assert isinstance(
        open_store("s3://weights/x", run_dir=tmp_path, max_shard_bytes=SHARD, storage_options={"anon": True}),
        FsspecWeightStore,
    )
