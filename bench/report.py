"""How a bench ends: its report as indented JSON on stdout, and in `--json PATH` when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], json_path: Path | None) -> int:
    """Print (and write) the report; the bench's exit code."""
    text = json.dumps(report, indent=1)
    if json_path:
        json_path.write_text(text)
    print(text)
    return 0
