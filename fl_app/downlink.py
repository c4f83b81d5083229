"""Compressed downloads (`federation.update: delta-int8 | delta-int4`, issue #38): the server's
step, quantized, so that a lane holding the previous global model fetches only the step.

After aggregation (and any server optimizer or `server_lr` step) the server holds the exact new
model x of a member. With w the previous round's global model and e the server's residual of the
previous round (zeros before round 2), it quantizes s = x - w + e with the uploads' codec and block
(fl_app.quant), and the round's global model is w' = w + deQ(Q(s)) in fp32 (`quant.decode_tensor`:
two separate operations, the bits a node computes), not x; it keeps e' = s - deQ(Q(s)) (error
feedback on the way down, as each client keeps its own on the way up), so what the global model
moved over the rounds sums to the aggregates' moves up to the last residual. Round r >= 1 keeps
beside its global model, as server state sealed in its COMPLETE marker (fl_app.rundir, like a
server optimizer's moments; a resume continues from exactly round r's residual):

    rounds/round-R/server_opt/downlink/<member>/step       Q(s): an update entry in w's layout whose
                                                           `UpdateMeta.base` is w's manifest sha256
    rounds/round-R/server_opt/downlink/<member>/residual   e' (fp32, w's layout; zeros for buffers)

The round's global model itself is written in full as always (new nodes, resumes and validation
read it as before); a call names it with its step (`Call.steps`), and a lane whose last read is
w rebuilds w' from the step alone (`apply_step`), then checks the result against w''s manifest
digest before using it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fl_app.quant import UpdateMeta, check_update, decode_tensor, encode, physical_names
from fl_app.rundir import RunDir
from fl_app.weights import (
    Manifest,
    ShardWriter,
    TensorInfo,
    WeightsError,
    all_finite,
    dtype_name,
    read_shard,
    same_layout,
    save_shards,
    tensor_views,
)

STEP, RESIDUAL = "step", "residual"


def state_entries(members: Sequence[str]) -> tuple[str, ...]:
    """The server state entries (below a round's server_opt dir) every round r >= 1 of a delta run holds."""
    return tuple(entry(m, part) for m in members for part in (STEP, RESIDUAL))


def entry(member: str, part: str) -> str:
    """The state entry of `member`'s step or residual (`STEP`, `RESIDUAL`)."""
    return f"downlink/{member}/{part}"


def server_step(
    previous: Path,
    exact: Path,
    residual_in: Path | None,
    step_out: Path,
    global_out: Path,
    residual_out: Path,
    mode: str,
    block: int,
) -> tuple[Manifest, Manifest]:
    """Quantize the server's step from the previous global model `previous` to the exact new
    model `exact` with the previous residual `residual_in` (None: zeros) into the fresh dirs
    `step_out` (the update entry), `global_out` (the round's global model, w + deQ(Q(s))) and
    `residual_out` (e'), shard by shard in `previous`'s layout (memory: a few shards). Every input
    is read against its digests. Returns the step's and the global model's manifests; an error
    before they are finished leaves nothing in them (and the round without its COMPLETE marker)."""
    w_m, x_m = Manifest.from_dir(previous), Manifest.from_dir(exact)
    e_m = Manifest.from_dir(residual_in) if residual_in is not None else None
    if not same_layout([w_m, x_m, *([e_m] if e_m else [])]) or w_m.max_shard_bytes != x_m.max_shard_bytes:
        raise WeightsError(
            f"the previous global model ({previous}), the new one ({exact}) and the server residual "
            f"({residual_in}) lay their tensors out differently; resume with the run's own model and "
            "run.shard_max_mb, or use a new run dir"
        )
    shapes = {t.name: list(t.shape) for t in w_m.tensors}
    meta = UpdateMeta.model_validate({"mode": mode, "block": block, "base": w_m.sha256, "shapes": shapes})
    with contextlib.ExitStack() as stack:
        step_w, glob_w, res_w = (
            stack.enter_context(ShardWriter(d, w_m.max_shard_bytes)) for d in (step_out, global_out, residual_out)
        )
        for s, shard in enumerate(w_m.shards):
            w, x = read_shard(w_m, s), read_shard(x_m, s)
            e = read_shard(e_m, s) if e_m is not None else None
            infos = {t.name: t for t in shard.tensors}
            order = [infos[n] for n in physical_names(w_m, s)]
            step_w.begin_shard(tuple(meta.info(t) for t in shard.tensors), [meta.info(t) for t in order])
            glob_w.begin_shard(shard.tensors, order)
            res_w.begin_shard(shard.tensors, order)
            keep = []  # every written tensor stays alive until end_shard (the writes are queued)
            for t in order:
                rows, new_w, res = _step_tensor(meta, t, w[t.name], x[t.name], None if e is None else e[t.name])
                for writer, out in ((step_w, rows), (glob_w, new_w), (res_w, res)):
                    keep.append(out)
                    for view in tensor_views(out):
                        writer.write(view)
            for writer in (step_w, glob_w, res_w):
                writer.end_shard()
            del keep
        res_w.finish()
        return step_w.finish(meta.text()), glob_w.finish()


def compress_round(rd: RunDir, r: int, mode: str, block: int) -> dict[str, Manifest]:
    """Replace round r's global model of every member of `rd`, as the aggregation (or the server
    optimizer) wrote it, by round r - 1's plus the quantized step to it (`server_step`), with the
    step and the new residual beside it as round r's server state. Returns the new manifests."""
    out = {}
    for m in rd.members:
        exact = rd.exact_dir(r, m)
        shutil.rmtree(exact, ignore_errors=True)
        exact.parent.mkdir(parents=True, exist_ok=True)
        rd.member_dir(r, m).rename(exact)
        residual = rd.opt_state_dir(r - 1, entry(m, RESIDUAL)) if r > 1 else None
        step, res = rd.opt_state_dir(r, entry(m, STEP)), rd.opt_state_dir(r, entry(m, RESIDUAL))
        _, out[m] = server_step(rd.member_dir(r - 1, m), exact, residual, step, rd.member_dir(r, m), res, mode, block)
    shutil.rmtree(rd.exact_dir(r, rd.members[0]).parent)
    return out


def _step_tensor(
    meta: UpdateMeta, t: TensorInfo, w: torch.Tensor, x: torch.Tensor, e: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tensor's (step rows, new global tensor, new residual). A buffer (non-floating) travels
    as its new value and keeps a zero residual."""
    if not t.torch_dtype.is_floating_point:
        return x, x, torch.zeros_like(x)
    d = torch.sub(x, w)
    if e is not None:
        d.add_(e)
    if not all_finite(d):
        raise WeightsError(
            f"the server's step of tensor {t.name!r} is not finite (fp32 overflow: the models it is "
            "computed from are finite); lower federation.server_lr, or find why the model moved so far"
        )
    rows, sent = encode(d, meta.mode, meta.block)
    return rows, decode_tensor(meta, t, rows, w), d.sub_(sent)


class StepError(WeightsError):
    """A compressed step a lane will not use (it holds another base, or the step does not rebuild
    the call's global model): the node falls back to the full download."""


def apply_step(
    held: Manifest,
    w: Mapping[str, torch.Tensor],
    meta: UpdateMeta,
    step: Mapping[str, torch.Tensor],
    target_sha256: str,
    out_dir: Path,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Rebuild the global model whose manifest sha256 is `target_sha256` from the held one `w`
    (its manifest `held`, verified) and its compressed step (`step`, by name; metadata `meta`):
    x = w + deQ(step) per tensor, written into the fresh dir `out_dir` with `held`'s shard size.
    The written manifest must be the target's (every shard's digest), else `StepError` and nothing
    stays in `out_dir`; `w` is never written to."""
    try:
        infos = {k: TensorInfo(k, tuple(v.shape), dtype_name(v.dtype)) for k, v in step.items()}
        check_update(meta, infos, held, "the step")
    except WeightsError as e:
        raise StepError(str(e)) from None
    new = {t.name: decode_tensor(meta, t, step[t.name], w[t.name]) for t in held.tensors}
    manifest = save_shards(new, out_dir, held.max_shard_bytes, durable=False)
    if manifest.sha256 != target_sha256:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise StepError(
            f"the step from global model {held.sha256[:12]}... rebuilds {manifest.sha256[:12]}..., not the "
            f"call's global model {target_sha256[:12]}... (a corrupted or foreign step)"
        )
    return manifest, new
