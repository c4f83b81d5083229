"""The Flower ServerApp: one federated run from config to checkpoints.

Round loop (read top to bottom to follow one round):
  1. load + validate the config (before anything starts), open the run dir (heartbeat.json vouches
     for this process from here on: server_app.liveness), find the resume point on disk (the
     highest complete round); summary.json says `running` from here on;
  2. round 0 = the initial model, exported by a trainer lane, written as fp32 shards, validated;
  3. each round r, in Flower's vocabulary: `configure_train` samples logical clients (a pure
     function of (seed, r), over-selected clients last) and builds the round's `FitCall` naming
     the global weights; `train` sends each client its message and collects the replies until
     the round closes (a failed client is dropped or re-dispatched, a straggler dropped at the
     round deadline: server_app.dispatch); `aggregate_train` stream-averages their fp32 shards
     into rounds/round-r; `evaluate_fn` validates on a trainer lane every `eval_every` rounds;
     one line goes to metrics.jsonl and the round is marked complete;
  4. after the last round: summary.json, the plot, and a shutdown message to every node's lane.

"The global weights" are every member the run federates (`Config.weight_members`): the actor,
and for PPO the critic beside it (invariant 7). Each member travels, is averaged and is written
on its own (rounds/round-r/<member>), and a round is complete only when all of them are.

Every message is one typed call (fl_app.calls: `InitCall`, `FitCall`, `EvalCall`), built here
once per round: the digest of the recipe the server resolved (checked by each lane against its
own resolution), the digest of the run's code (the FAB's, which the server first checks against
the code it and its environment import, fl_app.provenance), the run dir the server uses, the
token of its shared-disk probe, the weight store nodes open, and per member a `WeightsRef` to
the round's global weights (fl_app.channel).
"""

from __future__ import annotations

import shutil
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.config import get_project_dir
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from envs.ports import bind_listener
from fl_app import downlink
from fl_app.accounting import (
    add_counts,
    client_entry,
    is_traffic_key,
    message_bytes_in,
    round0_accounting,
    round_accounting,
    run_message_bytes,
)
from fl_app.aggregate import NonFiniteWeightsError
from fl_app.board import Board
from fl_app.calls import RECORD, Call, EvalCall, FitCall, InitCall
from fl_app.channel import Channel, WeightsRef, arrays_key, write_disk_probe
from fl_app.channel.credentials import Issuer
from fl_app.channel.http_server import WeightStoreServer
from fl_app.channel.open import open_store
from fl_app.config import COMPRESSED, Config, load_config, recipe_leaves, recipe_sha256, save_config
from fl_app.host import single_threaded_blas
from fl_app.outcomes import outcome_shares_of
from fl_app.plots import plot_phases, plot_validation
from fl_app.provenance import check_server_code
from fl_app.robust import RoundScores, Rule, flagged_clients
from fl_app.rundir import RunDir
from fl_app.server_opt import ServerOptimizer
from fl_app.weights import MANIFEST_NAME, Manifest, WeightsError, save_shards
from partitions.report import write_partition_report
from partitions.uniform import sampling_seed
from server_app.dispatch import Abandoned, Close, RoundDispatch, RoundOutcome, request_one
from server_app.errors import one_line, strip_ansi
from server_app.lanes import Lanes, lane_entry
from server_app.liveness import beating, every
from server_app.packed import pack
from server_app.pull_backoff import shorten_pull_backoff
from server_app.strategy import (
    ClientFailure,
    ClientRefused,
    ClientSampler,
    RoundError,
    StreamingAggregator,
    check_reply_keys,
    inline_state,
    metrics_of,
    reply_of,
)

# Flower's simulation engine forks beside the thread this module runs in (single_threaded_blas).
single_threaded_blas()
app = ServerApp()
NODE_WAIT_S = 120.0
HEARTBEAT_S = 30.0
ERROR_LOG = "logs/server-error.log"


def log(msg: str) -> None:
    print(f"[fedagent] {msg}", flush=True)


