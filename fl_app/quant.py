"""Compressed full updates (`federation.update: delta-int8 | delta-int4`, issue #38).

A client sends its update d = x - w (x its trained model, w the round's global model) instead of
x, blockwise absmax-quantized: each tensor, flattened and zero-padded to whole blocks of `block`
values, keeps per block one fp32 scale s = max|d| / L (L = 127 for int8, 7 for int4) and the
codes q = round(d / s) clamped to [-L, L] (a block of zeros: s = 0, q = 0, exactly zero again).
Decoding is q * s, two separate elementwise fp32 operations (the int -> float conversion is
exact, the product rounded once; no fused multiply-add), so every machine decodes the same bits
however the tensor is cut into pieces. The error of a value is at most s / 2 = max|d| / (2L)
of its block (plus the product's rounding).

An update entry is an ordinary weights dir (fl_app.weights) with the global model's shard
layout: shard s holds, under the same names and in the same physical order, one tensor per
tensor of the global model's shard s. A floating tensor of n values becomes a uint8 matrix of
ceil(n / block) rows, each row the block's scale (4 bytes, little-endian fp32) followed by its
codes (int8: one byte per value; int4: two values per byte, code + 8 in the low nibble for the
even index, the high nibble for the odd). Scale and codes of a block are adjacent, so an
aggregator streams a tensor's rows front to back, piece by piece in step with the global
model's fp32 pieces (a piece of fp32 values is a whole number of blocks: `block` divides
`PIECE_BYTES / 4`), reading and hashing every byte once. Non-floating tensors travel unchanged
(every client must hold the same values, as for full weights). The manifest's `update` records
the mode, the block, every tensor's shape in the global model and the sha256 of the global
manifest the delta is from (`UpdateMeta`); a server refuses an update from another global model.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD): a client quantizes
d + e, e its residual of the previous time it trained, and keeps e' = (d + e) - deQ(Q(d + e)),
so what it has sent over its rounds sums to its true updates up to the last residual. Residuals
are per (run dir, client, member) and per round on the node (`Residuals`); see its doc for
which one a fit reads.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fl_app.weights import (
    MANIFEST_NAME,
    Manifest,
    ShardStream,
    ShardWriter,
    TensorInfo,
    WeightsError,
    all_finite,
    canonical_json,
    dtype_name,
    load_shards,
    save_shards,
    tensor_views,
)

log = logging.getLogger(__name__)

LEVELS = {"delta-int8": 127, "delta-int4": 7}  # the largest code of each mode (symmetric)
SCALE_BYTES = 4


def row_bytes(mode: str, block: int) -> int:
    """Bytes of one block: its scale and its codes (one byte each for int8, two per byte for int4)."""
    return SCALE_BYTES + (block if mode == "delta-int8" else block // 2)


class UpdateMeta(BaseModel):
    """What an update entry is: its mode and block, the global model's tensor shapes, and the
    sha256 of the global manifest the delta is from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["delta-int8", "delta-int4"]
    block: int = Field(ge=8, le=4096)
    base: str = Field(pattern="^[0-9a-f]{64}$")
    shapes: dict[str, list[int]]

    @field_validator("block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block {v} is not a power of two (8 to 4096)")
        return v

    @classmethod
    def parse(cls, text: str, where: str) -> UpdateMeta:
        """The update metadata `text` (a manifest's or a ref's `update`) holds; a WeightsError
        naming `where` when it is empty (full weights) or malformed."""
        if not text:
            raise WeightsError(
                f"{where} is full weights, not a compressed update; server and client must share federation.update"
            )
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise WeightsError(
                f"{where}: its update metadata is malformed ({e.errors()[0]['msg']}); re-export it"
            ) from None

    @classmethod
    def of(cls, manifest: Manifest, where: str) -> UpdateMeta:
        """The update metadata a manifest carries (`parse`)."""
        return cls.parse(manifest.update, where)

    def text(self) -> str:
        """The canonical text a manifest keeps (`Manifest.update`)."""
        return canonical_json(self.model_dump())

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.mode, self.block)

    def info(self, t: TensorInfo) -> TensorInfo:
        """How the update holds the global tensor `t`: floating ones as rows of scale + codes."""
        if not t.torch_dtype.is_floating_point:
            return t
        return TensorInfo(t.name, (-(-t.numel // self.block), self.row_bytes), "uint8")

    def piece_bytes(self, t: TensorInfo, n: int) -> int:
        """Bytes of the update's piece for `n` values of `t` starting at a block boundary."""
        if not t.torch_dtype.is_floating_point:
            return n * t.itemsize
        return -(-n // self.block) * self.row_bytes


# ---- the codec --------------------------------------------------------------------------------
def encode(d: torch.Tensor, mode: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the fp32 values `d` (any shape): the rows (uint8, ceil(n / block) x row bytes) and
    what they decode to (fp32, `d`'s shape; the bits of `decode`: integer codes times the scale).
    NaN/Inf make their block's scale non-finite, so the block decodes non-finite (the server
    refuses it): codes are always defined. Few passes, in place where possible (the export of a
    large model is bound by memory bandwidth)."""
    level = LEVELS[mode]
    n = d.numel()
    nb = -(-n // block)
    if n == nb * block:
        x = d.reshape(nb, block)
    else:
        x = torch.zeros(nb * block, dtype=torch.float32)
        x[:n] = d.reshape(-1)
        x = x.view(nb, block)
    scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).div_(level)  # max |d| / L
    q = torch.div(x, scale.masked_fill(scale == 0, 1.0))  # an all-zero block: codes 0 (0 / 1)
    q.nan_to_num_(0.0).clamp_(-level, level).round_().add_(0.0)  # -0.0 -> 0.0: an integer code's float
    codes = q.to(torch.int8)
    rows = torch.empty(nb, row_bytes(mode, block), dtype=torch.uint8)
    rows[:, :SCALE_BYTES] = scale.view(torch.uint8)
    if level == 127:
        rows[:, SCALE_BYTES:] = codes.view(torch.uint8)
    else:
        u = codes.add_(8).view(torch.uint8)
        rows[:, SCALE_BYTES:] = u[:, 0::2] | (u[:, 1::2] << 4)
    return rows, q.mul_(scale).view(-1)[:n].view(d.shape)


def decode(rows: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    """The fp32 values of whole rows (uint8, flat or 2-D): codes * scale, one rounding each."""
    rows = rows.view(-1, row_bytes(mode, block))
    scale = rows[:, :SCALE_BYTES].contiguous().view(torch.float32)
    c = rows[:, SCALE_BYTES:]
    if mode == "delta-int8":
        codes = c.view(torch.int8)
    else:
        lo, hi = (c & 15).view(torch.int8) - 8, (c >> 4).view(torch.int8) - 8
        codes = torch.stack((lo, hi), dim=2).view(-1, block)
    return torch.mul(codes.float(), scale).view(-1)


def decode_piece(meta: UpdateMeta, t: TensorInfo, raw: torch.Tensor, n: int, base: torch.Tensor) -> torch.Tensor:
    """The client's model's piece x = w + deQ(q) of `n` values of `t` from its update's bytes
    `raw` (uint8) and the global model's piece `base`; a non-floating tensor's raw values."""
    if not t.torch_dtype.is_floating_point:
        return raw.view(t.torch_dtype)
    return decode(raw, meta.mode, meta.block)[:n].add_(base)


def decode_tensor(meta: UpdateMeta, t: TensorInfo, update: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """A whole tensor's x = w + deQ(q): `decode_piece` over all of it (the same bits)."""
    return decode_piece(meta, t, update.reshape(-1), t.numel, base.reshape(-1)).view(t.shape)


# ---- checks -----------------------------------------------------------------------------------
def check_update(meta: UpdateMeta, tensors: Mapping[str, TensorInfo], base: Manifest, where: str) -> None:
    """An update (`tensors`: what it holds, by name) must be a delta from `base`, the round's
    global model: its sha256, its tensors (names, shapes) and their encoding under `meta`."""
    if meta.base != base.sha256:
        raise WeightsError(
            f"{where} is a delta from global model {meta.base[:12]}..., not this round's {base.sha256[:12]}... "
            f"({base.root}); it was trained from another round's model and cannot be applied to this one"
        )
    want = {t.name: meta.info(t) for t in base.tensors}
    shapes = {t.name: list(t.shape) for t in base.tensors}
    if meta.shapes != shapes or dict(tensors) != want:
        bad = sorted(k for k in set(want) | set(tensors) if want.get(k) != tensors.get(k))[:3]
        raise WeightsError(
            f"{where} does not encode this round's global model under its {meta.mode} / block {meta.block} "
            f"metadata (first differing tensors: {bad}); client and server must run the same model and recipe"
        )


def check_update_layout(meta: UpdateMeta, update: Manifest, base: Manifest, where: str) -> None:
    """`check_update`, and the update lays its tensors into the global model's shards."""
    check_update(meta, {t.name: t for t in update.tensors}, base, where)
    if [[t.name for t in s.tensors] for s in update.shards] != [[t.name for t in s.tensors] for s in base.shards]:
        raise WeightsError(
            f"{where} splits its tensors into other shards than the round's global model; a client writes "
            "its update in the global model's shard layout (fl_app.quant.write_update)"
        )


def bad_update_tensors(meta: UpdateMeta, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """(name, non-finite decoded values, numel) of every floating tensor an update decodes to NaN/Inf."""
    out = []
    for name, u in tensors.items():
        shape = meta.shapes.get(name)
        if shape is None or list(u.shape) == shape:  # a non-floating tensor travels as it is
            continue  # (an encoded one has ceil(n / block) rows of more than block bytes: never its own shape)
        numel = math.prod(shape)
        d = decode(u.reshape(-1), meta.mode, meta.block)[:numel]
        if k := int((~torch.isfinite(d)).sum()):
            out.append((name, k, numel))
    return out


def is_update(m: Manifest) -> bool:
    return bool(m.update)


# ---- the client's side ------------------------------------------------------------------------
def physical_names(manifest: Manifest, s: int) -> list[str]:
    """The tensors of shard s in their data order (its safetensors header)."""
    with ShardStream(manifest, s, verify=False) as st:
        return [sl.info.name for sl in st.slots]


def write_update(
    base: Manifest,
    w: Mapping[str, torch.Tensor],
    x: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None,
    mode: str,
    block: int,
    out_dir: Path,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Write the update of the trained model `x` (fp32, any device) from the global model `w`
    (verified, CPU; its manifest `base`) with error feedback `residual` (None: zeros) into the
    fresh dir `out_dir`, tensor by tensor in `base`'s shard layout. Returns the manifest and the
    new residual. A tensor whose update is not finite is sent as is (the server refuses it and
    names this client) and keeps a zero residual, so a later round does not carry NaN on."""
    shapes = {t.name: list(t.shape) for t in base.tensors}
    meta = UpdateMeta.model_validate({"mode": mode, "block": block, "base": base.sha256, "shapes": shapes})
    new_residual: dict[str, torch.Tensor] = {}
    with ShardWriter(out_dir, base.max_shard_bytes, durable=False) as writer:
        for s, shard in enumerate(base.shards):
            infos = {t.name: meta.info(t) for t in shard.tensors}
            order = physical_names(base, s)
            writer.begin_shard(tuple(infos[t.name] for t in shard.tensors), [infos[n] for n in order])
            keep = []  # every written tensor stays alive until end_shard (the writes are queued)
            for name in order:
                xt = x[name].detach()
                if xt.dtype != w[name].dtype or xt.shape != w[name].shape:
                    raise WeightsError(
                        f"the trained {name!r} is {dtype_name(xt.dtype)}{list(xt.shape)}, the global model's "
                        f"{dtype_name(w[name].dtype)}{list(w[name].shape)}: the trainer must export the model it loaded"
                    )
                if not xt.is_floating_point():
                    out = xt.cpu().contiguous()
                else:
                    d = torch.sub(xt.cpu(), w[name])
                    if residual is not None:
                        d.add_(residual[name])
                    out, sent = encode(d, mode, block)
                    new_residual[name] = d.sub_(sent) if all_finite(d) else torch.zeros_like(d)
                keep.append(out)
                for view in tensor_views(out):
                    writer.write(view)
            writer.end_shard()
            del keep
        return writer.finish(meta.text()), new_residual


class Residuals:
    """A node's error-feedback residuals: root/<run>/client-<c>/<member>/round-<r>, fp32 shards
    (durable: a resumed run reads them), <run> a digest of the server's run dir.

    The rule: a fit of round r reads the newest complete residual of a round < r and writes its
    own under r (replacing one a killed attempt of round r left). A resumed or re-dispatched
    round r on the same node thus reads exactly the residual its first attempt read, and resume
    is exact. None found (the client's first fit, or one served by another node before): zeros,
    logged and reported in the fit's metrics (`ef_residual_zeros` 1). After writing round r, only
    r and the newest before it are kept (a redo of r reads the latter); later rounds' residuals
    (a run resumed from an earlier round) are removed, as they belong to a discarded future."""

    def __init__(self, root: Path, run_dir: Path) -> None:
        run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
        self.root = Path(root) / run

    def _dir(self, client: int, member: str) -> Path:
        return self.root / f"client-{client}" / member

    def _rounds(self, client: int, member: str) -> list[int]:
        d = self._dir(client, member)
        if not d.is_dir():
            return []
        return sorted(int(p.name.removeprefix("round-")) for p in d.glob("round-*") if (p / MANIFEST_NAME).exists())

    def read(self, client: int, member: str, r: int) -> tuple[int, dict[str, torch.Tensor] | None]:
        """(its round, the residual) a fit of round r starts from; (0, None) when none."""
        older = [q for q in self._rounds(client, member) if q < r]
        if not older:
            log.info(
                "client %d %s round %d: no error-feedback residual on this node, starting from zeros", client, member, r
            )
            return 0, None
        return older[-1], load_shards(self._dir(client, member) / f"round-{older[-1]}")

    def write(self, client: int, member: str, r: int, residual: Mapping[str, torch.Tensor], shard_bytes: int) -> None:
        """Keep round r's residual (durably), then prune (class doc)."""
        d = self._dir(client, member)
        out = d / f"round-{r}"
        shutil.rmtree(out, ignore_errors=True)
        save_shards(residual, out, shard_bytes)
        rounds = self._rounds(client, member)
        before = [q for q in rounds if q < r]
        for q in rounds:
            if q > r or q in before[:-1]:
                shutil.rmtree(d / f"round-{q}")
