"""Errors as a user reads them: one clean line naming the root cause.

A failed client reaches the server as Flower's error reason, which wraps the ClientApp's
exception as `<class 'pkg.mod.Type'>:<'message'>`, or in simulation, when the Ray actor died,
as hundreds of lines of Ray traceback with ANSI colour codes. summary.json and the round's
metrics row get `one_line(...)` of it; the full text goes to the run's log
(`logs/server-error.log`), which the summary points at.
"""

from __future__ import annotations

import re

MAX_CHARS = 600
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_FLOWER_REASON = re.compile(r"<class '([^']+)'>:<'(.*)'>", re.S)
# Python's separators between chained exceptions: the root cause comes first
_CHAINED = re.compile(
    r"The above exception was the direct cause of the following exception:|"
    r"During handling of the above exception, another exception occurred:"
)
# a line that names an exception: `SomeError: message` (optionally module-qualified)
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt)\b(?:\([\w.]*\))?(?::|\s|$)")
_FLOWER_PREFIX = re.compile(r"^Exception \w+ occurred\. Message:\s*")
_CLIENTAPP_RAISED = re.compile(r"Exception ClientAppException occurred\. Message:[ \t]*")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def printable(text: str) -> str:
    """`text` as one printable line: ANSI codes go, control characters and line breaks become spaces."""
    return " ".join("".join(ch if ch.isprintable() else " " for ch in strip_ansi(text)).split())


def one_line(text: str) -> str:
    """The root cause of an error text as one line (<= MAX_CHARS).

    ANSI codes are stripped and Flower's wrappers removed (`<class '...'>:<'...'>`, and in
    simulation everything before `Exception ClientAppException occurred. Message:`, which is
    followed by what the ClientApp raised); of a chain of tracebacks the first (the root cause)
    is kept, and of it the last line that names an exception, else its first line."""
    text = strip_ansi(text).strip()
    m = _FLOWER_REASON.fullmatch(text)
    if m:
        text = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}".strip()
    raised = _CLIENTAPP_RAISED.search(text)
    if raised:  # Flower's wrapper of what the ClientApp itself raised: that is the cause
        text = text[raised.end() :].strip()
    root = _CHAINED.split(text)[0]
    lines = [ln.strip() for ln in root.splitlines() if ln.strip()]
    if not lines:
        return "unknown error (no message)"
    if len(lines) > 1:
        named = [ln for ln in lines if _EXC_LINE.match(ln) and not ln.startswith("Traceback")]
        line = named[-1] if named else lines[0]
    else:
        line = lines[0]
    line = " ".join(_FLOWER_PREFIX.sub("", line).split())
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."
