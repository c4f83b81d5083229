"""How weights travel with a message: inline, or by reference to a weight store entry.

Flower is the control plane: a message carries a `WeightsRef` in its ConfigRecord and, for
models up to `inline_max_bytes` (tiny and LoRA-sized), the arrays themselves. Anything bigger
goes through the store as fp32 shards and the message carries only the key plus the sha256
of the manifest the sender wrote, so a receiver can never pick up a different (stale or
re-run) entry under the same key. Both paths give bit-identical tensors.

This module holds no Flower type (fl_app imports no Flower): inline weights are fp32 state
dicts here, and the Flower edge (server_app/, client_app/) wraps them as `ArrayRecord(state)`
and unwraps them with `ArrayRecord.to_torch_state_dict()`, both bit-exact (Flower serialises
arrays with np.save).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fl_app.aggregate import fedavg_manifests, fedavg_states
from fl_app.store import WeightStore
from fl_app.weights import Manifest, WeightsError, check_fp32, load_shards, save_shards, state_nbytes

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class WeightsRef:
    """Which weights a message means: inline arrays, or store entry `key` pinned by its manifest."""

    inline: bool
    nbytes: int
    key: str = ""
    manifest_sha256: str = ""

    def to_config(self, prefix: str = "weights") -> dict[str, str | int | bool]:
        """Flat, ConfigRecord-compatible entries (kebab-case keys, like Flower's own)."""
        return {
            f"{prefix}-inline": self.inline,
            f"{prefix}-nbytes": self.nbytes,
            f"{prefix}-key": self.key,
            f"{prefix}-manifest-sha256": self.manifest_sha256,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], prefix: str = "weights") -> WeightsRef:
        try:
            inline = config[f"{prefix}-inline"]
            if not isinstance(inline, bool):
                raise WeightsError(
                    f"message config {prefix}-inline={inline!r} is not a bool: the sender must "
                    "write WeightsRef.to_config()"
                )
            return cls(
                inline=inline,
                nbytes=int(config[f"{prefix}-nbytes"]),
                key=str(config[f"{prefix}-key"]),
                manifest_sha256=str(config[f"{prefix}-manifest-sha256"]),
            )
        except KeyError as e:
            raise WeightsError(
                f"message config lacks {e.args[0]!r}: the sender must add "
                f"WeightsRef.to_config(prefix={prefix!r}) to its ConfigRecord"
            ) from None


SHARED_DISK_PROBE = ".shared-disk-probe"


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


def arrays_key(member: str) -> str:
    """The RecordDict key of `member`'s inline arrays (its WeightsRef entries use prefix `member`)."""
    return f"{member}-arrays"


def send_weights(
    state: Mapping[str, torch.Tensor], store: WeightStore, key: str, inline_max_bytes: int
) -> tuple[WeightsRef, State]:
    """Ship an in-memory state: inline if small enough (the state, fp32-checked), else put it in
    the store under `key` (an empty inline state)."""
    n = state_nbytes(state)
    if n <= inline_max_bytes:
        check_fp32(state)
        return WeightsRef(inline=True, nbytes=n), dict(state)
    manifest = store.put(key, state)
    return WeightsRef(inline=False, nbytes=n, key=key, manifest_sha256=manifest.sha256), {}


def send_stored(store: WeightStore, key: str, inline_max_bytes: int) -> tuple[WeightsRef, State]:
    """Ship an entry already in the store (e.g. the global model): inline if small, else by ref."""
    manifest = store.manifest(key)
    if manifest.tensor_bytes <= inline_max_bytes:
        state = load_shards(manifest)
        check_fp32(state)
        return WeightsRef(inline=True, nbytes=manifest.tensor_bytes), state
    return WeightsRef(inline=False, nbytes=manifest.tensor_bytes, key=key, manifest_sha256=manifest.sha256), {}


def send_members(
    store: WeightStore, keys: Mapping[str, str], inline_max_bytes: int
) -> tuple[dict[str, State], dict[str, Any], dict[str, WeightsRef]]:
    """Ship several store entries in one message (policy, critic): per member its inline state
    under `arrays_key(member)`, its WeightsRef config entries prefixed by the member, and the refs."""
    arrays: dict[str, State] = {}
    config: dict[str, Any] = {}
    refs: dict[str, WeightsRef] = {}
    for member, key in keys.items():
        refs[member], arrays[arrays_key(member)] = send_stored(store, key, inline_max_bytes)
        config.update(refs[member].to_config(prefix=member))
    return arrays, config, refs


