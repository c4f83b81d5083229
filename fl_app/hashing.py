"""sha256 of a file or of a JSON value, standard library only (the wheelhouse runs where torch is
not installed)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of `path`, read through one reused 1 MiB buffer (no file-sized copy)."""
    h = hashlib.sha256()
    chunk = memoryview(bytearray(1 << 20))
    with open(path, "rb") as f:
        while n := f.readinto(chunk):
            h.update(chunk[:n])
    return h.hexdigest()


def content_hash(value: object) -> str:
    """Hex sha256 of `value`'s canonical JSON (sorted keys, no whitespace, ASCII): the same in
    every process and on every machine, unlike `hash()`. Tuples hash like lists."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()
