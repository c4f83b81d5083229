"""Inline weights in a Flower message as one array, not one per tensor.

Flower sends a message as a head and its objects: an ArrayRecord of a state dict is one object
for the record and two per tensor (the Array and its chunk), and every object is one request at
every hop (the ServerApp pushes to the SuperLink, the SuperNode pulls from it, its ClientApp pulls
from the node, and the reply goes back the same way), two at a time. The default tiny model's 26
tensors made 53 objects a message, ~0.3 s a hop on a 2-core box (docs/benchmarks.md). `pack`
puts a state in one Array (the state's safetensors bytes: names, dtypes, shapes and the exact
bytes of every tensor), 3 objects whatever the tensor count; `unpack` gives back the same state,
bit for bit. Both sides of every message (server_app, client_app) use them, in simulation too.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from safetensors.torch import load, save

PACKED = "safetensors"  # the one Array of a packed ArrayRecord
ORDER = "order"  # its metadata entry: the state's names in order


class NotPacked(ValueError):
    """An ArrayRecord that `pack` did not write (another app's message, or an older one)."""


def pack(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """`state` as an ArrayRecord of one uint8 Array (empty for an empty state); the names'
    order rides in the safetensors metadata (safetensors sorts them)."""
    if not state:
        return ArrayRecord()
    blob = save(dict(state), metadata={ORDER: json.dumps(list(state))})
    return ArrayRecord({PACKED: Array(np.frombuffer(blob, dtype=np.uint8))})


def unpack(record: ArrayRecord | None) -> dict[str, torch.Tensor]:
    """The state `pack` put in `record` ({} for none or an empty record)."""
    if record is None or not record:
        return {}
    if list(record) != [PACKED]:
        raise NotPacked(
            f"inline weights arrived as the arrays {sorted(record)[:4]}..., not as this app's one "
            f"{PACKED!r} array: the message comes from other code than this run's app"
        )
    blob = record[PACKED].numpy().tobytes()
    (header_len,) = struct.unpack("<Q", blob[:8])  # safetensors: u64 header length, JSON header
    order = json.loads(json.loads(blob[8 : 8 + header_len])["__metadata__"][ORDER])
    tensors = load(blob)
    return {name: tensors[name] for name in order}
