"""Is a run complete? For scripts and CI: `flwr run` exits 0 even when the run failed.

    python -m server_app.status runs/<name>                  # one line; the exit code says it
    python -m server_app.status runs/<name> --wait 3600      # block until it ends (or time out)
    python -m server_app.status runs/<name> --json           # outcome, exit code, line, summary

Exit codes (one line of output each, never a traceback):

    0  complete: summary.json says so, its final round is the highest complete round on disk,
       no round below it is missing or incomplete, and every shard of the final round's members
       and server optimizer state matches its manifest's digest (read in full: the one expensive
       check, done only here)
    1  failed: the one-line error and where the full log is
    2  running (its ServerApp is alive: server_app.liveness), or not started (no summary.json
       and no heartbeat.json yet)
    3  not a run dir (no such directory), or a bad command line
    4  dead: the summary says running (or there is none) but its ServerApp is gone (killed, its
       host lost, or it stopped without writing a final summary); rerun the same `flwr run`
       command with the same run-dir to resume after the last complete round
    5  corrupt or unreadable: summary.json or heartbeat.json cannot be read as what they must
       be, or the run dir does not hold what a complete summary claims (a round missing below
       the final one, a final round that is not the last on disk, a shard that fails its digest)

A live ServerApp outranks its summary: while its heartbeat is alive the run is running (a
resumed run's old summary may still say failed or complete until the new one is written).
`--wait` returns on 0, 1, 4 and 5; on 2 and 3 it polls (a run dir may not exist yet).
Only a `complete` summary costs a read of the final checkpoint; the other outcomes read
summary.json, heartbeat.json, the round markers and manifests, which keeps a poll loop cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fl_app.rundir import RunDir, RunDirError
from fl_app.weights import WeightsError
from server_app.errors import printable
from server_app.liveness import Beat, Liveness, check

COMPLETE, FAILED, UNFINISHED, NOT_A_RUN_DIR, DEAD, CORRUPT = 0, 1, 2, 3, 4, 5
OUTCOMES = {
    COMPLETE: "complete",
    FAILED: "failed",
    UNFINISHED: "running",
    NOT_A_RUN_DIR: "not-a-run-dir",
    DEAD: "dead",
    CORRUPT: "corrupt",
}
MAX_FILE_BYTES = 64 * 2**20  # summary.json holds the config and a node table: kilobytes
RESUME = "resume: rerun the same `flwr run` command with the same run-dir"
# what reading a run dir can raise (PathEscapeError and pydantic's errors are ValueErrors)
_DISK = (RunDirError, WeightsError, OSError, ValueError, RecursionError)

Status = tuple[int, str, dict[str, Any]]


class Summary(BaseModel):
    """The fields of summary.json this check reads, typed (any other shape is unreadable)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    status: str
    target_rounds: int | None = None
    final_round: int | None = None
    error: str = "(no error recorded)"
    error_log: str = "none"
    members: list[str] = Field(default=["actor"], min_length=1)


class Unreadable(Exception):
    """summary.json or heartbeat.json is not what the ServerApp writes; the message says why."""


