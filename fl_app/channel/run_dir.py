"""The run-dir backend: a directory of weights dirs, key `a/b` in `<root>/a/b/`.

The run dir itself in simulation (every process sees the same disk), or a disk every machine
mounts (`file:///shared/dir`): read in place, never copied. Every node writes there too, so every
key is resolved with its symlinks followed and must stay inside the root (`confined_key_path`):
a client's upload dir that is a symlink to weights elsewhere is refused, never read or averaged.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from fl_app.channel.files import install_entry, is_entry_file, link_or_copy, same_dir, sibling_tmp
from fl_app.channel.store import WeightStore, check_digest, check_key, check_pinned
from fl_app.paths import PathEscapeError, confine
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, load_shards, save_shards


def confined_key_path(root: Path, key: str) -> Path:
    """The real path of `key` under `root`: a bad key raises WeightsError (`check_key`), one that
    resolves out of `root` (a symlink anywhere along it) `PathEscapeError`."""
    return confine(Path(root) / check_key(key), root, "weight-store key")


class DirStore(WeightStore):
    """A directory of weights dirs: key `a/b` lives in `<root>/a/b/`."""

    def __init__(self, root: Path, max_shard_bytes: int):
        self.root = Path(root)
        self.max_shard_bytes = max_shard_bytes

    def path(self, key: str) -> Path:
        """The entry's dir, reading or writing (`confined_key_path`; an escape is a WeightsError)."""
        try:
            return confined_key_path(self.root, key)
        except PathEscapeError as e:
            raise WeightsError(f"refused: {e}") from None

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
