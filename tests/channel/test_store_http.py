"""The built-in HTTP weight store, end to end: a real uvicorn server on loopback (a thread, as in
the ServerApp) and real aiohttp clients, no mocks (issue #14 item 2)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from store_support import CuttingProxy, model, same_bits, write_ca_and_cert

from envs.ports import PRIVATE_BAND, bind_listener, in_ephemeral_range
from fl_app.channel.credentials import Issuer
from fl_app.channel.http import HttpWeightStore
from fl_app.channel.http_server import WeightStoreServer
from fl_app.channel.remote import WeightStoreRefused, WeightStoreUnreachable
from fl_app.channel.run_dir import DirStore
from fl_app.weights import Manifest, WeightsError, load_shards, save_shards

SHARD = 8 << 10
KEY = "rounds/round-0000/actor"


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    root = tmp_path / "run"
    DirStore(root, SHARD).put(KEY, model(0))
    return root


@pytest.fixture()
def served(run_dir):
    server = WeightStoreServer(run_dir, Issuer(run_id=7), bind_listener("127.0.0.1", None)).start()
    try:
        yield server
    finally:
        server.stop()


def _cred(server: WeightStoreServer, read=(), write=(), client: int = 0) -> str:
    """A node's credential as the ServerApp mints it for one call."""
    return server.issuer.mint(round=1, client=client, node=1, read=read, write=write, ttl_s=600)


def _client(url: str, token: str, **kw) -> HttpWeightStore:
    return HttpWeightStore(url, token, max_shard_bytes=SHARD, **kw)


def _pin(run_dir: Path, key: str = KEY) -> str:
    return DirStore(run_dir, SHARD).manifest(key).sha256


def test_fetch_gives_identical_fp32_bits_and_a_refetch_needs_no_server(served, run_dir, tmp_path):
    """invariant 1: a value bf16 cannot hold crosses the channel unchanged."""
    store = _client(served.url, _cred(served, read=[KEY]), node="n1")
    got = store.fetch(KEY, _pin(run_dir), tmp_path / "cache")
    assert got.root.parent == tmp_path / "cache" and got.sha256 == _pin(run_dir)
    assert same_bits(load_shards(got), model(0))
    assert len(got.shards) >= 3
    served.stop()
    again = store.fetch(KEY, _pin(run_dir), tmp_path / "cache")  # cached by digest: no request at all
    assert again.root == got.root
    with pytest.raises(WeightStoreUnreachable, match="node n1: cannot reach the weight store at http://127.0.0.1"):
        store.fetch(KEY, _pin(run_dir), tmp_path / "other-cache")


def test_fetch_refuses_an_entry_that_is_not_the_pinned_one(served, run_dir, tmp_path):
    store = _client(served.url, _cred(served, read=[KEY]))
    with pytest.raises(WeightsError, match="not the one the sender wrote"):
        store.fetch(KEY, "0" * 64, tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("0000*"))
    with pytest.raises(WeightsError, match="not a manifest digest"):  # it names a cache dir: hex only
        store.fetch(KEY, "../planted", tmp_path / "cache")


def test_publish_uploads_a_result_that_the_server_sees_only_complete(served, run_dir, tmp_path):
    key = "rounds/round-0001/clients/client-0003/actor"
    store = _client(served.url, _cred(served, write=[key]))
    local = save_shards(model(1), tmp_path / "out", SHARD)
    assert store.publish(local.root, key).sha256 == local.sha256
    server_view = DirStore(run_dir, SHARD)
    assert server_view.manifest(key).sha256 == local.sha256
    assert same_bits(server_view.get(key), model(1))
    assert not [p for p in (run_dir / "rounds/round-0001/clients/client-0003").iterdir() if p.name.startswith(".")]
    assert store.publish(local.root, key).sha256 == local.sha256  # the same bytes again: a no-op
    other = save_shards(model(2), tmp_path / "other", SHARD)
    with pytest.raises(WeightStoreRefused, match="immutable"):
        store.publish(other.root, key)


