"""The Flower ServerApp: one federated run from config to checkpoints.

Round loop (read top to bottom to follow one round):
  1. load + validate the config (before anything starts), open the run dir, find the resume point
     on disk (the highest complete round);
  2. round 0 = the initial model, exported by a trainer lane, written as fp32 shards, validated;
  3. each round r: sample logical clients (pure function of (seed, r)), send each a train message
     carrying the global weights (inline or a manifest path), stream-average their fp32 shards
     into rounds/round-r, validate on a trainer lane every `eval_every` rounds, append one line to
     metrics.jsonl, mark the round complete;
  4. after the last round: summary.json, the plot, and a shutdown message to every node's lane.

"The global weights" are every member the run federates (`Config.weight_members`): the actor,
and for PPO the critic beside it (invariant 7). Each member travels, is averaged and is written
on its own (rounds/round-r/<member>), and a round is complete only when all of them are.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fl_app.config import Config, load_config, save_config
from fl_app.plots import plot_validation
from fl_app.rundir import RunDir
from fl_app.store import DirStore
from fl_app.transport import WeightsRef, arrays_key, receive_weights, send_members
from fl_app.weights import save_shards
from partitions.report import write_partition_report
from server_app.strategy import RoundError, make_strategy

app = ServerApp()
NODE_WAIT_S = 120.0
HEARTBEAT_S = 30.0


def log(msg: str) -> None:
    print(f"[fedagent] {msg}", flush=True)


@contextmanager
def _heartbeat(what: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Log `what` with the elapsed time every `every_s` while the block waits on clients, so a
    streamed run never sits silent through a tiny-model build or a long round."""
    done, t0 = threading.Event(), time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            log(f"{what} ({time.monotonic() - t0:.0f} s)")

    thread = threading.Thread(target=beat, name="fedagent-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _wait_for_nodes(grid: Grid) -> list[int]:
    deadline = time.monotonic() + NODE_WAIT_S
    while time.monotonic() < deadline:
        nodes = sorted(grid.get_node_ids())
        if nodes:
            return nodes
        time.sleep(1.0)
    raise RoundError(f"no SuperNode connected within {NODE_WAIT_S:.0f} s; in simulation pass "
                     "--federation-config \"num-supernodes=2\", in deployment start flower-supernode")


class Weights:
    """The run's weight store and the rule for how weights travel (inline when small)."""

    def __init__(self, rd: RunDir, cfg: Config) -> None:
        self.rd = rd
        self.shard_bytes = int(cfg.run.shard_max_mb * 2**20)
        self.inline_bytes = int(cfg.run.inline_max_mb * 2**20)
        self.store = DirStore(rd.path, self.shard_bytes)

    def payload(self, r: int, members: tuple[str, ...]) -> tuple[dict[str, ArrayRecord], dict[str, Any]]:
        """What a message carries to name the global `members` of round r: per member its
        ArrayRecord (RecordDict key `arrays_key(member)`) and its WeightsRef config entries."""
        keys = {m: self.rd.store_key(self.rd.member_dir(r, m)) for m in members}
        arrays, config, _refs = send_members(self.store, keys, self.inline_bytes)
        return arrays, config


def _send_one(grid: Grid, node: int, mtype: str, arrays: dict[str, ArrayRecord], config: dict[str, Any]) -> Message:
    msg = Message(content=RecordDict({**arrays, "config": ConfigRecord(config)}),
                  message_type=mtype, dst_node_id=node)
    (reply,) = list(grid.send_and_receive([msg]))
    if reply.has_error():
        raise RoundError(f"{mtype} on node {node} failed: {reply.error.reason}")
    return reply


def _initial_model(grid: Grid, node: int, w: Weights, members: tuple[str, ...]) -> tuple[int, dict[str, Any]]:
    """Round 0: a lane exports its freshly built members; the server writes them as the checkpoint.
    Returns the bytes written and where the lane's critic came from (PPO; empty otherwise)."""
    reply = _send_one(grid, node, "query.init", {}, {})
    conf = reply.content["config"]
    nbytes = 0
    for member in members:
        state = receive_weights(WeightsRef.from_config(conf, prefix=member),
                                reply.content.get(arrays_key(member), ArrayRecord()), w.store)
        nbytes += save_shards(state, w.rd.member_dir(0, member), w.shard_bytes).tensor_bytes
    critic = {k.removeprefix("critic-start-"): str(v) for k, v in conf.items() if k.startswith("critic-start-")}
    return nbytes, critic


def _evaluate(grid: Grid, node: int, cfg: Config, w: Weights, rnd: int) -> dict[str, float]:
    arrays, ref = w.payload(rnd, ("actor",))
    reply = _send_one(grid, node, MessageType.EVALUATE, arrays, {**ref, "server-round": rnd, "seed": cfg.run.seed})
    return {f"val_{k}": float(v) for k, v in reply.content["metrics"].items() if k != "num-examples"}


def _due_for_eval(cfg: Config, rnd: int) -> bool:
    every, last = cfg.federation.eval_every, cfg.federation.rounds
    return rnd == 0 or rnd == last or (every > 0 and rnd % every == 0)


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    cfg = load_config(str(run_config.get("recipe") or "tiny-shop-grpo"), overrides=run_config)
    fed = cfg.federation
    rd = RunDir(cfg.resolved_run_dir(), total_rounds=fed.rounds, members=cfg.weight_members())
    start = rd.prepare_resume()       # refuses too many rounds, quarantines partials, checks every member
    partition = write_partition_report(rd.path, cfg, log)   # every client's shard, before any lane starts
    save_config(cfg, rd.path / "config.yaml")
    nodes = _wait_for_nodes(grid)
    w = Weights(rd, cfg)
    t_run = time.perf_counter()
    log(f"run {context.run_id}: {fed.clients} clients, {fed.clients_per_round}/round, {fed.rounds} rounds, "
        f"{fed.local_epochs} local epochs, strategy {fed.strategy}, {len(nodes)} node(s); run dir {rd.path}")

    try:
        critic = _rounds(grid, cfg, rd, w, nodes, start)
    except BaseException as e:
        # A run that dies mid-loop labels no final round (invariant 6); resume picks up from disk.
        rd.write_summary({"status": "failed", "error": f"{type(e).__name__}: {e}", "run_id": context.run_id,
                          "wall_s": time.perf_counter() - t_run})
        _shutdown_lanes(grid, nodes)
        raise
    services = _shutdown_lanes(grid, nodes)
    rd.write_summary({"status": "complete", "final_round": fed.rounds, "run_id": context.run_id,
                      "wall_s": time.perf_counter() - t_run, "nodes": len(nodes), "services": services,
                      "members": list(rd.members), **({"critic": critic} if critic else {}), "partition": partition,
                      "config": cfg.model_dump(mode="json")})
    plot_validation(rd.path / "metrics.jsonl", rd.path / "validation.png")
    log(f"done: {fed.rounds} rounds; checkpoints, metrics.jsonl, summary.json and validation.png in {rd.path}")


def _critic_provenance(rd: RunDir, resumed_after: int | None, lane_start: dict[str, Any]) -> dict[str, Any]:
    """Where this invocation's critic came from (summary.json): the lane's resolution at round 0
    (explicit | auto-sibling | fresh), or on a resume the run's own critic of the round it
    resumed after, with the round-0 record. Empty for a run without a critic."""
    if "critic" not in rd.members:
        return {}
    if resumed_after is None:
        return {"init": lane_start.get("mode", ""), "source": lane_start.get("path", ""), "round0": lane_start}
    round0 = next((row.get("critic_start", {}) for row in rd.read_metrics() if row.get("round") == 0), {})
    return {"init": "resume", "source": str(rd.member_dir(resumed_after, "critic")), "round0": round0}


def _rounds(grid: Grid, cfg: Config, rd: RunDir, w: Weights, nodes: list[int], start: int | None) -> dict[str, Any]:
    """Round 0 (if not on disk yet), then rounds start+1..T; returns the critic's provenance."""
    fed, eval_node, members = cfg.federation, nodes[0], rd.members
    lane_critic: dict[str, Any] = {}
    resumed_after = start
    if start is None:
        t0 = time.perf_counter()
        log("round 0: starting the trainer lane; its first start on a machine builds the tiny model "
            "(minutes on 2 CPU cores, cached afterwards; the lane's log says where)")
        with _heartbeat("round 0: waiting for the trainer lane to start and export the initial model"):
            nbytes, lane_critic = _initial_model(grid, eval_node, w, members)
        with _heartbeat("round 0: validating the initial model"):
            val = _evaluate(grid, eval_node, cfg, w, 0)
        extra = {"critic_start": lane_critic} if lane_critic else {}
        rd.complete_round(0, {**val, **extra, "wall_s": time.perf_counter() - t0})
        log(f"round 0: initial {'+'.join(members)} ({nbytes / 2**20:.1f} MiB), "
            f"val success {val.get('val_success', float('nan')):.3f}"
            + (f"; critic: {lane_critic.get('mode')} ({lane_critic.get('reason')})" if lane_critic else ""))
        start = 0
    else:
        log(f"resuming after round {start} (found on disk: {'+'.join(members)})")
    critic = _critic_provenance(rd, resumed_after, lane_critic)

    strategy = make_strategy(fed.strategy, fed.proximal_mu)
    strategy.setup(seed=cfg.run.seed, num_clients=fed.clients, per_round=fed.clients_per_round,
                   shard_max_bytes=int(cfg.run.shard_max_mb * 2**20), only_clients=fed.only_clients)
    for rnd in range(start + 1, fed.rounds + 1):
        t0 = time.perf_counter()
        arrays, ref = w.payload(rnd - 1, members)
        config = ConfigRecord({**ref, "local-epochs": fed.local_epochs, "seed": cfg.run.seed})
        messages = strategy.configure_train(rnd, arrays, config, grid)
        with _heartbeat(f"round {rnd}/{fed.rounds}: clients {list(strategy.last_sampled)} training"):
            replies = grid.send_and_receive(messages)
        manifests, train = strategy.aggregate_train(rnd, replies, w.store,
                                                    {m: rd.member_dir(rnd, m) for m in members})
        row: dict[str, Any] = {"clients": list(strategy.last_sampled)}
        row.update({k if k.startswith("train_") else f"train_{k}": float(v) for k, v in train.items()})
        if _due_for_eval(cfg, rnd):
            with _heartbeat(f"round {rnd}/{fed.rounds}: validating"):
                row.update(_evaluate(grid, eval_node, cfg, w, rnd))
        row["wall_s"] = time.perf_counter() - t0
        row["bytes_moved"] = 2 * fed.clients_per_round * sum(m.tensor_bytes for m in manifests.values())
        rd.complete_round(rnd, row)
        rd.drop_client_uploads(rnd)
        log(f"round {rnd}/{fed.rounds}: clients {row['clients']} | train success "
            f"{row.get('train_success', float('nan')):.3f} reward {row.get('train_reward', float('nan')):.3f} | "
            f"val success {row.get('val_success', float('nan')):.3f} | {row['wall_s']:.1f} s | "
            f"{row['bytes_moved'] / 2**20:.1f} MiB moved")
    return critic


def _shutdown_lanes(grid: Grid, nodes: list[int]) -> list[dict[str, float]]:
    """Stop every lane's trainer service; report fits served per service."""
    msgs = [Message(content=RecordDict({"config": ConfigRecord({})}), message_type="query.shutdown",
                    dst_node_id=n) for n in nodes]
    out = []
    for reply in grid.send_and_receive(msgs, timeout=120):
        if not reply.has_error() and reply.content["metrics"]["stopped"]:
            out.append({k: float(v) for k, v in reply.content["metrics"].items()})
    return out
