"""The Flower ClientApp: a thin, stateless adapter in front of the lane's trainer service.

It turns each Message into a fit / evaluate / init request for the trainer service of its node
and GPU lane (`client_app.lane`). Weights travel as fp32 safetensors shards (fl_app.transport):
inline in the Message for small models, by a manifest-pinned reference into the weight store
otherwise. Every member the run federates (`Config.weight_members`: the actor, and for PPO the
critic) travels the same way under its own name (`fl_app.transport.arrays_key`, WeightsRef
prefix = member). Nothing heavy lives here: in deployment this process exists for one message
only, while the trainer service lives as long as its SuperNode.

Every message names the recipe digest the server resolved and the digest of the run's code: this
node resolves its own config from the run config and refuses to train a different recipe, or to
run with code other than the run's app (fl_app.provenance). It also names the server's run dir
and the token of its shared-disk probe: a node that must pass weights through the run dir but
cannot read the probe is told so (no shared disk), instead of failing later on a missing file.
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.lane import LaneService
from fl_app.config import Config, ConfigError, load_config, recipe_sha256
from fl_app.provenance import check_node_code
from fl_app.rundir import RunDir
from fl_app.store import DirStore, WeightStore
from fl_app.store_open import open_store
from fl_app.store_remote import prune_cache
from fl_app.transport import WeightsRef, arrays_key, receive_manifest, receive_weights, sees_disk_probe, send_local
from fl_app.weights import Manifest, WeightsError, save_shards

app = ClientApp()
# fetched global models a node keeps (newest first; the members of the last few rounds): the
# rest is pruned, so a long run of a large model does not fill the node's disk
CACHE_KEEP = 8


@dataclass
class _Node:
    cfg: Config
    node_id: int
    run_dir: Path  # the server's run dir
    token: str  # its shared-disk probe
    store: WeightStore  # where weights travel by reference
    work: RunDir  # where this node writes (the run dir itself when it is the store)
    lane: LaneService

    @property
    def shard_bytes(self) -> int:
        return int(self.cfg.run.shard_max_mb * 2**20)

    @property
    def inline_bytes(self) -> int:
        return int(self.cfg.run.inline_max_mb * 2**20)

    @property
    def cache_dir(self) -> Path:
        return Path(self.cfg.run.weight_cache_dir).expanduser()

    def require_store(self, nbytes: int) -> None:
        """Weights of `nbytes` must travel through the store: make sure this node can reach it."""
        if self.store_is_run_dir and not sees_disk_probe(self.run_dir, self.token):
            raise WeightsError(
                f"node {self.node_id} ({socket.gethostname()}) cannot see the run dir at {self.run_dir}: the server "
                f"and this node do not share a disk, so weights of {nbytes / 2**20:.1f} MiB (above run.inline_max_mb="
                f"{self.cfg.run.inline_max_mb:g}) cannot travel through it. Set run.weight_store=http (the weight "
                "channel), mount the run dir at the same path on every node, or raise run.inline_max_mb"
            )

    @property
    def store_is_run_dir(self) -> bool:
        return isinstance(self.store, DirStore) and self.store.root == self.run_dir

    def info(self) -> dict[str, Any]:
        """Where this node's trainer service logs (the server lists it in summary.json)."""
        return {"node-host": socket.gethostname(), "lane": self.lane.lane, "service-log": str(self.lane.log_path)}


class RecipeMismatch(ConfigError):
    """This node resolved a different recipe than the server."""


def _config(msg: Message) -> dict[str, Any]:
    """The server's config record of `msg` as a plain dict."""
    return dict(msg.content.config_records["config"])


def _node(msg: Message, context: Context, check_code: bool = True) -> _Node:
    conf = _config(msg)
    if check_code:
        check_node_code(str(conf["code-sha256"]), f"node {context.node_id}")
    run_config = dict(context.run_config)
    cfg = load_config(str(run_config.get("recipe") or "tiny-shop-grpo"), overrides=run_config)
    want, got = str(conf["recipe-sha256"]), recipe_sha256(cfg)
    if want != got:
        raise RecipeMismatch(
            f"node {context.node_id} resolved a different recipe than the server (sha256 "
            f"{got[:12]}... vs {want[:12]}...): server and nodes must run the same app (FAB) and "
            "run config; check the recipe files and environment on this node"
        )
    run_dir = Path(str(conf["run-dir"]))
    spec = str(conf.get("weight-store", ""))  # '' = the run dir; else what the server says nodes open
    shard_bytes = int(cfg.run.shard_max_mb * 2**20)
    if not spec:
        store: WeightStore = DirStore(run_dir, shard_bytes)
        work = RunDir(run_dir)
    else:
        store = open_store(
            spec,
            run_dir=run_dir,
            max_shard_bytes=shard_bytes,
            token=str(conf.get("weight-store-token", "")),
            ca_file=cfg.run.weight_store_ca_file or None,
            parallel=cfg.run.weight_store_parallel,
            node=f"node {context.node_id} ({socket.gethostname()})",
        )
        # what this node writes stays node-local until published: never the server's run dir,
        # which a node on the same machine would otherwise write under the keys the store installs
        work = RunDir(Path(cfg.run.weight_cache_dir).expanduser() / "work" / f"run-{context.run_id}")
    lane = LaneService(context.run_id, run_config, log_dir=work.path / "logs", run_dir=run_dir)
    return _Node(cfg, context.node_id, run_dir, str(conf["run-dir-token"]), store, work, lane)


