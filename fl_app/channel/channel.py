"""put(local dir) -> ref, get(ref) -> local dir: how weights travel with a call.

Flower is the control plane: a call carries one `WeightsRef` per member and, for models up to
`inline_max_bytes` (tiny and LoRA-sized), the arrays themselves (the inline backend: they ride
in the Flower message and are materialised once, on the receiving side). Anything bigger goes
through the run's store as fp32 shards (the run dir, the served http store, a shared disk, an
object store: `open.open_store`), and the ref carries only the key plus the sha256 of the
manifest the sender wrote, so a receiver can never pick up a different (stale or re-run) entry
under the same key. Both ways give bit-identical tensors.

A client's upload under `federation.update: delta-int8 | delta-int4` travels the same ways: a
compressed update (fl_app.quant: uint8 tensors, its metadata in the manifest and in the ref's
`update`), which the server decodes onto the round's global model.

This module holds no Flower type (fl_app imports no Flower): inline weights are state
dicts here, and the Flower edge (server_app/, client_app/) packs each into one Flower Array
(`server_app.packed`: the state's safetensors bytes, so a message carries 3 objects instead of
2 per tensor) and unpacks it, bit-exact.
"""

from __future__ import annotations

import secrets
import shutil
import socket
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from fl_app.channel.remote import cached, prune_cache
from fl_app.channel.run_dir import DirStore
from fl_app.channel.store import WeightStore
from fl_app.weights import Manifest, WeightsError, check_fp32, load_shards, save_shards, state_nbytes

State = dict[str, torch.Tensor]
# fetched global models a node keeps (newest first; the members of the last few rounds): the
# rest is pruned, so a long run of a large model does not fill the node's disk
CACHE_KEEP = 8
SHARED_DISK_PROBE = ".shared-disk-probe"


class WeightsRef(BaseModel):
    """Which weights a call means: inline arrays, or store entry `key` pinned by its manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inline: StrictBool
    nbytes: int = Field(ge=0)
    key: str = ""
    manifest_sha256: str = ""
    update: str = ""  # a compressed update's metadata (`Manifest.update`, fl_app.quant); '' for weights


def arrays_key(member: str) -> str:
    """The RecordDict key of `member`'s inline arrays."""
    return f"{member}-arrays"


def write_disk_probe(run_dir: Path) -> str:
    """Leave a fresh random token in the run dir; a node that reads it back shares the disk."""
    token = secrets.token_hex(16)
    (run_dir / SHARED_DISK_PROBE).write_text(token)
    return token


def sees_disk_probe(run_dir: Path, token: str) -> bool:
    """True when this machine reads the same run dir the server wrote `token` into."""
    try:
        return (run_dir / SHARED_DISK_PROBE).read_text() == token
    except OSError:
        return False


