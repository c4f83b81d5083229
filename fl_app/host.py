"""What this process may use of its machine."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one (`taskset`,
    a cpuset), else the machine's count. A CPU-time quota (`docker --cpus`) does not show here."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
