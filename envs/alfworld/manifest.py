"""Game manifests: which games a split holds, pinned by path and content hash.

Why (field log 2026-07-26/27): ALFWorld's loader walks the data directory, so the game list came
out in filesystem order and its *set* depended on how far preprocessing had run on the machine;
every positional use (seeded shuffle, client shards, the validation slice) then silently changed.
A manifest fixes both: the sorted list of split-relative `game.tw-pddl` paths with each file's
sha256 and task type, plus one digest over all of it. The loader reads the manifest instead of
walking: a listed game missing on disk (or with other content) is an error naming how many and
which; games on disk that the manifest does not list are ignored.

Cut one (on the machine whose preprocessing is complete, then commit it):
    python -m envs.alfworld.manifest --data-dir $ALFWORLD_DATA --out-dir envs/alfworld/manifests/official
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from envs.alfworld.tasks import TASK_TYPES

FORMAT = "fedagent-alfworld-manifest/1"
GAME_FILE = "game.tw-pddl"
OFFICIAL_ROOT = "json_2.1.1"  # $ALFWORLD_DATA/json_2.1.1/<split>/...
SPLITS = ("train", "valid_seen", "valid_unseen")


class ManifestError(RuntimeError):
    """The games on disk do not match the pinned manifest (or no manifest exists)."""


@dataclass(frozen=True)
class Entry:
    path: str  # split-relative POSIX path of the game file
    sha256: str
    task_type: str


@dataclass(frozen=True)
class Manifest:
    split: str
    entries: tuple[Entry, ...]  # sorted by path

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for e in self.entries:
            h.update(f"{e.path}\t{e.sha256}\t{e.task_type}\n".encode())
        return h.hexdigest()

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "format": FORMAT,
                    "split": self.split,
                    "count": len(self.entries),
                    "digest": self.digest,
                    "games": [e.__dict__ for e in self.entries],
                },
                indent=1,
            )
            + "\n"
        )

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> Manifest:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ManifestError(f"{path} is not a {FORMAT} file")
        entries = tuple(sorted((Entry(**g) for g in data["games"]), key=lambda e: e.path))
        m = cls(data["split"], entries)
        if m.digest != data["digest"]:
            raise ManifestError(
                f"{path}: stored digest {data['digest'][:12]} does not match its "
                f"entries ({m.digest[:12]}); the file was edited by hand - re-cut it"
            )
        return m


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cut_manifest(split_root: Path, split: str) -> Manifest:
    """Walk `split_root` with ALFWorld's own eligibility rules (`collect_game_files`): a trial
    dir with traj_data.json, not movable/Sliced, one of the six task types, and a game.tw-pddl
    marked solvable. The walk order is irrelevant: entries are sorted by path."""
    split_root = Path(split_root)
    if not split_root.is_dir():
        raise ManifestError(f"no split directory at {split_root}")
    entries = []
    for traj in split_root.rglob("traj_data.json"):
        rel = traj.parent.relative_to(split_root).as_posix()
        if "movable" in rel or "Sliced" in rel:
            continue
        task_type = json.loads(traj.read_text())["task_type"]
        game = traj.parent / GAME_FILE
        if task_type not in TASK_TYPES or not game.is_file():
            continue
        if not json.loads(game.read_text()).get("solvable"):
            continue
        entries.append(Entry(f"{rel}/{GAME_FILE}", file_sha256(game), task_type))
    return Manifest(split, tuple(sorted(entries, key=lambda e: e.path)))


_verified: set[tuple[str, str]] = set()
_verified_lock = threading.Lock()


def verify_games(manifest: Manifest, split_root: Path) -> None:
    """Every listed game is on disk with the listed content (checked once per process)."""
    key = (str(Path(split_root).resolve()), manifest.digest)
    with _verified_lock:
        if key in _verified:
            return
        missing, changed = [], []
        for e in manifest.entries:
            path = Path(split_root) / e.path
            if not path.is_file():
                missing.append(e.path)
            elif file_sha256(path) != e.sha256:
                changed.append(e.path)
        for what, bad in (("missing", missing), ("different from the manifest", changed)):
            if bad:
                shown = "\n  ".join(bad[:10]) + ("\n  ..." if len(bad) > 10 else "")
                raise ManifestError(
                    f"{len(bad)} of {len(manifest.entries)} games listed in the {manifest.split!r} "
                    f"manifest are {what} under {split_root}:\n  {shown}\nThe task set would "
                    f"differ from the pinned one; complete the data (or its preprocessing) or "
                    f"re-cut the manifest on purpose."
                )
        _verified.add(key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m envs.alfworld.manifest", description="Cut (or --check) manifests of an ALFWorld data dir."
    )
    ap.add_argument("--data-dir", required=True, help=f"the dir holding {OFFICIAL_ROOT}/<split>/")
    ap.add_argument("--out-dir", required=True, help="where <split>.json manifests go / are")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    status = 0
    for split in args.splits:
        root = Path(args.data_dir) / OFFICIAL_ROOT / split
        if not root.is_dir():
            print(f"{split}: no {root}, skipped")
            continue
        m = cut_manifest(root, split)
        out = Path(args.out_dir) / f"{split}.json"
        if args.check:
            ok = out.is_file() and Manifest.load(out).digest == m.digest
            status |= 0 if ok else 1
            print(f"{split}: {len(m.entries)} games, {m.digest[:12]} {'OK' if ok else 'DIFFERS'}")
        else:
            m.dump(out)
            print(f"{split}: {len(m.entries)} games, digest {m.digest[:12]} -> {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
