"""Weight transport at scale: one round trip of an fp32 model, server -> 2
nodes and 2 nodes -> server, through the built-in HTTP weight store, next to a raw loopback copy
of the same bytes, and next to Flower's inline transport, all in one run.

    python bench/transport.py --gb 6.2 --workdir /tmp/fa-transport --json /tmp/transport.json

- raw copy: the physical limit on this machine. Per leg, the sender streams every shard file
  with sendfile over one loopback TCP connection per node; the receiver writes it to a file
  (4 MiB recv_into + write), no framing beyond a length per file, no verification.
- weight store: the ServerApp side (WeightStoreServer, a uvicorn thread in this process) and two
  node processes (HttpWeightStore): `fetch` into each node's cache (every shard verified), then
  `publish` of that copy back under a client key (every shard verified by the server, the
  entry renamed into place). Same files, same disk, same two cores.
- Flower inline: a minimal Flower app on a real SuperLink + 2 SuperNodes (loopback,
  deployment mode) sending one ArrayRecord of random fp32 to both nodes and back. Capped at
  --flower-mb (default 256 MB): 2.6 GB failed on a 24 GB machine (SuperLink state locked,
  ClientApps at ~9 GB RSS each: docs/architecture.md fact 1), so the model size is not tried.

Legs run interleaved (raw down, store down, raw up, store up) so load swings on a shared
machine hit both; every number printed is from this one run. Files are removed at the end.

    python bench/transport.py --updates --json /tmp/updates.json

- compressed updates (`federation.update`, fl_app/quant.py), instead of the legs above: per mode
  (full, delta-int8, delta-int4) and per model (the tiny default's tensor shapes, and a random
  fp32 state of --update-params values), 2 clients each upload a trained-like model (the global
  model + 1e-3 noise): the bytes each uploads (inline: its arrays; through a store: its shard
  files) and per round, a client's export time (full: its fp32 shards; delta: delta, error
  feedback, quantization and its shards) and the server's streaming FedAvg of both uploads
  (delta: decoded piece by piece), each the median of --repeats, and the aggregate's error
  against the exact fp32 mean, relative to the mean update's norm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from fl_app.config import Update

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECV_CHUNK = 4 << 20
KEY = "rounds/round-0000/actor"


# ---- the two node processes --------------------------------------------------------------
def _recv_files(conn: socket.socket, out: Path, files: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    buf = memoryview(bytearray(RECV_CHUNK))
    with conn:
        for name in files:
            (size,) = struct.unpack("!Q", _recv_exact(conn, 8))
            with open(out / name, "wb") as f:
                while size:
                    n = conn.recv_into(buf, min(size, RECV_CHUNK))
                    if not n:
                        raise ConnectionError("peer went away")
                    f.write(buf[:n])
                    size -= n


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = s.recv(n - len(data))
        if not piece:
            raise ConnectionError("sender went away")
        data += piece
    return data


def _raw_send(conn: socket.socket, paths: list[Path]) -> None:
    for path in paths:
        conn.sendall(struct.pack("!Q", path.stat().st_size))
        with open(path, "rb") as f:
            conn.sendfile(f)


def node_main() -> None:
    """A node: runs one JSON command per stdin line, answers with its wall-clock start and end."""
    from fl_app.channel.http import HttpWeightStore

    print(json.dumps({"ready": True}), flush=True)  # imports done: legs time transfers, not start-up
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        t0, c0 = time.time(), time.process_time()
        reply: dict[str, Any] = {}
        if op == "raw-recv":
            with socket.create_connection(("127.0.0.1", cmd["port"])) as s:
                _recv_files(s, Path(cmd["dir"]), cmd["files"])
        elif op == "raw-send":
            with socket.create_connection(("127.0.0.1", cmd["port"])) as s:
                _raw_send(s, [Path(cmd["dir"]) / f for f in cmd["files"]])
        elif op == "fetch":
            store = HttpWeightStore(cmd["url"], cmd["token"], max_shard_bytes=1, parallel=cmd["parallel"])
            reply["dir"] = str(store.fetch(KEY, cmd["sha"], Path(cmd["cache"])).root)
        elif op == "publish":
            store = HttpWeightStore(cmd["url"], cmd["token"], max_shard_bytes=1, parallel=cmd["parallel"])
            store.publish(Path(cmd["dir"]), cmd["key"])
        print(json.dumps({"t0": t0, "t1": time.time(), "cpu": time.process_time() - c0, **reply}), flush=True)


class Node:
    def __init__(self, i: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--node"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.i = i
        assert self.reply()["ready"]

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node {self.i} died (exit {self.proc.wait()})")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- legs --------------------------------------------------------------------------------
LEG_CPU: list[dict[str, float]] = []


class Leg(TypedDict, total=False):
    """One direction's figures in the report: seconds per method, their CPU seconds (LEG_CPU entries), rates."""

    raw: float
    raw_cpu: dict[str, float]
    store: float
    store_cpu: dict[str, float]
    raw_gbps: float
    store_gbps: float
    ratio: float


