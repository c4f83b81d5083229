"""One config value -> the weight store it names (the run's `run.weight_store`, or the URL the
ServerApp sends its nodes).

  ""                      the run dir (a DirStore): every process sees the same disk (simulation)
  "file:///shared/dir"    a DirStore on a disk every machine mounts: read in place, never copied
  "http(s)://host:port"   the built-in store a ServerApp serves beside itself (http_server.py);
                          needs the call's credential, and for https a CA file unless the system trusts it
  "s3://bucket/prefix"    any other fsspec URL: a user's object store (object_store.py)

"http" (the config value that asks for the built-in store) is not a store a process can open:
the ServerApp keeps using its run dir ("") and serves it, and sends nodes the URL it serves at.

`node_channel` opens a node's end of the channel from the call the server sent: the store it
names, and the node-local settings (cache, CA file, parallel transfers) from the node's recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fl_app.channel.channel import Channel
from fl_app.channel.remote import DEFAULT_PARALLEL
from fl_app.channel.run_dir import DirStore
from fl_app.channel.store import WeightStore
from fl_app.rundir import RunDir
from fl_app.weights import WeightsError

if TYPE_CHECKING:
    from fl_app.calls import Call
    from fl_app.config import RunCfg

SERVED = "http"


def open_store(
    spec: str,
    *,
    run_dir: Path,
    max_shard_bytes: int,
    token: str = "",
    ca_file: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    node: str = "",
) -> WeightStore:
    """The store `spec` names (see the module doc); `node` labels this process in error messages."""
    spec = spec.strip()
    if not spec:
        return DirStore(Path(run_dir), max_shard_bytes)
    if spec == SERVED:
        raise WeightsError(
            "weight store 'http' is the built-in store the ServerApp serves from its run dir: the "
            "ServerApp opens '' (its run dir) and starts fl_app.channel.http_server.WeightStoreServer; a "
            "node opens the http(s):// URL the ServerApp sends"
        )
    parts = urlsplit(spec)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise WeightsError(f"weight store {spec!r}: a shared disk is file:///absolute/path")
        return DirStore(Path(parts.path), max_shard_bytes)
    if parts.scheme in ("http", "https"):
        from fl_app.channel.http import HttpWeightStore

        return HttpWeightStore(
            spec, token, max_shard_bytes=max_shard_bytes, ca_file=ca_file, parallel=parallel, node=node
        )
    if not parts.scheme:
        raise WeightsError(
            f"weight store {spec!r} is neither '' (the run dir), 'http' (the built-in store) nor a "
            "URL such as s3://bucket/prefix or file:///shared/dir"
        )
    from fl_app.channel.object_store import FsspecWeightStore

    return FsspecWeightStore(
        spec, max_shard_bytes=max_shard_bytes, storage_options=storage_options, parallel=parallel, node=node
    )


def node_channel(call: Call, run: RunCfg, node: str) -> tuple[Channel, RunDir]:
    """A node's end of the channel for `call`, and the run dir it writes its uploads into: the
    server's own run dir when that is the store (a shared disk: publishing is free), else a
    node-local one, so that a node on the server's machine never writes under keys the store
    installs. `node` labels this process in error messages."""
    run_dir, shard_bytes = Path(call.run_dir), int(run.shard_max_mb * 2**20)
    store = open_store(
        call.weight_store,
        run_dir=run_dir,
        max_shard_bytes=shard_bytes,
        token=call.weight_store_token,
        ca_file=run.weight_store_ca_file or None,
        parallel=run.weight_store_parallel,
        node=node,
    )
    cache_dir = Path(run.weight_cache_dir).expanduser()
    work = RunDir(run_dir) if not call.weight_store else RunDir(cache_dir / "work" / f"run-{call.run_id}")
    channel = Channel(
        store,
        cache_dir=cache_dir,
        inline_max_bytes=int(run.inline_max_mb * 2**20),
        shard_bytes=shard_bytes,
        run_dir=run_dir,
        run_dir_token=call.run_dir_token,
        node=node,
    )
    return channel, work