@contextmanager
def _heartbeat(what: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Log `what` with the elapsed time every `every_s` while the block waits on clients, so a
    streamed run never sits silent through a tiny-model build or a long round."""
    t0 = time.monotonic()
    with every(every_s, lambda: log(f"{what} ({time.monotonic() - t0:.0f} s)"), "fedagent-heartbeat"):
        yield


def _wait_for_nodes(grid: Grid) -> list[int]:
    deadline = time.monotonic() + NODE_WAIT_S
    while time.monotonic() < deadline:
        nodes = sorted(grid.get_node_ids())
        if nodes:
            return nodes
        time.sleep(1.0)
    raise RoundError(
        f"no SuperNode connected within {NODE_WAIT_S:.0f} s; in simulation pass "
        '--federation-config "num-supernodes=2", in deployment start flower-supernode'
    )


class Weights:
    """The server's end of the weight channel, and what nodes are told to open.

    The server's own copy of every entry is its run dir. `channel.store` is where nodes put and
    get what does not travel inline (`run.weight_store`, docs/weight-store.md): the run dir
    itself on a shared disk (''), the run dir served over HTTP(S) from this process ('http':
    nodes get its URL, and every message a credential for that call alone: `credential`), or a
    disk or object store everybody reaches (file://, s3://: the global model is published there
    before a call names it). `close()` stops the served store; the run calls it on every path.
    """

    def __init__(self, rd: RunDir, cfg: Config, run_id: int) -> None:
        self.rd = rd
        r = cfg.run
        shard_bytes = int(r.shard_max_mb * 2**20)
        self.server: WeightStoreServer | None = None
        spec = r.weight_store.strip()
        if spec not in ("", "http"):  # entries are immutable: each run its own prefix, or a later run's
            spec = f"{spec.rstrip('/')}/run-{run_id}"  # uploads collide with an earlier one's under the same keys
        self.node_store: dict[str, str] = {"weight_store": spec}
        self.issuer: Issuer | None = None  # the served store's: its secret never leaves this process
        # a store other than the run dir gets each global model published once before a call names it
        self.remote = spec not in ("", "http")
        self._published: set[str] = set()
        self.delta = cfg.federation.update in COMPRESSED  # compressed downloads too (fl_app.downlink)
        store = open_store(
            spec if self.remote else "",
            run_dir=rd.path,
            max_shard_bytes=shard_bytes,
            parallel=r.weight_store_parallel,
            node="server",
        )
        self.channel = Channel(
            store,
            cache_dir=rd.path / "scratch" / "fetched",
            inline_max_bytes=int(r.inline_max_mb * 2**20),
            shard_bytes=shard_bytes,
            run_dir=rd.path,
        )
        if spec == "http":
            self.issuer = Issuer(run_id)
            advertise = urlsplit(r.weight_store_url).hostname if r.weight_store_url else None
            sock = bind_listener(r.weight_store_host, r.weight_store_port or None)
            self.server = WeightStoreServer(
                rd.path,
                self.issuer,
                sock,
                certfile=r.weight_store_certfile or None,
                keyfile=r.weight_store_keyfile or None,
                advertise_host=advertise,
            ).start()
            self.node_store = {"weight_store": self.server.url}
            log(f"weight store: serving {rd.path} at {self.server.url} (nodes fetch and upload shards there)")

    def payload(
        self, r: int, members: tuple[str, ...]
    ) -> tuple[dict[str, ArrayRecord], dict[str, WeightsRef], dict[str, WeightsRef]]:
        """What a call carries to name the global `members` of round r: per member its ref, its
        ArrayRecord (RecordDict key `arrays_key(member)`, empty unless the ref is inline) and,
        under a compressed download (`delta`, rounds >= 1), its step from round r - 1
        (fl_app.downlink). Then both travel by key whatever their size: a lane fetches only what
        it lacks (the step, nothing when it holds the model, the model when it holds neither),
        which inline arrays, riding in every message, could not do."""
        arrays: dict[str, ArrayRecord] = {}
        refs, steps = {}, {}
        for m in members:
            local = self.rd.member_dir(r, m)
            if self.delta and r >= 1:
                refs[m] = self._by_key(local)
                steps[m] = self._by_key(self.rd.opt_state_dir(r, downlink.entry(m, downlink.STEP)))
                continue
            key = self._publish(local, always=False)
            refs[m], state = self.channel.put_entry(key)
            arrays[arrays_key(m)] = pack(state)
        return arrays, refs, steps

    def _publish(self, local: Path, always: bool) -> str:
        """The store key of the run dir entry `local`, published once to a store other than the
        run dir (`always`, or when it is too big to travel inline)."""
        key = self.rd.store_key(local)
        if self.remote and key not in self._published:
            if always or Manifest.from_dir(local).tensor_bytes > self.channel.inline_max_bytes:
                self.channel.store.publish(local, key)
            self._published.add(key)
        return key

    def _by_key(self, local: Path) -> WeightsRef:
        """A ref to the run dir entry `local` by key (never inline), pinned by its manifest digest."""
        key = self._publish(local, always=True)
        m = self.channel.store.manifest(key)
        return WeightsRef(inline=False, nbytes=m.tensor_bytes, key=key, manifest_sha256=m.sha256, update=m.update)

    def upload_keys(self, call: Call) -> dict[str, str]:
        """member -> the store key a node publishes `call`'s result under (the layout
        client_app/app.py `_serve` writes in its work dir): a fit's upload of its client and
        round, the init call's export; an evaluation or the shutdown publish nothing."""
        if isinstance(call, FitCall):
            return self.client_keys(call.round, call.client_id)
        if isinstance(call, InitCall):
            return self._keys(self.rd.scratch_dir(call.kind, call.round))
        return {}

    def client_keys(self, r: int, client: int) -> dict[str, str]:
        """member -> the key client `client` uploads its round-r result under."""
        return self._keys(self.rd.client_dir(r, client))

    def _keys(self, base: Path) -> dict[str, str]:
        return {m: self.rd.store_key(base / m) for m in self.rd.members}

    def credential(self, call: Call, node: int, ttl_s: float) -> str:
        """The served store's credential for `call` sent to `node`, valid `ttl_s` (the call's
        TTL) plus a margin: it reads the global entries the call names and its own uploads, and
        writes only those uploads. Empty when the store is not served (no credentials there)."""
        if self.issuer is None:
            return ""
        write = self.upload_keys(call).values()
        read = [ref.key for ref in (*call.weights.values(), *call.steps.values()) if not ref.inline]
        client = call.client_id if isinstance(call, FitCall) else None
        return self.issuer.mint(round=call.round, client=client, node=node, read=read, write=write, ttl_s=ttl_s)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class Nodes:
    """What the nodes told us about themselves: host, lane, and where their trainer logs are
    (summary.json `nodes`, so the server's run dir says where every node's logs live)."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, str]] = {}

    def note(self, reply: Message) -> None:
        if reply.has_error() or RECORD not in reply.content:
            return
        r = reply_of(reply)
        info = {"node-host": r.node_host, "lane": r.lane, "service-log": r.service_log}
        node = int(reply.metadata.src_node_id)
        if info and self.seen.get(node) != info:
            self.seen[node] = info
            log(
                f"node {node} ({info.get('node-host', '?')}, lane {info.get('lane', '?')}): trainer service log "
                f"at {info.get('service-log', '?')}"
            )


class Run:
    """One invocation of the ServerApp: config, run dir, weights, the nodes' messages."""

    def __init__(self, grid: Grid, context: Context, cfg: Config, rd: RunDir, code: str) -> None:
        self.grid, self.context, self.cfg, self.rd = grid, context, cfg, rd
        self.w = Weights(rd, cfg, context.run_id)
        try:
            self.nodes = Nodes()
            self.lanes = Lanes()
            self.sampler = ClientSampler(
                seed=sampling_seed(cfg.run.seed, cfg.federation.sampling_seed),
                num_clients=cfg.federation.clients,
                per_round=cfg.federation.clients_per_round,
                over_select=cfg.federation.over_select,
                only_clients=cfg.federation.only_clients,
            )
            self.abandoned = Abandoned(self._late_upload)
            self.server_opt = ServerOptimizer.from_config(cfg.federation)
            self.aggregator = StreamingAggregator(
                cfg.federation.strategy,
                cfg.federation.proximal_mu,
                cfg.federation.fold_lr(),
                Rule.of(cfg.federation),
            )
            self.token = write_disk_probe(rd.path)
            self.board = Board(rd.path) if cfg.run.tensorboard else None  # TensorBoard mirror of metrics.jsonl
        except BaseException:
            self.w.close()
            raise
        # what every call of this run carries (fl_app.calls.Call)
        self.header: dict[str, Any] = {
            "run_id": context.run_id,
            "recipe_sha256": recipe_sha256(cfg),
            "recipe_leaves": recipe_leaves(cfg),
            "code_sha256": code,
            "run_dir": str(rd.path),
            "run_dir_token": self.token,
            **self.w.node_store,
        }

    def set_base(self, digest: str, source: str) -> None:
        """The frozen base every call names from now on (`federation.update: lora`; nodes refuse
        another): from the init lane, or on a resume from the round resumed after. Fails closed
        on a lora run without one and on a full-weights run with one."""
        lora = self.cfg.federation.update == "lora"
        if lora != bool(digest):
            raise RoundError(
                f"{source} records {'no' if lora else 'a'} LoRA base digest, and this run has federation.update="
                f"{self.cfg.federation.update!r}: "
                + (
                    "the lane built no adapters (is every node on this code?)"
                    if lora
                    else "resume with the update mode the run was started with, or use a new run dir"
                )
            )
        self.header["base_sha256"] = digest

    def close(self) -> None:
        """Stop the served store and close the TensorBoard writer (every path out of the run)."""
        self.w.close()
        if self.board is not None:
            self.board.close()

    def _late_upload(self, rnd: int, client: int) -> None:
        """Remove what a dropped or spare client of round `rnd` uploaded after its round closed
        (once the round is complete its scratch is redundant; before, `drop_client_uploads` will)."""
        if self.rd.is_complete(rnd):
            shutil.rmtree(self.rd.client_dir(rnd, client), ignore_errors=True)

    def message(self, node: int, mtype: str, call: Call, arrays: dict[str, ArrayRecord] | None = None) -> Message:
        """`call` as one record, with the inline arrays of its weights beside it, and the weight
        store's credential for this call on this node (`Weights.credential`)."""
        ttl = self.cfg.federation.client_timeout_s + 60.0
        call = call.model_copy(update={"weight_store_token": self.w.credential(call, node, ttl)})
        content = RecordDict({**(arrays or {}), RECORD: ConfigRecord({RECORD: call.model_dump_json()})})
        return Message(content=content, message_type=mtype, dst_node_id=node, ttl=ttl)

    def ask(self, mtype: str, what: str, call: Call, arrays: dict[str, ArrayRecord] | None = None) -> Message:
        """One request to the first connected node (the nodes connected now: a lost one is gone)."""
        nodes = sorted(self.grid.get_node_ids())
        reply = request_one(
            self.grid,
            nodes,
            lambda n: self.message(n, mtype, call, arrays),
            what,
            self.cfg.federation.client_timeout_s,
            log,
        )
        self.nodes.note(reply)
        return reply


