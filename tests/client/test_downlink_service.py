"""Compressed downloads on the node (fl_app.downlink, issue #38): the ClientApp fetches only what
its lane lacks (nothing, the step, or the model) through a real store, counting exactly those
bytes; a real TrainerService rebuilds the round's global model from the step onto its last read
and trains from it, and refuses a step it cannot apply (another base, a corrupted step) with
`StepRefused`, which leaves its last read as it was (the ClientApp then downloads the model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_support import delta_service, env_url, model_dir, one_torch_thread, service_call  # noqa: F401

from client_app.downloads import fetch
from client_app.service import Dirs, StepRefused
from fl_app.calls import EvalCall, FitCall
from fl_app.channel import Channel, WeightsRef
from fl_app.channel.run_dir import DirStore
from fl_app.downlink import server_step
from fl_app.quant import UpdateMeta
from fl_app.weights import Manifest, load_shards, save_shards

SHARD = 1 << 20


def _ref(m: Manifest, key: str = "") -> WeightsRef:
    return WeightsRef(inline=False, nbytes=m.tensor_bytes, key=key, manifest_sha256=m.sha256, update=m.update)


def _next_global(tmp: Path, prev: Path, r: int) -> tuple[Manifest, Manifest]:
    """Round r's step and global model as the server writes them, from a moved copy of `prev`."""
    w = load_shards(prev)
    g = torch.Generator().manual_seed(r)
    exact = save_shards({k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in w.items()}, tmp / f"x{r}", SHARD)
    assert exact.root is not None
    outs = [tmp / "rounds" / f"{p}-{r}" for p in ("step", "global", "residual")]
    return server_step(prev, exact.root, None, *outs, "delta-int8", 64)


def test_the_node_fetches_only_what_its_lane_lacks_and_counts_those_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    w0 = save_shards(
        {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g)}, tmp_path / "g0", SHARD
    )
    assert w0.root is not None
    step, w1 = _next_global(tmp_path, w0.root, 1)
    channel = Channel(DirStore(tmp_path, SHARD), cache_dir=tmp_path / "cache", inline_max_bytes=0, shard_bytes=SHARD)
    call = EvalCall(
        round=1, seed=0, weights={"actor": _ref(w1, "rounds/global-1")}, steps={"actor": _ref(step, "rounds/step-1")}
    )
    got = {}
    for what, held in (("none", {}), ("base", {"actor": w0.sha256}), ("model", {"actor": w1.sha256})):
        got[what] = fetch(channel, call, {}, tmp_path / "scratch", held)
    assert got["none"].steps == {} and got["none"].down == {"actor": w1.total_bytes}  # the full model
    assert Manifest.from_dir(got["none"].dirs["actor"]).sha256 == w1.sha256
    assert got["base"].steps == {"actor": str(tmp_path / "rounds" / "step-1")}
    assert got["base"].down == {"actor": step.total_bytes} and step.total_bytes * 3.7 < w1.total_bytes
    assert got["model"].steps == {"actor": ""} and got["model"].down == {"actor": 0}  # nothing moved
    assert got["model"].dirs == {}
    full = EvalCall(round=1, seed=0, weights={"actor": _ref(w1, "rounds/global-1")})  # no step (round 0, full)
    assert fetch(channel, full, {}, tmp_path / "scratch", {"actor": w0.sha256}).down == {"actor": w1.total_bytes}


