"""What holds memory when a persistent trainer grows (invariant 24's debug aid).

`FEDAGENT_MEMORY_DEBUG=1` in a lane service's environment makes it take a census of every live
torch tensor after each fit, at the same phase point as its memory readings (after export), and
log what grew since the previous fit: tensors grouped by (device, dtype, shape), how many more
there are and how many bytes they hold, and who holds one of them (the types of its referrers,
and for a dict or object referrer the attribute or key that holds it). The field log's reload
leaks were each one retired weight copy, optimizer state or anchor kept alive by a reference:
exactly what a group of +N tensors shaped like the model's parameters, held by a named owner,
shows. Off by default: the census walks every object the garbage collector tracks.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

ENV_VAR = "FEDAGENT_MEMORY_DEBUG"
Key = tuple[str, str, tuple[int, ...]]


@dataclass(slots=True)
class Group:
    """One (device, dtype, shape) group of a census: tensor ids, and bytes of distinct storages."""

    ids: set[int]
    bytes: int


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "0") not in ("", "0")


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """Hand frozen objects back to the collector for the block, then freeze again. A lane
    freezes what survives each fit (`client_app.trainer.device.freeze_survivors`), which hides
    it from `gc.get_objects` and `gc.get_referrers`: a census must see it."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()


def tensor_census() -> dict[Key, list[torch.Tensor]]:
    """Every live tensor the garbage collector tracks (parameters included), grouped."""
    groups: dict[Key, list[torch.Tensor]] = {}
    with warnings.catch_warnings():  # isinstance() on torch's deprecated lazy aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in objects:
        groups.setdefault((str(obj.device), str(obj.dtype).removeprefix("torch."), tuple(obj.shape)), []).append(obj)
    return groups


def _is_tensor(obj: object) -> bool:
    """A tensor that holds memory: not a meta tensor, nor one of torch.compile's fake tensors
    (their symbolic shapes cannot key a census, and they own no storage)."""
    try:
        return (
            isinstance(obj, torch.Tensor)
            and not obj.is_meta
            and not isinstance(obj, FakeTensor)
            and all(isinstance(n, int) for n in obj.shape)
        )
    except ReferenceError:  # a dead weakref proxy
        return False


def _summary(members: list[torch.Tensor]) -> Group:
    storages = {}
    for t in members:
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no real storage (sparse, functional wrappers,
            continue  # a released FSDP shard's invalid storage)
        if ptr:
            storages[ptr] = storage.nbytes()
    return Group({id(t) for t in members}, sum(storages.values()))


def holders(tensor: torch.Tensor, census: dict[Key, list[torch.Tensor]], limit: int = 3) -> list[str]:
    """Who refers to `tensor` (the census's own lists and this lookup's frames left out): the
    referrer's type, with the key of a dict or the attribute of an object that holds it."""
    skip = {id(members) for members in census.values()}
    out = []
    for ref in gc.get_referrers(tensor):
        if isinstance(ref, types.FrameType) or id(ref) in skip:
            continue
        # plain loops: a comprehension over `tensor` would make it a closure cell, a referrer itself
        items = ref.items() if isinstance(ref, dict) else vars(ref).items() if hasattr(ref, "__dict__") else ()
        label = type(ref).__name__
        for k, v in items:
            if v is tensor:
                label += f"[{str(k)!r}]" if isinstance(ref, dict) else f".{k}"
                break
        out.append(label)
        if len(out) == limit:
            break
    return out


class MemoryGrowthReport:
    """Census after each fit; `report` names the groups that grew since the previous one."""

    def __init__(self, top: int = 8) -> None:
        self.top = top
        self.previous: dict[Key, Group] | None = None

    def report(self) -> list[str] | None:
        """Lines for the groups that grew (most bytes first); None on the first call (the baseline)."""
        with thawed():
            return self._report()

    def _report(self) -> list[str] | None:
        gc.collect()
        now = tensor_census()
        summaries = {k: _summary(v) for k, v in now.items()}
        previous, self.previous = self.previous, summaries
        if previous is None:
            return None
        grown = []
        for key, g in summaries.items():
            before = previous.get(key, Group(set(), 0))
            if len(g.ids) > len(before.ids) or g.bytes > before.bytes:
                grown.append((g.bytes - before.bytes, len(g.ids) - len(before.ids), key, g, before))
        grown.sort(key=lambda x: (-x[0], -x[1]))
        lines = []
        for dbytes, dcount, key, g, before in grown[: self.top]:
            new = now[key][-1]
            for t in now[key]:
                if id(t) not in before.ids:
                    new = t
                    break
            held = ", ".join(holders(new, now)) or "no tracked referrer"
            device, dtype, shape = key
            lines.append(
                f"+{dcount} x {dtype} {list(shape)} on {device} (+{dbytes / 2**20:.1f} MB; now "
                f"{len(g.ids)} tensors, {g.bytes / 2**20:.1f} MB), a new one held by: {held}"
            )
        return lines


def log_growth(reporter: MemoryGrowthReport, log: logging.Logger, label: str) -> None:
    lines = reporter.report()
    if lines is None:
        log.info("memory debug (%s): tensor census taken; growth is reported from the next fit on", label)
    elif lines:
        log.warning("memory debug (%s): tensors that grew since the previous fit:\n  %s", label, "\n  ".join(lines))
    else:
        log.info("memory debug (%s): no tensor group grew since the previous fit", label)