def _both_ways(nodes: list[Node], raw_s: float, raw_dirs: list[Path], ops: list[dict[str, Any]]) -> tuple[Leg, list]:
    """One direction, timed both ways: the raw copy just made (`raw_s`, its `raw_dirs` removed
    now), then the same bytes through the store (`ops`, one per node)."""
    leg: Leg = {"raw": raw_s, "raw_cpu": LEG_CPU[-1]}
    for d in raw_dirs:
        shutil.rmtree(d)
    leg["store"], replies = _leg(nodes, ops, [])
    leg["store_cpu"] = LEG_CPU[-1]
    return leg, replies


def _leg(nodes: list[Node], cmds: list[dict[str, Any]], local: list[threading.Thread]) -> tuple[float, list[dict]]:
    """Start `local` threads (this process's side), send each node its command, wait for all;
    the leg's time runs from the first start to the last finish. CPU seconds of the server side
    (this process) and the nodes go to LEG_CPU."""
    t_local, c_local = time.time(), time.process_time()
    for t in local:
        t.start()
    for node, cmd in zip(nodes, cmds, strict=True):
        node.send(**cmd)
    replies = [node.reply() for node in nodes]
    for t in local:
        t.join()
    LEG_CPU.append({"server": time.process_time() - c_local, "nodes": sum(r["cpu"] for r in replies)})
    t_end = max([r["t1"] for r in replies] + [time.time() if local else 0.0])
    return t_end - min([r["t0"] for r in replies] + ([t_local] if local else [])), replies


def raw_down(nodes: list[Node], src: Path, files: list[str], outs: list[Path]) -> float:
    from envs.ports import bind_listener

    lsock = bind_listener("127.0.0.1", None)

    def serve() -> None:
        conns = [lsock.accept()[0] for _ in nodes]
        senders = [threading.Thread(target=_raw_send, args=(c, [src / f for f in files])) for c in conns]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        for c in conns:
            c.close()

    try:
        dt, _ = _leg(
            nodes,
            [{"op": "raw-recv", "port": lsock.getsockname()[1], "dir": str(o), "files": files} for o in outs],
            [threading.Thread(target=serve)],
        )
    finally:
        lsock.close()
    return dt


def raw_up(nodes: list[Node], srcs: list[Path], files: list[str], outs: list[Path]) -> float:
    from envs.ports import bind_listener

    lsock = bind_listener("127.0.0.1", None)
    port = lsock.getsockname()[1]

    def receive() -> None:
        conns = [lsock.accept()[0] for _ in nodes]
        receivers = [
            threading.Thread(target=_recv_files, args=(c, out, files)) for c, out in zip(conns, outs, strict=True)
        ]
        for t in receivers:
            t.start()
        for t in receivers:
            t.join()

    try:
        dt, _ = _leg(
            nodes,
            [{"op": "raw-send", "port": port, "dir": str(s), "files": files} for s in srcs],
            [threading.Thread(target=receive)],
        )
    finally:
        lsock.close()
    return dt