def _weights_dir(node: _Node, msg: Message, member: str, scratch: Path) -> Path:
    """A weights dir holding the message's global `member`: a verified local copy of the store
    entry, or a spill of the inline arrays into `scratch`."""
    ref = WeightsRef.from_config(_config(msg), prefix=member)
    if not ref.inline:
        node.require_store(ref.nbytes)
        local = receive_manifest(ref, node.store, node.cache_dir).root
        if not node.store_is_run_dir:
            prune_cache(node.cache_dir, keep=CACHE_KEEP)
        if local is None:
            raise WeightsError(f"the weight store returned no local copy of {ref.key!r}")
        return local
    shutil.rmtree(scratch, ignore_errors=True)
    arrays = msg.content.array_records.get(arrays_key(member)) or ArrayRecord()
    save_shards(receive_weights(ref, arrays.to_torch_state_dict(), None), scratch, node.shard_bytes)
    return scratch


def _reply(
    msg: Message, node: _Node, outs: dict[str, Path], metrics: dict[str, Any], config: dict[str, Any]
) -> Message:
    """Ship each member's freshly written dir: inline, or published to the store under its key."""
    content = RecordDict()
    refs: dict[str, Any] = {}
    for member, out in outs.items():
        nbytes = Manifest.from_dir(out).tensor_bytes
        if nbytes > node.inline_bytes:
            node.require_store(nbytes)
        ref, state = send_local(node.store, out, node.work.store_key(out), node.inline_bytes)
        content[arrays_key(member)] = ArrayRecord(state)
        refs.update(ref.to_config(prefix=member))
    content["config"] = ConfigRecord({**refs, **config, **node.info()})
    if metrics:
        content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    node = _node(msg, context)
    conf = _config(msg)
    rnd, cid = int(conf["server-round"]), int(conf["client-id"])
    base = node.work.client_dir(rnd, cid)
    shutil.rmtree(base, ignore_errors=True)  # a dead attempt's leftovers are never reused
    members = node.cfg.weight_members()
    spills = {m: base / f"global-{m}" for m in members}
    w_in = {m: _weights_dir(node, msg, m, spills[m]) for m in members}
    outs = {m: base / m for m in members}
    reply = node.lane.request(
        "/fit",
        {
            "run_id": context.run_id,
            "round": rnd,
            "client_id": cid,
            "local_epochs": int(conf["local-epochs"]),
            "seed": int(conf["seed"]),
            "proximal_mu": float(conf.get("proximal-mu", 0.0)),
            "weights_in": {m: str(p) for m, p in w_in.items()},
            "weights_out": {m: str(p) for m, p in outs.items()},
        },
    )
    for m in members:
        if w_in[m] == spills[m]:
            shutil.rmtree(spills[m])
    metrics: dict[str, Any] = {k: float(v) for k, v in reply["metrics"].items()}
    metrics["num-examples"] = int(reply["num_examples"])
    return _reply(msg, node, outs, metrics, {"client-id": cid})


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    node = _node(msg, context)
    conf = _config(msg)
    rnd = int(conf["server-round"])
    scratch = node.work.path / "scratch" / f"eval-{rnd:04d}"
    w_in = _weights_dir(node, msg, "actor", scratch)
    reply = node.lane.request(
        "/evaluate",
        {"run_id": context.run_id, "round": rnd, "seed": int(conf["seed"]), "weights_in": str(w_in)},
    )
    shutil.rmtree(scratch, ignore_errors=True)
    metrics: dict[str, Any] = {k: float(v) for k, v in reply["metrics"].items()}
    metrics["num-examples"] = int(reply["num_examples"])
    return Message(
        content=RecordDict({"metrics": MetricRecord(metrics), "config": ConfigRecord(node.info())}), reply_to=msg
    )


@app.query("init")
def init_weights(msg: Message, context: Context) -> Message:
    """Export the lane's freshly built members as round 0 (the server never loads a model), and
    where the lane's critic came from (PPO)."""
    node = _node(msg, context)
    outs = {m: node.work.path / "scratch" / f"init-{m}" for m in node.cfg.weight_members()}
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    reply = node.lane.request("/init", {"run_id": context.run_id, "weights_out": {m: str(p) for m, p in outs.items()}})
    critic = {f"critic-start-{k}": str(v) for k, v in (reply.get("critic_start") or {}).items()}
    return _reply(msg, node, outs, {}, {"fits": int(reply["fits"]), **critic})


@app.query("shutdown")
def shutdown(msg: Message, context: Context) -> Message:
    """End of run: stop this node's lane service and report what it served."""
    node = _node(msg, context, check_code=False)  # whatever code runs, its lane must stop
    h = node.lane.shutdown()  # None: another node of this lane stopped it (simulation)
    return Message(
        content=RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "stopped": int(h is not None),
                        "fits": int((h or {}).get("fits", 0)),
                        "evals": int((h or {}).get("evals", 0)),
                        "rss_mb": float((h or {}).get("rss_mb", 0.0)),
                    }
                ),
                "config": ConfigRecord(node.info()),
            }
        ),
        reply_to=msg,
    )
