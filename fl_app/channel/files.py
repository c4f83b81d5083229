"""File-level rules every weight store shares: what an entry's files are, how a shard that
crossed a machine boundary is verified, and how a finished entry appears all at once.

An entry appears by renaming a fully written sibling dir (manifest inside) onto its key's dir,
so a reader sees nothing or the whole entry, never a half-published one; the same move is used
when the directory store publishes a copy, when the HTTP store's server commits an upload, and
when a node's cache completes a download.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, fsync_path, read_shard

_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Verification reads a whole shard into memory (up to run.shard_max_mb) and hashes it: two at a
# time per process keeps both cores busy without holding many shard-sized buffers at once.
_VERIFY_SLOTS = threading.BoundedSemaphore(2)


def is_entry_file(name: str) -> bool:
    """True for the files a weights entry may hold (shards and its manifest)."""
    return name.endswith(".safetensors") or name.startswith(MANIFEST_NAME)


def check_shard_names(manifest: Manifest) -> None:
    """A manifest from another machine names only plain, distinct shard files (no paths)."""
    names = [s.file for s in manifest.shards]
    bad = [n for n in names if not _FILE.match(n) or not n.endswith(".safetensors")]
    if bad or len(set(names)) != len(names):
        raise WeightsError(
            f"manifest lists shard files {bad or names} that are not plain, distinct "
            "'*.safetensors' names; it was not written by fl_app.weights: re-export the weights"
        )


def verify_shard(manifest: Manifest, index: int, where: Path) -> None:
    """Check shard `index` of `manifest`, held as `where/<its file name>`, exactly as a loader
    would (size, header, and the digest with the manifest's own algorithm): raises WeightsError."""
    with _VERIFY_SLOTS:
        read_shard(dataclasses.replace(manifest, root=Path(where)), index, verify=True)


def write_all(fd: int, pieces: list[bytes]) -> None:
    """Write `pieces` at the file's offset with as few syscalls as writev allows, no joining copy."""
    views = [memoryview(p) for p in pieces if len(p)]
    while views:
        n = os.writev(fd, views[:1024])  # IOV_MAX
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def sibling_tmp(dest: Path, what: str) -> Path:
    """A fresh hidden dir next to `dest` (same filesystem, so the final rename is atomic). Its
    leading dot keeps it out of every key: `check_key` refuses segments that start with '.'."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{what}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def install_entry(staged: Path, manifest: Manifest, dest: Path, durable: bool) -> Manifest:
    """Write the manifest into `staged` (which holds every shard), then rename `staged` onto
    `dest`, which must not exist yet. `durable` fsyncs shards, manifest and both renames first
    (a checkpoint's promise that a manifest means complete shards survives a crash)."""
    if durable:
        for shard in manifest.shards:
            fsync_path(staged / shard.file)
    tmp = staged / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, staged / MANIFEST_NAME)
    try:
        os.rename(staged, dest)
    except OSError as e:
        raise WeightsError(
            f"cannot publish {dest}: something appeared there while it was being written "
            f"({e.strerror}); entries are immutable: delete it or use another key"
        ) from e
    if durable:
        fsync_path(dest.parent)
    return Manifest.from_dir(dest)


def link_or_copy(src: Path, dst: Path) -> None:
    """Entries are immutable, so a hard link is as good as a copy and costs nothing; copy across
    filesystems (or where links are not allowed)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def same_dir(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
