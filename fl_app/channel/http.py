"""A node's view of the built-in HTTP weight store (fl_app/channel/http_server.py) on another machine.

Shards travel as plain files over HTTP/1.1 (TLS when the URL is https), several at a time, each
streamed to or from disk in large chunks; a download that is cut off resumes with a range read,
and every shard is verified before it counts (the node's cache, fl_app/channel/remote.py; the
server for uploads). aiohttp carries the bytes: on 2 cores it moves a 4 MiB-chunked body ~3x
faster than httpx (docs/weight-store.md). The blocking API runs each call on a private event
loop in a worker thread, so it works the same from plain code and from inside a running loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Coroutine
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import uvloop

from fl_app.channel.files import write_all
from fl_app.channel.remote import (
    DEFAULT_PARALLEL,
    DOWNLOAD_RETRIES,
    CacheSlot,
    RemoteStore,
    WeightStoreRefused,
    WeightStoreUnreachable,
    raise_first_failure,
)
from fl_app.channel.store import check_key
from fl_app.weights import Manifest, WeightsError

CHUNK = 4 << 20
T = TypeVar("T")
_SSL_ERRORS = (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedagent-weights") as pool:
        return pool.submit(uvloop.run, coro).result()


async def _all_or_nothing(jobs: list[Awaitable[None]], limit: int) -> None:
    """Run `jobs` `limit` at a time; the first failure cancels the rest and is raised."""
    gate = asyncio.Semaphore(limit)

    async def gated(job: Awaitable[None]) -> None:
        async with gate:
            await job

    tasks = [asyncio.ensure_future(gated(j)) for j in jobs]
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    raise_first_failure(done)


class HttpWeightStore(RemoteStore):
    """`HttpWeightStore("https://10.0.0.1:20456", credential, max_shard_bytes=..., ca_file=...)`: the
    credential is the one the ServerApp minted for the call being served (`Call.weight_store_token`,
    fl_app/channel/credentials.py); it reads and writes only what that call may."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        max_shard_bytes: int,
        ca_file: str | None = None,
        parallel: int = DEFAULT_PARALLEL,
        node: str = "",
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
    ):
        super().__init__(max_shard_bytes, parallel)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise WeightsError(f"weight store URL {url!r} is not http(s)://host:port (as the ServerApp sends it)")
        if not token:
            raise WeightsError(
                f"the weight store at {url} needs the call's credential (the ServerApp sends it as weight_store_token)"
            )
        if ca_file and parts.scheme != "https":
            raise WeightsError(f"a CA file was given for {url}, which is not https: use the https URL")
        self.url = url.rstrip("/")
        self.node = node
        self._token = token
        self._ssl: ssl.SSLContext | bool = True
        if ca_file:
            try:
                self._ssl = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise WeightsError(f"cannot load the CA file {ca_file} for {url}: {e}") from e
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)

    # ---- errors that name the cause -------------------------------------------------------
    def _who(self) -> str:
        return f"node {self.node}: " if self.node else ""

    def _transport_error(self, e: BaseException, what: str) -> WeightsError:
        if isinstance(e, _SSL_ERRORS):
            return WeightsError(
                f"{self._who()}TLS with the weight store at {self.url} failed while {what} ({e}): "
                "give this node the CA certificate that signed the store's certificate "
                "(weight-store CA file); see docs/deployment.md"
            )
        if isinstance(e, aiohttp.ClientConnectorError):
            errno = getattr(e.os_error, "errno", None)
            cause = os.strerror(errno) if errno else str(e)
            return WeightStoreUnreachable(
                f"{self._who()}cannot reach the weight store at {self.url} ({cause.lower()}) while {what}: is the "
                "ServerApp's weight store reachable from this node? see docs/deployment.md"
            )
        if isinstance(e, asyncio.TimeoutError):
            return WeightStoreUnreachable(
                f"{self._who()}the weight store at {self.url} stopped answering while "
                f"{what} (timed out); is the ServerApp still running?"
            )
        return WeightStoreUnreachable(
            f"{self._who()}the connection to the weight store at {self.url} broke while "
            f"{what} ({type(e).__name__}: {e})"
        )

    async def _refusal(self, resp: aiohttp.ClientResponse, what: str) -> WeightStoreRefused:
        try:
            detail = (await resp.json()).get("detail", "")
        except (aiohttp.ContentTypeError, ValueError):
            detail = (await resp.text())[:500]
        if resp.status == 401:
            return WeightStoreRefused(
                f"{self._who()}the weight store at {self.url} refused this node's credential "
                f"while {what} (HTTP 401: {detail})"
            )
        return WeightStoreRefused(
            f"{self._who()}{what}: the weight store at {self.url} answered HTTP {resp.status}: {detail}"
        )

    @asynccontextmanager
    async def _session(self, what: str) -> AsyncIterator[aiohttp.ClientSession]:
        connector = aiohttp.TCPConnector(ssl=self._ssl, limit=self.parallel + 1)
        async with aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self._token}"},
            connector=connector,
            timeout=self._timeout,
            read_bufsize=CHUNK,
            auto_decompress=False,
        ) as s:
            try:
                yield s
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise self._transport_error(e, what) from e

    async def _json(
        self, s: aiohttp.ClientSession, method: str, path: str, what: str, ok404: bool = False, **kw: Any
    ) -> dict[str, Any] | None:
        async with s.request(method, self.url + path, **kw) as resp:
            if ok404 and resp.status == 404:
                return None
            if resp.status >= 300:
                raise await self._refusal(resp, what)
            return await resp.json(content_type=None)

    # ---- small calls ----------------------------------------------------------------------
    def ping(self) -> None:
        """Raise (naming the cause) unless the store answers and accepts this node's credential."""

        async def go() -> None:
            async with self._session("checking the store") as s:
                await self._json(s, "GET", "/v1/ping", "checking the store")

        _run(go())

    def manifest_or_none(self, key: str) -> str | None:
        what = f"reading the manifest of {key!r}"

        async def go() -> str | None:
            async with self._session(what) as s, s.get(self.url + "/v1/manifest", params={"key": key}) as resp:
                if resp.status == 404:
                    return None
                if resp.status >= 300:
                    raise await self._refusal(resp, what)
                return await resp.text()

        return _run(go())

    def delete(self, key: str) -> None:
        what = f"deleting {key!r}"

        async def go() -> None:
            async with self._session(what) as s:
                await self._json(s, "DELETE", "/v1/entry", what, params={"key": check_key(key)})

        _run(go())

    # ---- downloads ------------------------------------------------------------------------
    def download(self, key: str, slot: CacheSlot, shards: list[int]) -> None:
        async def go() -> None:
            async with self._session(f"downloading {key!r}") as s:
                await _all_or_nothing([self._download_shard(s, key, slot, i) for i in shards], self.parallel)

        _run(go())

    async def _download_shard(self, s: aiohttp.ClientSession, key: str, slot: CacheSlot, index: int) -> None:
        info = slot.manifest.shards[index]
        part = slot.part(index)
        what = f"downloading {key}/{info.file}"
        for attempt in range(1, DOWNLOAD_RETRIES + 1):
            offset = part.stat().st_size if part.exists() else 0
            if offset > info.bytes:
                part.unlink()
                offset = 0
            try:
                if offset < info.bytes:
                    await self._read_into(s, key, info.file, part, offset, what)
                await asyncio.to_thread(slot.accept, index)
                return
            except (WeightStoreRefused, *_SSL_ERRORS):
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, WeightsError):
                # cut off: resume from what is on disk; failed verification: the shard was deleted, so afresh
                if attempt == DOWNLOAD_RETRIES:
                    raise
                await asyncio.sleep(0.2 * attempt)

    async def _read_into(
        self, s: aiohttp.ClientSession, key: str, file: str, part: Path, offset: int, what: str
    ) -> None:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        async with s.get(self.url + "/v1/shard", params={"key": key, "file": file}, headers=headers) as resp:
            if resp.status == 200:
                offset = 0  # a full body: start the file over
            elif resp.status != 206 or not resp.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
                raise await self._refusal(resp, what)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, offset)
                os.lseek(fd, offset, os.SEEK_SET)
                pieces: list[bytes] = []
                size = 0
                try:
                    async for piece, _ in resp.content.iter_chunks():  # as received: no joining copy
                        pieces.append(piece)
                        size += len(piece)
                        if size >= CHUNK:
                            await asyncio.to_thread(write_all, fd, pieces)
                            pieces, size = [], 0
                finally:
                    write_all(fd, pieces)  # keep what arrived, so a retry resumes after it
            finally:
                os.close(fd)

    # ---- uploads --------------------------------------------------------------------------
    def publish(self, local_dir: Path, key: str) -> Manifest:
        check_key(key)
        local = Manifest.from_dir(local_dir)
        for shard in local.shards:
            size = (Path(local_dir) / shard.file).stat().st_size
            if size != shard.bytes:
                raise WeightsError(
                    f"{local_dir}/{shard.file} has {size} bytes, its manifest says {shard.bytes}: "
                    "the export was truncated; re-export the weights"
                )
        what = f"uploading {key!r}"

        async def go() -> None:
            async with self._session(what) as s:
                start = await self._json(
                    s, "POST", "/v1/uploads", what, params={"key": key}, json={"manifest": local.to_json()}
                )
                assert start is not None
                if start["exists"]:
                    return
                uid = start["upload_id"]
                try:
                    await _all_or_nothing(
                        [self._put_shard(s, uid, Path(local_dir), i, local, what) for i in range(len(local.shards))],
                        self.parallel,
                    )
                    done = await self._json(s, "POST", f"/v1/uploads/{uid}/commit", what)
                except BaseException:
                    with suppress(Exception):
                        await s.delete(f"{self.url}/v1/uploads/{uid}")
                    raise
                assert done is not None
                if done["manifest_sha256"] != local.sha256:
                    raise WeightsError(
                        f"the weight store published {key!r} with manifest sha256 "
                        f"{done['manifest_sha256'][:12]}..., not the uploaded {local.sha256[:12]}..."
                    )

        _run(go())
        return dataclasses.replace(local, root=None)  # the entry is not on this machine

    async def _put_shard(
        self, s: aiohttp.ClientSession, uid: str, local_dir: Path, index: int, manifest: Manifest, what: str
    ) -> None:
        info = manifest.shards[index]
        for attempt in range(1, DOWNLOAD_RETRIES + 1):
            try:
                await self._json(
                    s,
                    "PUT",
                    f"/v1/uploads/{uid}/{info.file}",
                    what,
                    data=_chunks(local_dir / info.file),
                    headers={"Content-Length": str(info.bytes), "Content-Type": "application/octet-stream"},
                )
                return
            except _SSL_ERRORS:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError):
                if attempt == DOWNLOAD_RETRIES:
                    raise
                await asyncio.sleep(0.2 * attempt)  # the server dropped the partial shard: send it again


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while piece := await asyncio.to_thread(f.read, CHUNK):
            yield piece
