"""metrics.jsonl rows for the tests of the accounting and the report."""

from __future__ import annotations


def old_row(rnd: int, **over: object) -> dict:
    """A round row as fedagent-flower wrote it before the accounting keys (per_client,
    bytes_down/up, phase_s): readers must still get phases and bytes from it."""
    return {
        "round": rnd,
        "wall_s": 10.0,
        "aggregate_s": 1.0,
        "fits_rollout_update_s": 6.0,
        "fits_load_s": 0.5,
        "fits_export_s": 0.5,
        "fits_total_s": 7.5,
        "val_success": 0.25,
        "bytes_moved": 4000,
        **over,
    }