def test_an_upload_is_invisible_until_every_shard_is_verified_and_committed(served, run_dir, tmp_path):
    local = save_shards(model(1), tmp_path / "out", SHARD)
    key = "rounds/round-0001/clients/client-0000/actor"
    auth = {"Authorization": f"Bearer {_cred(served, write=[key])}"}
    with httpx.Client(base_url=served.url, headers=auth) as http:
        uid = http.post("/v1/uploads", params={"key": key}, json={"manifest": local.to_json()}).json()["upload_id"]
        first = local.shards[0]
        assert http.put(f"/v1/uploads/{uid}/{first.file}", content=(local.root / first.file).read_bytes()).is_success
        assert http.get("/v1/manifest", params={"key": key}).status_code == 404
        refused = http.post(f"/v1/uploads/{uid}/commit")
        assert refused.status_code == 409 and local.shards[1].file in refused.json()["detail"]
        for shard in local.shards[1:]:
            http.put(f"/v1/uploads/{uid}/{shard.file}", content=(local.root / shard.file).read_bytes())
        assert http.post(f"/v1/uploads/{uid}/commit").json()["manifest_sha256"] == local.sha256
    assert DirStore(run_dir, SHARD).manifest(key).sha256 == local.sha256


def test_a_corrupt_upload_is_refused_and_never_published(served, run_dir, tmp_path):
    local = save_shards(model(1), tmp_path / "out", SHARD)
    shard = local.root / local.shards[1].file
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in tensor data, size unchanged
    shard.write_bytes(bytes(data))
    key = "rounds/round-0001/clients/client-0001/actor"
    with pytest.raises(WeightStoreRefused, match="HTTP 422.*nothing published.*corrupt"):
        _client(served.url, _cred(served, write=[key])).publish(local.root, key)
    assert not DirStore(run_dir, SHARD).exists(key)
    assert not (run_dir / key).exists()
    assert not list((run_dir / key).parent.glob(".*")), "the refused upload's staging dir was left behind"
    assert not served.app.state.uploads


