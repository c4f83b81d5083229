"""Is a run complete? For scripts and CI: `flwr run` exits 0 even when the run failed.

    python -m server_app.status runs/<name>                  # one line; exit code says it
    python -m server_app.status runs/<name> --wait 3600      # block until it ends (or time out)
    python -m server_app.status runs/<name> --json           # the summary, machine-readable

Exit codes: 0 complete (summary.json says so and its final round is the highest complete round
on disk), 1 failed (the one-line error and where the full log is are printed), 2 not finished
(running, or no summary yet: the run was refused before it started, see `flwr log <run-id>`),
3 not a run dir or an unreadable summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fl_app.rundir import RunDir, RunDirError

COMPLETE, FAILED, UNFINISHED, UNKNOWN = 0, 1, 2, 3


def run_status(run_dir: Path) -> tuple[int, str, dict[str, Any]]:
    """(exit code, one line for a human, the summary) of the run in `run_dir`."""
    if not run_dir.is_dir():
        return UNKNOWN, f"{run_dir}: no such run dir", {}
    path = run_dir / "summary.json"
    if not path.exists():
        return UNFINISHED, f"{run_dir}: no summary.json yet (not started, or refused before it started)", {}
    try:
        summary = json.loads(path.read_text())
        status = summary["status"]
    except (ValueError, KeyError, TypeError) as e:
        return UNKNOWN, f"{path}: unreadable summary ({type(e).__name__}: {e})", {}
    try:
        on_disk = RunDir(run_dir).last_complete_round()
    except (RunDirError, OSError, ValueError) as e:
        return UNKNOWN, f"{run_dir}: unreadable rounds ({type(e).__name__}: {e})", summary
    if status == "complete":
        final = summary.get("final_round")
        if final is None or final != on_disk:
            return (
                UNKNOWN,
                (
                    f"{run_dir}: summary.json says complete at round {final}, but the highest complete "
                    f"round on disk is {on_disk}: the run dir changed after it was written"
                ),
                summary,
            )
        return COMPLETE, f"{run_dir}: complete, {final} rounds", summary
    if status == "failed":
        return (
            FAILED,
            (
                f"{run_dir}: failed after round {on_disk}: {summary.get('error', '(no error recorded)')} "
                f"(full log: {summary.get('error_log', 'none')})"
            ),
            summary,
        )
    if status == "running":
        target = summary.get("target_rounds", "?")
        return (
            UNFINISHED,
            f"{run_dir}: running, {on_disk if on_disk is not None else 'no'} of {target} rounds done",
            summary,
        )
    return UNKNOWN, f"{path}: unknown status {status!r}", summary


def wait_for(run_dir: Path, timeout_s: float, poll_s: float = 2.0) -> tuple[int, str, dict[str, Any]]:
    """run_status once the run has ended (complete or failed), or when `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        code, line, summary = run_status(run_dir)
        if code in (COMPLETE, FAILED) or time.monotonic() >= deadline:
            return code, line, summary
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Exit 0 only when the run in RUN_DIR is complete (see module doc).")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for a running (or not yet started) run to end",
    )
    ap.add_argument("--json", action="store_true", help="print {status, exit_code, line, summary} as JSON")
    args = ap.parse_args(argv)
    code, line, summary = wait_for(args.run_dir, args.wait) if args.wait > 0 else run_status(args.run_dir)
    if args.json:
        print(json.dumps({"exit_code": code, "line": line, "summary": summary}, indent=1))
    else:
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