class Channel:
    """One process's end of the weight channel over `store`.

    `cache_dir` is where a remote store puts its verified local copies; `run_dir` and
    `run_dir_token` name the server's run dir and its shared-disk probe, so that a node that
    must pass weights through a run dir it cannot see is told so, instead of failing later on a
    missing file.
    """

    def __init__(
        self,
        store: WeightStore,
        *,
        cache_dir: Path,
        inline_max_bytes: int,
        shard_bytes: int,
        run_dir: Path | None = None,
        run_dir_token: str = "",
        node: str = "",
    ) -> None:
        self.store, self.cache_dir = store, Path(cache_dir)
        self.inline_max_bytes, self.shard_bytes = inline_max_bytes, shard_bytes
        self.run_dir, self.run_dir_token, self.node = run_dir, run_dir_token, node

    @property
    def is_run_dir(self) -> bool:
        """The store is the server's run dir itself (simulation, a shared disk)."""
        return isinstance(self.store, DirStore) and self.run_dir is not None and self.store.root == self.run_dir

    def require_store(self, nbytes: int) -> None:
        """Weights of `nbytes` must travel through the store: make sure this process reaches it."""
        if (
            self.is_run_dir
            and self.run_dir
            and self.run_dir_token
            and not sees_disk_probe(self.run_dir, self.run_dir_token)
        ):
            raise WeightsError(
                f"{self.node or socket.gethostname()} cannot see the run dir at {self.run_dir}: the server "
                f"and this node do not share a disk, so weights of {nbytes / 2**20:.1f} MiB (above "
                f"run.inline_max_mb={self.inline_max_bytes / 2**20:g}) cannot travel through it. Set "
                "run.weight_store=http (the weight channel), mount the run dir at the same path on every node, "
                "or raise run.inline_max_mb"
            )

    def put(self, local_dir: Path, key: str) -> tuple[WeightsRef, State]:
        """Ship a weights dir this process just wrote: inline if small (read back, the dir
        deleted: it travels in the message), else published to the store under `key` (the local
        dir deleted too unless it is the entry itself: the store holds its own copy)."""
        manifest = Manifest.from_dir(local_dir)
        if manifest.tensor_bytes <= self.inline_max_bytes:
            state = load_shards(manifest)
            check_fp32(state)
            shutil.rmtree(local_dir)
            return WeightsRef(inline=True, nbytes=manifest.tensor_bytes, update=manifest.update), state
        self.require_store(manifest.tensor_bytes)
        manifest = self.store.publish(local_dir, key)
        if manifest.root is None or Path(manifest.root).resolve() != Path(local_dir).resolve():
            shutil.rmtree(local_dir)
        sha = manifest.sha256
        return WeightsRef(
            inline=False, nbytes=manifest.tensor_bytes, key=key, manifest_sha256=sha, update=manifest.update
        ), {}

    def down_bytes(self, ref: WeightsRef) -> int:
        """The bytes a `get(ref)` about to run moves to this process: the inline arrays the message
        carries; a store entry's shard files, read from the shared disk (a DirStore) or downloaded
        (a remote store: 0 when the node's cache holds the entry already)."""
        if ref.inline:
            return ref.nbytes
        if isinstance(self.store, DirStore):
            return self.manifest(ref).total_bytes
        return 0 if cached(self.cache_dir, ref.manifest_sha256) else self.store.manifest(ref.key).total_bytes

    def up_bytes(self, local_dir: Path) -> int:
        """The bytes a `put(local_dir)` about to run moves from this process: the arrays, inline;
        else the shard files it writes to the shared disk or uploads."""
        manifest = Manifest.from_dir(local_dir)
        return manifest.tensor_bytes if manifest.tensor_bytes <= self.inline_max_bytes else manifest.total_bytes

    def get_all(
        self, refs: Mapping[str, WeightsRef], arrays: Mapping[str, Mapping[str, torch.Tensor]], scratch: Path
    ) -> tuple[dict[str, Path], dict[str, int]]:
        """`get` of every member (inline ones into `scratch/global-<member>`), and per member the
        bytes that travelled for it (`down_bytes`)."""
        down = {m: self.down_bytes(r) for m, r in refs.items()}
        return {m: self.get(r, arrays[m], scratch / f"global-{m}") for m, r in refs.items()}, down

    @staticmethod
    def release_all(refs: Mapping[str, WeightsRef], dirs: Mapping[str, Path]) -> None:
        """Drop the dirs `get_all` wrote for inline members (a store entry's copy stays: the store's)."""
        for m, ref in refs.items():
            if ref.inline:
                shutil.rmtree(dirs[m])

    def put_all(
        self, outs: Mapping[str, Path], key: Callable[[Path], str]
    ) -> tuple[dict[str, WeightsRef], dict[str, State], dict[str, int]]:
        """`put` of every member's dir under `key(dir)`: per member its ref, its inline state (empty
        unless inline) and the bytes that travelled for it (`up_bytes`)."""
        up = {m: self.up_bytes(d) for m, d in outs.items()}
        shipped = {m: self.put(d, key(d)) for m, d in outs.items()}
        return {m: r for m, (r, _) in shipped.items()}, {m: s for m, (_, s) in shipped.items()}, up

    def put_entry(self, key: str) -> tuple[WeightsRef, State]:
        """Ship an entry already in the store (the global model): inline if small, else by ref."""
        manifest = self.store.manifest(key)
        if manifest.tensor_bytes <= self.inline_max_bytes:
            state = load_shards(manifest)
            check_fp32(state)
            return WeightsRef(inline=True, nbytes=manifest.tensor_bytes), state
        return WeightsRef(inline=False, nbytes=manifest.tensor_bytes, key=key, manifest_sha256=manifest.sha256), {}

    def get(self, ref: WeightsRef, arrays: Mapping[str, torch.Tensor], scratch: Path) -> Path:
        """A verified local weights dir holding what `ref` names: the store entry's local copy
        (a remote store's node cache, pruned to the newest `CACHE_KEEP`), or the inline `arrays`
        written once into `scratch`."""
        if ref.inline:
            shutil.rmtree(scratch, ignore_errors=True)
            save_shards(self.state(ref, arrays), scratch, self.shard_bytes)
            return scratch
        local = self.manifest(ref).root
        if not self.is_run_dir:
            prune_cache(self.cache_dir, keep=CACHE_KEEP)
        if local is None:
            raise WeightsError(f"the weight store returned no local copy of {ref.key!r}")
        return Path(local)

    def manifest(self, ref: WeightsRef) -> Manifest:
        """A verified local copy of the store entry a by-reference `ref` pins (by its manifest digest)."""
        if ref.inline:
            raise WeightsError("this WeightsRef is inline: read the message's arrays (Channel.state)")
        self.require_store(ref.nbytes)
        return self.store.fetch(ref.key, ref.manifest_sha256, self.cache_dir)

    def state(self, ref: WeightsRef, arrays: Mapping[str, torch.Tensor], verify: bool = True) -> State:
        """The state a call carries, whichever way it travelled (`arrays`: its inline state)."""
        if not ref.inline:
            return load_shards(self.manifest(ref), verify)
        state = dict(arrays)
        if state_nbytes(state) != ref.nbytes:
            raise WeightsError(
                f"inline arrays hold {state_nbytes(state)} bytes, the WeightsRef says "
                f"{ref.nbytes}: the message lost or gained arrays"
            )
        return state