def _read_json(path: Path) -> Any:
    """The JSON in `path` (None when there is no such file)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Unreadable(f"{path}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise Unreadable(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Unreadable(f"{path}: not JSON ({type(e).__name__}: {e})") from None


def _parse(model: type[BaseModel], raw: Any, path: Path) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the document"
        raise Unreadable(f"{path}: {where}: {first['msg']} (got {str(first['input'])[:80]!r})") from None


def _read(rd: RunDir) -> tuple[dict[str, Any] | None, Summary | None, Beat | None]:
    """(raw summary, summary, heartbeat) as one consistent view: the heartbeat is read before and
    after the summary and must name the same server in the same state (a server that ends
    writes its final summary before its last beat; a new one beats before it rewrites the summary)."""
    for _ in range(3):
        before = _parse_beat(rd)
        raw = _read_json(rd.summary_path)
        after = _parse_beat(rd)
        if _same(before, after):
            break
    summary = None if raw is None else _parse(Summary, raw, rd.summary_path)
    return raw, summary, after


def _parse_beat(rd: RunDir) -> Beat | None:
    raw = _read_json(rd.heartbeat_path)
    return None if raw is None else _parse(Beat, raw, rd.heartbeat_path)


def _same(a: Beat | None, b: Beat | None) -> bool:
    key = lambda x: None if x is None else (x.pid, x.start_ticks, x.proc_ns, x.host, x.stopped_at)  # noqa: E731
    return key(a) == key(b)


def run_status(run_dir: Path) -> Status:
    """(exit code, one line for a human, the summary) of the run in `run_dir`."""
    code, line, summary = _status(Path(run_dir))
    return code, printable(line), summary


def _status(run_dir: Path) -> Status:
    if not run_dir.is_dir():
        return NOT_A_RUN_DIR, f"{run_dir}: no such run dir", {}
    try:
        raw, summary, beat = _read(RunDir(run_dir))
        members = summary.members if summary is not None else ("actor",)
        rd = RunDir(run_dir, members=members)
    except Unreadable as e:
        return CORRUPT, f"unreadable: {e}", {}
    except _DISK as e:  # e.g. summary.json a symlink out of the run dir, a bad member name
        return CORRUPT, f"{run_dir}: unreadable ({type(e).__name__}: {e})", {}
    raw = raw if isinstance(raw, dict) else {}
    try:
        life = check(beat) if beat is not None else None
        if life is not None and life.alive:
            return UNFINISHED, f"{run_dir}: running ({life.why}), {_progress(rd, summary)}", raw
        if summary is None:
            return _no_summary(run_dir, beat, life)
        if summary.status == "complete":
            code, line = _complete(rd, summary)
            return code, line, raw
        if summary.status == "failed":
            line = f"failed after round {_last(rd)}: {summary.error} (full log: {summary.error_log})"
            return FAILED, f"{run_dir}: {line}", raw
        if summary.status == "running":
            why = life.why if life else "there is no heartbeat.json (no ServerApp vouches for it)"
            return DEAD, f"{run_dir}: dead after round {_last(rd)}: the summary says running but {why}; {RESUME}", raw
        return CORRUPT, f"{rd.summary_path}: unknown status {summary.status!r}", raw
    except _DISK as e:
        return CORRUPT, f"{run_dir}: unreadable rounds ({type(e).__name__}: {e})", raw


def _no_summary(run_dir: Path, beat: Beat | None, life: Liveness | None) -> Status:
    if beat is None or life is None:
        return UNFINISHED, f"{run_dir}: no summary.json yet (not started)", {}
    return (
        DEAD,
        (
            f"{run_dir}: dead before it started: {life.why} without writing summary.json (it refused "
            f"to start: `flwr log {beat.run_id}` says why); {RESUME}"
        ),
        {},
    )


def _last(rd: RunDir) -> str:
    last = rd.last_complete_round()
    return "none" if last is None else str(last)


def _progress(rd: RunDir, summary: Summary | None) -> str:
    target = summary.target_rounds if summary and summary.target_rounds is not None else "?"
    return f"{_last(rd)} of {target} rounds done"


def _complete(rd: RunDir, summary: Summary) -> tuple[int, str]:
    """COMPLETE only when the disk holds what the summary claims, verified as resume would."""
    final = summary.final_round
    complete = rd.complete_rounds()
    on_disk = max(complete) if complete else None
    if final is None or final != on_disk:
        return CORRUPT, (
            f"{rd.path}: summary.json says complete at round {final}, but the highest complete round on disk "
            f"is {on_disk}: the run dir changed after it was written"
        )
    missing = rd.gaps(complete)
    if missing:
        first = rd.round_dir(missing[0])
        what = f"{first / 'COMPLETE'} is missing or invalid" if first.is_dir() else f"{first} is missing"
        return CORRUPT, (
            f"{rd.path}: complete at round {final}, but round(s) {missing} below it are missing or incomplete "
            f"({what}): rounds were moved or deleted after the run"
        )
    try:
        rd.verify_round(final)
    except WeightsError as e:
        return CORRUPT, (
            f"{rd.path}: complete at round {final}, but its checkpoint fails verification: {e}; {RESUME} "
            f"(resume moves round {final} aside and redoes it)"
        )
    return COMPLETE, f"{rd.path}: complete, {final} rounds (round {final} verified)"


def wait_for(run_dir: Path, timeout_s: float, poll_s: float = 2.0) -> Status:
    """run_status once the run has an outcome (complete, failed, dead, corrupt), or at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, line, summary = run_status(run_dir)
        if code in (COMPLETE, FAILED, DEAD, CORRUPT) or time.monotonic() >= deadline:
            return code, line, summary
        time.sleep(poll_s)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own exit code 2 means "running" here
        print(printable(f"{self.prog}: {message} (usage: {self.format_usage().strip()})"))
        sys.exit(NOT_A_RUN_DIR)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="server_app.status", description="Exit 0 only when the run in RUN_DIR is complete (module doc).")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for a running (or not yet started) run to end",
    )
    ap.add_argument("--json", action="store_true", help="print {outcome, exit_code, line, summary} as JSON")
    args = ap.parse_args(argv)
    code, line, summary = wait_for(args.run_dir, args.wait) if args.wait > 0 else run_status(args.run_dir)
    if args.json:
        print(json.dumps({"outcome": OUTCOMES[code], "exit_code": code, "line": line, "summary": summary}, indent=1))
    else:
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