def _initial_model(run: Run, members: tuple[str, ...]) -> tuple[int, dict[str, Any], dict[str, float]]:
    """Round 0: a lane exports its freshly built members; the server writes them as the checkpoint.
    Returns the bytes written, where the lane's critic came from (PPO; empty otherwise) and the
    reply's metrics (what travelled up from the lane: fl_app.accounting). Under
    `federation.update: lora` the lane's base digest becomes the run's (`Run.header`)."""
    call = InitCall(**run.header)
    reply = run.ask("query.init", "round 0: initial model", call)
    done, channel = reply_of(reply), run.w.channel
    try:
        check_reply_keys("the init lane", done, run.w.upload_keys(call))
    except WeightsError as e:
        raise RoundError(f"round 0: {e}") from None
    nbytes = 0
    for member in members:
        state = channel.state(done.weights[member], inline_state(reply, member))
        nbytes += save_shards(state, run.rd.member_dir(0, member), channel.shard_bytes).tensor_bytes
    run.set_base(done.base_sha256, "the init lane")
    return nbytes, dict(done.critic_start), metrics_of(reply)


def evaluate_fn(run: Run, rnd: int) -> dict[str, float]:
    """Validation of round `rnd`'s global actor on a lane (Flower's `evaluate_fn`, on a node:
    the server never loads the model)."""
    arrays, refs, steps = run.w.payload(rnd, ("actor",))
    call = EvalCall(**run.header, round=rnd, seed=run.cfg.run.seed, weights=refs, steps=steps)
    reply = run.ask(MessageType.EVALUATE, f"round {rnd}: validation", call, arrays)
    return {f"val_{k}": v for k, v in metrics_of(reply).items() if k != "num-examples"}


