"""What an engine's `load_weights` refuses before it copies anything into a live model.

Both engines load the same fp32 weights, exported by either of them and averaged on the server;
one check gives both the same refusals, each naming the problem.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def check_loadable(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], member: str) -> None:
    """What `load_weights` refuses before it copies anything: other names than the model's
    parameters (`shapes`), another shape, anything but fp32 (invariant 1)."""
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise KeyError(
            f"weights do not match the {member} model: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)}); they must come from "
            f"export_weights({member!r}) of the same architecture"
        )
    for name, t in state.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"weight {name}: shape {tuple(t.shape)} != model {shapes[name]}")
        if t.dtype != torch.float32:
            raise TypeError(
                f"weight {name} is {t.dtype}; weights travel as fp32 (invariant 1), never cast them on the way"
            )
