"""Path confinement: every path that arrives from outside (a request, a reply, a manifest, a
store key) must resolve inside the root it belongs to, or it is refused.

One rule, used everywhere a path crosses a trust boundary: resolve the candidate with every
symlink followed (`os.path.realpath`) and require the result to be the root itself or below
the root's own real path. That refuses absolute paths elsewhere, `..` walks, and symlinks
inside the root that point out of it (followed on read, or written through), while a root that
is itself reached through a symlink (e.g. /tmp on some systems) keeps working.
"""

from __future__ import annotations

import os
from pathlib import Path


class PathEscapeError(ValueError):
    """A path from outside resolves out of the root it must stay in."""


def confine(path: str | os.PathLike[str], root: str | os.PathLike[str], what: str = "path") -> Path:
    """The real path of `path` (relative paths are taken from `root`), which must lie inside the
    real path of `root`; otherwise `PathEscapeError` naming `what`, the path and the root.

    The path need not exist yet (a directory about to be written): its existing part is
    resolved, so a symlink anywhere along it is followed before the check.
    """
    root_real = Path(os.path.realpath(root))
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root_real / candidate
    real = Path(os.path.realpath(candidate))
    if real != root_real and root_real not in real.parents:
        via = "" if real == Path(os.path.abspath(candidate)) else f" (it resolves to {real})"
        raise PathEscapeError(
            f"{what} {os.fspath(path)!r} lies outside {root_real}{via}; only paths inside "
            f"{root_real} are accepted here (a symlink out of it is refused too)"
        )
    return real


def is_inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """True when `confine(path, root)` would accept `path`."""
    try:
        confine(path, root)
    except PathEscapeError:
        return False
    return True
