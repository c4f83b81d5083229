"""Trust between owners on the served weight store (issue #37): each node holds a credential for
one call, scoped to what that call may read and write, checked on the request head before any
body byte is read; slow or silent clients are cut by deadlines. Every test runs a real
`WeightStoreServer` (real uvicorn thread, real sockets) and speaks real HTTP to it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
from store_support import model, same_bits

from envs.ports import bind_listener
from fl_app.channel.credentials import Issuer
from fl_app.channel.http import HttpWeightStore
from fl_app.channel.http_server import MAX_JSON_BYTES, WeightStoreServer
from fl_app.channel.remote import WeightStoreRefused
from fl_app.channel.run_dir import DirStore
from fl_app.rundir import RunDir
from fl_app.weights import save_shards

SHARD = 8 << 10
GLOBAL = "rounds/round-0001/actor"  # the global model the round-2 fit calls name
NEXT = "rounds/round-0002/actor"  # the global model the server writes after round 2


def own(client: int, r: int = 2) -> str:
    return f"rounds/round-{r:04d}/clients/client-{client:04d}/actor"


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    root = tmp_path / "run"
    rd = RunDir(root, total_rounds=3)
    for r in (0, 1):
        DirStore(root, SHARD).put(f"rounds/round-{r:04d}/actor", model(r))
        rd.complete_round(r, {})
    return root


def serve(run_dir: Path, **kw) -> WeightStoreServer:
    return WeightStoreServer(run_dir, Issuer(run_id=7), bind_listener("127.0.0.1", None), **kw).start()


@pytest.fixture()
def served(run_dir):
    server = serve(run_dir)
    try:
        yield server
    finally:
        server.stop()


def fit_credential(server: WeightStoreServer, client: int) -> str:
    """What the ServerApp mints for client `client`'s round-2 fit (server_app.app.Weights.credential)."""
    return server.issuer.mint(round=2, client=client, node=100 + client, read=[GLOBAL], write=[own(client)], ttl_s=600)


