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
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fl_app.config import Config, load_config, save_config
from fl_app.plots import plot_validation
from fl_app.rundir import RunDir
from fl_app.store import DirStore
from fl_app.transport import WeightsRef, receive_weights, send_stored
from fl_app.weights import Manifest, save_shards
from server_app.strategy import RoundError, make_strategy

app = ServerApp()
NODE_WAIT_S = 120.0


def log(msg: str) -> None:
    print(f"[fedagent] {msg}", flush=True)


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

    def payload(self, r: int) -> tuple[ArrayRecord, dict[str, Any]]:
        """What a message carries to name the global model of round r."""
        ref, arrays = send_stored(self.store, self.rd.store_key(self.rd.member_dir(r)), self.inline_bytes)
        return arrays, ref.to_config()


def _send_one(grid: Grid, node: int, mtype: str, arrays: ArrayRecord, config: dict[str, Any]) -> Message:
    msg = Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(config)}),
                  message_type=mtype, dst_node_id=node)
    (reply,) = list(grid.send_and_receive([msg]))
    if reply.has_error():
        raise RoundError(f"{mtype} on node {node} failed: {reply.error.reason}")
    return reply


def _initial_model(grid: Grid, node: int, w: Weights) -> Manifest:
    """Round 0: a lane exports its freshly built model; the server writes it as the checkpoint."""
    reply = _send_one(grid, node, "query.init", ArrayRecord(), {})
    ref = WeightsRef.from_config(reply.content["config"])
    state = receive_weights(ref, reply.content["arrays"], w.store)
    return save_shards(state, w.rd.member_dir(0), w.shard_bytes)


def _evaluate(grid: Grid, node: int, cfg: Config, w: Weights, rnd: int) -> dict[str, float]:
    arrays, ref = w.payload(rnd)
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
    rd = RunDir(cfg.resolved_run_dir(), total_rounds=fed.rounds)
    start = rd.prepare_resume()       # refuses too many rounds, quarantines partials
    save_config(cfg, rd.path / "config.yaml")
    nodes = _wait_for_nodes(grid)
    w = Weights(rd, cfg)
    t_run = time.perf_counter()
    log(f"run {context.run_id}: {fed.clients} clients, {fed.clients_per_round}/round, {fed.rounds} rounds, "
        f"{fed.local_epochs} local epochs, strategy {fed.strategy}, {len(nodes)} node(s); run dir {rd.path}")

    try:
        _rounds(grid, cfg, rd, w, nodes, start)
    except BaseException as e:
        # A run that dies mid-loop labels no final round (invariant 6); resume picks up from disk.
        rd.write_summary({"status": "failed", "error": f"{type(e).__name__}: {e}", "run_id": context.run_id,
                          "wall_s": time.perf_counter() - t_run})
        _shutdown_lanes(grid, nodes)
        raise
    services = _shutdown_lanes(grid, nodes)
    rd.write_summary({"status": "complete", "final_round": fed.rounds, "run_id": context.run_id,
                      "wall_s": time.perf_counter() - t_run, "nodes": len(nodes), "services": services,
                      "config": cfg.model_dump(mode="json")})
    plot_validation(rd.path / "metrics.jsonl", rd.path / "validation.png")
    log(f"done: {fed.rounds} rounds; checkpoints, metrics.jsonl, summary.json and validation.png in {rd.path}")


def _rounds(grid: Grid, cfg: Config, rd: RunDir, w: Weights, nodes: list[int], start: int | None) -> None:
    """Round 0 (if not on disk yet), then rounds start+1..T."""
    fed, eval_node = cfg.federation, nodes[0]
    if start is None:
        t0 = time.perf_counter()
        manifest = _initial_model(grid, eval_node, w)
        val = _evaluate(grid, eval_node, cfg, w, 0)
        rd.complete_round(0, {**val, "wall_s": time.perf_counter() - t0})
        log(f"round 0: initial model ({manifest.tensor_bytes / 2**20:.1f} MiB), "
            f"val success {val.get('val_success', float('nan')):.3f}")
        start = 0
    else:
        log(f"resuming after round {start} (found on disk)")

    strategy = make_strategy(fed.strategy, fed.proximal_mu)
    strategy.setup(seed=cfg.run.seed, num_clients=fed.clients, per_round=fed.clients_per_round,
                   shard_max_bytes=int(cfg.run.shard_max_mb * 2**20))
    for rnd in range(start + 1, fed.rounds + 1):
        t0 = time.perf_counter()
        arrays, ref = w.payload(rnd - 1)
        config = ConfigRecord({**ref, "local-epochs": fed.local_epochs, "seed": cfg.run.seed})
        messages = strategy.configure_train(rnd, arrays, config, grid)
        replies = grid.send_and_receive(messages)
        manifest, train = strategy.aggregate_train(rnd, replies, w.store, rd.member_dir(rnd))
        row: dict[str, Any] = {"clients": list(strategy.last_sampled)}
        row.update({k if k.startswith("train_") else f"train_{k}": float(v) for k, v in train.items()})
        if _due_for_eval(cfg, rnd):
            row.update(_evaluate(grid, eval_node, cfg, w, rnd))
        row["wall_s"] = time.perf_counter() - t0
        row["bytes_moved"] = 2 * fed.clients_per_round * manifest.tensor_bytes
        rd.complete_round(rnd, row)
        rd.drop_client_uploads(rnd)
        log(f"round {rnd}/{fed.rounds}: clients {row['clients']} | train success "
            f"{row.get('train_success', float('nan')):.3f} reward {row.get('train_reward', float('nan')):.3f} | "
            f"val success {row.get('val_success', float('nan')):.3f} | {row['wall_s']:.1f} s | "
            f"{row['bytes_moved'] / 2**20:.1f} MiB moved")


def _shutdown_lanes(grid: Grid, nodes: list[int]) -> list[dict[str, float]]:
    """Stop every lane's trainer service; report fits served per service."""
    msgs = [Message(content=RecordDict({"config": ConfigRecord({})}), message_type="query.shutdown",
                    dst_node_id=n) for n in nodes]
    out = []
    for reply in grid.send_and_receive(msgs, timeout=120):
        if not reply.has_error() and reply.content["metrics"]["stopped"]:
            out.append({k: float(v) for k, v in reply.content["metrics"].items()})
    return out
