"""Compressed downloads (fl_app.downlink, issue #38): the server's quantized step rebuilds, on a
node holding the previous global model, exactly the round's global model the server wrote (every
shard's digest), keeps exactly what quantization lost as its residual, and a step that does not
rebuild the call's global model is refused without touching the held model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_app.downlink import StepError, apply_step, server_step
from fl_app.quant import UpdateMeta, decode
from fl_app.weights import Manifest, load_shards, save_shards

SHARD = 20_000  # bytes: the model spans several shards


def _model(seed: int, scale: float = 1.0, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (70, 90), "b": (77,), "emb": (33, 41)}  # b and emb: not whole blocks
    out = {k: scale * torch.randn(s, generator=g) + (base[k] if base else 0) for k, s in shapes.items()}
    out["steps"] = torch.tensor([seed], dtype=torch.int64)  # a buffer travels as it is
    return out


def _round(tmp: Path, r: int, prev: Path, exact: dict[str, torch.Tensor], res: Path | None, mode: str, block: int):
    x = save_shards(exact, tmp / f"exact-{r}", SHARD).root
    assert x is not None
    out = [tmp / f"{p}-{r}" for p in ("step", "global", "residual")]
    step, glob = server_step(prev, x, res, *out, mode, block)
    return step, glob, out


@pytest.mark.parametrize(("mode", "block"), [("delta-int8", 64), ("delta-int4", 32)])
def test_a_node_rebuilds_the_servers_global_model_bit_for_bit_from_the_step(tmp_path, mode, block):
    w0 = _model(0)
    prev = save_shards(w0, tmp_path / "global-0", SHARD)
    assert len(prev.shards) > 1
    held, state, residual = prev, load_shards(prev), None
    for r in (1, 2, 3):
        assert held.root is not None
        exact = _model(r, 1e-2, base=load_shards(held))
        step, glob, (_, gdir, rdir) = _round(tmp_path, r, held.root, exact, residual, mode, block)
        meta = UpdateMeta.of(step, "step")
        assert (meta.mode, meta.block, meta.base) == (mode, block, held.sha256)
        assert step.total_bytes < glob.total_bytes / (3.5 if mode == "delta-int8" else 6)
        rebuilt, new = apply_step(held, state, meta, load_shards(step), glob.sha256, tmp_path / f"node-{r}")
        assert rebuilt.sha256 == glob.sha256  # every shard's digest: the server's global model, bit for bit
        assert [s.digest for s in rebuilt.shards] == [s.digest for s in glob.shards]
        # e' = (x - w + e) - deQ(Q(x - w + e)), and the global model moved by deQ(Q(.)) only
        e_prev = load_shards(residual) if residual is not None else None
        e_new, q, g = load_shards(rdir), load_shards(step), load_shards(gdir)
        for k, t in state.items():
            if not t.is_floating_point():
                assert torch.equal(g[k], exact[k]) and torch.equal(e_new[k], torch.zeros_like(t))
                continue
            s = exact[k] - t + (e_prev[k] if e_prev is not None else 0)
            sent = decode(q[k].reshape(-1), mode, block)[: t.numel()].view(t.shape)
            assert torch.equal(g[k], sent + t) and torch.equal(e_new[k], s - sent), (r, k)
            assert not torch.equal(g[k], exact[k])  # the global model is the quantized step's, not x
        held, state, residual = rebuilt, new, rdir


def test_a_step_that_does_not_rebuild_the_calls_global_model_is_refused_and_the_held_model_is_kept(tmp_path):
    prev = save_shards(_model(0), tmp_path / "global-0", SHARD)
    assert prev.root is not None
    state = load_shards(prev)
    kept = {k: v.clone() for k, v in state.items()}
    step, glob, _ = _round(tmp_path, 1, prev.root, _model(1, 1e-2, base=state), None, "delta-int8", 64)
    meta, q = UpdateMeta.of(step, "step"), load_shards(step)
    bad = {k: v.clone() for k, v in q.items()}
    bad["w"][3, 10] ^= 1  # one code off by one: a consistent entry (its own digests match) that is wrong
    with pytest.raises(StepError, match="not the call's global model"):
        apply_step(prev, state, meta, bad, glob.sha256, tmp_path / "node")
    assert not (tmp_path / "node").exists()
    assert all(torch.equal(state[k], kept[k]) for k in kept)  # the held model is untouched
    other = Manifest.from_dir(save_shards(_model(5), tmp_path / "other", SHARD).root)  # type: ignore[arg-type]
    with pytest.raises(StepError, match="a delta from global model"):
        apply_step(other, load_shards(other), meta, q, glob.sha256, tmp_path / "node")  # another base
    rebuilt, _ = apply_step(prev, state, meta, q, glob.sha256, tmp_path / "node")  # the right one still works
    assert rebuilt.sha256 == glob.sha256
