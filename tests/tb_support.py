"""Read TensorBoard event files back (what fl_app.board writes), for the tests."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2


def events(tb: Path) -> dict[tuple[str, int], float]:
    """Every scalar in the TFRecord event files under `tb` (length, crc, event, crc per record)."""
    out = {}
    for f in sorted(tb.glob("events.out.tfevents.*")):
        data, at = f.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            ev = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            for v in ev.summary.value:
                out[(v.tag, ev.step)] = v.simple_value
    return out
