"""Where weights live between a sender and a receiver, addressed by a key like
`rounds/round-0003/actor`.

`WeightStore` is the interface both sides program against; `DirStore` implements it on a
directory (the run dir: a shared disk in simulation). The weight channel adds two operations
that let a node on another machine take part without any shared path: `fetch` (a verified
node-local weights dir for an entry) and `publish` (make a locally written weights dir an
entry). On a DirStore both are free (the entry's own dir, nothing to copy); the remote stores
(fl_app/store_http.py, fl_app/store_fsspec.py) download into a node cache and upload.
"""

from __future__ import annotations

import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch

from fl_app.store_files import install_entry, is_entry_file, link_or_copy, same_dir, sibling_tmp
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, load_shards, save_shards

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DIGEST = re.compile(r"^[0-9a-f]{16,128}$")


def check_key(key: str) -> str:
    """Keys are relative POSIX paths of plain segments (no '..', no absolute paths)."""
    parts = key.split("/")
    if not key or not all(_SEGMENT.match(p) and p not in (".", "..") for p in parts):
        raise WeightsError(
            f"bad weight-store key {key!r}: use '/'-separated segments of letters, digits, "
            "'.', '_' or '-' (e.g. 'rounds/round-0003/actor')"
        )
    return key


def check_digest(manifest_sha256: str) -> str:
    """A manifest digest is lowercase hex (it also names cache dirs, so nothing else may pass)."""
    if not _DIGEST.match(manifest_sha256):
        raise WeightsError(
            f"{manifest_sha256!r} is not a manifest digest (hex); pass the "
            "manifest_sha256 the sender's WeightsRef carries"
        )
    return manifest_sha256


def check_pinned(key: str, manifest: Manifest, expected_manifest_sha256: str) -> Manifest:
    """The entry under `key` must be the one the sender wrote (its manifest digest), not a stale
    or re-run entry that reuses the key."""
    if manifest.sha256 != expected_manifest_sha256:
        raise WeightsError(
            f"store entry {key!r} is not the one the sender wrote (manifest sha256 "
            f"{manifest.sha256[:12]}... != {expected_manifest_sha256[:12]}...): it was replaced, "
            "e.g. by a re-run; drop this message and re-run the fit"
        )
    return manifest


class WeightStore(ABC):
    """Put/get fp32 state dicts by key; every entry is a sharded, manifest-pinned weights dir."""

    @abstractmethod
    def put(self, key: str, state: Mapping[str, torch.Tensor]) -> Manifest:
        """Write a new entry; an existing key is an error (entries are immutable)."""

    @abstractmethod
    def get(self, key: str, verify: bool = True) -> dict[str, torch.Tensor]:
        """The verified state dict of an entry."""

    @abstractmethod
    def manifest(self, key: str) -> Manifest:
        """The entry's manifest (raises WeightsError when the entry is absent or incomplete)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True only for complete entries (manifest present)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an entry, complete or a dead partial write."""

    @abstractmethod
    def fetch(self, key: str, expected_manifest_sha256: str, cache_dir: Path) -> Manifest:
        """A node-local weights dir holding the entry `key`, which must be the one pinned by
        `expected_manifest_sha256`; its manifest's `root` is that dir. A store on this machine
        returns the entry's own dir; a remote one downloads into `cache_dir/<digest>/`, verifying
        every shard, so fetching the same entry again is free and an interrupted download resumes."""

    @abstractmethod
    def publish(self, local_dir: Path, key: str) -> Manifest:
        """Make the complete weights dir `local_dir` (written by fl_app.weights) the entry `key`.
        Nothing moves when `local_dir` already is the key's dir; otherwise it is copied or
        uploaded, and the entry appears only once all of it is there and verified. Publishing the
        same bytes again is a no-op; different bytes under an existing key are an error. The
        manifest returned has the entry's dir as `root` for a store on this machine, None for a
        remote one (the sender may then drop `local_dir`)."""


class DirStore(WeightStore):
    """A directory of weights dirs: key `a/b` lives in `<root>/a/b/`."""

    def __init__(self, root: Path, max_shard_bytes: int):
        self.root = Path(root)
        self.max_shard_bytes = max_shard_bytes

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, state: Mapping[str, torch.Tensor]) -> Manifest:
        return save_shards(state, self.path(key), self.max_shard_bytes)

    def get(self, key: str, verify: bool = True) -> dict[str, torch.Tensor]:
        return load_shards(self.manifest(key), verify)

    def manifest(self, key: str) -> Manifest:
        return Manifest.from_dir(self.path(key))

    def exists(self, key: str) -> bool:
        return (self.path(key) / MANIFEST_NAME).is_file()

    def delete(self, key: str) -> None:
        path = self.path(key)
        if not path.exists():
            return
        # Refuse anything that is not a weights dir (e.g. a parent key holding many entries).
        if any(p.is_dir() or not is_entry_file(p.name) for p in path.iterdir()):
            raise WeightsError(
                f"{path} is not a single weights entry (it holds other files or dirs); "
                "refusing to delete it: delete the entries inside it by their own keys"
            )
        shutil.rmtree(path)

    def fetch(self, key: str, expected_manifest_sha256: str, cache_dir: Path | None = None) -> Manifest:
        """The entry's own dir (this store is local: no copy, `cache_dir` unused). Its shards are
        verified by whoever loads them (fl_app.weights.read_shard)."""
        return check_pinned(key, self.manifest(key), check_digest(expected_manifest_sha256))

    def publish(self, local_dir: Path, key: str) -> Manifest:
        """Nothing to do when `local_dir` is the key's dir; else hard-link (or copy) its files into
        a sibling of the key's dir and rename that into place. `local_dir` stays as it was."""
        local = Manifest.from_dir(local_dir)
        dest = self.path(key)
        if same_dir(local_dir, dest):
            return local
        if self.exists(key):
            existing = self.manifest(key)
            if existing.sha256 == local.sha256:
                return existing
            raise WeightsError(
                f"store entry {key!r} already holds other weights (manifest sha256 "
                f"{existing.sha256[:12]}... != {local.sha256[:12]}...); entries are immutable: "
                "publish under a new key"
            )
        if dest.exists():
            raise WeightsError(
                f"{dest} holds an incomplete write (no {MANIFEST_NAME}); delete it "
                f"(store.delete({key!r})) before publishing there"
            )
        staged = sibling_tmp(dest, "publish")
        try:
            for shard in local.shards:
                link_or_copy(Path(local_dir) / shard.file, staged / shard.file)
            return install_entry(staged, local, dest, durable=True)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
