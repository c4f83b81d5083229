"""Where a round's bytes and wall time go: the arithmetic behind metrics.jsonl's `per_client`,
`bytes_down`/`bytes_up`, `message_bytes` and `phase_s`, `bench.round_overhead` and
`server_app.report`.

Numbers are taken where they are measured. A ClientApp reply carries, besides the trainer
service's phase times (`load_s`, `rollout_s`, `scoring_s`, `update_s`, `export_s`), what the
ClientApp itself measured (`client_traffic`): per member the bytes that travelled to it and from
it (`bytes_down_<member>`, `bytes_up_<member>`), the Flower messages that carried the call and its
reply (`message_bytes_down`, `message_bytes_up`: `client_app.fleet_bytes`), the time it spent getting and
shipping the weights (`transport_s`) and its whole serve time (`serve_s`). The server times its
own dispatch, aggregation, checkpoint and validation. `round_accounting` turns both into the round's row;
docs/architecture.md ("metrics.jsonl") defines every phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

# the round's phases, in the order they happen (and stack in phases.png)
PHASES = (
    "dispatch",
    "transport",
    "load",
    "rollout",
    "scoring",
    "update",
    "export",
    "aggregation",
    "checkpoint",
    "validation",
)
CLIENT_PHASES = ("transport", "load", "rollout", "scoring", "update", "export")
DOWN, UP = "bytes_down_", "bytes_up_"
MESSAGE_DOWN, MESSAGE_UP = "message_bytes_down", "message_bytes_up"
CLIENT_KEYS = ("transport_s", "serve_s", MESSAGE_DOWN, MESSAGE_UP)


def client_traffic(
    down: Mapping[str, int], up: Mapping[str, int], transport_s: float, serve_s: float
) -> dict[str, float]:
    """What a ClientApp adds to its reply's metric record (flat numbers: Flower's MetricRecord);
    the message bytes are 0.0 until `client_app.fleet_bytes.count_reply` fills them in."""
    return {
        **{f"{DOWN}{m}": float(n) for m, n in down.items()},
        **{f"{UP}{m}": float(n) for m, n in up.items()},
        "transport_s": transport_s,
        "serve_s": serve_s,
        MESSAGE_DOWN: 0.0,
        MESSAGE_UP: 0.0,
    }


class Meter:
    """A ClientApp's count of one call: the bytes per member each way (set by the caller from the
    channel's counts), the seconds spent in `transport()` blocks, and the call's whole time."""

    def __init__(self) -> None:
        self.start, self.transport_s = time.perf_counter(), 0.0
        self.down: dict[str, int] = {}
        self.up: dict[str, int] = {}

    @contextmanager
    def transport(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.transport_s += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """The reply's accounting metrics (`client_traffic`), the serve time ending now."""
        return client_traffic(self.down, self.up, self.transport_s, time.perf_counter() - self.start)


def is_traffic_key(key: str) -> bool:
    """A reply metric that is accounting, not training: it goes to `per_client`, not `train_*`."""
    return key.startswith((DOWN, UP)) or key in CLIENT_KEYS


def _members(metrics: Mapping[str, Any], prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): int(v) for k, v in metrics.items() if k.startswith(prefix)}


