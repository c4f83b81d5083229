"""TensorBoard event files of a run's metrics rows (`run.tensorboard`), written as rows are.

tensorboardX writes them: pure Python on protobuf (which Flower already needs), so a plain
install gets it; torch.utils.tensorboard would need the whole tensorboard package. On a resume
the writer opens a new event file beside the old ones; TensorBoard reads them as one run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

# nested row keys mirrored per entry (per_client is left to metrics.jsonl: a scalar per client
# id and metric would make hundreds of tags in a 100-client run)
NESTED = ("phase_s", "bytes_down", "bytes_up")


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The tags and values of one row: its numbers, and each entry of the `NESTED` dicts."""
    out = {k: float(v) for k, v in row.items() if isinstance(v, int | float) and k != "round"}
    for key in NESTED:
        for name, v in (row.get(key) or {}).items():
            out[f"{key}/{name}"] = float(v)
    return out


class Board:
    """One run's TensorBoard writer, under `<run dir>/tb`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "tb"
        self.writer = SummaryWriter(logdir=str(self.path), flush_secs=3600)

    def add_row(self, rnd: int, row: Mapping[str, Any]) -> None:
        """Every scalar of round `rnd`'s row, flushed: a viewer sees the round once it is sealed."""
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=rnd)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
