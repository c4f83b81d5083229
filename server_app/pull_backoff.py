"""Flower's object pulls wait 1 s before they ask again; on a one-machine message path that wait
is most of a message's overhead (docs/benchmarks.md, the deployment round).

A message travels as a head and its objects (a record, two per array), and each hop hands the
head on before the objects: a SuperNode gives a message's task to its SuperExec before it has
pulled the objects from the SuperLink, and pushes a reply's head before its objects. So the next hop (the
forked ClientApp, the ServerApp pulling replies) asks for an object too early, is told
"unavailable", and Flower's `pull_objects` waits its initial backoff, 1 s (+-20%), doubling up
to 10 s, before it asks again: measured 1.0-1.3 s of most messages at each of those two hops.
`shorten_pull_backoff` sets that first wait (and optionally the cap) of this process's pulls;
the retries, their deadline and what a pull checks stay Flower's.
"""

from __future__ import annotations

from flwr.supercore.inflatable import inflatable_utils

FIRST_WAIT_S = 0.05
# `pull_objects` (a SuperNode, the ServerApp's grid) and `pull_and_inflate_object_from_tree` (a
# ClientApp) take the waits from their own keyword defaults; the latter passes its own on.
PULLS = (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)


class FlowerChanged(RuntimeError):
    """Flower's pulls no longer take the waits set here (flwr is pinned: fix this module)."""


def shorten_pull_backoff(first_wait_s: float = FIRST_WAIT_S, cap_s: float | None = None) -> None:
    """The first retry of this process's object pulls after `first_wait_s`, doubling up to
    `cap_s` (None: Flower's cap)."""
    waits = {"initial_backoff": first_wait_s, **({} if cap_s is None else {"backoff_cap": cap_s})}
    for fn in PULLS:
        defaults = fn.__kwdefaults__ or {}
        if not set(waits) <= set(defaults):
            raise FlowerChanged(f"flwr's {fn.__qualname__} no longer takes the keywords {sorted(waits)}")
        fn.__kwdefaults__ = {**defaults, **waits}