def _validation(row: dict[str, Any]) -> str:
    """`val success S`, then how the other validation episodes ended, largest share first (the
    env's outcome labels, e.g. the shop's `wrong_options`), so a stalled curve says why."""
    misses = sorted(((v, label) for label, v in outcome_shares_of(row, "val_").items() if v > 0), reverse=True)
    shares = ", ".join(f"{label} {v:.2f}" for v, label in misses if label != "won")
    return f"val success {row.get('val_success', float('nan')):.3f}" + (f" (misses: {shares})" if shares else "")


def _due_for_eval(cfg: Config, rnd: int) -> bool:
    every, last = cfg.federation.eval_every, cfg.federation.rounds
    return rnd == 0 or rnd == last or (every > 0 and rnd % every == 0)


def _app_dir(grid: Grid) -> Path | None:
    """Where Flower installed this run's FAB; None for a run without one (started from Python)."""
    run = grid.run
    return get_project_dir(run.fab_id, run.fab_version, run.fab_hash) if run.fab_hash else None


# A reply's objects follow its head: pulling them, the ServerApp retries after 50 ms (not Flower's
# 1 s), doubling up to this cap, so a long upload costs a request a second per object at most.
PULL_CAP_S = 1.0


@app.main()
def main(grid: Grid, context: Context) -> None:
    shorten_pull_backoff(cap_s=PULL_CAP_S)
    run_config = dict(context.run_config)
    cfg = load_config(str(run_config.get("recipe") or "tiny-shop-grpo"), overrides=run_config)
    # before the run dir, which may be another checkout's
    code = check_server_code(_app_dir(grid), Path.cwd(), simulation=isinstance(grid, InMemoryGrid))
    rd = run_dir(cfg)
    with beating(rd, context.run_id, log):  # heartbeat.json: `server_app.status` tells running from dead
        _serve_run(grid, context, cfg, rd, code)


