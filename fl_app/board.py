"""TensorBoard event files of a run's metrics rows (`run.tensorboard`), written as rows are.

tensorboardX's record writer writes them: pure Python on the protobuf Flower already needs, so
a plain install gets it (torch.utils.tensorboard would need the whole tensorboard package).
Its synchronous `EventsWriter`, not its `SummaryWriter`: that one queues events through a
multiprocessing queue to a thread and its flush does not wait for them, while a row must be on
disk once its round is sealed, and the ServerApp forks beside it. Each writer opens its own
event file (a resume adds one); TensorBoard reads a dir's files as one run.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary

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
    """One run's TensorBoard event file, under `<run dir>/tb`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "tb"
        self.path.mkdir(parents=True, exist_ok=True)
        # the writer names its file by the second and host: the suffix keeps two writers apart
        self.writer = EventsWriter(str(self.path / "events"), f".{os.getpid()}.{secrets.token_hex(4)}")

    def add_row(self, rnd: int, row: Mapping[str, Any]) -> None:
        """Every scalar of round `rnd`'s row as one event, flushed: a viewer sees the round once it is sealed."""
        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(row).items()]
        self.writer.write_event(Event(wall_time=time.time(), step=rnd, summary=Summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
