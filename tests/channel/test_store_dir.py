"""The directory store's side of the weight channel (fetch in place, publish by link or copy)
and open_store's mapping from config values to stores (issue #14 item 2)."""

from __future__ import annotations

import os

import pytest
from store_support import model, same_bits

from fl_app.channel.http import HttpWeightStore
from fl_app.channel.open import open_store
from fl_app.channel.run_dir import DirStore
from fl_app.weights import MANIFEST_NAME, WeightsError, save_shards

SHARD = 8 << 10
KEY = "rounds/round-0001/clients/client-0000/actor"


def test_fetch_is_the_entry_itself_and_checks_the_pin(tmp_path):
    store = DirStore(tmp_path / "run", SHARD)
    m = store.put(KEY, model(0))
    got = store.fetch(KEY, m.sha256, tmp_path / "cache")
    assert got.root == tmp_path / "run" / KEY and not (tmp_path / "cache").exists()
    with pytest.raises(WeightsError, match="not the one the sender wrote"):
        store.fetch(KEY, "f" * 64, tmp_path / "cache")
    with pytest.raises(WeightsError, match="not a manifest digest"):
        store.fetch(KEY, "../x", tmp_path / "cache")


def test_publish_in_place_moves_nothing(tmp_path):
    store = DirStore(tmp_path / "run", SHARD)
    written = save_shards(model(1), tmp_path / "run" / KEY, SHARD)
    before = {p.name: p.stat().st_ino for p in written.root.iterdir()}
    assert store.publish(written.root, KEY).sha256 == written.sha256
    assert {p.name: p.stat().st_ino for p in written.root.iterdir()} == before


def test_publish_from_elsewhere_links_the_files_and_leaves_the_source(tmp_path):
    store = DirStore(tmp_path / "run", SHARD)
    local = save_shards(model(2), tmp_path / "local", SHARD)
    published = store.publish(local.root, KEY)
    assert published.root == tmp_path / "run" / KEY and published.sha256 == local.sha256
    shard = local.shards[0].file
    assert (local.root / shard).stat().st_ino == (published.root / shard).stat().st_ino  # a link, not a copy
    assert same_bits(store.get(KEY), model(2)) and (local.root / MANIFEST_NAME).is_file()
    assert not [p for p in published.root.parent.iterdir() if p.name.startswith(".")]  # no staging left
    assert store.publish(local.root, KEY).sha256 == local.sha256  # same bytes: no-op
    with pytest.raises(WeightsError, match="immutable"):
        store.publish(save_shards(model(3), tmp_path / "other", SHARD).root, KEY)


def test_publish_refuses_an_incomplete_source_or_a_dead_write_at_the_key(tmp_path):
    store = DirStore(tmp_path / "run", SHARD)
    local = save_shards(model(4), tmp_path / "local", SHARD)
    half = tmp_path / "half"
    half.mkdir()
    os.link(local.root / local.shards[0].file, half / local.shards[0].file)
    with pytest.raises(WeightsError, match="no manifest.json"):
        store.publish(half, KEY)
    dead = tmp_path / "run" / KEY
    dead.mkdir(parents=True)
    (dead / "shard-00000.safetensors").write_bytes(b"partial")
    with pytest.raises(WeightsError, match="incomplete write"):
        store.publish(local.root, KEY)


def test_open_store_maps_config_values_to_stores(tmp_path):
    run = tmp_path / "run"
    assert isinstance(open_store("", run_dir=run, max_shard_bytes=SHARD), DirStore)
    assert open_store("file:///shared/w", run_dir=run, max_shard_bytes=SHARD).root.as_posix() == "/shared/w"
    http = open_store("https://10.0.0.1:20456", run_dir=run, max_shard_bytes=SHARD, token="t" * 43, node="3")
    assert isinstance(http, HttpWeightStore) and http.url == "https://10.0.0.1:20456"
    for spec, why in (
        ("http", "built-in store the ServerApp serves"),
        ("runs/x", "neither"),
        ("file://host/x", "file:///absolute"),
        ("https://10.0.0.1:20456", "needs the call's credential"),
        ("nosuchproto://x", "not a URL fsspec knows"),
    ):
        with pytest.raises(WeightsError, match=why):
            open_store(spec, run_dir=run, max_shard_bytes=SHARD)
