"""One config value -> the weight store it names (the run's `run.weight_store`, or the URL the
ServerApp sends its nodes).

  ""                      the run dir (a DirStore): every process sees the same disk (simulation)
  "file:///shared/dir"    a DirStore on a disk every machine mounts: read in place, never copied
  "http(s)://host:port"   the built-in store a ServerApp serves beside itself (store_server.py);
                          needs the run's token, and for https a CA file unless the system trusts it
  "s3://bucket/prefix"    any other fsspec URL: a user's object store (store_fsspec.py)

"http" (the config value that asks for the built-in store) is not a store a process can open:
the ServerApp keeps using its run dir ("") and serves it, and sends nodes the URL it serves at.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fl_app.store import DirStore, WeightStore
from fl_app.store_remote import DEFAULT_PARALLEL
from fl_app.weights import WeightsError

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
            "ServerApp opens '' (its run dir) and starts fl_app.store_server.WeightStoreServer; a "
            "node opens the http(s):// URL the ServerApp sends"
        )
    parts = urlsplit(spec)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise WeightsError(f"weight store {spec!r}: a shared disk is file:///absolute/path")
        return DirStore(Path(parts.path), max_shard_bytes)
    if parts.scheme in ("http", "https"):
        from fl_app.store_http import HttpWeightStore

        return HttpWeightStore(
            spec, token, max_shard_bytes=max_shard_bytes, ca_file=ca_file, parallel=parallel, node=node
        )
    if not parts.scheme:
        raise WeightsError(
            f"weight store {spec!r} is neither '' (the run dir), 'http' (the built-in store) nor a "
            "URL such as s3://bucket/prefix or file:///shared/dir"
        )
    from fl_app.store_fsspec import FsspecWeightStore

    return FsspecWeightStore(
        spec, max_shard_bytes=max_shard_bytes, storage_options=storage_options, parallel=parallel, node=node
    )
