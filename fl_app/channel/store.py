"""Where weights live between a sender and a receiver, addressed by a key like
`rounds/round-0003/actor`.

`WeightStore` is the interface both sides program against; `run_dir.DirStore` implements it on a
directory (the run dir: a shared disk in simulation). The weight channel adds two operations
that let a node on another machine take part without any shared path: `fetch` (a verified
node-local weights dir for an entry) and `publish` (make a locally written weights dir an
entry). On a DirStore both are free (the entry's own dir, nothing to copy); the remote stores
(fl_app/channel/http.py, fl_app/channel/object_store.py) download into a node cache and upload.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch

from fl_app.weights import Manifest, WeightsError

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
