"""What every store on another machine shares: a node-local cache of fetched entries, and
put/get/fetch written once on top of three transport primitives.

An entry is cached under its manifest digest, not its key: a key names an entry only within one
run, the digest names exactly one set of bytes, so fetching the same entry again is free and a
different entry under a reused key is never mistaken for it. Downloads resume: a shard grows in
`<digest>.partial/.incoming/<file>` (the transport picks up at its size, with a range read),
moves to `<digest>.partial/<file>` once verified, and the dir becomes `<digest>/` with its
manifest only when every shard is verified, so a cache entry that looks complete is verified.
A lock file per digest keeps two fetchers of one node (two trainers) from writing it together.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import tempfile
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fl_app.channel.files import check_shard_names, install_entry, verify_shard
from fl_app.channel.store import WeightStore, check_digest, check_key, check_pinned
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, load_shards, save_shards

DEFAULT_PARALLEL = 4
DOWNLOAD_RETRIES = 3


def raise_first_failure(done: Iterable[Any]) -> None:
    """Raise the first exception among finished jobs (threads' futures or asyncio tasks alike),
    so a transfer that fails stops as one error, its cause named."""
    for job in done:
        if job.exception() is not None:
            raise job.exception()


class WeightStoreUnreachable(WeightsError):
    """The store did not answer (refused, unroutable, timed out, cut off); the message names where."""


class WeightStoreRefused(WeightsError):
    """The store answered with an error (wrong token or credentials, unknown or immutable entry,
    corrupt upload); the message carries its reason."""


@dataclass(frozen=True)
class CacheSlot:
    """Where one entry (by manifest digest) lives in a node's cache, and its download state."""

    cache_dir: Path
    manifest: Manifest

    @property
    def entry(self) -> Path:
        return self.cache_dir / self.manifest.sha256

    @property
    def partial(self) -> Path:
        return self.cache_dir / f"{self.manifest.sha256}.partial"

    @property
    def incoming(self) -> Path:
        return self.partial / ".incoming"

    def part(self, index: int) -> Path:
        """The file shard `index` is downloaded into; its size is the offset to resume from."""
        return self.incoming / self.manifest.shards[index].file

    def missing(self) -> list[int]:
        """Shards not yet downloaded and verified (creates the partial dirs)."""
        self.incoming.mkdir(parents=True, exist_ok=True)
        return [i for i, s in enumerate(self.manifest.shards) if not (self.partial / s.file).is_file()]

    def accept(self, index: int) -> None:
        """Verify a fully downloaded shard and move it out of `.incoming`; a bad one is deleted
        (so the next attempt starts it afresh) and raises WeightsError."""
        try:
            verify_shard(self.manifest, index, self.incoming)
        except WeightsError:
            self.part(index).unlink(missing_ok=True)
            raise
        os.replace(self.part(index), self.partial / self.manifest.shards[index].file)

    def complete(self) -> Manifest:
        """All shards verified: the partial dir becomes the cache entry, manifest included."""
        if missing := self.missing():
            raise WeightsError(f"{self.partial}: shards {missing} are still missing; fetch again")
        shutil.rmtree(self.incoming)  # only leftovers of shards verified since
        return install_entry(self.partial, self.manifest, self.entry, durable=False)


_DIGEST = re.compile(r"[0-9a-f]{64}")  # a cache entry's name: its manifest's sha256


def cached(cache_dir: Path, manifest_sha256: str) -> Manifest | None:
    """The complete cache entry for a digest, or None."""
    entry = Path(cache_dir) / manifest_sha256
    if not (entry / MANIFEST_NAME).is_file():
        return None
    manifest = Manifest.from_dir(entry)
    return manifest if manifest.sha256 == manifest_sha256 else None


@contextmanager
def _locked(cache_dir: Path, manifest_sha256: str) -> Iterator[None]:
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(cache_dir) / f"{manifest_sha256}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class RemoteStore(WeightStore):
    """A weight store on another machine; subclasses move bytes, this class keeps them honest."""

    def __init__(self, max_shard_bytes: int, parallel: int = DEFAULT_PARALLEL):
        if parallel < 1:
            raise WeightsError(f"parallel transfers must be >= 1 (got {parallel})")
        self.max_shard_bytes = max_shard_bytes
        self.parallel = parallel

    url: str  # where the store is, for error messages
    node: str  # which process asks ('' for the server), for error messages

    @abstractmethod
    def manifest_or_none(self, key: str) -> str | None:
        """The entry's manifest JSON, or None when the entry is absent or incomplete."""

    def manifest_text(self, key: str) -> str:
        """The entry's manifest JSON (raises WeightsError naming the entry when it is absent)."""
        if (text := self.manifest_or_none(check_key(key))) is None:
            who = f"node {self.node}: " if self.node else ""
            raise WeightsError(
                f"{who}the weight store at {self.url} has no complete entry {key!r} (no {MANIFEST_NAME}: "
                "never published, or its upload did not finish)"
            )
        return text

    def exists(self, key: str) -> bool:
        return self.manifest_or_none(check_key(key)) is not None

    @abstractmethod
    def download(self, key: str, slot: CacheSlot, shards: list[int]) -> None:
        """Bring each of `shards` into `slot.part(i)`, resuming from its current size, and call
        `slot.accept(i)` once it is complete; up to `self.parallel` at a time."""

    def manifest(self, key: str) -> Manifest:
        manifest = Manifest.from_json(self.manifest_text(check_key(key)))
        check_shard_names(manifest)
        return manifest

    def fetch(self, key: str, expected_manifest_sha256: str, cache_dir: Path) -> Manifest:
        check_key(key)
        if hit := cached(cache_dir, check_digest(expected_manifest_sha256)):
            os.utime(Path(cache_dir) / hit.sha256)  # recently used: kept by prune_cache
            return hit
        manifest = check_pinned(key, self.manifest(key), expected_manifest_sha256)
        with _locked(cache_dir, manifest.sha256):
            if hit := cached(cache_dir, manifest.sha256):  # another fetcher finished it meanwhile
                return hit
            slot = CacheSlot(Path(cache_dir), manifest)
            if todo := slot.missing():
                self.download(key, slot, todo)
            return slot.complete()

    def get(self, key: str, verify: bool = True) -> dict[str, torch.Tensor]:
        manifest = self.manifest(key)
        with tempfile.TemporaryDirectory(prefix="fa-get-") as tmp:
            # The tensors live on freshly read buffers, not on the files: the dir can go.
            return load_shards(self.fetch(key, manifest.sha256, Path(tmp)), verify)

    def put(self, key: str, state: Mapping[str, torch.Tensor]) -> Manifest:
        check_key(key)
        with tempfile.TemporaryDirectory(prefix="fa-put-") as tmp:
            save_shards(state, Path(tmp) / "w", self.max_shard_bytes)
            return dataclasses.replace(self.publish(Path(tmp) / "w", key), root=None)


def prune_cache(cache_dir: Path, keep: int) -> list[str]:
    """Drop all but the `keep` most recently fetched or used entries of a node's cache (a 70-round
    run of a 6 GB model must not keep 70 global models on every node); an entry another process
    is fetching right now (its lock held) is skipped. Returns the digests dropped."""
    root = Path(cache_dir)
    if not root.is_dir():
        return []
    entries = sorted(
        (p for p in root.iterdir() if p.is_dir() and _DIGEST.fullmatch(p.name)),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    dropped = []
    for entry in entries[keep:]:
        with open(root / f"{entry.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            shutil.rmtree(root / f"{entry.name}.partial", ignore_errors=True)
        (root / f"{entry.name}.lock").unlink(missing_ok=True)
        dropped.append(entry.name)
    return dropped


def drop_cached(cache_dir: Path, manifest_sha256: str) -> None:
    """Remove one fetched entry (complete or partial) from a node's cache."""
    for path in (Path(cache_dir) / manifest_sha256, Path(cache_dir) / f"{manifest_sha256}.partial"):
        shutil.rmtree(path, ignore_errors=True)
    (Path(cache_dir) / f"{manifest_sha256}.lock").unlink(missing_ok=True)
