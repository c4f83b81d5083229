"""fp32 state dicts <-> safetensors shards plus a JSON manifest.

Weights move between server and clients as files, not as Flower messages, so the files carry
their own integrity: every shard's sha256 and size sit in `manifest.json`, and that manifest is
written last (tmp + fsync + rename), so its presence means every shard is complete on disk.
Readers check the sha256 before any tensor is used: a truncated upload or a file that changed
under a manifest must never be averaged into a global model.

Shard assignment is a pure function of tensor order and sizes (greedy fill up to
`max_shard_bytes`; a tensor bigger than the bound sits alone in its own shard), so the same
state always gives the same files, and clients exporting one model agree on the layout.
Floating tensors must be fp32 (invariant 1: fp32 end to end); integer and bool buffers pass.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from fl_app.hashing import sha256_file

FORMAT = "fedagent-weights"
VERSION = 1
MANIFEST_NAME = "manifest.json"
_READ_CHUNK = 16 << 20

# safetensors dtype tags <-> torch dtypes (the ones a model state can hold).
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


class WeightsError(RuntimeError):
    """Weights on disk are missing, corrupt, inconsistent or not fp32; the message names the fix."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Payload bytes of a state dict (what decides inline vs store transport)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def check_fp32(state: Mapping[str, torch.Tensor]) -> None:
    """Refuse floating tensors that are not fp32 (integer/bool buffers are fine)."""
    bad = [f"{k} ({dtype_name(t.dtype)})" for k, t in state.items()
           if (t.is_floating_point() or t.is_complex()) and t.dtype != torch.float32]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise WeightsError(
            f"non-fp32 floating tensors: {shown}. The project keeps weights fp32 end to end "
            "(invariant 1): export the fp32 master weights, not a bf16/fp16 copy (casting one "
            "back with .float() does not restore the lost bits); pass allow_non_fp32=True only "
            "for a deliberate non-fp32 artifact")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class ShardInfo:
    file: str
    sha256: str
    bytes: int  # file size
    tensors: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class Manifest:
    """What a weights directory holds. `root` is where it was read from (not serialized)."""

    shards: tuple[ShardInfo, ...]
    max_shard_bytes: int
    root: Path | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes on disk over all shards (what a transfer moves)."""
        return sum(s.bytes for s in self.shards)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for s in self.shards for t in s.tensors)

    @property
    def tensors(self) -> list[TensorInfo]:
        return [t for s in self.shards for t in s.tensors]

    @property
    def sha256(self) -> str:
        """Digest of the manifest itself: pins one exact set of shards."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def shard_path(self, index: int) -> Path:
        if self.root is None:
            raise WeightsError("this manifest was not read from a directory; use Manifest.from_dir(path)")
        return self.root / self.shards[index].file

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT,
            "version": VERSION,
            "max_shard_bytes": self.max_shard_bytes,
            "total_bytes": self.total_bytes,
            "tensor_bytes": self.tensor_bytes,
            "shards": [{
                "file": s.file, "sha256": s.sha256, "bytes": s.bytes,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in s.tensors],
            } for s in self.shards],
        }, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, root: Path | None = None) -> "Manifest":
        d = json.loads(text)
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise WeightsError(f"{root}: not a {FORMAT} v{VERSION} manifest (format={d.get('format')!r}, "
                               f"version={d.get('version')!r}); re-export it with fl_app.weights.save_shards")
        shards = tuple(ShardInfo(s["file"], s["sha256"], int(s["bytes"]), tuple(
            TensorInfo(t["name"], tuple(t["shape"]), t["dtype"]) for t in s["tensors"]))
            for s in d["shards"])
        return cls(shards, int(d["max_shard_bytes"]), root)

    @classmethod
    def from_dir(cls, path: Path) -> "Manifest":
        path = Path(path)
        mf = path / MANIFEST_NAME
        if not mf.exists():
            hint = ("it holds files but no manifest: the write that filled it died, so the shards are "
                    "incomplete; re-export them" if path.is_dir() and any(path.iterdir())
                    else "nothing was exported there")
            raise WeightsError(f"{path}: no {MANIFEST_NAME} ({hint})")
        return cls.from_json(mf.read_text(), path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Streams named tensors into bounded shards; `finish()` writes the manifest last.

    Used by `save_shards` and by streaming aggregation, so both split a model identically.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise WeightsError(f"max_shard_bytes must be > 0 (got {max_shard_bytes})")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if any(self.out_dir.iterdir()):
            raise WeightsError(
                f"{self.out_dir} is not empty; weights are written only into a fresh directory "
                "(a complete one is never overwritten, an incomplete one is a dead write): "
                "delete it or choose another directory")
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._pending_ptrs: set[int] = set()
        self._shards: list[ShardInfo] = []
        self._names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise WeightsError(f"tensor {name!r} added twice")
        self._names.add(name)
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        if t.numel() and t.data_ptr() in self._pending_ptrs:
            t = t.clone()  # tied weights: safetensors refuses aliases within one file
        self._pending[name] = t
        self._pending_bytes += nbytes
        if t.numel():
            self._pending_ptrs.add(t.data_ptr())

    def add_all(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.add(name, t)

    def flush(self) -> None:
        """Close the current shard now (no-op when empty)."""
        if not self._pending:
            return
        file = f"shard-{len(self._shards):05d}.safetensors"
        path = self.out_dir / file
        save_file(self._pending, str(path), metadata={"format": "pt"})
        infos = tuple(TensorInfo(k, tuple(v.shape), dtype_name(v.dtype)) for k, v in self._pending.items())
        self._shards.append(ShardInfo(file, sha256_file(path), path.stat().st_size, infos))
        self._pending, self._pending_bytes, self._pending_ptrs = {}, 0, set()

    def finish(self) -> Manifest:
        """Make every shard durable, then publish the manifest (tmp + fsync + rename)."""
        self.flush()
        for shard in self._shards:  # deferred to here so disk writeback overlaps the work above
            _fsync_file(self.out_dir / shard.file)
        manifest = Manifest(tuple(self._shards), self.max_shard_bytes, self.out_dir)
        tmp = self.out_dir / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out_dir / MANIFEST_NAME)
        _fsync_file(self.out_dir)  # the rename itself
        return manifest


def save_shards(state: Mapping[str, torch.Tensor], out_dir: Path, max_shard_bytes: int,
                allow_non_fp32: bool = False) -> Manifest:
    """Write `state` as bounded safetensors shards + manifest into the fresh directory `out_dir`."""
    if not allow_non_fp32:
        check_fp32(state)
    writer = ShardWriter(out_dir, max_shard_bytes)
    writer.add_all(state)
    return writer.finish()


def _read_verified(path: Path, info: ShardInfo, verify: bool) -> mmap.mmap:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise WeightsError(f"shard {path} is missing although the manifest lists it; "
                           "the weights directory was tampered with: re-export the weights") from None
    if size != info.bytes:
        raise WeightsError(f"shard {path} has {size} bytes, the manifest says {info.bytes}: "
                           "it was truncated or replaced after export; re-export the weights")
    # Anonymous mmap, not bytearray: unmapped as soon as the last tensor on it dies, so
    # streaming aggregation does not leave freed shard buffers in malloc arenas (peak RSS);
    # huge pages cut the page-fault cost of filling it (~3x faster reads measured).
    buf = mmap.mmap(-1, max(size, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    h = hashlib.sha256() if verify else None
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos:pos + _READ_CHUNK])
            if not n:
                raise WeightsError(f"shard {path} ended early at byte {pos}; re-export the weights")
            if h is not None:
                h.update(view[pos:pos + n])
            pos += n
    if h is not None and h.hexdigest() != info.sha256:
        raise WeightsError(
            f"shard {path} is corrupt: sha256 {h.hexdigest()[:16]}... does not match the manifest's "
            f"{info.sha256[:16]}...; the file changed after export. Nothing was loaded. Re-export "
            "the weights (client: re-run its fit; server: move the round aside and resume)")
    return buf


def read_shard(manifest: Manifest, index: int, verify: bool = True) -> dict[str, torch.Tensor]:
    """One shard's tensors, in manifest order, after checking its size and sha256.

    The tensors are writable views on one freshly read buffer (one disk read, no extra copy).
    """
    info = manifest.shards[index]
    path = manifest.shard_path(index)
    buf = _read_verified(path, info, verify)
    header_len = int.from_bytes(buf[:8], "little")
    header = json.loads(bytes(buf[8:8 + header_len]))
    base = 8 + header_len
    out: dict[str, torch.Tensor] = {}
    for t in info.tensors:
        entry = header.get(t.name)
        dtype = _ST_DTYPES.get(entry["dtype"]) if entry else None
        if entry is None or dtype is None or dtype_name(dtype) != t.dtype or tuple(entry["shape"]) != t.shape:
            raise WeightsError(f"shard {path} does not hold {t.name} as {t.dtype}{list(t.shape)} like its "
                               f"manifest says (found {entry}); re-export the weights")
        begin, end = entry["data_offsets"]
        if end - begin != t.nbytes or base + end > len(buf):
            raise WeightsError(f"shard {path}: {t.name} spans bytes [{begin}, {end}) which does not fit "
                               f"{t.dtype}{list(t.shape)}; the file is malformed: re-export the weights")
        if t.numel == 0:
            out[t.name] = torch.empty(t.shape, dtype=dtype)
        else:
            out[t.name] = torch.frombuffer(buf, dtype=dtype, count=t.numel, offset=base + begin).view(t.shape)
    return out


def load_shards(src: Path | Manifest, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict, in the original tensor order; every shard is verified before use."""
    manifest = src if isinstance(src, Manifest) else Manifest.from_dir(src)
    state: dict[str, torch.Tensor] = {}
    for i in range(len(manifest.shards)):
        state.update(read_shard(manifest, i, verify))
    return state


def same_layout(manifests: Iterable[Manifest]) -> bool:
    """True when all manifests split the same tensors (names, shapes, dtypes) into the same shards."""
    layouts = {tuple(s.tensors for s in m.shards) for m in manifests}
    return len(layouts) <= 1
