"""The run directory: checkpoints, round markers, metrics, summary; resume keyed on the disk.

    runs/<name>/
      config.yaml                      resolved config (fl_app.config.save_config)
      rounds/round-0000/actor/         round 0 = the initial model (fp32 shards + manifest)
      rounds/round-0003/actor/         the global model after round 3 = the checkpoint
      rounds/round-0003/critic/        PPO: the aggregated critic beside it (invariant 7)
      rounds/round-0003/server_opt/fedadam/actor/m/   a server optimizer's moments after round 3
                                       (fl_app.server_opt; none for sgd, none in round 0)
      rounds/round-0003/mean/actor/    the clients' mean before the server optimizer's step (scratch)
      rounds/round-0003/server_opt/downlink/actor/step/   federation.update delta-*: the quantized
                                       step from round 2's global model, and beside it the server's
                                       residual (`residual`) (fl_app.downlink; none in round 0)
      rounds/round-0003/exact/actor/   the exact model before that step is quantized (scratch)
      rounds/round-0003/clients/client-0007/actor/   client uploads of round 3 (scratch)
      rounds/round-0003/COMPLETE       written last: {"round", "time", "metrics", "members"}
      metrics.jsonl                    one line per complete round
      summary.json
      heartbeat.json                   the ServerApp's liveness while it runs (server_app.liveness)

A round is complete only when its COMPLETE marker exists and every required member (`actor`,
and `critic` for PPO) still holds the exact weights the marker recorded; so does every server
optimizer state entry the marker records (`"server_opt"`), and a RunDir told the run's entries
(`opt_state`) requires exactly those in every round after 0: state is part of the round, so a
resume continues from the resumed round's moments, and a round without them is refused. Resume (invariant 6,
field-log "find_resume_round", "fabricated round T", "RESUME could FedAvg a dead attempt's
checkpoint") scans the round dirs on disk instead of counting up to the configured total,
refuses a dir that holds rounds beyond that total or a gap below its last complete round,
reads every shard of the round it resumes from against its digests (a corrupt one is renamed
aside and the round before it is tried), and renames every incomplete round dir aside (never
deletes it), so a re-run round starts from an empty dir and cannot pick up a dead attempt's
uploads. Every path below the run dir goes through `fl_app.paths.confine`: a round or client
dir that is a symlink out of the run dir is neither read nor written through.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_app.paths import confine
from fl_app.weights import Manifest, WeightsError, verify_shards

log = logging.getLogger("fedagent.rundir")

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
    tmp.unlink(missing_ok=True)  # a dead write's leftover (or a planted link: unlink does not follow it)
    with open(tmp, "x") as f:  # O_CREAT | O_EXCL: never opens through a symlink
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RunDir:
    """One run's directory. `total_rounds` is the configured T (needed to resume); `members`
    are the weights every complete round must hold."""

    def __init__(
        self,
        path: Path,
        total_rounds: int | None = None,
        members: Sequence[str] = ("actor",),
        opt_state: Sequence[str] | None = None,
    ):
        if not members:
            raise RunDirError("a round needs at least one required member, e.g. ('actor',)")
        self.path = Path(path)
        self.total_rounds = total_rounds
        self.members = tuple(members)
        # the server optimizer's state entries every round after 0 holds (None: not known here, so
        # whatever a marker records is checked, and nothing more is required)
        self.opt_state = None if opt_state is None else tuple(opt_state)
        self.moved_aside: list[tuple[Path, str]] = []  # (where, why) for rounds prepare_resume set aside

    # ---- layout -------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self._inside(self.path / "metrics.jsonl", "metrics file")

    @property
    def summary_path(self) -> Path:
        return self._inside(self.path / "summary.json", "summary file")

    @property
    def heartbeat_path(self) -> Path:
        return self._inside(self.path / "heartbeat.json", "heartbeat file")

    @property
    def rounds_dir(self) -> Path:
        return self.path / "rounds"

    def _inside(self, path: Path, what: str) -> Path:
        """`path` (below self.path), after checking it resolves inside the run dir."""
        confine(path, self.path, what=what)
        return path

    def round_dir(self, r: int) -> Path:
        if r < 0:
            raise RunDirError(f"round must be >= 0 (got {r})")
        return self._inside(self.rounds_dir / f"round-{r:04d}", f"round {r} dir")

    def member_dir(self, r: int, member: str = "actor") -> Path:
        """Where the global `member` weights of round r live (a weights dir)."""
        if not _CLIENT_ID.match(member):
            raise RunDirError(f"bad member name {member!r}: use letters, digits, '.', '_', '-'")
        return self._inside(self.round_dir(r) / member, f"round {r} {member} dir")

    def opt_state_dir(self, r: int, entry: str) -> Path:
        """Where server optimizer state `entry` (`<optimizer>/<member>/<moment>`) of round r lives."""
        parts = entry.split("/")
        if len(parts) != 3 or not all(_CLIENT_ID.match(p) for p in parts):
            raise RunDirError(f"bad server optimizer state entry {entry!r}: use <optimizer>/<member>/<moment>")
        return self._inside(self.round_dir(r) / "server_opt" / entry, f"round {r} server optimizer state")

    def mean_dir(self, r: int, member: str) -> Path:
        """Scratch for the clients' mean of `member` in round r, before the server optimizer's step."""
        if not _CLIENT_ID.match(member):
            raise RunDirError(f"bad member name {member!r}: use letters, digits, '.', '_', '-'")
        return self._inside(self.round_dir(r) / "mean" / member, f"round {r} {member} mean dir")

    def exact_dir(self, r: int, member: str) -> Path:
        """Scratch for the exact new `member` of round r, before a compressed download quantizes the step to it."""
        if not _CLIENT_ID.match(member):
            raise RunDirError(f"bad member name {member!r}: use letters, digits, '.', '_', '-'")
        return self._inside(self.round_dir(r) / "exact" / member, f"round {r} {member} exact dir")

    def client_dir(self, r: int, client_id: int | str) -> Path:
        """Scratch space for one client's uploads in round r (members go in subdirs)."""
        cid = f"{client_id:04d}" if isinstance(client_id, int) else str(client_id)
        if not _CLIENT_ID.match(cid):
            raise RunDirError(f"bad client id {client_id!r}: use an int or letters, digits, '.', '_', '-'")
        return self._inside(self.round_dir(r) / "clients" / f"client-{cid}", f"round {r} client dir")

    def scratch_dir(self, kind: str, r: int) -> Path:
        """Scratch space of a call that is not a fit (`init`, `evaluate`) in round r; an init
        call's export is uploaded from here, so its store key is fixed by this layout too."""
        if not _CLIENT_ID.match(kind):
            raise RunDirError(f"bad call kind {kind!r}: use letters, digits, '.', '_', '-'")
        return self._inside(self.path / "scratch" / f"{kind}-{r:04d}", f"{kind} scratch dir")

    def store_key(self, path: Path) -> str:
        """The weight-store key of a path inside this run dir (for a DirStore rooted here)."""
        return path.relative_to(self.path).as_posix()

    # ---- state on disk ------------------------------------------------------------------
    def rounds_on_disk(self) -> list[int]:
        """Every round-NNNN dir, complete or not, ascending (renamed-aside dirs do not match)."""
        if not self.rounds_dir.is_dir():
            return []
        return sorted(
            int(m.group(1)) for p in self.rounds_dir.iterdir() if p.is_dir() and (m := _ROUND_DIR.match(p.name))
        )

    def marker(self, r: int) -> dict[str, str] | None:
        """member -> manifest sha256 as round r's COMPLETE marker records them (None: no marker).
        A marker that cannot be read or has the wrong shape is a RunDirError naming it."""
        found = self._read_marker(r)
        return None if found is None else found[0]

    def _read_marker(self, r: int) -> tuple[dict[str, str], dict[str, str]] | None:
        """(member -> manifest sha256, server optimizer state entry -> manifest sha256) as round
        r's COMPLETE marker records them; None: no marker."""
        path = self.round_dir(r) / MARKER
        if not path.is_file():
            return None
        fix = (
            f"the marker was damaged after the round completed: move {self.round_dir(r)} aside "
            f"(e.g. `mv {self.round_dir(r)} {self.round_dir(r)}.damaged`) to redo that round, or use a new run dir"
        )
        try:
            body = json.loads(path.read_text())
            digests = {m: d["manifest_sha256"] for m, d in body["members"].items()}
            state = {e: d["manifest_sha256"] for e, d in body.get("server_opt", {}).items()}
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise RunDirError(f"{path} is not a valid {MARKER} marker ({type(e).__name__}: {e}); {fix}") from None
        if not all(isinstance(m, str) and isinstance(d, str) for m, d in [*digests.items(), *state.items()]):
            raise RunDirError(f"{path}: members must map names to {{'manifest_sha256': <hex>}}; {fix}")
        return digests, state

    def _round_state(self, r: int) -> tuple[str, str]:
        """('complete' | 'partial' | 'broken', why). Broken = a marker whose members or server
        optimizer state do not match, or whose state is not the run's (`opt_state`)."""
        try:
            found = self._read_marker(r)
        except RunDirError as e:
            return "broken", str(e)
        if found is None:
            return "partial", "no COMPLETE marker"
        recorded, state = found
        for m in self.members:
            if m not in recorded:
                return "broken", f"completed without required member {m!r} (has {sorted(recorded)})"
        if self.opt_state is not None and r > 0 and set(state) != set(self.opt_state):
            return "broken", (
                f"holds server optimizer state {sorted(state) or 'none (server_optimizer sgd)'}, and this run's "
                f"federation.server_optimizer (and federation.update delta-*: its step and residual) needs "
                f"{list(self.opt_state) or 'none (sgd)'}: resume with the server_optimizer and update the run "
                "was started with, or use a new run dir"
            )
        dirs = [(f"member {m!r}", self.member_dir(r, m), recorded[m]) for m in self.members]
        try:
            dirs += [(f"server optimizer state {e!r}", self.opt_state_dir(r, e), d) for e, d in sorted(state.items())]
        except RunDirError as e:
            return "broken", str(e)
        for what, path, want in dirs:
            try:
                digest = Manifest.from_dir(path).sha256
            except (WeightsError, RunDirError) as e:
                return "broken", f"{what}: {e}"
            if digest != want:
                return "broken", f"{what} was replaced after the round completed"
        return "complete", ""

    def recorded_members(self, r: int) -> list[str] | None:
        """The members round r's COMPLETE marker records (None: no marker)."""
        recorded = self.marker(r)
        return None if recorded is None else sorted(recorded)

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
                "if you mean to redo them"
            )

    def _move_aside(self, r: int, why: str) -> Path:
        """Rename round r's dir to `round-NNNN.<why>-<utc time>` (never deleted)."""
        src = self.round_dir(r)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dst = src.with_name(f"{src.name}.{why}-{stamp}")
        n = 1
        while dst.exists():
            dst = src.with_name(f"{src.name}.{why}-{stamp}-{n}")
            n += 1
        src.rename(dst)
        return dst

    def quarantine_partials(self) -> list[Path]:
        """Rename every round dir without a COMPLETE marker to `round-NNNN.partial-<utc time>`."""
        return [self._move_aside(r, "partial") for r in self.rounds_on_disk() if self._round_state(r)[0] == "partial"]

    def complete_rounds(self) -> list[int]:
        """Every complete round on disk, ascending; moves nothing. A round whose COMPLETE marker
        does not match its members (broken) is a RunDirError naming it: its weights cannot be trusted."""
        complete = []
        for r in self.rounds_on_disk():
            state, why = self._round_state(r)
            if state == "broken":
                raise RunDirError(
                    f"round {r} in {self.path} has a COMPLETE marker but {why}; this run requires members "
                    f"{list(self.members)}. Use a new run dir, or move {self.round_dir(r)} aside if it is damaged"
                )
            if state == "complete":
                complete.append(r)
        return complete

    @staticmethod
    def gaps(complete: Sequence[int]) -> list[int]:
        """The rounds missing or incomplete below the last complete one (rounds complete in order,
        so a gap means rounds were moved or deleted afterwards)."""
        return sorted(set(range(max(complete))) - set(complete)) if complete else []

    def check_gaps(self, complete: Sequence[int]) -> None:
        """Refuse a gap below the last complete round: resuming would skip the missing rounds."""
        missing = self.gaps(complete)
        if missing:
            first, last = missing[0], max(complete)
            raise RunDirError(
                f"{self.path}: round(s) {missing} are missing or incomplete below the last complete round {last}; "
                "rounds complete in order, so they were moved or deleted afterwards. Refusing to resume (nothing was "
                f"touched). Ways out: (1) put the missing round dirs back into {self.rounds_dir} (a dir renamed aside "
                f"as round-NNNN.partial-* or .corrupt-* can be renamed back if it is complete); (2) to redo the rounds "
                f"from {first} on, move rounds {first}..{last} aside (e.g. `mv {self.round_dir(last)} "
                f"{self.round_dir(last)}.moved`, likewise for each); (3) use a new run dir"
            )

    def verify_round(self, r: int) -> None:
        """Read every shard of round r's required members, and of the server optimizer state its
        marker records, against their manifests' digests; moves nothing. WeightsError names the
        first bad file. Costs a read of the whole checkpoint."""
        found = self._read_marker(r)
        paths = [self.member_dir(r, m) for m in self.members]
        paths += [self.opt_state_dir(r, e) for e in sorted(found[1] if found else {})]
        for path in paths:
            verify_shards(Manifest.from_dir(path))

    def _verified_resume_round(self, last: int | None) -> int | None:
        """The highest complete round whose every shard matches its digests, from `last` down;
        a round that fails is renamed `round-NNNN.corrupt-<utc time>` (its weights cannot be trusted)."""
        while last is not None:
            try:
                self.verify_round(last)
                return last
            except WeightsError as e:
                moved = self._move_aside(last, "corrupt")
                self.moved_aside.append((moved, str(e)))
                log.warning(
                    "round %d is corrupt (%s); moved it to %s and resume from the round before it", last, e, moved
                )
                last = last - 1 if last > 0 else None
        return None

    def read_metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl as dicts; a torn last line (a crash mid-append) is ignored."""
        if not self.metrics_path.exists():
            return []
        lines = self.metrics_path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:
                    break
                raise RunDirError(f"{self.metrics_path}:{i + 1} is not JSON; fix or remove that line") from None
            if not isinstance(row, dict) or not isinstance(row.get("round"), int):
                raise RunDirError(
                    f"{self.metrics_path}:{i + 1} is not a metrics row (a JSON object with an integer "
                    "'round'); fix or remove that line"
                )
            rows.append(row)
        return rows

    def trim_metrics(self) -> None:
        """Rewrite metrics.jsonl to one line per complete round (the last line written for it)."""
        if not self.metrics_path.exists():
            return
        complete = {r for r in self.rounds_on_disk() if self._round_state(r)[0] == "complete"}
        by_round = {row["round"]: row for row in self.read_metrics() if row.get("round") in complete}
        _write_atomic(
            self.metrics_path, "".join(json.dumps(by_round[r], default=_json_default) + "\n" for r in sorted(by_round))
        )

    def prepare_resume(self) -> int | None:
        """Make the disk consistent before the round loop; returns the last complete round.

        Order matters: refuse first (nothing moved: rounds beyond the total, a broken marker, a
        gap), then read the resume round's shards against their digests (moving a corrupt round
        aside and trying the one before), then move partial rounds aside, then drop metrics of
        rounds that are not complete. The loop resumes at the returned round + 1 (at round 0,
        the initial model, when None). `moved_aside` lists what was renamed and why.
        """
        self.check_total()
        complete = self.complete_rounds()
        self.check_gaps(complete)
        last = self._verified_resume_round(max(complete) if complete else None)
        self.moved_aside += [(p, "partial round") for p in self.quarantine_partials()]
        self.trim_metrics()
        return last

    # ---- writing rounds -----------------------------------------------------------------
    def complete_round(self, r: int, metrics: Mapping[str, Any]) -> None:
        """Seal round r: append its metrics line, then write the COMPLETE marker last.

        Rounds complete in order (r = last complete + 1, or 0), and only when every required
        member holds complete weights.
        """
        last = self.last_complete_round()
        expected = 0 if last is None else last + 1
        if r != expected:
            raise RunDirError(
                f"cannot complete round {r}: the last complete round on disk is {last}, so the "
                f"next one is {expected}; call prepare_resume() before the round loop"
            )
        members = {m: self._sealed(r, f"member {m!r}", self.member_dir(r, m)) for m in self.members}
        entries = self.opt_state if self.opt_state and r > 0 else ()
        state = {e: self._sealed(r, f"server optimizer state {e!r}", self.opt_state_dir(r, e)) for e in entries}
        line = json.dumps({"round": r, **metrics}, default=_json_default)
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        _write_atomic(
            self.round_dir(r) / MARKER,
            json.dumps(
                {
                    "round": r,
                    "time": _utc_now(),
                    "metrics": dict(metrics),
                    "members": members,
                    **({"server_opt": state} if state else {}),
                },
                default=_json_default,
                indent=1,
            )
            + "\n",
        )

    @staticmethod
    def _sealed(r: int, what: str, path: Path) -> dict[str, Any]:
        """What a COMPLETE marker records of one weights dir of round r (it must be complete)."""
        try:
            man = Manifest.from_dir(path)
        except WeightsError as e:
            raise RunDirError(f"cannot complete round {r}: {what} has no complete weights ({e})") from None
        return {"manifest_sha256": man.sha256, "total_bytes": man.total_bytes}

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
            raise RunDirError(
                f"refusing to label round {final_round} final: the highest complete round on "
                f"disk is {last}. A run that stopped early has no final round; omit final_round"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        body = {**summary, "final_round": final_round, "last_complete_round": last, "written_at": _utc_now()}
        _write_atomic(self.summary_path, json.dumps(body, default=_json_default, indent=1) + "\n")
        return self.summary_path

    def write_heartbeat(self, beat: Mapping[str, Any]) -> None:
        """Replace heartbeat.json atomically: a reader never sees half a beat."""
        self.path.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.heartbeat_path, json.dumps(dict(beat)) + "\n")


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
        raise RunDirError(
            f"{weights_dir} belongs to round {r} of {rd.path}, which never completed (no readable "
            f"{MARKER} marker); start from a complete round (see {rd.metrics_path})"
        )
    return rd.member_dir(r, member) if member in recorded else None
