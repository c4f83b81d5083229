"""The Flower ClientApp: a thin, stateless adapter in front of the lane's trainer service.

It turns each Message into a fit / evaluate / init request for the trainer service of its GPU
lane (`client_app.lane`). Weights travel as fp32 safetensors shards (fl_app.transport): inline
in the Message for small models, by a manifest-pinned reference into the run directory's
weight store otherwise. Every member the run federates (`Config.weight_members`: the actor, and
for PPO the critic) travels the same way under its own name (`fl_app.transport.arrays_key`,
WeightsRef prefix = member). Nothing heavy lives here: in deployment this process exists for
one message only.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.lane import LaneService
from fl_app.config import Config, load_config
from fl_app.rundir import RunDir
from fl_app.store import DirStore
from fl_app.transport import WeightsRef, arrays_key, receive_manifest, receive_weights, send_members
from fl_app.weights import save_shards

app = ClientApp()


@dataclass
class _Node:
    cfg: Config
    rd: RunDir
    store: DirStore
    lane: LaneService

    @property
    def shard_bytes(self) -> int:
        return int(self.cfg.run.shard_max_mb * 2**20)

    @property
    def inline_bytes(self) -> int:
        return int(self.cfg.run.inline_max_mb * 2**20)


def _node(context: Context) -> _Node:
    run_config = dict(context.run_config)
    cfg = load_config(str(run_config.get("recipe") or "tiny-shop-grpo"), overrides=run_config)
    rd = RunDir(cfg.resolved_run_dir())
    store = DirStore(rd.path, int(cfg.run.shard_max_mb * 2**20))
    return _Node(cfg, rd, store, LaneService(context.run_id, run_config, log_dir=rd.path / "logs"))


def _weights_dir(node: _Node, msg: Message, member: str, scratch: Path) -> Path:
    """A weights dir holding the message's global `member`: the store entry itself, or a spill
    of the inline arrays into `scratch`."""
    ref = WeightsRef.from_config(msg.content["config"], prefix=member)
    if not ref.inline:
        return receive_manifest(ref, node.store).root
    shutil.rmtree(scratch, ignore_errors=True)
    save_shards(receive_weights(ref, msg.content.get(arrays_key(member), ArrayRecord()), None), scratch,
                node.shard_bytes)
    return scratch


def _reply(msg: Message, node: _Node, outs: dict[str, Path], metrics: dict[str, Any],
           config: dict[str, Any]) -> Message:
    arrays, refs, sent = send_members(node.store, {m: node.rd.store_key(out) for m, out in outs.items()},
                                      node.inline_bytes)
    for member, ref in sent.items():
        if ref.inline:                        # travels in the message: the upload dir is not needed
            shutil.rmtree(outs[member], ignore_errors=True)
    content = RecordDict(arrays)
    content["config"] = ConfigRecord({**refs, **config})
    if metrics:
        content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    node = _node(context)
    conf = msg.content["config"]
    rnd, cid = int(conf["server-round"]), int(conf["client-id"])
    base = node.rd.client_dir(rnd, cid)
    shutil.rmtree(base, ignore_errors=True)  # a dead attempt's leftovers are never reused
    members = node.cfg.weight_members()
    spills = {m: base / f"global-{m}" for m in members}
    w_in = {m: _weights_dir(node, msg, m, spills[m]) for m in members}
    outs = {m: base / m for m in members}
    reply = node.lane.request("/fit", {
        "run_id": context.run_id, "round": rnd, "client_id": cid, "local_epochs": int(conf["local-epochs"]),
        "seed": int(conf["seed"]), "proximal_mu": float(conf.get("proximal-mu", 0.0)),
        "weights_in": {m: str(p) for m, p in w_in.items()}, "weights_out": {m: str(p) for m, p in outs.items()}})
    for m in members:
        if w_in[m] == spills[m]:
            shutil.rmtree(spills[m])
    metrics = {k: float(v) for k, v in reply["metrics"].items()}
    metrics["num-examples"] = int(reply["num_examples"])
    return _reply(msg, node, outs, metrics, {"client-id": cid})


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    node = _node(context)
    rnd = int(msg.content["config"]["server-round"])
    scratch = node.rd.path / "scratch" / f"eval-{rnd:04d}"
    w_in = _weights_dir(node, msg, "actor", scratch)
    reply = node.lane.request("/evaluate", {"run_id": context.run_id, "round": rnd,
                                            "seed": int(msg.content["config"]["seed"]), "weights_in": str(w_in)})
    shutil.rmtree(scratch, ignore_errors=True)
    metrics = {k: float(v) for k, v in reply["metrics"].items()}
    metrics["num-examples"] = int(reply["num_examples"])
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query("init")
def init_weights(msg: Message, context: Context) -> Message:
    """Export the lane's freshly built members as round 0 (the server never loads a model), and
    where the lane's critic came from (PPO)."""
    node = _node(context)
    outs = {m: node.rd.path / "scratch" / f"init-{m}" for m in node.cfg.weight_members()}
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    reply = node.lane.request("/init", {"run_id": context.run_id,
                                        "weights_out": {m: str(p) for m, p in outs.items()}})
    critic = {f"critic-start-{k}": str(v) for k, v in (reply.get("critic_start") or {}).items()}
    return _reply(msg, node, outs, {}, {"fits": int(reply["fits"]), "lane": node.lane.lane, **critic})


@app.query("shutdown")
def shutdown(msg: Message, context: Context) -> Message:
    """End of run: stop this lane's trainer service and report what it served."""
    node = _node(context)
    h = node.lane.shutdown()      # None: another node of this lane stopped it (simulation)
    return Message(content=RecordDict({"metrics": MetricRecord({
        "stopped": int(h is not None), "fits": int((h or {}).get("fits", 0)), "evals": int((h or {}).get("evals", 0)),
        "rss_mb": float((h or {}).get("rss_mb", 0.0))})}), reply_to=msg)
