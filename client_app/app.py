"""The Flower ClientApp: forwards each call to its lane's trainer service, which outlives it (it may serve one message).

A call (`fl_app.calls`) names per member the round's global weights: this app gets each as a local dir (`Channel.get`),
has its node and GPU lane's trainer service (`client_app.lane`) serve the call with those dirs (validated before any
work), ships back what it wrote (`Channel.put`), answers a failed service call in one line (`client_app.failures`).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.downloads import serve
from client_app.failures import failure_reply
from client_app.fleet_bytes import UNCOUNTED, count_reply
from client_app.lane import ServiceError, lane_services, serving_lane, stop_lanes
from client_app.poison import poison_fit
from fl_app.accounting import Meter
from fl_app.calls import RECORD, Call, EvalCall, FitCall, InitCall, Reply
from fl_app.channel import arrays_key
from fl_app.channel.open import node_channel
from fl_app.config import load_config
from fl_app.provenance import check_node_code
from server_app.packed import pack, unpack

app = ClientApp()


def _serve(msg: Message, context: Context, call: Call, path: str) -> Message:
    """Get the call's weights as local dirs, have the lane serve the call, ship its output (counted: `Meter`)."""
    meter = Meter()
    node = f"node {context.node_id} ({socket.gethostname()})"
    check_node_code(call.code_sha256, node)
    run_config = dict(context.run_config)
    cfg = load_config(str(run_config.get("recipe") or "tiny-shop-grpo"), overrides=run_config)
    cfg.faults.straggle(call.client_id if isinstance(call, FitCall) else None, call.round)  # before the lane
    channel, work = node_channel(call, cfg.run, node)
    scratch = work.scratch_dir(path.strip("/"), call.round)
    base = work.client_dir(call.round, call.client_id) if isinstance(call, FitCall) else scratch
    shutil.rmtree(base, ignore_errors=True)  # a dead attempt's leftovers are never reused
    inline = {m: unpack(msg.content.array_records.get(arrays_key(m))) for m in call.weights}
    outs = {m: base / m for m in (() if isinstance(call, EvalCall) else cfg.weight_members())}
    with serving_lane(context.run_id, run_config, cfg.run, work.path / "logs", Path(call.run_dir)) as lane:
        try:  # the weights as this lane needs them (client_app.downloads), then the lane's work
            forwarded = call.model_dump(mode="json")
            got, served, fallback = serve(lane, channel, call, forwarded, path, inline, base, outs, meter, node)
        except ServiceError as e:  # a known failure: one line to the server, not Ray's traceback in the stream
            return failure_reply(msg, lane, path, e)
    meter.down = got.down
    ins = {m: d for m, d in got.dirs.items() if m not in got.steps}
    poison_fit(cfg, call, ins, outs)  # faults.poison (testing): a poisoned fit's exports rewritten before the upload
    channel.release_all(got.refs, got.dirs)
    with meter.transport():
        refs, states, meter.up = channel.put_all(outs, work.store_key)
    content = RecordDict({arrays_key(m): pack(state) for m, state in states.items()})
    if isinstance(call, EvalCall):
        shutil.rmtree(base, ignore_errors=True)
    client = call.client_id if isinstance(call, FitCall) else None
    init = {k: served[k] for k in ("critic_start", "base_sha256") if served.get(k)}  # the init reply's
    span = lane.span if client is not None else None
    reply = Reply(weights=refs, client_id=client, lane_span=span, **init, **lane.where())
    content[RECORD] = ConfigRecord({RECORD: reply.model_dump_json()})
    examples = {"num-examples": int(served["num_examples"])} if "num_examples" in served else {}
    content["metrics"] = MetricRecord({**served.get("metrics", {}), **examples, **fallback, **meter.metrics()})
    return count_reply(msg, Message(content=content, reply_to=msg))


def _call(msg: Message, kind: type[Call]) -> Call:
    return kind.model_validate_json(str(msg.content.config_records[RECORD][RECORD]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _serve(msg, context, _call(msg, FitCall), "/fit")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _serve(msg, context, _call(msg, EvalCall), "/evaluate")


@app.query("init")
def init_weights(msg: Message, context: Context) -> Message:
    return _serve(msg, context, _call(msg, InitCall), "/init")


@app.query("shutdown")
def shutdown(msg: Message, context: Context) -> Message:
    """End of run: stop this node's lane service, whatever code runs, and report what it served."""
    call, run_config = _call(msg, Call), dict(context.run_config)
    cfg = load_config(str(run_config.get("recipe") or "tiny-shop-grpo"), overrides=run_config)
    _, work = node_channel(call, cfg.run, f"node {context.node_id}")
    lanes = lane_services(context.run_id, run_config, cfg.run, work.path / "logs", Path(call.run_dir))
    content = RecordDict({"metrics": MetricRecord({**stop_lanes(lanes), **UNCOUNTED})})  # zeros: stopped elsewhere
    content[RECORD] = ConfigRecord({RECORD: Reply(**lanes[0].where()).model_dump_json()})
    return count_reply(msg, Message(content=content, reply_to=msg))
