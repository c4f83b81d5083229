"""Where weights live between a sender and a receiver, addressed by a key like
`rounds/round-0003/actor`.

`WeightStore` is the interface both sides program against; `DirStore` implements it on a
directory (the run dir: a shared disk in simulation). An HTTP store for real deployments can
implement the same methods without touching callers. Callers move weights with two of them:
`fetch` (a verified node-local copy of an entry, pinned by its manifest digest) and `publish`
(a locally written weights dir becomes an entry); for a DirStore both touch nothing (the entry
is its own local copy; a dir written at the key's own path is already published).
"""
from __future__ import annotations

import os
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch

from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, load_shards, save_shards

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_key(key: str) -> str:
    """Keys are relative POSIX paths of plain segments (no '..', no absolute paths)."""
    parts = key.split("/")
    if not key or not all(_SEGMENT.match(p) and p not in (".", "..") for p in parts):
        raise WeightsError(f"bad weight-store key {key!r}: use '/'-separated segments of letters, digits, "
                           "'.', '_' or '-' (e.g. 'rounds/round-0003/actor')")
    return key


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
        """A verified node-local copy of entry `key`, whose manifest must have the expected
        digest (WeightsError otherwise: the entry was replaced); remote stores copy it under
        `cache_dir`."""

    @abstractmethod
    def publish(self, local_dir: Path, key: str) -> Manifest:
        """Make the complete weights dir `local_dir` the (new) entry `key`; returns its manifest."""


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
        if any(p.is_dir() or not (p.suffix == ".safetensors" or p.name.startswith(MANIFEST_NAME))
               for p in path.iterdir()):
            raise WeightsError(f"{path} is not a single weights entry (it holds other files or dirs); "
                               "refusing to delete it: delete the entries inside it by their own keys")
        shutil.rmtree(path)

    def fetch(self, key: str, expected_manifest_sha256: str, cache_dir: Path) -> Manifest:
        manifest = self.manifest(key)
        if manifest.sha256 != expected_manifest_sha256:
            raise WeightsError(f"store entry {key!r} is not the one the sender wrote (manifest sha256 "
                               f"{manifest.sha256[:12]}... != {expected_manifest_sha256[:12]}...): it was replaced, "
                               "e.g. by a re-run; drop this reply and re-run the fit")
        return manifest

    def publish(self, local_dir: Path, key: str) -> Manifest:
        path = self.path(key)
        if Path(local_dir).resolve() != path.resolve():
            if path.exists():
                raise WeightsError(f"store entry {key!r} already exists; entries are immutable")
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(local_dir, path)
        return self.manifest(key)
