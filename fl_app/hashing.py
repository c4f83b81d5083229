"""File and buffer digests: sha256 (standard library; pip, the v1 weight manifests and canonical-JSON
content hashes) and BLAKE3.

Standard library only at import time: the wheelhouse runs where torch and blake3 are not
installed and needs `sha256_file` alone. BLAKE3 (the `blake3` package) is imported on first
use; it is the weight shards' hash because it ran 2.2-4.8x faster than sha256 per core in
every run of bench/aggregate.py (docs/benchmarks.md) while staying a cryptographic hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

HASHES = ("sha256", "blake3")
DIGEST_HEX_LEN = 64  # both give 32-byte digests


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(name: str) -> Hasher:
    """An incremental hasher for `name` ("sha256" or "blake3"); both release the GIL on large updates."""
    if name == "sha256":
        return hashlib.sha256()
    if name == "blake3":
        try:
            import blake3
        except ImportError:
            raise RuntimeError(
                "BLAKE3 weight digests need the `blake3` package: pip install blake3==1.0.11 "
                "(it is a dependency of fedagent-flower; requirements/ lists it for GPU images)"
            ) from None
        return blake3.blake3()
    raise ValueError(f"unknown hash {name!r}; known: {', '.join(HASHES)}")


def file_digest(path: Path, name: str, chunk_bytes: int = 1 << 20) -> str:
    """Hex digest of `path`, read through one reused buffer (no file-sized copy)."""
    h = new_hasher(name)
    chunk = memoryview(bytearray(chunk_bytes))
    with open(path, "rb") as f:
        while n := f.readinto(chunk):
            h.update(chunk[:n])
    return h.hexdigest()


def content_hash(value: object) -> str:
    """Hex sha256 of `value`'s canonical JSON (sorted keys, no whitespace, ASCII): the same in
    every process and on every machine, unlike `hash()`. Tuples hash like lists."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of `path` (pip's wheel hash)."""
    return file_digest(path, "sha256")
