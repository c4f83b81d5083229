"""Which lanes served a run's fits, and which lanes of the nodes' hosts none served.

Every fit reply names its lane (`client_app.lane`: a GPU set such as `0` or `0-1`, or a CPU
lane), its devices, the host's lanes and when the lane started and ended the fit. The round's
`per_client` entries carry the first three per client; summary.json `lanes` lists per host and
lane the fits it served and its devices, and the idle lanes: those a host offers that served no
fit of this invocation. With fewer clients per round than lanes, the server says once which
lanes stay idle and what to raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fl_app.calls import Reply


def lane_entry(reply: Reply) -> dict[str, Any]:
    """A fit's lane for its `per_client` entry: the lane, its devices, and its [start, end] in epoch seconds."""
    return {"lane": reply.lane, "devices": list(reply.devices), "lane_span": list(reply.lane_span or ())}


class Lanes:
    """The lanes this invocation's fits ran on, per host (summary.json `lanes`)."""

    def __init__(self) -> None:
        self.served: dict[str, dict[str, dict[str, Any]]] = {}  # host -> lane -> {fits, devices}
        self.offered: dict[str, list[str]] = {}  # host -> the lanes it offers
        self.told = False

    def note(self, reply: Reply) -> None:
        lanes = self.served.setdefault(reply.node_host, {})
        entry = lanes.setdefault(reply.lane, {"fits": 0, "devices": list(reply.devices)})
        entry["fits"] += 1
        if reply.host_lanes:
            self.offered[reply.node_host] = list(reply.host_lanes)

    def idle(self) -> dict[str, list[str]]:
        """Per host, its lanes that served no fit (hosts with none left out)."""
        out = {h: [ln for ln in lanes if ln not in self.served.get(h, {})] for h, lanes in self.offered.items()}
        return {h: lanes for h, lanes in out.items() if lanes}

    def tell_idle(self, clients_per_round: int, log: Callable[[str], None]) -> None:
        """Say once, when a round can never fill the lanes, which lanes stay idle and what to raise."""
        total = sum(len(lanes) for lanes in self.offered.values())
        if self.told or clients_per_round >= total or not (idle := self.idle()):
            return
        self.told = True
        where = "; ".join(f"{h}: {', '.join(lanes)}" for h, lanes in sorted(idle.items()))
        log(
            f"lanes idle ({where}): federation.clients_per_round={clients_per_round} is below the {total} "
            "lanes the nodes offer; raise it to use them, or give the run fewer lanes"
        )

    def table(self) -> dict[str, Any]:
        return {"served": self.served, "idle": self.idle()}