def http(server: WeightStoreServer, credential: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {credential}"}, timeout=10)


def node(server: WeightStoreServer, credential: str) -> HttpWeightStore:
    return HttpWeightStore(server.url, credential, max_shard_bytes=SHARD)


def test_a_node_credential_cannot_delete_a_global_checkpoint(served, run_dir):
    """Was: DELETE /v1/entry?key=rounds/round-0001/actor -> 200 with the run's token."""
    with http(served, fit_credential(served, 3)) as h:
        refused = h.delete("/v1/entry", params={"key": GLOBAL})
    assert refused.status_code == 403
    assert "client 3 (round 2, node 103) has no 'write' scope for 'rounds/round-0001/actor'" in refused.json()["detail"]
    with pytest.raises(WeightStoreRefused, match="HTTP 403.*may not delete it"):
        node(served, fit_credential(served, 3)).delete(GLOBAL)
    assert DirStore(run_dir, SHARD).manifest(GLOBAL).sha256  # still there, complete


def test_a_node_cannot_publish_under_the_next_rounds_global_key(served, run_dir, tmp_path):
    """Was: a node published rounds/round-0002/actor first, and the server's own write failed."""
    local = save_shards(model(9), tmp_path / "w", SHARD)
    with pytest.raises(WeightStoreRefused, match="HTTP 403.*no 'write' scope for 'rounds/round-0002/actor'"):
        node(served, fit_credential(served, 3)).publish(local.root, NEXT)
    assert not (run_dir / "rounds" / "round-0002").exists()  # not even a staging dir
    DirStore(run_dir, SHARD).put(NEXT, model(2))  # the server's own write goes through
    assert same_bits(DirStore(run_dir, SHARD).get(NEXT), model(2))


def test_a_node_reads_the_global_model_and_its_own_upload_but_not_another_clients(served, tmp_path):
    """Was: any node downloaded any client's update."""
    three, four = node(served, fit_credential(served, 3)), node(served, fit_credential(served, 4))
    upload = save_shards(model(3), tmp_path / "up", SHARD)
    three.publish(upload.root, own(3))
    assert three.manifest(own(3)).sha256 == upload.sha256  # its own: readable
    assert same_bits(four.get(GLOBAL), model(1))  # the global model its call names: readable
    with pytest.raises(
        WeightStoreRefused,
        match="HTTP 403.*client 4 .*no 'read' scope for 'rounds/round-0002/clients/client-0003/actor'",
    ):
        four.fetch(own(3), upload.sha256, tmp_path / "cache")
    shard = upload.shards[0].file
    with http(served, fit_credential(served, 4)) as h:
        assert h.get("/v1/shard", params={"key": own(3), "file": shard}).status_code == 403
        assert h.get("/v1/manifest", params={"key": own(3), "key2": "x"}).status_code == 403
        assert h.get("/v1/manifest", params=[("key", own(4)), ("key", own(3))]).status_code == 400  # one key only
        assert h.get("/v1/manifest", params={"key": "rounds/round-0000/actor"}).status_code == 403  # not its call's
        assert h.get("/docs").status_code == 404 and h.head("/v1/ping").status_code == 404  # only the wire's routes


def test_no_node_leaves_a_future_round_behind_and_abandoned_uploads_do_not_stop_a_resume(served, run_dir, tmp_path):
    """Was: a node created rounds/round-0099/, and the next resume refused the run dir. Now the key
    is out of every scope; and uploads that were abandoned or left half done (a node gone, a
    server killed) sit only in hidden staging dirs of the current round, which resume sets aside."""
    local = save_shards(model(5), tmp_path / "w", SHARD)
    with pytest.raises(WeightStoreRefused, match="HTTP 403"):
        node(served, fit_credential(served, 3)).publish(local.root, own(3, r=99))
    assert not (run_dir / "rounds" / "round-0099").exists()
    for client, abandon in ((3, True), (4, False)):
        with http(served, fit_credential(served, client)) as h:
            uid = h.post("/v1/uploads", params={"key": own(client)}, json={"manifest": local.to_json()}).json()[
                "upload_id"
            ]
            first = local.shards[0].file
            assert h.put(f"/v1/uploads/{uid}/{first}", content=(local.root / first).read_bytes()).is_success
            if abandon:
                assert h.delete(f"/v1/uploads/{uid}").is_success
    assert not list((run_dir / "rounds/round-0002/clients/client-0003").iterdir())  # the abandoned one: gone
    assert [p.name[:13] for p in (run_dir / "rounds/round-0002/clients/client-0004").iterdir()] == [".actor.upload"]
    rd = RunDir(run_dir, total_rounds=3)
    assert rd.prepare_resume() == 1  # as after a crash: the store still holds the half-done upload
    assert [why for _, why in rd.moved_aside] == ["partial round"]
    assert not (run_dir / "rounds" / "round-0002").exists()


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _head(path: str, length: int, credential: str = "") -> bytes:
    auth = f"Authorization: Bearer {credential}\r\n" if credential else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: store\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _answer(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return got


def test_an_unauthenticated_body_is_refused_on_its_head_never_read(served):
    """Was: FastAPI read and parsed a whole unauthenticated 256 MiB POST /v1/uploads before 401
    (+0.75-1.0 GiB peak RSS). Now 401 answers the head alone, and the connection is closed."""
    host, port = served.sock.getsockname()[:2]
    path = f"/v1/uploads?key={own(3)}"
    with socket.create_connection((host, port)) as s:  # a head promising 256 MiB, and no body at all
        t0 = time.monotonic()
        s.sendall(_head(path, 256 << 20))
        answer = _answer(s, 5.0)
        assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 1.0, answer[:200]
    before = _rss_bytes()  # the server is a thread of this process
    with socket.create_connection((host, port)) as s:  # ... and one that sends the 256 MiB as fast as it can
        s.sendall(_head(path, 256 << 20))
        zeros, sent = memoryview(bytes(1 << 20)), 0
        try:
            while sent < 256 << 20:
                s.sendall(zeros)
                sent += len(zeros)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _answer(s, 5.0)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert sent < 256 << 20, "the server kept reading an unauthenticated body"
    assert _rss_bytes() - before < 32 << 20
    # an authenticated JSON body beyond the cap is refused on its head too
    with socket.create_connection((host, port)) as s:
        s.sendall(_head(path, MAX_JSON_BYTES + 1, fit_credential(served, 3)))
        answer = _answer(s, 5.0)
    assert answer.startswith(b"HTTP/1.1 413") and b"at most" in answer, answer[:300]


def test_a_shard_body_is_bounded_by_its_manifest_before_it_is_read(served, tmp_path):
    local = save_shards(model(6), tmp_path / "w", SHARD)
    first = local.shards[0]
    with http(served, fit_credential(served, 3)) as h:
        uid = h.post("/v1/uploads", params={"key": own(3)}, json={"manifest": local.to_json()}).json()["upload_id"]
        too_long = h.put(
            f"/v1/uploads/{uid}/{first.file}",
            headers={"Content-Length": str(first.bytes + 1)},
            content=b"x" * (first.bytes + 1),
        )
        assert too_long.status_code == 413
    with http(served, fit_credential(served, 4)) as h:  # another client cannot feed this upload
        assert (
            h.put(f"/v1/uploads/{uid}/{first.file}", content=(local.root / first.file).read_bytes()).status_code == 403
        )
        assert h.post(f"/v1/uploads/{uid}/commit").status_code == 403


def test_forged_foreign_and_expired_credentials_get_401(served, run_dir):
    cred = fit_credential(served, 3)
    prefix, payload, sig = cred.split(".")
    forged = f"{prefix}.{payload[:-2]}{'A' if payload[-2] != 'A' else 'B'}{payload[-1]}.{sig}"
    other_run = Issuer(run_id=8).mint(round=2, client=3, node=1, read=[GLOBAL], ttl_s=600)
    for bad, why in ((forged, "signature"), (other_run, "signature"), ("x", "no weight-store credential")):
        with http(served, bad) as h:
            answer = h.get("/v1/manifest", params={"key": GLOBAL})
        assert answer.status_code == 401 and why in answer.json()["detail"], (bad, answer.text)
    short_lived = Issuer(run_id=7, margin_s=0.0)
    with WeightStoreServer(run_dir, short_lived, bind_listener("127.0.0.1", None)) as server:
        cred = short_lived.mint(round=2, client=3, node=1, read=[GLOBAL], ttl_s=1)
        with http(server, cred) as h:
            assert h.get("/v1/manifest", params={"key": GLOBAL}).is_success
            time.sleep(2.1)
            expired = h.get("/v1/manifest", params={"key": GLOBAL})
        assert expired.status_code == 401 and "expired" in expired.json()["detail"]


def test_half_sent_heads_are_answered_408_and_closed_within_the_deadline(run_dir):
    """Was: 100 unauthenticated half-sent request heads stayed open 30 s later."""
    server = serve(run_dir, head_timeout_s=1.0)
    try:
        host, port = server.sock.getsockname()[:2]
        socks = [socket.create_connection((host, port)) for _ in range(100)]
        t0 = time.monotonic()
        for s in socks:
            s.sendall(b"POST /v1/uploads HTTP/1.1\r\nHost: store\r\nContent-Length: 99")
        with httpx.Client(base_url=server.url) as h:  # others are still served meanwhile
            assert h.get("/v1/ping").status_code == 401
        answers = [_answer(s, 5.0) for s in socks]
        waited = time.monotonic() - t0
        for s in socks:
            s.close()
    finally:
        server.stop()
    assert all(a.startswith(b"HTTP/1.1 408") and b"request head did not arrive" in a for a in answers), answers[0]
    assert waited < 3.0, f"closing 100 half-sent heads took {waited:.1f} s"


def test_a_shard_body_may_take_long_while_it_moves_but_not_stall(run_dir, tmp_path):
    """The body deadline is an idle deadline: a shard trickling in over 3 s passes a 1 s deadline,
    one that stops for 1 s is answered 408 and its partial file removed."""
    server = serve(run_dir, body_idle_s=1.0)
    local = save_shards(model(7), tmp_path / "w", SHARD)
    cred = fit_credential(server, 3)
    try:
        with http(server, cred) as h:
            uid = h.post("/v1/uploads", params={"key": own(3)}, json={"manifest": local.to_json()}).json()["upload_id"]
        up = server.app.state.uploads[uid]
        host, port = server.sock.getsockname()[:2]
        for shard, pause in ((local.shards[0], 0.4), (local.shards[1], 1.6)):
            data = (local.root / shard.file).read_bytes()
            head = (
                f"PUT /v1/uploads/{uid}/{shard.file} HTTP/1.1\r\nHost: store\r\nAuthorization: Bearer {cred}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode()
            with socket.create_connection((host, port)) as s:
                s.sendall(head)
                pieces = [data[i : i + len(data) // 8 + 1] for i in range(0, len(data), len(data) // 8 + 1)]
                t0 = time.monotonic()
                try:
                    for piece in pieces:
                        s.sendall(piece)
                        time.sleep(pause)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                answer = _answer(s, 5.0)
            if pause < 1.0:
                assert time.monotonic() - t0 > 3.0 and answer.startswith(b"HTTP/1.1 200"), answer[:300]
                assert shard.file in up.verified
            else:
                assert answer.startswith(b"HTTP/1.1 408") and b"no byte of the request body arrived for 1 s" in answer
                assert shard.file not in up.verified and not (up.staged / shard.file).exists()
    finally:
        server.stop()