def message_bytes_in(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """A reply's Flower message bytes each way (0 for a reply without them)."""
    return {"down": int(metrics.get(prefix + MESSAGE_DOWN, 0)), "up": int(metrics.get(prefix + MESSAGE_UP, 0))}


def add_counts(total: Mapping[str, int], more: Mapping[str, int]) -> dict[str, int]:
    """Two counts keyed alike (per member, per direction) added key by key."""
    return {k: total.get(k, 0) + more.get(k, 0) for k in {**total, **more}}


def client_entry(metrics: Mapping[str, float]) -> dict[str, Any]:
    """One client's `per_client` entry from its reply's metrics: bytes per member each way, the
    bytes of its call's and reply's Flower messages, its phases (seconds, 0 for a phase the reply
    lacks) and its serve time."""
    return {
        "bytes_down": _members(metrics, DOWN),
        "bytes_up": _members(metrics, UP),
        "message_bytes": message_bytes_in(metrics),
        "phases": {p: float(metrics.get(f"{p}_s", 0.0)) for p in CLIENT_PHASES},
        "lane_s": float(metrics.get("fit_total_s", 0.0)),
        "serve_s": float(metrics.get("serve_s", 0.0)),
    }


def round_accounting(
    per_client: Mapping[int, Mapping[str, Any]],
    server: Mapping[str, float],
    val: Mapping[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """The round's accounting keys from its clients' entries (`client_entry`), the server's own
    timings (`train`: the whole dispatch of the round's messages until it closed, `transport`:
    building the calls' weight payloads, `aggregation`, `checkpoint`, `validation`) and the
    validation reply's metrics `val` (`val_`-prefixed, as the row holds them).

    Client phases are summed over the clients. A client is busy for its transport plus its time
    in the lane (`lane_s`, the service's whole fit, its unnamed part counted in `other`); when
    the clients' busy times overlap (several lanes) and add up to more than the server's `train`
    wall, every client phase is scaled by train / sum(busy), so the phases are shares of the
    round's wall and never add up to more: `other` (the rest of `wall_s`) is >= 0 whatever the
    lanes. `dispatch` is the train wall no client was busy in (Flower's messages, the ClientApps'
    start, a client waiting for its lane while another fits)."""
    busy = sum(c["lane_s"] + c["phases"]["transport"] for c in per_client.values())
    scale = min(1.0, server["train"] / busy) if busy > 0 else 1.0
    phases = {p: 0.0 for p in PHASES}
    for c in per_client.values():
        for p in CLIENT_PHASES:
            phases[p] += c["phases"][p] * scale
    phases["dispatch"] = max(0.0, server["train"] - busy)
    phases["transport"] += server.get("transport", 0.0)
    for p in ("aggregation", "checkpoint", "validation"):
        phases[p] = server.get(p, 0.0)
    phases["other"] = wall_s - sum(phases.values())
    down = _members(val, f"val_{DOWN}")
    up: dict[str, int] = {}
    messages = message_bytes_in(val, "val_")
    for c in per_client.values():
        down, up = add_counts(down, c["bytes_down"]), add_counts(up, c["bytes_up"])
        messages = add_counts(messages, c.get("message_bytes", {}))
    return {
        "per_client": {str(cid): c for cid, c in sorted(per_client.items())},
        **_totals(down, up, messages),
        "phase_s": phases,
    }


def round0_accounting(init: Mapping[str, float], val: Mapping[str, Any]) -> dict[str, Any]:
    """Round 0's traffic: the initial members up from the init lane (its reply's metrics
    `init`), the validation's global model down, and both calls' Flower messages."""
    messages = add_counts(message_bytes_in(init), message_bytes_in(val, "val_"))
    return _totals(_members(val, f"val_{DOWN}"), _members(init, UP), messages)


def _totals(down: dict[str, int], up: dict[str, int], messages: dict[str, int]) -> dict[str, Any]:
    return {
        "bytes_down": down,
        "bytes_up": up,
        "bytes_moved": sum(down.values()) + sum(up.values()),
        "message_bytes": messages,
    }


def phases_of(row: Mapping[str, Any]) -> dict[str, float] | None:
    """A round row's `phase_s`; for a row written before it existed, what its fit sums and
    `aggregate_s` say (rollout and update together under `rollout`, the rest `other`); None for a
    row with neither (round 0)."""
    if "phase_s" in row:
        return {k: float(v) for k, v in row["phase_s"].items()}
    if "fits_total_s" not in row or "aggregate_s" not in row:
        return None
    phases = {p: 0.0 for p in PHASES}
    phases.update(
        rollout=row["fits_rollout_update_s"],
        load=row["fits_load_s"],
        export=row["fits_export_s"],
        aggregation=row["aggregate_s"],
    )
    phases["other"] = row["wall_s"] - sum(phases.values())
    return phases


def run_message_bytes(rows: Sequence[Mapping[str, Any]], shutdown: Mapping[str, int]) -> dict[str, int]:
    """One Flower run's message bytes each way: its rows' (`message_bytes`, none in a row written
    before they were counted) and its shutdown calls' (after the last row)."""
    total = dict(shutdown)
    for row in rows:
        total = add_counts(total, row.get("message_bytes", {}))
    return {"down": total.get("down", 0), "up": total.get("up", 0)}


def run_weight_bytes(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The weight bytes of these rows each way (`bytes_of` summed)."""
    pairs = [bytes_of(r) for r in rows]
    return {"down": sum(d for d, _ in pairs), "up": sum(u for _, u in pairs)}


def bytes_of(row: Mapping[str, Any]) -> tuple[int, int]:
    """A row's bytes down and up over all members; an old row has only `bytes_moved`, counted
    half each way (what it meant: the global model down and each upload up, once per client)."""
    if "bytes_down" in row:
        return sum(row["bytes_down"].values()), sum(row.get("bytes_up", {}).values())
    moved = int(row.get("bytes_moved", 0))
    return moved // 2, moved - moved // 2


# bench.round_overhead: one round split into work (rollouts, updates, the validation's episodes)
# and named overhead, from the rows' fit sums
OVERHEAD_NEEDED = ("wall_s", "aggregate_s", "fits_rollout_update_s", "fits_load_s", "fits_export_s", "fits_total_s")


def overhead_split(row: Mapping[str, Any]) -> dict[str, float]:
    """One round's wall time, split into work and overhead parts (seconds)."""
    parts = {
        "wall": row["wall_s"],
        "fits_work": row["fits_rollout_update_s"],
        "val_work": row.get("val_eval_s", 0.0),
        "load": row["fits_load_s"] + row.get("val_load_s", 0.0),
        "export": row["fits_export_s"],
        "in_fits": row["fits_total_s"] - row["fits_rollout_update_s"] - row["fits_load_s"] - row["fits_export_s"],
        "aggregate": row["aggregate_s"],
    }
    parts["overhead"] = parts["wall"] - parts["fits_work"] - parts["val_work"]
    parts["other"] = parts["overhead"] - parts["load"] - parts["export"] - parts["in_fits"] - parts["aggregate"]
    parts["overhead_frac"] = parts["overhead"] / parts["wall"]
    return parts


def mean_rows(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The per-key mean of equally keyed dicts (a key some lack is 0 there)."""
    keys = {k: None for p in parts for k in p}
    return {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in keys}
