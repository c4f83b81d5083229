"""How weights travel with a Flower message: inline in its ArrayRecord, or by reference to a
weight store entry.

Flower is the control plane: a message carries a `WeightsRef` in its ConfigRecord and, for
models up to `inline_max_bytes` (tiny and LoRA-sized), the arrays themselves. Anything bigger
goes through the store as fp32 shards and the message carries only the key plus the sha256
of the manifest the sender wrote, so a receiver can never pick up a different (stale or
re-run) entry under the same key. Both paths give bit-identical tensors.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fl_app.aggregate import fedavg_manifests, fedavg_states
from fl_app.store import WeightStore
from fl_app.weights import Manifest, WeightsError, check_fp32, load_shards, save_shards, state_nbytes


@dataclass(frozen=True)
class WeightsRef:
    """Which weights a message means: inline arrays, or store entry `key` pinned by its manifest."""

    inline: bool
    nbytes: int
    key: str = ""
    manifest_sha256: str = ""

    def to_config(self, prefix: str = "weights") -> dict[str, str | int | bool]:
        """Flat, ConfigRecord-compatible entries (kebab-case keys, like Flower's own)."""
        return {f"{prefix}-inline": self.inline, f"{prefix}-nbytes": self.nbytes,
                f"{prefix}-key": self.key, f"{prefix}-manifest-sha256": self.manifest_sha256}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], prefix: str = "weights") -> "WeightsRef":
        try:
            return cls(inline=bool(config[f"{prefix}-inline"]), nbytes=int(config[f"{prefix}-nbytes"]),
                       key=str(config[f"{prefix}-key"]),
                       manifest_sha256=str(config[f"{prefix}-manifest-sha256"]))
        except KeyError as e:
            raise WeightsError(f"message config lacks {e.args[0]!r}: the sender must add "
                               f"WeightsRef.to_config(prefix={prefix!r}) to its ConfigRecord") from None


def arrays_key(member: str) -> str:
    """The RecordDict key of `member`'s inline arrays (its WeightsRef entries use prefix `member`)."""
    return f"{member}-arrays"


def state_to_arrayrecord(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """fp32 state -> ArrayRecord (bit-exact: Flower serializes arrays with np.save)."""
    check_fp32(state)
    return ArrayRecord({k: Array(t.detach().cpu().contiguous().numpy()) for k, t in state.items()})


def arrayrecord_to_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(a.numpy()) for k, a in record.items()}


def send_weights(state: Mapping[str, torch.Tensor], store: WeightStore, key: str,
                 inline_max_bytes: int) -> tuple[WeightsRef, ArrayRecord]:
    """Ship an in-memory state: inline if small enough, else put it in the store under `key`."""
    n = state_nbytes(state)
    if n <= inline_max_bytes:
        return WeightsRef(inline=True, nbytes=n), state_to_arrayrecord(state)
    manifest = store.put(key, state)
    return WeightsRef(inline=False, nbytes=n, key=key, manifest_sha256=manifest.sha256), ArrayRecord()


def send_stored(store: WeightStore, key: str, inline_max_bytes: int) -> tuple[WeightsRef, ArrayRecord]:
    """Ship an entry already in the store (e.g. the global model): inline if small, else by ref."""
    manifest = store.manifest(key)
    if manifest.tensor_bytes <= inline_max_bytes:
        return WeightsRef(inline=True, nbytes=manifest.tensor_bytes), state_to_arrayrecord(load_shards(manifest))
    return WeightsRef(inline=False, nbytes=manifest.tensor_bytes, key=key,
                      manifest_sha256=manifest.sha256), ArrayRecord()


def send_members(store: WeightStore, keys: Mapping[str, str], inline_max_bytes: int
                 ) -> tuple[dict[str, ArrayRecord], dict[str, Any], dict[str, WeightsRef]]:
    """Ship several store entries in one message (policy, critic): per member its ArrayRecord
    under `arrays_key(member)`, its WeightsRef config entries prefixed by the member, and the refs."""
    arrays: dict[str, ArrayRecord] = {}
    config: dict[str, Any] = {}
    refs: dict[str, WeightsRef] = {}
    for member, key in keys.items():
        refs[member], arrays[arrays_key(member)] = send_stored(store, key, inline_max_bytes)
        config.update(refs[member].to_config(prefix=member))
    return arrays, config, refs


def receive_manifest(ref: WeightsRef, store: WeightStore) -> Manifest:
    """The store entry a by-reference `ref` points at, checked against the pinned manifest digest."""
    if ref.inline:
        raise WeightsError("this WeightsRef is inline: read the message's ArrayRecord (receive_weights)")
    manifest = store.manifest(ref.key)
    if manifest.sha256 != ref.manifest_sha256:
        raise WeightsError(f"store entry {ref.key!r} is not the one the sender wrote (manifest sha256 "
                           f"{manifest.sha256[:12]}... != {ref.manifest_sha256[:12]}...): it was replaced, "
                           "e.g. by a re-run; drop this reply and re-run the fit")
    return manifest


def receive_weights(ref: WeightsRef, arrays: ArrayRecord, store: WeightStore | None,
                    verify: bool = True) -> dict[str, torch.Tensor]:
    """The state a message carries, whichever way it travelled."""
    if ref.inline:
        state = arrayrecord_to_state(arrays)
        if state_nbytes(state) != ref.nbytes:
            raise WeightsError(f"inline arrays hold {state_nbytes(state)} bytes, the WeightsRef says "
                               f"{ref.nbytes}: the message lost or gained arrays")
        return state
    if store is None:
        raise WeightsError(f"weights {ref.key!r} travel through the store but no store was given")
    return load_shards(receive_manifest(ref, store), verify)


def fedavg_received(items: Sequence[tuple[WeightsRef, ArrayRecord, float]], store: WeightStore | None,
                    out_dir: Path, max_shard_bytes: int) -> Manifest:
    """FedAvg of client replies (ref, arrays, num-examples) into the fresh weights dir `out_dir`.

    Inline replies are averaged in memory, store replies are streamed shard by shard; the two
    give identical bits. One round's replies all travel one way (same model, same threshold).
    """
    if not items:
        raise WeightsError("no client replies to aggregate")
    inline = {ref.inline for ref, _, _ in items}
    if inline == {True}:
        avg = fedavg_states([(receive_weights(r, a, None), w) for r, a, w in items])
        return save_shards(avg, out_dir, max_shard_bytes)
    if inline == {False}:
        if store is None:
            raise WeightsError("replies travel through the store but no store was given")
        return fedavg_manifests([(receive_manifest(r, store), w) for r, _, w in items], out_dir, max_shard_bytes)
    raise WeightsError("some replies are inline and some by reference; clients of one round must share "
                       "run.inline_max_mb (it is part of the run config)")