def run_dir(cfg: Config) -> RunDir:
    """The run's directory, told what every complete round must hold: its members and the server
    state entries (a server optimizer's moments, a compressed download's step and residual)."""
    members = cfg.weight_members()
    opt = ServerOptimizer.from_config(cfg.federation)
    state = opt.state_entries(members) if opt is not None else ()
    if cfg.federation.update in COMPRESSED:
        state += downlink.state_entries(members)
    return RunDir(cfg.resolved_run_dir(), total_rounds=cfg.federation.rounds, members=members, opt_state=state)


def _serve_run(grid: Grid, context: Context, cfg: Config, rd: RunDir, code: str) -> None:
    """The run from its resume point to its final summary (complete, or failed and re-raised)."""
    fed = cfg.federation
    start = rd.prepare_resume()  # refuses too many rounds, quarantines partials, checks every member
    partition = write_partition_report(rd.path, cfg, log)  # every client's shard, before any lane starts
    save_config(cfg, rd.path / "config.yaml")
    t_run = time.perf_counter()
    first = 0 if start is None else start + 1  # this Flower run's first round (its message bytes)
    base = {
        "run_id": context.run_id,
        "first_round": first,
        "target_rounds": fed.rounds,
        "members": list(rd.members),
        "code_sha256": code,
    }
    rd.write_summary({"status": "running", **base, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    run = None
    try:
        nodes = _wait_for_nodes(grid)
        run = Run(grid, context, cfg, rd, code)
        log(
            f"run {context.run_id}: {fed.clients} clients, {fed.clients_per_round}/round (at least "
            f"{cfg.min_clients()} must reply), {fed.rounds} rounds, {fed.local_epochs} local epochs, strategy "
            f"{fed.strategy}, server optimizer {fed.server_optimizer} (lr {fed.server_lr}), {len(nodes)} node(s); "
            f"run dir {rd.path}"
        )
        critic = _rounds(run, start)
    except BaseException as e:
        if run is not None:
            run.close()
        # A run that dies mid-loop labels no final round (invariant 6); resume picks up from disk.
        error_log = _write_error_log(rd, e)
        services = _shutdown_lanes(run)[0] if run else []
        rd.write_summary(
            {
                "status": "failed",
                **base,
                "error": one_line(f"{type(e).__name__}: {e}"),
                "error_log": str(error_log),
                "wall_s": time.perf_counter() - t_run,
                "nodes": _node_table(run),
                "services": services,
                "lanes": run.lanes.table() if run else {},
            }
        )
        raise
    run.close()
    services, shutdown = _shutdown_lanes(run)
    rd.write_summary(
        {
            "status": "complete",
            **base,
            "message_bytes": _message_bytes(rd, first, shutdown),
            "final_round": fed.rounds,
            "wall_s": time.perf_counter() - t_run,
            "nodes": _node_table(run),
            "services": services,
            "lanes": run.lanes.table(),
            "partition": partition,
            **({"critic": critic} if critic else {}),
            **({"base_sha256": run.header["base_sha256"]} if run.header.get("base_sha256") else {}),
            "config": cfg.model_dump(mode="json"),
        }
    )
    plot_validation(rd.path / "metrics.jsonl", rd.path / "validation.png")
    plot_phases(rd.path / "metrics.jsonl", rd.path / "phases.png")
    log(
        f"done: {fed.rounds} rounds; checkpoints, metrics.jsonl, summary.json, validation.png and phases.png "
        f"in {rd.path}"
    )


def _message_bytes(rd: RunDir, first: int, shutdown: Mapping[str, int]) -> dict[str, int]:
    """The Flower message bytes of this Flower run (its rounds from `first` and its shutdown):
    what Flower's own count of the run (`python -m server_app.traffic`) is compared with."""
    return run_message_bytes([r for r in rd.read_metrics() if r["round"] >= first], shutdown)


def _write_error_log(rd: RunDir, e: BaseException) -> Path:
    """The whole story of a failure (traceback, every client's full error) for the one line in summary.json."""
    path = rd.path / ERROR_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {socket.gethostname()}\n")
        fh.write(strip_ansi("".join(traceback.format_exception(e))) + "\n")
    return path


def _node_table(run: Run | None) -> dict[str, dict[str, str]]:
    return {str(n): info for n, info in sorted(run.nodes.seen.items())} if run else {}


def _critic_provenance(rd: RunDir, resumed_after: int | None, lane_start: dict[str, Any]) -> dict[str, Any]:
    """Where this invocation's critic came from (summary.json): the lane's resolution at round 0
    (explicit | auto-sibling | fresh), or on a resume the run's own critic of the round it
    resumed after, with the round-0 record. Empty for a run without a critic."""
    if "critic" not in rd.members:
        return {}
    if resumed_after is None:
        return {"init": lane_start.get("mode", ""), "source": lane_start.get("path", ""), "round0": lane_start}
    round0: dict[str, Any] = next(
        (row.get("critic_start", {}) for row in rd.read_metrics() if row.get("round") == 0), {}
    )
    return {"init": "resume", "source": str(rd.member_dir(resumed_after, "critic")), "round0": round0}


def _rounds(run: Run, start: int | None) -> dict[str, Any]:
    """Round 0 (if not on disk yet), then rounds start+1..T; returns the critic's provenance."""
    cfg, rd = run.cfg, run.rd
    fed, members = cfg.federation, rd.members
    lane_critic: dict[str, Any] = {}
    resumed_after = start
    if start is None:
        t0 = time.perf_counter()
        tiny = cfg.model.path == "tiny"
        builds = "the tiny model" if tiny else "the warm-started model"
        first_start = (
            f"; its first start on a machine builds {builds} (minutes, then cached; the lane's log says where)"
        )
        log("round 0: starting the trainer lane" + (first_start if tiny or cfg.model.warm_start.episodes else ""))
        with _heartbeat("round 0: waiting for the trainer lane to start and export the initial model"):
            nbytes, lane_critic, init = _initial_model(run, members)
        with _heartbeat("round 0: validating the initial model"):
            val = evaluate_fn(run, 0)
        extra = {"critic_start": lane_critic} if lane_critic else {}
        _seal(run, 0, {**val, **extra, "wall_s": time.perf_counter() - t0, **round0_accounting(init, val)})
        log(
            f"round 0: initial {'+'.join(members)} ({nbytes / 2**20:.1f} MiB), "
            + _validation(val)
            + (f"; critic: {lane_critic.get('mode')} ({lane_critic.get('reason')})" if lane_critic else "")
        )
        start = 0
    else:
        resumed = next((r for r in rd.read_metrics() if r.get("round") == start), {})
        run.set_base(str(resumed.get("base_sha256", "")), f"round {start} (resumed after)")
        log(f"resuming after round {start} (found on disk: {'+'.join(members)})")
    critic = _critic_provenance(rd, resumed_after, lane_critic)

    for rnd in range(start + 1, fed.rounds + 1):
        t0 = time.perf_counter()
        sampled, call, arrays = configure_train(run, rnd)
        server = {"transport": time.perf_counter() - t0}
        row: dict[str, Any] = {"clients": sampled}
        t_train = time.perf_counter()
        with _heartbeat(f"round {rnd}/{fed.rounds}: clients {sampled} training"):
            outcome = train(run, sampled, call, arrays)
        server["train"] = time.perf_counter() - t_train
        replies, failures = outcome.replies, outcome.failures
        row.update(_fit_times(replies))  # before aggregation may refuse a reply
        t_agg = time.perf_counter()
        manifests, train_metrics, scores = aggregate_train(run, rnd, replies, failures, server)
        row["aggregate_s"] = time.perf_counter() - t_agg
        server["aggregation"] = row["aggregate_s"] - server.get("checkpoint", 0.0)
        row["update_scores"], row["flagged"] = scores, flagged_clients(scores)
        if cfg.federation.drop_flagged:
            row["excluded"] = flagged_clients(scores, "excluded")
        if failures:
            row["failed"] = [f.as_dict() for f in failures]
            row["dropped"] = sorted(set(sampled) - set(replies) - set(outcome.spare))
        if outcome.spare:
            row["spare"] = outcome.spare
        row.update(
            {
                k if k.startswith("train_") else f"train_{k}": v
                for k, v in train_metrics.items()
                if not is_traffic_key(k)
            }
        )
        if _due_for_eval(cfg, rnd):
            t_val = time.perf_counter()
            with _heartbeat(f"round {rnd}/{fed.rounds}: validating"):
                row.update(evaluate_fn(run, rnd))
            server["validation"] = time.perf_counter() - t_val
        row["wall_s"] = time.perf_counter() - t0
        per_client = {c: {**client_entry(metrics_of(m)), **lane_entry(reply_of(m))} for c, m in replies.items()}
        row.update(round_accounting(per_client, server, row, row["wall_s"]))
        _seal(run, rnd, row)
        rd.drop_client_uploads(rnd)
        log(
            f"round {rnd}/{fed.rounds}: clients {row['clients']}"
            + (f" (dropped {row['dropped']})" if row.get("dropped") else "")
            + (f" (spare {row['spare']})" if row.get("spare") else "")
            + " | train success "
            f"{row.get('train_success', float('nan')):.3f} reward {row.get('train_reward', float('nan')):.3f} | "
            f"{_validation(row)} | {row['wall_s']:.1f} s | "
            f"{row['bytes_moved'] / 2**20:.1f} MiB moved"
            + (f" | flagged updates: clients {row['flagged']}" if row["flagged"] else "")
        )
    return critic


def _seal(run: Run, rnd: int, row: dict[str, Any]) -> None:
    """Complete round `rnd` with its metrics row (and, under LoRA, the base its adapters add to:
    recorded in the row and its COMPLETE marker), then mirror the row into TensorBoard."""
    if run.header.get("base_sha256"):
        row = {**row, "base_sha256": run.header["base_sha256"]}
    run.rd.complete_round(rnd, row)
    if run.board is not None:
        run.board.add_row(rnd, row)


def configure_train(run: Run, rnd: int) -> tuple[list[int], FitCall, dict[str, ArrayRecord]]:
    """Round `rnd`'s clients and its fit call (Flower's `configure_train`): the call is built
    once and each sampled client's message names that client."""
    fed = run.cfg.federation
    arrays, refs, steps = run.w.payload(rnd - 1, run.rd.members)
    call = FitCall(
        **run.header,
        round=rnd,
        client_id=0,
        local_epochs=fed.local_epochs,
        seed=run.cfg.run.seed,
        proximal_mu=run.aggregator.fit_mu,
        weights=refs,
        steps=steps,
    )
    return run.sampler.sample(rnd), call, arrays


def train(run: Run, sampled: list[int], call: FitCall, arrays: dict[str, ArrayRecord]) -> RoundOutcome:
    """Every sampled client's train message, with failed clients dropped or re-dispatched and
    the round closed by `federation.round_deadline_s` and over-selection (server_app.dispatch)."""
    make: Callable[[int, int], Message] = lambda cid, node: run.message(  # noqa: E731
        node, MessageType.TRAIN, call.model_copy(update={"client_id": cid}), arrays
    )
    nodes = sorted(run.grid.get_node_ids())
    fed = run.cfg.federation
    close = Close(fed.clients_per_round, run.cfg.min_clients(), fed.round_deadline_s)
    outcome = RoundDispatch(
        run.grid,
        make,
        round_=call.round,
        close=close,
        timeout_s=fed.client_timeout_s,
        log=log,
        abandoned=run.abandoned,
    ).run(run.sampler.assign(sampled, nodes))
    for reply in outcome.replies.values():
        run.nodes.note(reply)
        run.lanes.note(reply_of(reply))
    run.lanes.tell_idle(fed.clients_per_round, log)
    return outcome


def _fit_times(replies: dict[int, Message]) -> dict[str, float]:
    """The round's fits' phase times, summed over its replies: the fits' own work (rollouts,
    scoring and updates), their loads and exports, and their whole time. On one lane, where fits take turns,
    `bench.round_overhead` splits the round's wall time by them; a lost attempt's time is not here."""
    sums = dict.fromkeys(("rollout_update", "load", "export", "total"), 0.0)
    for reply in replies.values():
        m = metrics_of(reply)
        sums["rollout_update"] += m.get("rollout_s", 0.0) + m.get("scoring_s", 0.0) + m.get("update_s", 0.0)
        sums["load"] += m.get("load_s", 0.0)
        sums["export"] += m.get("export_s", 0.0)
        sums["total"] += m.get("fit_total_s", 0.0)
    return {f"fits_{k}_s": v for k, v in sums.items()}


def aggregate_train(
    run: Run,
    rnd: int,
    replies: dict[int, Message],
    failures: list[ClientFailure],
    timings: dict[str, float] | None = None,
) -> tuple[dict[str, Manifest], dict[str, float], RoundScores]:
    """Aggregate the replies into the round's checkpoint (Flower's `aggregate_train`, streamed
    from the replies' refs; `federation.aggregator`), with every member's anomaly scores; with a
    server optimizer, the aggregate goes to the round's mean dirs instead (at server_lr 1) and the
    optimizer steps from the round's global model along it (fl_app.server_opt), writing the
    round's moments beside the checkpoint; under a compressed download (`federation.update`
    delta-int8 | delta-int4) the round's global model is then the previous one plus the quantized
    step to it (fl_app.downlink), the step and the server residual kept beside it
    (`timings["checkpoint"]`: the seconds of both)."""
    rd, opt = run.rd, run.server_opt
    out_dirs = {m: rd.member_dir(rnd, m) for m in rd.members}
    previous = {m: rd.member_dir(rnd - 1, m) for m in rd.members}
    earlier = {m: rd.member_dir(rnd - 2, m) for m in rd.members} if rnd >= 2 else {}
    before = {m: d for m, d in earlier.items() if (d / MANIFEST_NAME).exists()}  # the server's last step's origin
    if opt is None:
        manifests, train_metrics, scores = _average(run, rnd, replies, failures, out_dirs, previous, before)
    else:
        mean_dirs = {m: rd.mean_dir(rnd, m) for m in rd.members}
        _, train_metrics, scores = _average(run, rnd, replies, failures, mean_dirs, previous, before)
    if opt is None and not run.w.delta:
        return manifests, train_metrics, scores
    t0 = time.perf_counter()
    if opt is not None:
        manifests = opt.step_round(rd, rnd)
    if run.w.delta:
        fed = run.cfg.federation
        manifests = downlink.compress_round(rd, rnd, fed.update, fed.quant.block)
    if timings is not None:
        timings["checkpoint"] = time.perf_counter() - t0
    return manifests, train_metrics, scores


def _average(
    run: Run,
    rnd: int,
    replies: dict[int, Message],
    failures: list[ClientFailure],
    out_dirs: dict[str, Path],
    previous: dict[str, Path],
    before: dict[str, Path],
) -> tuple[dict[str, Manifest], dict[str, float], RoundScores]:
    """The aggregator's combination of the replies into `out_dirs`, and the updates' scores
    against `previous` (the round's global model) and the server's step to it from `before`. A
    reply the aggregator refuses (one naming a key that is not its client's own upload of this
    round, an entry that does not resolve, a non-finite upload) is a failed client: dropped (and
    the aggregate recomputed without it) when the round can afford it, else the round fails
    closed."""
    while True:
        order = sorted(replies)
        try:
            return run.aggregator.aggregate_train(
                {c: replies[c] for c in order},
                run.w.channel,
                out_dirs,
                lambda c: run.w.client_keys(rnd, c),
                previous,
                before,
            )
        except WeightsError as e:
            client = _blamed(e, order)
            if client is None:
                raise
            failures.append(ClientFailure(client, int(replies[client].metadata.src_node_id), one_line(str(e))))
            if len(order) - 1 < run.cfg.min_clients():
                raise RoundError(
                    f"round {rnd}: client {client}'s upload was refused ({one_line(str(e))}), and "
                    f"the round needs {run.cfg.min_clients()} of its clients "
                    "(federation.min_clients_per_round)"
                ) from e
            log(f"round {rnd}: client {client}'s upload was refused ({one_line(str(e))}); dropped")
            del replies[client]
            for d in out_dirs.values():
                shutil.rmtree(d, ignore_errors=True)


def _blamed(e: WeightsError, order: list[int]) -> int | None:
    """The client an aggregation error blames: a refused reply's, or a non-finite upload's (the
    first culprit; the loop drops one at a time); None for any other error (not a client's)."""
    if isinstance(e, ClientRefused):
        return e.client
    return order[e.inputs[0]] if isinstance(e, NonFiniteWeightsError) and e.inputs else None


def _shutdown_lanes(run: Run) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Stop every node's lane services: one entry per service stopped (fits, evals, its node and
    log), and the shutdown calls' Flower message bytes each way (`client_app.fleet_bytes`)."""
    msgs = [run.message(n, "query.shutdown", Call(**run.header)) for n in sorted(run.grid.get_node_ids())]
    seen = run.nodes
    out, messages = [], {"down": 0, "up": 0}
    for reply in run.grid.send_and_receive(msgs, timeout=120):
        if reply.has_error():
            log(f"shutdown on node {reply.metadata.src_node_id} failed: {one_line(reply.error.reason or '')}")
            continue
        metrics = metrics_of(reply)
        messages = add_counts(messages, message_bytes_in(metrics))
        if metrics["stopped"]:
            node = int(reply.metadata.src_node_id)
            stopped = {k: v for k, v in metrics.items() if not is_traffic_key(k)}
            out.append({"node": node, **stopped, **seen.seen.get(node, {})})
    return out, messages