# ---- the model ---------------------------------------------------------------------------
def build_model(dest: Path, gb: float, shard_bytes: int) -> Any:
    """Random fp32 tensors of 64 MiB (the last one smaller) written as the run's round 0."""
    import torch

    from fl_app.weights import ShardWriter

    total, tensor = int(gb * 1e9), 64 << 20
    writer = ShardWriter(dest, shard_bytes)
    g = torch.Generator().manual_seed(0)
    for i, start in enumerate(range(0, total, tensor)):
        writer.add(f"layer.{i}.weight", torch.rand(min(tensor, total - start) // 4, generator=g))
    return writer.finish()


# ---- compressed updates ------------------------------------------------------------------
UPDATE_MODES: tuple[Update, ...] = ("full", "delta-int8", "delta-int4")


def tiny_state() -> dict[str, Any]:
    """The tiny default's tensors (TinyModelCfg's defaults: Qwen2, width 96, 2 layers, 4 heads,
    a 4096-token vocabulary, tied embeddings), randomly initialised."""
    import torch
    from transformers import Qwen2ForCausalLM

    from client_app.tiny_model import tiny_config
    from fl_app.config import TinyModelCfg

    t = TinyModelCfg()
    config = tiny_config(t, t.vocab_size)
    torch.manual_seed(0)
    return {k: v.detach().float().clone() for k, v in Qwen2ForCausalLM(config).state_dict().items()}


def random_state(params: int) -> dict[str, Any]:
    """`params` random fp32 values in 16 Mi-value tensors (64 MiB; the last one smaller)."""
    import torch

    g, step = torch.Generator().manual_seed(0), 16 << 20
    return {
        f"layer.{i}.weight": torch.randn(min(step, params - o), generator=g)
        for i, o in enumerate(range(0, params, step))
    }


def update_modes(work: Path, name: str, w: dict[str, Any], shard_bytes: int, repeats: int) -> dict[str, Any]:
    """One model's row per mode (module doc)."""
    import statistics

    import torch

    from fl_app.quant import write_update
    from fl_app.robust import Rule, aggregate_manifests
    from fl_app.weights import load_shards, save_shards

    base = save_shards(w, work / name / "global", shard_bytes)
    xs = []
    for c in range(2):
        g = torch.Generator().manual_seed(1 + c)
        xs.append({k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in w.items()})
    exact = {k: (xs[0][k].double() + xs[1][k].double()) / 2 for k in w}
    step = sum(float(((exact[k] - w[k].double()) ** 2).sum()) for k in w) ** 0.5
    rows: dict[str, Any] = {"params": sum(v.numel() for v in w.values()), "fp32_bytes": base.tensor_bytes}
    for mode in UPDATE_MODES:
        export_s, agg_s = [], []
        for i in range(repeats):
            ups, dirs = (
                [],
                [work / name / f"{mode}-{i}-client-{c}" for c in range(2)] + [work / name / f"{mode}-{i}-avg"],
            )
            t = time.perf_counter()
            for x, out in zip(xs, dirs):
                if mode == "full":
                    ups.append(save_shards(x, out, shard_bytes, durable=False))
                else:
                    ups.append(write_update(base, w, x, None, mode, 64, out)[0])
            export_s.append((time.perf_counter() - t) / 2)
            t = time.perf_counter()
            aggregate_manifests([(m, 1.0) for m in ups], base, dirs[-1], shard_bytes, Rule(update=mode))
            agg_s.append(time.perf_counter() - t)
            if i < repeats - 1:
                for d in dirs:
                    shutil.rmtree(d)
        got = load_shards(dirs[-1])
        err = sum(float(((got[k].double() - exact[k]) ** 2).sum()) for k in w) ** 0.5
        rows[mode] = {
            "bytes_up_client": ups[0].tensor_bytes,  # inline: the arrays
            "files_up_client": ups[0].total_bytes,  # through a store: the shard files
            "bytes_up_round": sum(m.tensor_bytes for m in ups),
            "fewer_than_full": base.tensor_bytes / ups[0].tensor_bytes,
            "export_s": statistics.median(export_s),
            "aggregate_s": statistics.median(agg_s),
            "error_vs_step": err / step,
        }
        for d in dirs:
            shutil.rmtree(d)
        print(f"{name} {mode}: {json.dumps(rows[mode])}", flush=True)
    return rows


def _report_updates(r: dict[str, Any]) -> None:
    load = f"load average {r['load_start']:.1f} -> {r['load_end']:.1f}"
    print(f"\ncompressed updates, 2 clients, block 64, median of {r['repeats']}; {load}")
    head = ("model", "mode", "up/client", "up/round", "x fewer", "export", "aggregate", "error/step")
    print("".join(f"{h:<10}" if i < 2 else f"{h:>12}" for i, h in enumerate(head)))
    for name in ("tiny", "random"):
        for mode in UPDATE_MODES:
            x = r[name][mode]
            cells = [
                f"{x['bytes_up_client'] / 2**20:.2f} MiB",
                f"{x['bytes_up_round'] / 2**20:.2f} MiB",
                f"{x['fewer_than_full']:.2f}",
                f"{x['export_s']:.3f} s",
                f"{x['aggregate_s']:.3f} s",
                f"{x['error_vs_step']:.2e}",
            ]
            print(f"{name:<10}{mode:<10}" + "".join(f"{c:>12}" for c in cells))


# ---- Flower inline -----------------------------------------------------------------------
_FLOWER_APP = {
    "pyproject.toml": """
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [project]
        name = "fa-inline-bench"
        version = "1.0.0"
        dependencies = []
        [tool.hatch.build.targets.wheel]
        packages = ["fa_inline_bench"]
        [tool.flwr.app]
        publisher = "fedagent"
        [tool.flwr.app.components]
        serverapp = "fa_inline_bench:server"
        clientapp = "fa_inline_bench:client"
        [tool.flwr.app.config]
        mb = 1
        out = ""
        """,
    "fa_inline_bench/__init__.py": """
        import json, time
        import numpy as np
        from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
        from flwr.clientapp import ClientApp
        from flwr.serverapp import Grid, ServerApp

        server = ServerApp()
        client = ClientApp()

        @server.main()
        def main(grid: Grid, context: Context) -> None:
            while len(list(grid.get_node_ids())) < 2:
                time.sleep(0.5)
            nodes = sorted(grid.get_node_ids())[:2]
            result = {}
            for label, mb in (("small", 1), ("big", int(context.run_config["mb"]))):
                n = mb * 2**20 // 4
                w = np.random.default_rng(mb).random(n, dtype=np.float32)
                msgs = [Message(RecordDict({"arrays": ArrayRecord({"w": Array(w)})}), message_type="train",
                                dst_node_id=nid) for nid in nodes]
                t0 = time.time()
                replies = list(grid.send_and_receive(msgs, timeout=3600))
                t1 = time.time()
                errors = [r.error.reason for r in replies if r.has_error()]
                ok = len(replies) == 2 and not errors and all(
                    r.content["arrays"]["w"].numpy().shape == (n,) for r in replies)
                result[label] = {"mb": mb, "s": t1 - t0, "ok": ok, "errors": errors}
            with open(context.run_config["out"], "w") as f:
                json.dump(result, f)

        @client.train()
        def train(msg: Message, context: Context) -> Message:
            w = msg.content["arrays"]["w"].numpy()
            back = w + np.float32(context.node_id % 997 + 1)    # a different result per node, like a fit
            return Message(RecordDict({"arrays": ArrayRecord({"w": Array(back)})}), reply_to=msg)
        """,
}


def flower_inline(work: Path, mb: int, timeout_s: float) -> dict[str, Any]:
    """One round trip of `mb` MB inline through a real SuperLink and 2 SuperNodes (after one of
    1 MB: the fixed cost, a ClientApp process per message); the seconds the ServerApp's
    send_and_receive took, or why it failed."""
    from envs.ports import choose_free_port

    app, home, out = work / "flower-app", work / "flower-home", work / "flower-result.json"
    for name, text in _FLOWER_APP.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(textwrap.dedent(text).lstrip())
    home.mkdir(parents=True, exist_ok=True)
    link = choose_free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    bindir = Path(sys.executable).parent
    procs: list[subprocess.Popen] = []
    logs = [open(work / f"flower-{n}.log", "w") for n in ("superlink", "node0", "node1")]
    try:
        procs.append(
            subprocess.Popen(
                [
                    str(bindir / "flower-superlink"),
                    "--insecure",
                    "--port",
                    str(link),
                    "--disable-runtime-dependency-installation",
                ],
                env=env,
                stdout=logs[0],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        time.sleep(3)
        for i in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        str(bindir / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link}",
                        "--port",
                        str(choose_free_port()),
                    ],
                    env=env,
                    stdout=logs[1 + i],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        run = subprocess.run(
            [str(bindir / "flwr"), "run", str(app), "bench", "--stream", "--run-config", f'mb={mb} out="{out}"'],
            env=env,
            cwd=app,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if not out.exists():
            return {
                "mb": mb,
                "ok": False,
                "error": f"no result (flwr run exit {run.returncode}): {(run.stdout + run.stderr)[-1500:]}",
            }
        res = json.loads(out.read_text())
        return {
            "mb": mb,
            "ok": res["small"]["ok"] and res["big"]["ok"],
            "s": res["big"]["s"],
            "s_1mb": res["small"]["s"],
            "errors": res["small"]["errors"] + res["big"]["errors"],
        }
    except subprocess.TimeoutExpired:
        return {"mb": mb, "ok": False, "error": f"no result within {timeout_s:.0f} s"}
    finally:
        for p in reversed(procs):  # each started in its own session: stop its whole group by its id
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()


# ---- main --------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.5, help="model size in GB (1e9 bytes); 6.2 = Qwen2.5-1.5B fp32")
    ap.add_argument("--shard-mb", type=float, default=512, help="shard bound (run.shard_max_mb)")
    ap.add_argument("--parallel", type=int, default=4, help="shards in flight per node")
    ap.add_argument("--flower-mb", type=int, default=256, help="Flower inline payload (0 skips it)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fa-transport"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--node", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--updates", action="store_true", help="compressed updates per federation.update mode instead")
    ap.add_argument("--update-params", type=int, default=100_000_000, help="--updates: the random state's values")
    ap.add_argument("--repeats", type=int, default=3, help="--updates: timings are the median of this many")
    args = ap.parse_args()
    if args.node:
        return node_main()
    if args.updates:
        if args.workdir.exists():
            raise SystemExit(f"{args.workdir} exists; remove it or pick another --workdir")
        res: dict[str, Any] = {"repeats": args.repeats, "load_start": os.getloadavg()[0]}
        try:
            shard = int(args.shard_mb * 2**20)
            res["tiny"] = update_modes(args.workdir, "tiny", tiny_state(), shard, args.repeats)
            res["random"] = update_modes(args.workdir, "random", random_state(args.update_params), shard, args.repeats)
        finally:
            shutil.rmtree(args.workdir, ignore_errors=True)
        res["load_end"] = os.getloadavg()[0]
        _report_updates(res)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return None

    from envs.ports import bind_listener
    from fl_app.channel.credentials import Issuer
    from fl_app.channel.http_server import WeightStoreServer

    work = args.workdir
    if work.exists():
        raise SystemExit(f"{work} exists; remove it or pick another --workdir (the bench deletes what it makes)")
    nodes: list[Node] = []
    result: dict[str, Any] = {"gb": args.gb, "parallel": args.parallel, "load_start": os.getloadavg()[0]}
    try:
        run_dir = work / "server"
        t = time.perf_counter()
        model = build_model(run_dir / KEY, args.gb, int(args.shard_mb * 2**20))
        files, nbytes = [s.file for s in model.shards], model.total_bytes
        print(
            f"model: {nbytes / 1e9:.2f} GB in {len(files)} shards ({time.perf_counter() - t:.0f} s to write)",
            flush=True,
        )
        nodes = [Node(i) for i in range(2)]
        issuer = Issuer(run_id=0)
        server = WeightStoreServer(run_dir, issuer, bind_listener("127.0.0.1", None)).start()
        uploads = [f"rounds/round-0001/clients/client-{i:04d}/actor" for i in range(2)]
        # each node's credential, as the ServerApp mints it for a fit: read the global model, write its upload
        tokens = [issuer.mint(round=1, client=i, node=i, read=[KEY], write=[uploads[i]], ttl_s=3600) for i in range(2)]
        legs: dict[str, Leg] = {}
        try:
            raw = [work / f"raw-node{i}" for i in range(2)]
            raw_s = raw_down(nodes, model.root, files, raw)
            fetch = [
                {
                    "op": "fetch",
                    "url": server.url,
                    "token": tokens[i],
                    "sha": model.sha256,
                    "cache": str(work / f"node{i}-cache"),
                    "parallel": args.parallel,
                }
                for i in range(2)
            ]
            legs["down"], replies = _both_ways(nodes, raw_s, raw, fetch)
            fetched = [Path(r["dir"]) for r in replies]
            print(f"down: raw {legs['down']['raw']:.1f} s, store {legs['down']['store']:.1f} s", flush=True)
            raw = [work / f"raw-up{i}" for i in range(2)]
            raw_s = raw_up(nodes, fetched, files, raw)
            publish = [
                {
                    "op": "publish",
                    "url": server.url,
                    "token": tokens[i],
                    "dir": str(fetched[i]),
                    "key": uploads[i],
                    "parallel": args.parallel,
                }
                for i in range(2)
            ]
            legs["up"], _ = _both_ways(nodes, raw_s, raw, publish)
            print(f"up: raw {legs['up']['raw']:.1f} s, store {legs['up']['store']:.1f} s", flush=True)
        finally:
            server.stop()
        moved = 2 * nbytes
        for leg in legs.values():
            leg["raw_gbps"] = moved / leg["raw"] / 1e9
            leg["store_gbps"] = moved / leg["store"] / 1e9
            leg["ratio"] = leg["raw"] / leg["store"]
        raw_s = sum(leg["raw"] for leg in legs.values())
        store_s = sum(leg["store"] for leg in legs.values())
        result.update(
            {
                "bytes": nbytes,
                "shards": len(files),
                "legs": legs,
                "round_trip": {
                    "raw_s": raw_s,
                    "store_s": store_s,
                    "raw_gbps": 2 * moved / raw_s / 1e9,
                    "store_gbps": 2 * moved / store_s / 1e9,
                    "ratio": raw_s / store_s,
                },
            }
        )
        for i in range(2):
            shutil.rmtree(work / f"node{i}-cache")
        shutil.rmtree(run_dir)
        if args.flower_mb:
            fl = flower_inline(work, args.flower_mb, timeout_s=1800)
            if fl.get("ok"):
                fl["gbps"] = 4 * fl["mb"] * 2**20 / fl["s"] / 1e9
                fl["marginal_gbps"] = 4 * (fl["mb"] - 1) * 2**20 / (fl["s"] - fl["s_1mb"]) / 1e9
            result["flower_inline"] = fl
        result["load_end"] = os.getloadavg()[0]
    finally:
        for node in nodes:
            node.stop()
        shutil.rmtree(work, ignore_errors=True)
    _report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _report(r: dict[str, Any]) -> None:
    print(
        f"\n{r['bytes'] / 1e9:.2f} GB fp32 model, {r['shards']} shards, 2 nodes, {r['parallel']} shards in flight "
        f"per node; load average {r['load_start']:.1f} -> {r['load_end']:.1f}"
    )
    print(f"{'leg':<22}{'raw loopback copy':>20}{'HTTP weight store':>20}{'store / raw':>14}")
    for name, leg in r["legs"].items():
        what = "server -> 2 nodes" if name == "down" else "2 nodes -> server"
        print(
            f"{what:<22}{leg['raw']:>9.1f} s {leg['raw_gbps']:>5.2f} GB/s{leg['store']:>9.1f} s "
            f"{leg['store_gbps']:>5.2f} GB/s{leg['ratio']:>13.0%}"
        )
    for name, leg in r["legs"].items():
        cpu = {k: leg[f"{k}_cpu"] for k in ("raw", "store")}
        gb = 2 * r["bytes"] / 1e9
        print(
            f"  CPU s per GB moved, {name}: raw server {cpu['raw']['server'] / gb:.2f} + nodes "
            f"{cpu['raw']['nodes'] / gb:.2f}; store server {cpu['store']['server'] / gb:.2f} + nodes "
            f"{cpu['store']['nodes'] / gb:.2f}"
        )
    rt = r["round_trip"]
    print(
        f"{'round trip':<22}{rt['raw_s']:>9.1f} s {rt['raw_gbps']:>5.2f} GB/s{rt['store_s']:>9.1f} s "
        f"{rt['store_gbps']:>5.2f} GB/s{rt['ratio']:>13.0%}"
    )
    if fl := r.get("flower_inline"):
        if fl.get("ok"):
            print(
                f"Flower inline, {fl['mb']} MB round trip (capped; 2.6 GB fails): {fl['s']:.1f} s "
                f"(1 MB: {fl['s_1mb']:.1f} s), {fl['gbps']:.3f} GB/s, {fl['marginal_gbps']:.3f} GB/s without the "
                f"fixed cost = {fl['marginal_gbps'] / rt['store_gbps']:.1%} of the store's bandwidth"
            )
        else:
            print(f"Flower inline, {fl['mb']} MB: FAILED: {fl.get('error') or fl.get('errors')}")


if __name__ == "__main__":
    main()
