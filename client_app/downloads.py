"""What a node downloads for a call, as its lane needs it, and the lane's request around it.

Under a compressed download (`federation.update: delta-int8 | delta-int4`, fl_app.downlink) a
call names beside each member's global model its compressed step from the previous round. The
node asks its lane what it holds (the service's `/health` `held`) and fetches nothing, the step or
the model (`fetch`); a step the lane refuses (`StepRefused`: it lost the base, or the step does
not rebuild the call's model) is logged and the model downloaded in full, then asked again
(`serve`), so a refused step costs bytes, never the fit. Without steps this is `Channel.get_all`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from client_app.lane import LaneService, ServiceRequestError
from fl_app.accounting import Meter
from fl_app.calls import Call
from fl_app.channel import Channel, WeightsRef
from fl_app.quant import UpdateMeta


class Fetched(NamedTuple):
    """What a node got for a call's weights: per member a local dir (its global model, or its
    compressed step), the members fetched as steps ('': none, the lane holds the model), the refs
    fetched (what `Channel.release_all` drops) and the bytes that travelled per member."""

    dirs: dict[str, Path]
    steps: dict[str, str]
    refs: dict[str, WeightsRef]
    down: dict[str, int]


def fetch(
    channel: Channel, call: Call, states: Mapping[str, Mapping[str, Any]], scratch: Path, held: Mapping[str, str]
) -> Fetched:
    """Get every member of `call` as its lane needs it (fl_app.downlink): nothing when the lane
    holds the call's global model (`held`: member -> the lane's last read), only the compressed
    step when it holds the step's base, else the model itself (`Channel.get`, as without steps)."""
    full: dict[str, WeightsRef] = {}
    steps: dict[str, WeightsRef | None] = {}
    for m, ref in call.weights.items():
        step, have = call.steps.get(m), held.get(m)
        if step is not None and have == ref.manifest_sha256:
            steps[m] = None
        elif step is not None and have == UpdateMeta.parse(step.update, f"the call's step of {m}").base:
            steps[m] = step
        else:
            full[m] = ref
    fetched = {m: r for m, r in steps.items() if r is not None}
    dirs, down = channel.get_all(full, {m: states.get(m, {}) for m in full}, scratch)
    step_dirs, step_down = channel.get_all(fetched, {m: {} for m in fetched}, scratch / "steps")
    return Fetched(
        {**dirs, **step_dirs},
        {m: str(step_dirs[m]) if m in step_dirs else "" for m in steps},
        {**full, **fetched},
        {**down, **{m: step_down.get(m, 0) for m in steps}},
    )


def request_body(forwarded: dict[str, Any], got: Fetched, outs: Mapping[str, Path]) -> dict[str, Any]:
    """The lane's request: the call as the ClientApp forwards it, and its dirs (client_app.service.Dirs)."""
    dirs = {
        "weights_in": {m: str(d) for m, d in got.dirs.items() if m not in got.steps},
        "weights_out": {m: str(d) for m, d in outs.items()},
        "steps": got.steps,
    }
    return {"call": forwarded, "dirs": dirs}


def serve(
    lane: LaneService,
    channel: Channel,
    call: Call,
    forwarded: dict[str, Any],
    path: str,
    inline: Mapping[str, Mapping[str, Any]],
    scratch: Path,
    outs: Mapping[str, Path],
    meter: Meter,
    node: str,
) -> tuple[Fetched, dict[str, Any], dict[str, float]]:
    """Have `lane` serve `call` (`forwarded`: its JSON, as the ClientApp forwards it) at `path`
    with its weights fetched as the lane needs them
    (`inline`: the message's arrays per member, `scratch`: where they are written), counting the
    transport in `meter`. Returns what was fetched (its bytes: `down`), the lane's answer and, for
    a call with steps, `step_fallback` (1: a refused step, then the model in full). A failed
    request raises `ServiceError` as `LaneService.request` does."""
    held = dict(lane.ensure_started().get("held", {})) if call.steps else {}
    with meter.transport():
        got = fetch(channel, call, inline, scratch, held)
    try:
        served = lane.request(path, request_body(forwarded, got, outs))
    except ServiceRequestError as e:
        if e.error_type != "StepRefused":
            raise
        print(f"[{node}] {e.message}; falling back to the full download", file=sys.stderr, flush=True)
    else:
        return got, served, {"step_fallback": 0.0} if call.steps else {}
    channel.release_all(got.refs, got.dirs)
    with meter.transport():
        full = fetch(channel, call, inline, scratch, {})
    full = full._replace(down={m: got.down[m] + full.down[m] for m in call.weights})
    return full, lane.request(path, request_body(forwarded, full, outs)), {"step_fallback": 1.0}