def test_a_lane_trains_from_the_model_it_rebuilt_and_refuses_a_step_it_cannot_apply(env_url, model_dir, tmp_path):  # noqa: F811
    svc = delta_service(model_dir, tmp_path)
    try:
        svc.start()
        assert svc.trainer is not None
        w0 = save_shards(svc.trainer.export_weights("actor"), tmp_path / "rounds" / "g0", SHARD)
        assert w0.root is not None
        step, w1 = _next_global(tmp_path, w0.root, 1)
        fit = {"round": 2, "client_id": 1, "local_epochs": 1, "seed": 0}
        call = service_call(svc, FitCall, **fit)
        call = call.model_copy(update={"weights": {"actor": _ref(w1)}, "steps": {"actor": _ref(step)}})
        step_dir = str(step.root)

        def dirs(steps: dict[str, str], r: int) -> Dirs:
            return Dirs(steps=steps, weights_out={"actor": str(tmp_path / f"up-{r}")})

        with pytest.raises(StepRefused, match="holds global model none"):  # nothing read yet: no base
            svc.fit(call, dirs({"actor": step_dir}, 0))
        svc.load({"actor": w0.root})  # the lane's last read: round 1's global model (w0 here)
        bad = tmp_path / "bad-step"
        q = load_shards(step.root)  # type: ignore[arg-type]
        q["model.norm.weight"][0, 9] ^= 1  # one code off: a consistent entry that rebuilds another model
        save_shards(q, bad, SHARD)
        with pytest.raises(StepRefused, match="not the call's global model"):
            svc.fit(call, dirs({"actor": str(bad)}, 0))
        assert svc.held() == {"actor": w0.sha256}  # the last read is untouched
        metrics = svc.fit(call, dirs({"actor": step_dir}, 1))["metrics"]
        assert svc.held() == {"actor": w1.sha256} and metrics["load_reused"] == 1.0
        rebuilt = svc._lane_global_dir("actor")
        assert [s.digest for s in Manifest.from_dir(rebuilt).shards] == [s.digest for s in w1.shards]
        up = Manifest.from_dir(tmp_path / "up-1")
        assert UpdateMeta.of(up, "upload").base == w1.sha256  # trained from the rebuilt round-1 model
        svc.fit(call.model_copy(update={"client_id": 0}), dirs({"actor": ""}, 2))  # the lane holds it: nothing fetched
        assert UpdateMeta.of(Manifest.from_dir(tmp_path / "up-2"), "upload").base == w1.sha256
    finally:
        svc.close()


def test_through_the_served_http_store_a_node_fetches_the_step_its_credential_names(tmp_path):
    """Deployment: the ServerApp's own `Weights` (run.weight_store http) names round 1's model and
    its step by key, mints a credential that reads both, and a node holding round 0's model
    downloads only the step; one holding nothing downloads the model."""
    from fl_app.channel.http import HttpWeightStore
    from fl_app.config import load_config
    from fl_app.downlink import compress_round, state_entries
    from fl_app.rundir import RunDir
    from server_app.app import Weights

    overrides = {"federation.update": "delta-int8", "run.weight_store": "http", "run.shard_max_mb": 1}
    cfg = load_config("tiny-shop-grpo", overrides=overrides)
    rd = RunDir(tmp_path / "run", total_rounds=2, members=("actor",), opt_state=state_entries(("actor",)))
    g = torch.Generator().manual_seed(0)
    w0 = save_shards({"w": torch.randn(300, 70, generator=g)}, rd.member_dir(0), SHARD)
    rd.complete_round(0, {})
    save_shards({"w": load_shards(w0)["w"] + 1e-3 * torch.randn(300, 70, generator=g)}, rd.member_dir(1), SHARD)
    w1 = compress_round(rd, 1, "delta-int8", 64)["actor"]
    rd.complete_round(1, {})
    weights = Weights(rd, cfg, run_id=3)
    try:
        arrays, refs, steps = weights.payload(1, ("actor",))
        assert arrays == {} and not refs["actor"].inline and refs["actor"].manifest_sha256 == w1.sha256
        call = EvalCall(round=1, seed=0, weights=refs, steps=steps)
        assert weights.server is not None
        store = HttpWeightStore(weights.server.url, weights.credential(call, 1, 600), max_shard_bytes=SHARD)
        for held, want in (({"actor": w0.sha256}, "step"), ({}, "model")):
            cache = tmp_path / f"cache-{want}"
            channel = Channel(store, cache_dir=cache, inline_max_bytes=0, shard_bytes=SHARD)
            got = fetch(channel, call, {}, tmp_path / f"scratch-{want}", held)
            step = Manifest.from_dir(rd.opt_state_dir(1, "downlink/actor/step"))
            assert got.down == {"actor": (step if want == "step" else w1).total_bytes}, want
            fetched = Manifest.from_dir(got.dirs["actor"])
            assert fetched.sha256 == (step.sha256 if want == "step" else w1.sha256)
    finally:
        weights.close()
