"""The run directory: checkpoints, round markers, metrics, summary; resume keyed on the disk.

    runs/<name>/
      config.yaml                      resolved config (fl_app.config.save_config)
      rounds/round-0000/actor/         round 0 = the initial model (fp32 shards + manifest)
      rounds/round-0003/actor/         the global model after round 3 = the checkpoint
      rounds/round-0003/critic/        PPO: the aggregated critic beside it (invariant 7)
      rounds/round-0003/clients/client-0007/actor/   client uploads of round 3 (scratch)
      rounds/round-0003/COMPLETE       written last: {"round", "time", "metrics", "members"}
      metrics.jsonl                    one line per complete round
      summary.json

A round is complete only when its COMPLETE marker exists and every required member (`actor`,
and `critic` for PPO) still holds the exact weights the marker recorded. Resume (invariant 6,
field-log "find_resume_round", "fabricated round T", "RESUME could FedAvg a dead attempt's
checkpoint") scans the round dirs on disk instead of counting up to the configured total,
refuses a dir that holds rounds beyond that total, and renames every incomplete round dir
aside (never deletes it), so a re-run round starts from an empty dir and cannot pick up a dead
attempt's uploads.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_app.weights import Manifest, WeightsError

MARKER = "COMPLETE"
_ROUND_DIR = re.compile(r"^round-(\d{4,})$")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message names the ways out."""


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RunDir:
    """One run's directory. `total_rounds` is the configured T (needed to resume); `members`
    are the weights every complete round must hold."""

    def __init__(self, path: Path, total_rounds: int | None = None, members: Sequence[str] = ("actor",)):
        if not members:
            raise RunDirError("a round needs at least one required member, e.g. ('actor',)")
        self.path = Path(path)
        self.total_rounds = total_rounds
        self.members = tuple(members)

    # ---- layout -------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def rounds_dir(self) -> Path:
        return self.path / "rounds"

    def round_dir(self, r: int) -> Path:
        if r < 0:
            raise RunDirError(f"round must be >= 0 (got {r})")
        return self.rounds_dir / f"round-{r:04d}"

    def member_dir(self, r: int, member: str = "actor") -> Path:
        """Where the global `member` weights of round r live (a weights dir)."""
        return self.round_dir(r) / member

    def client_dir(self, r: int, client_id: int | str) -> Path:
        """Scratch space for one client's uploads in round r (members go in subdirs)."""
        cid = f"{client_id:04d}" if isinstance(client_id, int) else str(client_id)
        if not _CLIENT_ID.match(cid):
            raise RunDirError(f"bad client id {client_id!r}: use an int or letters, digits, '.', '_', '-'")
        return self.round_dir(r) / "clients" / f"client-{cid}"

    def store_key(self, path: Path) -> str:
        """The weight-store key of a path inside this run dir (for a DirStore rooted here)."""
        return path.relative_to(self.path).as_posix()

    # ---- state on disk ------------------------------------------------------------------
    def rounds_on_disk(self) -> list[int]:
        """Every round-NNNN dir, complete or not, ascending (renamed-aside dirs do not match)."""
        if not self.rounds_dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.rounds_dir.iterdir()
                      if p.is_dir() and (m := _ROUND_DIR.match(p.name)))

    def _round_state(self, r: int) -> tuple[str, str]:
        """('complete' | 'partial' | 'broken', why). Broken = a marker whose members do not match."""
        marker = self.round_dir(r) / MARKER
        if not marker.is_file():
            return "partial", "no COMPLETE marker"
        try:
            recorded = json.loads(marker.read_text())["members"]
        except (ValueError, KeyError) as e:
            return "broken", f"unreadable marker ({e})"
        for m in self.members:
            if m not in recorded:
                return "broken", f"completed without required member {m!r} (has {sorted(recorded)})"
            try:
                digest = Manifest.from_dir(self.member_dir(r, m)).sha256
            except WeightsError as e:
                return "broken", str(e)
            if digest != recorded[m]["manifest_sha256"]:
                return "broken", f"member {m!r} was replaced after the round completed"
        return "complete", ""

    def recorded_members(self, r: int) -> list[str] | None:
        """The members round r's COMPLETE marker records (None: no readable marker)."""
        try:
            return sorted(json.loads((self.round_dir(r) / MARKER).read_text())["members"])
        except (OSError, ValueError, KeyError):
            return None

    def is_complete(self, r: int) -> bool:
        return self.round_dir(r).is_dir() and self._round_state(r)[0] == "complete"

    def last_complete_round(self) -> int | None:
        """The highest complete round on disk (None: nothing complete, start at round 0)."""
        done = [r for r in self.rounds_on_disk() if self._round_state(r)[0] == "complete"]
        return max(done) if done else None

    # ---- resume -------------------------------------------------------------------------
    def check_total(self) -> None:
        """Refuse a run dir holding rounds (complete or not) beyond the configured total."""
        total_rounds = self.total_rounds
        if total_rounds is None:
            raise RunDirError("RunDir(path, total_rounds=T) is needed to resume: T bounds the rounds on disk")
        beyond = [r for r in self.rounds_on_disk() if r > total_rounds]
        if beyond:
            hi = max(beyond)
            raise RunDirError(
                f"{self.path} holds rounds up to {hi} but this run is configured for rounds={total_rounds}; "
                f"refusing to resume (nothing was touched). Ways out: (1) raise `rounds` to at least {hi} "
                f"(e.g. `flwr run . --run-config rounds={hi}`) to continue this run; (2) use a new run dir "
                f"(`--run-config 'run-dir=\"runs/<new-name>\"'`); (3) move the rounds above {total_rounds} "
                f"out of {self.rounds_dir} (e.g. `mv {self.round_dir(hi)} {self.round_dir(hi)}.moved`) "
                "if you mean to redo them")

    def quarantine_partials(self) -> list[Path]:
        """Rename every round dir without a COMPLETE marker to `round-NNNN.partial-<utc time>`."""
        moved = []
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for r in self.rounds_on_disk():
            if self._round_state(r)[0] != "partial":
                continue
            src = self.round_dir(r)
            dst = src.with_name(f"{src.name}.partial-{stamp}")
            n = 1
            while dst.exists():
                dst = src.with_name(f"{src.name}.partial-{stamp}-{n}")
                n += 1
            src.rename(dst)
            moved.append(dst)
        return moved

    def read_metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl as dicts; a torn last line (a crash mid-append) is ignored."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if i == len(lines) - 1:
                    break
                raise RunDirError(f"{self.metrics_path}:{i + 1} is not JSON; fix or remove that line") from None
        return rows

    def trim_metrics(self) -> None:
        """Rewrite metrics.jsonl to one line per complete round (the last line written for it)."""
        if not self.metrics_path.exists():
            return
        complete = {r for r in self.rounds_on_disk() if self._round_state(r)[0] == "complete"}
        by_round = {row["round"]: row for row in self.read_metrics() if row.get("round") in complete}
        _write_atomic(self.metrics_path, "".join(json.dumps(by_round[r], default=_json_default) + "\n"
                                                 for r in sorted(by_round)))

    def prepare_resume(self) -> int | None:
        """Make the disk consistent before the round loop; returns the last complete round.

        Order matters: refuse first (nothing moved), then move partial rounds aside, then drop
        metrics of rounds that are not complete. The loop resumes at the returned round + 1
        (at round 0, the initial model, when None).
        """
        self.check_total()
        for r in self.rounds_on_disk():
            state, why = self._round_state(r)
            if state == "broken":
                raise RunDirError(
                    f"round {r} in {self.path} has a COMPLETE marker but {why}; this run requires members "
                    f"{list(self.members)}. Use a new run dir, or move {self.round_dir(r)} aside if it is damaged")
        self.quarantine_partials()
        self.trim_metrics()
        return self.last_complete_round()

    # ---- writing rounds -----------------------------------------------------------------
    def complete_round(self, r: int, metrics: Mapping[str, Any]) -> None:
        """Seal round r: append its metrics line, then write the COMPLETE marker last.

        Rounds complete in order (r = last complete + 1, or 0), and only when every required
        member holds complete weights.
        """
        last = self.last_complete_round()
        expected = 0 if last is None else last + 1
        if r != expected:
            raise RunDirError(f"cannot complete round {r}: the last complete round on disk is {last}, so the "
                              f"next one is {expected}; call prepare_resume() before the round loop")
        members = {}
        for m in self.members:
            try:
                man = Manifest.from_dir(self.member_dir(r, m))
            except WeightsError as e:
                raise RunDirError(f"cannot complete round {r}: member {m!r} has no complete weights ({e})") from None
            members[m] = {"manifest_sha256": man.sha256, "total_bytes": man.total_bytes}
        line = json.dumps({"round": r, **metrics}, default=_json_default)
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        _write_atomic(self.round_dir(r) / MARKER, json.dumps(
            {"round": r, "time": _utc_now(), "metrics": dict(metrics), "members": members},
            default=_json_default, indent=1) + "\n")

    def drop_client_uploads(self, r: int) -> None:
        """Delete round r's client scratch (only once the round is complete: it is then redundant)."""
        if not self.is_complete(r):
            raise RunDirError(f"round {r} is not complete; its client uploads are still needed")
        shutil.rmtree(self.round_dir(r) / "clients", ignore_errors=True)

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        """Write summary.json (atomically), adding the last complete round found on disk.

        A `final_round` entry may only name the highest complete round on disk: a run that
        stopped early has no final round (field log "fabricated round T"), so it omits the
        entry or sets it to None.
        """
        last = self.last_complete_round()
        final_round = summary.get("final_round")
        if final_round is not None and final_round != last:
            raise RunDirError(f"refusing to label round {final_round} final: the highest complete round on "
                              f"disk is {last}. A run that stopped early has no final round; omit final_round")
        self.path.mkdir(parents=True, exist_ok=True)
        body = {**summary, "final_round": final_round, "last_complete_round": last, "written_at": _utc_now()}
        _write_atomic(self.summary_path, json.dumps(body, default=_json_default, indent=1) + "\n")
        return self.summary_path


def round_of(weights_dir: Path) -> tuple[RunDir, int, str] | None:
    """(run dir, round, member) when `weights_dir` is `<run>/rounds/round-NNNN/<member>`, else None."""
    p = Path(weights_dir).expanduser().resolve()
    m = _ROUND_DIR.match(p.parent.name)
    if m is None or p.parent.parent.name != "rounds":
        return None
    return RunDir(p.parent.parent.parent), int(m.group(1)), p.name


def sibling_member(weights_dir: Path, member: str) -> Path | None:
    """The `member` weights of the same complete round as `weights_dir` (e.g. the critic beside an
    aggregated actor); None when `weights_dir` is no round member of a run dir, or its round
    recorded no such member. A member of a round that never completed is refused: its weights
    may be a dead attempt's."""
    found = round_of(weights_dir)
    if found is None:
        return None
    rd, r, _ = found
    recorded = rd.recorded_members(r)
    if recorded is None:
        raise RunDirError(f"{weights_dir} belongs to round {r} of {rd.path}, which never completed (no readable "
                          f"{MARKER} marker); start from a complete round (see {rd.metrics_path})")
    return rd.member_dir(r, member) if member in recorded else None
