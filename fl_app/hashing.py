"""sha256 of a file, standard library only (the wheelhouse runs where torch is not installed)."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of `path`, read through one reused 1 MiB buffer (no file-sized copy)."""
    h = hashlib.sha256()
    chunk = memoryview(bytearray(1 << 20))
    with open(path, "rb") as f:
        while n := f.readinto(chunk):
            h.update(chunk[:n])
    return h.hexdigest()