def test_concurrent_clients_fetch_and_publish_at_once(served, run_dir, tmp_path):
    pin, errors, results = _pin(run_dir), [], {}

    def node(i: int, cache: Path) -> None:
        try:
            own = f"rounds/round-0001/clients/client-{i:04d}/actor"
            store = _client(served.url, _cred(served, read=[KEY], write=[own], client=i), node=f"n{i}", parallel=2)
            got = store.fetch(KEY, pin, cache)
            results[i] = same_bits(load_shards(got), model(0))
            out = save_shards(model(10 + i), tmp_path / f"out-{i}", SHARD)
            store.publish(out.root, own)
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    # four nodes, two of them sharing one cache dir (two trainers on one machine)
    caches = [tmp_path / "c0", tmp_path / "c1", tmp_path / "shared", tmp_path / "shared"]
    threads = [threading.Thread(target=node, args=(i, c)) for i, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {0: True, 1: True, 2: True, 3: True}
    server_view = DirStore(run_dir, SHARD)
    for i in range(4):
        assert same_bits(server_view.get(f"rounds/round-0001/clients/client-{i:04d}/actor"), model(10 + i))
    assert sorted(p.name for p in (tmp_path / "shared").iterdir() if p.is_dir()) == [pin]


def test_a_dropped_connection_resumes_with_a_range_request(served, run_dir, tmp_path):
    big = save_shards(model(3, rows=4096), tmp_path / "big", 256 << 10)  # 2 shards of ~256 KiB
    key = "rounds/round-0002/actor"
    DirStore(run_dir, SHARD).publish(big.root, key)
    proxy = CuttingProxy(served.sock.getsockname()[:2], cuts=2, after=100_000)
    try:
        got = _client(proxy.url, _cred(served, read=[key]), parallel=1).fetch(key, big.sha256, tmp_path / "cache")
    finally:
        proxy.close()
    assert same_bits(load_shards(got), load_shards(big))
    resumed = [r for r in proxy.ranges() if r > 0]
    assert len(resumed) >= 2, proxy.requests  # both cut shards went on where they stopped
    # nothing was sent twice beyond what was in flight at the cut
    assert proxy.response_bytes < big.total_bytes + 2 * 100_000


def test_an_interrupted_fetch_resumes_in_the_next_call(served, run_dir, tmp_path):
    big = save_shards(model(4, rows=8192), tmp_path / "big", 1 << 20)  # 1 shard of 1 MiB
    key = "rounds/round-0002/actor"
    DirStore(run_dir, SHARD).publish(big.root, key)
    cache = tmp_path / "cache"
    cutting = CuttingProxy(served.sock.getsockname()[:2], cuts=100, after=64 << 10)
    try:
        with pytest.raises(WeightStoreUnreachable, match="broke while downloading"):
            _client(cutting.url, _cred(served, read=[key]), parallel=1).fetch(key, big.sha256, cache)
    finally:
        cutting.close()
    part = cache / f"{big.sha256}.partial" / ".incoming" / big.shards[0].file
    kept = part.stat().st_size
    assert 0 < kept < big.shards[0].bytes
    logging = CuttingProxy(served.sock.getsockname()[:2])
    try:
        got = _client(logging.url, _cred(served, read=[key])).fetch(key, big.sha256, cache)
    finally:
        logging.close()
    assert logging.ranges() == [kept]
    assert same_bits(load_shards(got), load_shards(big))
    assert not (cache / f"{big.sha256}.partial").exists()


def test_wrong_or_missing_credential_is_refused_on_every_route(served, run_dir, tmp_path):
    foreign = Issuer(run_id=7).mint(round=1, client=0, node=1, read=[KEY], ttl_s=600)  # another run's secret
    with pytest.raises(WeightStoreRefused, match="refused this node's credential.*HTTP 401.*signature"):
        _client(served.url, foreign).fetch(KEY, _pin(run_dir), tmp_path / "cache")
    first = DirStore(run_dir, SHARD).manifest(KEY).shards[0].file
    good = _cred(served, read=[KEY], write=[KEY])  # a scope no real call gets: only the credential is wrong below
    for headers in ({}, {"Authorization": f"Bearer {good[:-1]}"}, {"Authorization": good}, {"Authorization": foreign}):
        with httpx.Client(base_url=served.url, headers=headers) as http:
            for method, path, params in (
                ("GET", "/v1/ping", {}),
                ("GET", "/v1/manifest", {"key": KEY}),
                ("GET", "/v1/shard", {"key": KEY, "file": first}),
                ("DELETE", "/v1/entry", {"key": KEY}),
                ("POST", "/v1/uploads", {}),
            ):
                assert http.request(method, path, params=params).status_code == 401, (headers, path)
    assert DirStore(run_dir, SHARD).exists(KEY)


def test_keys_that_escape_the_root_are_refused(served, run_dir, tmp_path):
    outside = tmp_path / "outside"
    DirStore(outside, SHARD).put("secret", model(5))
    os.symlink(outside / "secret", run_dir / "rounds" / "link")
    auth = {"Authorization": f"Bearer {_cred(served, read=['rounds/link', KEY], write=['rounds/link/x', 'rounds/x'])}"}
    with httpx.Client(base_url=served.url, headers=auth) as http:
        for key in ("../outside/secret", "/etc", "rounds/../../outside/secret", ".hidden"):
            assert http.get("/v1/manifest", params={"key": key}).status_code == 400, key
        escaped = http.get("/v1/manifest", params={"key": "rounds/link"})
        assert escaped.status_code == 403 and "outside" in escaped.json()["detail"]
        shard = Manifest.from_dir(outside / "secret").shards[0].file
        assert http.get("/v1/shard", params={"key": "rounds/link", "file": shard}).status_code == 403
        assert http.get("/v1/shard", params={"key": KEY, "file": "../../../etc/passwd"}).status_code == 404
        up = http.post("/v1/uploads", params={"key": "rounds/link/x"}, json={"manifest": "{}"})
        assert up.status_code == 403 and "outside" in up.json()["detail"]
        bad = save_shards(model(1), tmp_path / "bad", SHARD).to_json().replace("shard-00000", "../../evil")
        assert http.post("/v1/uploads", params={"key": "rounds/x"}, json={"manifest": bad}).status_code == 400
    assert not (tmp_path / "evil.safetensors").exists()
    with pytest.raises(WeightsError, match="bad weight-store key"):
        _client(served.url, _cred(served)).fetch("../outside/secret", "0" * 64, tmp_path / "cache")


def test_tls_round_trip_with_a_private_ca(run_dir, tmp_path):
    ca, cert, key = write_ca_and_cert(tmp_path)
    with WeightStoreServer(
        run_dir, Issuer(run_id=7), bind_listener("127.0.0.1", None), certfile=str(cert), keyfile=str(key)
    ) as server:
        token = _cred(server, read=[KEY], write=["rounds/round-0001/clients/client-0000/actor"])
        assert server.url.startswith("https://127.0.0.1:")
        store = _client(server.url, token, ca_file=str(ca))
        got = store.fetch(KEY, _pin(run_dir), tmp_path / "cache")
        assert same_bits(load_shards(got), model(0))
        out = save_shards(model(6), tmp_path / "out", SHARD)
        store.publish(out.root, "rounds/round-0001/clients/client-0000/actor")
        assert same_bits(DirStore(run_dir, SHARD).get("rounds/round-0001/clients/client-0000/actor"), model(6))
        with pytest.raises(WeightsError, match="TLS with the weight store at https://127.0.0.1.*CA certificate"):
            _client(server.url, token).ping()  # the system CAs do not know the private one
        plain = server.url.replace("https://", "http://")
        with pytest.raises(WeightsError):
            _client(plain, token).ping()


def test_a_tls_pair_that_does_not_load_fails_before_serving(run_dir, tmp_path):
    ca, cert, _key = write_ca_and_cert(tmp_path)
    sock = bind_listener("127.0.0.1", None)
    try:
        with pytest.raises(WeightsError, match="cannot load the weight store's TLS"):
            WeightStoreServer(run_dir, Issuer(run_id=7), sock, certfile=str(cert), keyfile=str(ca))
        with pytest.raises(WeightsError, match="both a certificate and its key"):
            WeightStoreServer(run_dir, Issuer(run_id=7), sock, certfile=str(cert))
    finally:
        sock.close()


def test_store_listens_on_loopback_in_the_private_band_and_stops_cleanly(run_dir):
    """invariants 22 and 23: the listener's port comes from the private band outside the ephemeral
    range; stop() ends the thread and frees the socket on every path."""
    sock = bind_listener("127.0.0.1", None)
    server = WeightStoreServer(run_dir, Issuer(run_id=7), sock).start()
    host, port = sock.getsockname()
    assert host == "127.0.0.1" and PRIVATE_BAND[0] <= port <= PRIVATE_BAND[1] and not in_ephemeral_range(port)
    thread = server._thread
    server.stop()
    assert thread is not None and not thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/ping")
    server.stop()  # twice is fine
    everywhere = bind_listener("0.0.0.0", None)
    try:
        unnamed = WeightStoreServer(run_dir, Issuer(run_id=7), everywhere)
        with pytest.raises(WeightsError, match="all interfaces"):
            _ = unnamed.url
        named = WeightStoreServer(run_dir, Issuer(run_id=7), everywhere, advertise_host="10.0.0.1")
        assert named.url == f"http://10.0.0.1:{everywhere.getsockname()[1]}"
    finally:
        everywhere.close()


def test_a_node_deletes_only_its_own_upload_and_secrets_are_long(served, run_dir):
    store = _client(served.url, _cred(served, write=["scratch/x", "scratch"]))
    store.put("scratch/x", model(7))
    assert store.exists("scratch/x") and same_bits(store.get("scratch/x"), model(7))
    with pytest.raises(WeightStoreRefused, match="not a single weights entry"):
        store.delete("scratch")
    store.delete("scratch/x")
    assert not store.exists("scratch/x") and not (run_dir / "scratch" / "x").exists()
    with pytest.raises(WeightsError, match="needs >= 32 random bytes"):
        Issuer(run_id=7, secret=b"short")
    shutil.rmtree(run_dir / "scratch")


def test_prune_cache_keeps_the_newest_entries_and_skips_one_being_fetched(tmp_path):
    """A node's cache of fetched global models stays bounded (a 70-round run of a large model must
    not keep every round), and never removes an entry whose fetch is in progress (lock held)."""
    import fcntl
    import os

    from fl_app.channel.remote import prune_cache

    names = [f"{i:064x}" for i in range(5)]
    for age, name in enumerate(names):  # names[0] newest ... names[-1] oldest
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        os.utime(tmp_path / name, (1000 - age, 1000 - age))
    (tmp_path / "work").mkdir()  # not an entry: never touched
    with open(tmp_path / f"{names[4]}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        dropped = prune_cache(tmp_path, keep=2)
    assert sorted(dropped) == sorted(names[2:4])
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted([names[0], names[1], names[4], "work"])


def test_the_served_run_dir_store_lives_until_the_run_closes_it(tmp_path):
    """run.weight_store=http: the ServerApp's store answers a call's credential while the run
    lives, refuses a request without one, and is gone (port closed) once the run closes it."""
    import socket
    from urllib.parse import urlsplit

    import httpx

    from fl_app.calls import Call
    from fl_app.config import load_config
    from fl_app.rundir import RunDir
    from server_app.app import Weights

    cfg = load_config(overrides={"run.weight_store": "http"})
    (tmp_path / "run").mkdir()
    w = Weights(RunDir(tmp_path / "run"), cfg, run_id=7)
    try:
        url, token = w.node_store["weight_store"], w.credential(Call(run_id=7), node=3, ttl_s=60)
        assert urlsplit(url).hostname == "127.0.0.1" and token.startswith("fa1.")
        assert httpx.get(f"{url}/v1/ping", headers={"Authorization": f"Bearer {token}"}).is_success
        assert httpx.get(f"{url}/v1/ping").status_code in (401, 403)
    finally:
        w.close()
    with pytest.raises(OSError):
        socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=2).close()
