"""The built-in HTTP weight store: serves a run dir's entries to nodes on other machines and
receives their results, from a uvicorn thread inside the ServerApp's process.

The wire; every request carries `Authorization: Bearer <credential>`, a per-call credential the
ServerApp minted (fl_app/channel/credentials.py), and is allowed by its scope:
  GET    /v1/ping                          reachability and credential check     any valid credential
  GET    /v1/manifest?key=K                the entry's manifest (404 while it is   read K
                                           absent or incomplete)
  GET    /v1/shard?key=K&file=F            one shard file listed by that manifest; read K
                                           Range requests (206) resume a download
  DELETE /v1/entry?key=K                   remove an entry (DirStore.delete's rule) write K
  POST   /v1/uploads?key=K {manifest}      start an upload into a hidden staging   write K
                                           dir beside the key
  PUT    /v1/uploads/ID/F                  one shard's bytes, streamed; verified    write the upload's K
                                           as soon as it is complete (422 and deleted if not)
  POST   /v1/uploads/ID/commit             publish: manifest written, staging dir   write the upload's K
                                           renamed onto the key
  DELETE /v1/uploads/ID                    abandon an upload                        write the upload's K
A node's credential writes only its own uploads of its round: the global entries are written
and deleted by the ServerApp alone, through its run dir, never over this wire.

`_Guard` (pure ASGI) decides on the request head alone, before any body byte is read: 401 for a
missing, forged, foreign or expired credential, 403 for a key outside its scope, 411/413 for a
body without a length or longer than the route takes (a JSON body: `MAX_JSON_BYTES`; a shard:
its manifest's size). `DeadlineProtocol` closes connections whose head does not arrive within
`HEAD_TIMEOUT_S` or whose body stops moving for `BODY_IDLE_S` (408). An upload is never visible
under its key before every shard is verified and the rename is done. Keys pass `check_key` and
resolve inside the root (`fl_app.paths.confine`), symlinks included.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import orjson
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse

from fl_app.channel.credentials import CredentialError, Issuer
from fl_app.channel.files import check_shard_names, install_entry, sibling_tmp, verify_shard, write_all
from fl_app.channel.run_dir import DirStore, confined_key_path
from fl_app.channel.store import check_key
from fl_app.http_deadlines import DeadlineProtocol
from fl_app.paths import PathEscapeError, confine
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError

CHUNK = 4 << 20  # bytes per read/write: large enough that per-chunk Python overhead vanishes
UPLOAD_IDLE_S = 3600.0  # an upload nobody touched for this long is abandoned
# An upload's manifest (POST /v1/uploads) is the largest JSON body: ~150 bytes per tensor, so
# 32 MiB holds ~200,000 tensors, far beyond the largest models' few thousand (MoE included).
MAX_JSON_BYTES = 32 << 20
HEAD_TIMEOUT_S = 10.0  # a request head must arrive within this (as the env service's)
# A shard body may take minutes on a slow link; only a sender that stops is cut (DeadlineProtocol).
BODY_IDLE_S = 60.0

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _ShardFile(FileResponse):
    chunk_size = CHUNK


class _NewUpload(BaseModel):
    manifest: str


ABANDON_WAIT_S = 5.0  # an abandon answers once the upload's in-flight shards have stopped (or after this)


@dataclass
class _Upload:
    key: str
    dest: Path
    manifest: Manifest
    staged: Path
    verified: set[str] = field(default_factory=set)
    busy: set[str] = field(default_factory=set)
    touched: float = field(default_factory=time.monotonic)
    abandoned: bool = False  # the client gave up while shards were still arriving: the last one cleans up


def _fail(status: int, e: Exception | str) -> HTTPException:
    return HTTPException(status, str(e))


def _no_upload(upload_id: str) -> str:
    return (
        f"no upload {upload_id!r} in progress (finished, abandoned after {UPLOAD_IDLE_S:.0f} s "
        "idle, or the store restarted): start the upload again"
    )


class _Refusal(Exception):
    """An answer `_Guard` gives on the request head (the body is never read)."""

    def __init__(self, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


class _Guard:
    """Authentication, scope and body size on the request head (pure ASGI), before FastAPI, which
    would read and parse a JSON body before any dependency ran. A refusal closes the connection
    (`connection: close`), so an unread body is never drained either."""

    def __init__(self, app: ASGIApp, issuer: Issuer, uploads: dict[str, _Upload], max_json_bytes: int) -> None:
        self.app, self.issuer, self.uploads, self.max_json_bytes = app, issuer, uploads, max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self._check(scope)
            except _Refusal as r:
                await _refuse(send, r)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> None:
        headers = {k.lower(): v for k, v in scope["headers"]}
        scheme, _, credential = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        try:
            grant = self.issuer.verify(credential if scheme == "Bearer" else "")
        except CredentialError as e:
            raise _Refusal(401, str(e), ((b"www-authenticate", b"Bearer"),)) from None
        action, key, limit = self._route(scope)
        if key is not None:
            try:
                check_key(key)
            except WeightsError as e:
                raise _Refusal(400, str(e)) from None
        need, allowed = ("read", grant.may_read) if action == "read" else ("write", grant.may_write)
        if key is not None and not allowed(key):
            raise _Refusal(
                403,
                f"the credential of {grant.who()} has no '{need}' scope for {key!r}, so it may not {action} it: "
                "a node reads the global entries its call names and its own uploads, and writes (or deletes) only "
                "its own uploads of its round; global entries are the ServerApp's alone",
            )
        length = headers.get(b"content-length")
        if b"transfer-encoding" in headers or (length is None and limit and scope["method"] == "PUT"):
            raise _Refusal(411, "send the body with a Content-Length (no chunked transfer)")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise _Refusal(413, f"a body of {length.decode('latin-1')} bytes; this route takes at most {limit}")

    def _route(self, scope: Scope) -> tuple[str, str | None, int]:
        """(action, key, body limit) of a route of the wire: the scope it needs ('read', or
        'write'/'delete' of `key`; no key: any valid credential) and the most body bytes it takes.
        Anything else is 404 here, so a route added to the app without a scope serves nobody."""
        method, path = scope["method"], scope["path"]
        parts = path.strip("/").split("/")
        if parts[:2] == ["v1", "uploads"] and len(parts) in (3, 4):
            if (up := self.uploads.get(parts[2])) is None:
                raise _Refusal(404, _no_upload(parts[2]))
            if method == "PUT" and len(parts) == 4:
                if (shard := next((s for s in up.manifest.shards if s.file == parts[3]), None)) is None:
                    raise _Refusal(404, f"the upload's manifest lists no shard {parts[3]!r}")
                return "write", up.key, shard.bytes
            if (method, parts[3:]) in (("POST", ["commit"]), ("DELETE", [])):
                return "write", up.key, 0
            raise _Refusal(404, f"the weight store has no route {method} {scope['path']}")
        keys = [v for k, v in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True) if k == "key"]
        if len(keys) > 1:
            raise _Refusal(400, "name one key per request (the query has several 'key' parameters)")
        key = keys[0] if keys else None
        routes = {
            ("GET", "v1/ping"): ("read", None, 0),
            ("GET", "v1/manifest"): ("read", key, 0),
            ("GET", "v1/shard"): ("read", key, 0),
            ("DELETE", "v1/entry"): ("delete", key, 0),
            ("POST", "v1/uploads"): ("write", key, self.max_json_bytes),
        }
        if (found := routes.get((method, "/".join(parts)))) is None:
            raise _Refusal(404, f"the weight store has no route {method} {path}")
        return found


async def _refuse(send: Send, r: _Refusal) -> None:
    body = orjson.dumps({"detail": r.detail})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *r.headers,
    ]
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(root: Path, issuer: Issuer, max_json_bytes: int = MAX_JSON_BYTES) -> FastAPI:
    """The store's FastAPI app over the DirStore at `root` (the run dir), behind `_Guard`:
    `app.state.guarded` is what the server runs."""
    root = Path(os.path.realpath(root))
    uploads: dict[str, _Upload] = {}
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.uploads = uploads
    app.state.guarded = _Guard(app, issuer, uploads, max_json_bytes)

    def entry_dir(key: str) -> Path:
        try:
            return confined_key_path(root, key)
        except PathEscapeError as e:
            raise _fail(403, e) from None
        except WeightsError as e:
            raise _fail(400, e) from None

    def complete_manifest(key: str) -> Manifest | None:
        path = entry_dir(key)
        return Manifest.from_dir(path) if (path / MANIFEST_NAME).is_file() else None

    def upload(upload_id: str) -> _Upload:
        if (up := uploads.get(upload_id)) is None:
            raise _fail(404, _no_upload(upload_id))
        up.touched = time.monotonic()
        return up

    def drop_idle() -> None:
        cutoff = time.monotonic() - UPLOAD_IDLE_S
        for uid in [u for u, up in uploads.items() if up.touched < cutoff and not up.busy]:
            shutil.rmtree(uploads.pop(uid).staged, ignore_errors=True)

    @app.get("/v1/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/v1/manifest")
    def get_manifest(key: str) -> Response:
        if (manifest := complete_manifest(key)) is None:
            raise _fail(
                404,
                f"no complete entry {key!r} in this store (nothing published there yet, or its write has not finished)",
            )
        return Response(manifest.to_json(), media_type="application/json")

    @app.get("/v1/shard")
    def get_shard(key: str, file: str) -> FileResponse:
        if (manifest := complete_manifest(key)) is None:
            raise _fail(404, f"no complete entry {key!r} in this store")
        if not any(s.file == file for s in manifest.shards):
            raise _fail(404, f"entry {key!r} lists no shard {file!r}")
        try:
            path = confine(entry_dir(key) / file, root, "shard file")
        except PathEscapeError as e:
            raise _fail(403, e) from None
        return _ShardFile(path, media_type="application/octet-stream")

    @app.delete("/v1/entry")
    def delete_entry(key: str) -> dict[str, bool]:
        entry_dir(key)
        try:
            DirStore(root, 1).delete(key)
        except WeightsError as e:
            raise _fail(409, e) from None
        return {"deleted": True}

    # Routes that touch `uploads` are coroutines: they all run on the event loop's one thread, so
    # the bookkeeping needs no lock; their slow parts (verification, fsync) go to worker threads.
    @app.post("/v1/uploads")
    async def start_upload(key: str, body: _NewUpload) -> dict[str, Any]:
        dest = entry_dir(key)
        try:
            manifest = Manifest.from_json(body.manifest)
            check_shard_names(manifest)
        except (WeightsError, ValueError, KeyError, TypeError) as e:
            raise _fail(400, f"the upload's manifest is not a weights manifest: {e}") from None
        if (existing := complete_manifest(key)) is not None:
            if existing.sha256 == manifest.sha256:
                return {"exists": True, "manifest_sha256": existing.sha256}
            raise _fail(
                409,
                f"entry {key!r} already holds other weights (manifest sha256 "
                f"{existing.sha256[:12]}...); entries are immutable: publish under a new key",
            )
        if dest.exists():
            raise _fail(409, f"entry {key!r} holds an incomplete write; delete it first")
        drop_idle()
        uid = uuid.uuid4().hex
        uploads[uid] = _Upload(key, dest, manifest, sibling_tmp(dest, f"upload-{uid[:8]}"))
        return {"exists": False, "upload_id": uid}

    @app.put("/v1/uploads/{upload_id}/{file}")
    async def put_shard(upload_id: str, file: str, request: Request) -> dict[str, Any]:
        up = upload(upload_id)
        index = next((i for i, s in enumerate(up.manifest.shards) if s.file == file), None)
        if index is None:
            raise _fail(404, f"the upload's manifest lists no shard {file!r}")
        if file in up.busy:
            raise _fail(409, f"shard {file!r} of this upload is already being received")
        expected_bytes = up.manifest.shards[index].bytes
        path = up.staged / file
        up.busy.add(file)
        up.verified.discard(file)
        try:
            got = await _receive(request, path, expected_bytes)
            if got != expected_bytes:
                raise _fail(400, f"shard {file!r}: received {got} bytes, the manifest says {expected_bytes}")
            try:
                await asyncio.to_thread(verify_shard, up.manifest, index, up.staged)
            except WeightsError as e:
                raise _fail(422, f"refused, nothing published: {e}") from None
            up.verified.add(file)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            up.busy.discard(file)
            up.touched = time.monotonic()
            if up.abandoned and not up.busy:
                shutil.rmtree(up.staged, ignore_errors=True)
        return {"verified": file}

    @app.post("/v1/uploads/{upload_id}/commit")
    async def commit(upload_id: str) -> dict[str, str]:
        up = upload(upload_id)
        missing = [s.file for s in up.manifest.shards if s.file not in up.verified]
        if missing or up.busy:
            raise _fail(
                409, f"cannot publish {up.key!r}: shards {missing or sorted(up.busy)} not received and verified yet"
            )
        uploads.pop(upload_id)
        try:
            if (existing := complete_manifest(up.key)) is not None:  # a concurrent upload won the race
                if existing.sha256 != up.manifest.sha256:
                    raise _fail(409, f"entry {up.key!r} was published with other weights meanwhile")
                shutil.rmtree(up.staged, ignore_errors=True)
                return {"manifest_sha256": existing.sha256}
            # Not fsynced: an upload is scratch for one round, every reader verifies it again, and a
            # server that crashes re-runs the round; a checkpoint (the average) is written durably.
            done = await asyncio.to_thread(install_entry, up.staged, up.manifest, up.dest, False)
            return {"manifest_sha256": done.sha256}
        except WeightsError as e:
            shutil.rmtree(up.staged, ignore_errors=True)
            raise _fail(409, e) from None
        except BaseException:
            shutil.rmtree(up.staged, ignore_errors=True)
            raise

    @app.delete("/v1/uploads/{upload_id}")
    async def abandon(upload_id: str) -> dict[str, bool]:
        if (up := uploads.pop(upload_id, None)) is not None:
            up.abandoned = True
            deadline = time.monotonic() + ABANDON_WAIT_S  # shards still arriving end with their connection
            while up.busy and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if not up.busy:  # else the last shard still arriving removes the staging dir
                shutil.rmtree(up.staged, ignore_errors=True)
        return {"abandoned": True}

    return app


async def _receive(request: Request, path: Path, limit: int) -> int:
    """Stream a request body into `path` in CHUNK-sized writes (off the event loop); refuse more
    than `limit` bytes without reading them."""
    got = size = 0
    pieces: list[bytes] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        async for piece in request.stream():
            got += len(piece)
            if got > limit:
                raise _fail(400, f"{path.name}: body longer than the manifest's {limit} bytes")
            pieces.append(piece)
            size += len(piece)
            if size >= CHUNK:
                await asyncio.to_thread(write_all, fd, pieces)
                pieces, size = [], 0
        await asyncio.to_thread(write_all, fd, pieces)
    except ClientDisconnect:
        raise _fail(400, f"{path.name}: the client went away after {got} bytes") from None
    finally:
        os.close(fd)
    return got


def _tls_pair(certfile: str | None, keyfile: str | None) -> tuple[str, str] | None:
    """Both or neither; a pair that does not load is an error now, not when the first node calls."""
    if not certfile and not keyfile:
        return None
    if not (certfile and keyfile):
        raise WeightsError(
            "the weight store's TLS needs both a certificate and its key "
            f"(got certfile={certfile!r}, keyfile={keyfile!r})"
        )
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise WeightsError(f"cannot load the weight store's TLS certificate {certfile} / key {keyfile}: {e}") from e
    return certfile, keyfile


class WeightStoreServer:
    """The built-in store served from a background thread (real uvicorn) of the calling process.

    The caller binds the listening socket, so the port follows the project's port rules
    (envs.ports.bind_listener: a private band outside the ephemeral range, one clean retry);
    `advertise_host` is the address nodes use when `sock` is bound to all interfaces.
    """

    def __init__(
        self,
        root: Path,
        issuer: Issuer,
        sock: socket.socket,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
        advertise_host: str | None = None,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_idle_s: float = BODY_IDLE_S,
        max_json_bytes: int = MAX_JSON_BYTES,
    ):
        if not Path(root).is_dir():
            raise WeightsError(f"the weight store's root {root} is not a directory")
        for name, value in (("head timeout", head_timeout_s), ("body idle timeout", body_idle_s)):
            if not 0 < value < float("inf"):
                raise WeightsError(f"the weight store's {name} must be a positive number of seconds, got {value}")
        self.root, self.issuer, self.sock = Path(root), issuer, sock
        self.tls = _tls_pair(certfile, keyfile)
        self.advertise_host = advertise_host
        self.app = build_app(self.root, issuer, max_json_bytes)
        self._protocol = functools.partial(
            DeadlineProtocol, header_timeout_s=head_timeout_s, body_timeout_s=body_idle_s, body_idle=True
        )
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """The URL nodes open (`HttpWeightStore(url, credential)`)."""
        host, port = self.sock.getsockname()[:2]
        if self.advertise_host:
            host = self.advertise_host
        elif host in ("0.0.0.0", "::"):
            raise WeightsError(
                f"the weight store listens on all interfaces ({host}); name the address nodes "
                "reach it at (advertise_host / run.weight_store_url)"
            )
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> WeightStoreServer:
        cert, key = self.tls or (None, None)
        config = uvicorn.Config(
            self.app.state.guarded,
            loop="uvloop",
            http=self._protocol,  # type: ignore[arg-type]  # uvicorn takes any protocol factory; its stub names classes
            ws="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            ssl_certfile=cert,
            ssl_keyfile=key,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)

        def serve() -> None:
            try:
                assert self._server is not None
                self._server.run(sockets=[self.sock])
            except BaseException as e:  # SystemExit included: uvicorn exits on some start-up errors
                self._error = e

        self._thread = threading.Thread(target=serve, name="fedagent-weight-store", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise WeightsError(
                    f"the weight store did not start on {self.sock.getsockname()}: "
                    f"{self._error or f'not serving after {timeout_s:.0f} s'}"
                )
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving, abandon unfinished uploads, close the socket; safe to call twice."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout_s)
        for up in self.app.state.uploads.values():
            shutil.rmtree(up.staged, ignore_errors=True)
        self.app.state.uploads.clear()
        self.sock.close()

    def __enter__(self) -> WeightStoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