def send_local(store: WeightStore, local_dir: Path, key: str, inline_max_bytes: int) -> tuple[WeightsRef, State]:
    """Ship a weights dir the sender just wrote locally: inline if small (read back, the dir
    deleted: it travels in the message), else published to the store under `key` (the local dir
    deleted too unless it is the entry itself: the store holds its own copy)."""
    manifest = Manifest.from_dir(local_dir)
    if manifest.tensor_bytes <= inline_max_bytes:
        state = load_shards(manifest)
        check_fp32(state)
        shutil.rmtree(local_dir)
        return WeightsRef(inline=True, nbytes=manifest.tensor_bytes), state
    manifest = store.publish(local_dir, key)
    if manifest.root is None or Path(manifest.root).resolve() != Path(local_dir).resolve():
        shutil.rmtree(local_dir)
    return WeightsRef(inline=False, nbytes=manifest.tensor_bytes, key=key, manifest_sha256=manifest.sha256), {}


def receive_manifest(ref: WeightsRef, store: WeightStore, cache_dir: Path) -> Manifest:
    """A verified local copy of the store entry a by-reference `ref` pins (by its manifest digest)."""
    if ref.inline:
        raise WeightsError("this WeightsRef is inline: read the message's arrays (receive_weights)")
    return store.fetch(ref.key, ref.manifest_sha256, cache_dir)


def receive_weights(
    ref: WeightsRef,
    arrays: Mapping[str, torch.Tensor],
    store: WeightStore | None,
    cache_dir: Path | None = None,
    verify: bool = True,
) -> State:
    """The state a message carries, whichever way it travelled (`arrays`: its inline state;
    `cache_dir`: where a remote store puts its local copy)."""
    if ref.inline:
        state = dict(arrays)
        if state_nbytes(state) != ref.nbytes:
            raise WeightsError(
                f"inline arrays hold {state_nbytes(state)} bytes, the WeightsRef says "
                f"{ref.nbytes}: the message lost or gained arrays"
            )
        return state
    if store is None or cache_dir is None:
        raise WeightsError(f"weights {ref.key!r} travel through the store but no store (and cache dir) was given")
    return load_shards(receive_manifest(ref, store, cache_dir), verify)


def fedavg_received(
    items: Sequence[tuple[WeightsRef, Mapping[str, torch.Tensor], float]],
    store: WeightStore | None,
    out_dir: Path,
    max_shard_bytes: int,
    cache_dir: Path | None = None,
    names: Sequence[str] | None = None,
    previous: Path | None = None,
    server_lr: float = 1.0,
) -> Manifest:
    """FedAvg of client replies (ref, inline state, num-examples) into the fresh weights dir `out_dir`.

    Inline replies are averaged in memory, store replies are streamed shard by shard; the two
    give identical bits. One round's replies all travel one way (same model, same threshold).
    `names` label the replies in errors (a non-finite upload: `NonFiniteWeightsError`). With
    `server_lr` != 1 the result steps from `previous`, the round's global weights dir.
    """
    step = previous if server_lr != 1.0 else None  # FedAvg itself never reads it
    if not items:
        raise WeightsError("no client replies to aggregate")
    inline = {ref.inline for ref, _, _ in items}
    if inline == {True}:
        avg = fedavg_states(
            [(receive_weights(r, a, None), w) for r, a, w in items],
            names=names,
            previous=load_shards(step) if step is not None else None,
            server_lr=server_lr,
        )
        return save_shards(avg, out_dir, max_shard_bytes)
    if inline == {False}:
        if store is None or cache_dir is None:
            raise WeightsError("replies travel through the store but no store (and cache dir) was given")
        return fedavg_manifests(
            [(receive_manifest(r, store, cache_dir), w) for r, _, w in items],
            out_dir,
            max_shard_bytes,
            names=names,
            previous=step,
            server_lr=server_lr,
        )
    raise WeightsError(
        "some replies are inline and some by reference; clients of one round must share "
        "run.inline_max_mb (it is part of the run config)"
    )
