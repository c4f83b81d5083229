"""Entries in a user's own object store or shared filesystem, through fsspec URLs:
`s3://bucket/prefix` (S3, MinIO; needs s3fs) or `file:///shared/weights`.

Key `a/b` lives under `<url>/a/b/` as the same shard files plus manifest.json as in a DirStore.
Object stores have no atomic directory rename, so an entry is published shards first, each
checked for its full size, and its manifest last (one object PUT, or a rename on a filesystem):
a reader never takes an entry without a manifest, and every shard is verified on arrival in the
node's cache. Credentials and endpoints come from `storage_options` or the driver's usual
environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws), never from the run config.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec

from fl_app.channel.files import is_entry_file
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
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError

RANGE_BYTES = 16 << 20  # one ranged read; what a cut-off download loses at most


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a driver raises when the store cannot be reached (botocore's own, where installed)."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError)


def _each(jobs: list[Callable[[], None]], parallel: int) -> None:
    """Run `jobs` on `parallel` threads; the first failure stops the ones not started and is raised."""
    with concurrent.futures.ThreadPoolExecutor(parallel, thread_name_prefix="fedagent-fsspec") as pool:
        futures = [pool.submit(job) for job in jobs]
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        raise_first_failure(done)


class FsspecWeightStore(RemoteStore):
    """`FsspecWeightStore("s3://bucket/run-7", max_shard_bytes=..., storage_options={...})`."""

    def __init__(
        self,
        url: str,
        *,
        max_shard_bytes: int,
        storage_options: Mapping[str, Any] | None = None,
        parallel: int = DEFAULT_PARALLEL,
        node: str = "",
    ):
        super().__init__(max_shard_bytes, parallel)
        scheme = urlsplit(url).scheme
        try:
            self.fs, base = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except ImportError as e:
            raise WeightsError(
                f"weight store {url!r}: fsspec's driver for {scheme}:// is not installed ({e}); "
                "for s3:// install s3fs (pyproject pins the tested version)"
            ) from e
        except ValueError as e:
            raise WeightsError(f"weight store {url!r} is not a URL fsspec knows: {e}") from e
        self.url = url.rstrip("/")
        self.base = base.rstrip("/")
        self.node = node

    def _path(self, key: str, file: str = "") -> str:
        return f"{self.base}/{check_key(key)}" + (f"/{file}" if file else "")

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        who = f"node {self.node}: " if self.node else ""
        try:
            yield
        except WeightsError:
            raise
        except PermissionError as e:
            raise WeightStoreRefused(
                f"{who}{what}: {self.url} refused access ({e}); check the credentials this "
                "node uses for it (environment or storage options)"
            ) from e
        except FileNotFoundError:
            raise
        except _transport_errors() as e:
            raise WeightStoreUnreachable(
                f"{who}cannot reach the weight store at {self.url} while {what} "
                f"({type(e).__name__}: {e}); is it reachable from this node? "
                "see docs/weight-store.md"
            ) from e

    def manifest_or_none(self, key: str) -> str | None:
        path = self._path(key, MANIFEST_NAME)
        with self._errors(f"reading the manifest of {key!r}"):
            self.fs.invalidate_cache(self._path(key))  # another machine may have published it since
            try:
                return self.fs.cat_file(path).decode()
            except FileNotFoundError:
                return None

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._errors(f"deleting {key!r}"):
            self.fs.invalidate_cache(path)
            try:
                listing = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return
            names = [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in listing]
            if any(e["type"] == "directory" for e in listing) or not all(map(is_entry_file, names)):
                raise WeightsError(
                    f"{self.url}/{key} is not a single weights entry (it holds {sorted(names)}); "
                    "refusing to delete it: delete the entries inside it by their own keys"
                )
            if MANIFEST_NAME in names:  # first: the entry stops looking complete at once
                self.fs.rm_file(self._path(key, MANIFEST_NAME))
            self.fs.rm(path, recursive=True)

    def download(self, key: str, slot: CacheSlot, shards: list[int]) -> None:
        _each([functools.partial(self._download_shard, key, slot, i) for i in shards], self.parallel)

    def _download_shard(self, key: str, slot: CacheSlot, index: int) -> None:
        info = slot.manifest.shards[index]
        part, remote = slot.part(index), self._path(key, info.file)
        for attempt in range(1, DOWNLOAD_RETRIES + 1):
            offset = part.stat().st_size if part.exists() else 0
            if offset > info.bytes:
                part.unlink()
                offset = 0
            try:
                with self._errors(f"downloading {key}/{info.file}"), open(part, "ab") as f:
                    while offset < info.bytes:
                        data = self.fs.cat_file(remote, start=offset, end=min(offset + RANGE_BYTES, info.bytes))
                        if not data:
                            raise WeightsError(
                                f"{self.url}/{key}/{info.file} ended at byte {offset}, its manifest says {info.bytes}"
                            )
                        f.write(data)
                        offset += len(data)
                slot.accept(index)
                return
            except FileNotFoundError:
                raise WeightsError(
                    f"{self.url}/{key} lists {info.file} in its manifest but the store has no such "
                    "file: the entry was damaged after it was published; publish it again"
                ) from None
            except WeightStoreRefused:
                raise
            except WeightsError:  # cut off or failed verification: resume / start over
                if attempt == DOWNLOAD_RETRIES:
                    raise

    def publish(self, local_dir: Path, key: str) -> Manifest:
        local = Manifest.from_dir(local_dir)
        if (text := self.manifest_or_none(key)) is not None:
            existing = Manifest.from_json(text)
            if existing.sha256 == local.sha256:
                return dataclasses.replace(local, root=None)  # the entry is not on this machine
            raise WeightsError(
                f"{self.url}/{key} already holds other weights (manifest sha256 "
                f"{existing.sha256[:12]}... != {local.sha256[:12]}...); entries are immutable: "
                "publish under a new key"
            )

        def put(index: int) -> None:
            info = local.shards[index]
            remote = self._path(key, info.file)
            with self._errors(f"uploading {key}/{info.file}"):
                self.fs.put_file(str(Path(local_dir) / info.file), remote)
                self.fs.invalidate_cache(self._path(key))
                size = self.fs.info(remote)["size"]
            if size != info.bytes:
                raise WeightsError(
                    f"{self.url}/{key}/{info.file} holds {size} bytes after the upload, the manifest "
                    f"says {info.bytes}; nothing was published: publish again"
                )

        with self._errors(f"publishing {key!r}"):
            self.fs.makedirs(self._path(key), exist_ok=True)  # a filesystem needs the dir; S3 has none
        _each([functools.partial(put, i) for i in range(len(local.shards))], self.parallel)
        tmp = self._path(key, f"{MANIFEST_NAME}.tmp-{uuid.uuid4().hex[:12]}")
        with self._errors(f"publishing {key!r}"):
            self.fs.pipe_file(tmp, local.to_json().encode())
            self.fs.mv(tmp, self._path(key, MANIFEST_NAME))
        return dataclasses.replace(local, root=None)  # the entry is not on this machine
