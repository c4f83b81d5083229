"""What a lane does around a fit, done once and cheaply (issue #17's round overhead): it reads a
round's global once and keeps no more than its last read (invariant 24), fsyncs only what a
crash must not lose, and its end-of-fit collection scans only what the fit created. A real
TrainerService, real fits on a real env service, CPU."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import psutil
import pytest
import torch
from trainer_support import (  # noqa: F401
    assert_flat,
    env_url,
    model_dir,
    one_torch_thread,
    random_model_dir,
    service_call,
    service_fit,
    small_config,
)

import fl_app.weights as weights
from client_app.service import Dirs, TrainerService
from fl_app.calls import EvalCall, InitCall
from fl_app.weights import load_shards, save_shards


def test_a_lane_reads_each_global_once_and_every_fit_starts_from_it(env_url, model_dir, tmp_path):  # noqa: F811
    """The second client's fit of a round (and the validation) reuse the lane's verified read of
    the global; both fits start from the global itself, never from what the first fit trained
    (a fresh read gives the same result bit for bit); a new manifest is read from disk."""
    cfg = small_config(model_dir, federation={"clients": 4, "clients_per_round": 2, "tasks_per_client": 20})
    svc = TrainerService(cfg, run_id=1, lane="cpu", run_dir=tmp_path)
    try:
        svc.start()
        assert svc.trainer is not None
        global_dir = save_shards(svc.trainer.export_weights("actor"), tmp_path / "global", 1 << 20).root

        def fit(client: int, weights_in: Path, out: str) -> dict[str, float]:
            return service_fit(svc, client, weights_in, tmp_path / out)

        assert fit(0, global_dir, "c0")["load_reused"] == 0.0
        second = fit(1, global_dir, "c1")
        assert second["load_reused"] == 1.0
        svc._last_read.clear()  # what a lane without the reuse would do: read the global again
        assert fit(1, global_dir, "c1-fresh")["load_reused"] == 0.0
        reused, fresh = load_shards(tmp_path / "c1"), load_shards(tmp_path / "c1-fresh")
        assert all(torch.equal(reused[k], fresh[k]) for k in fresh), "the kept read was trained in place"
        assert any(not torch.equal(fresh[k], v) for k, v in load_shards(global_dir).items()), "the fit must train"
        # validation of the same global reuses the read; another manifest is read from disk
        validation = svc.evaluate(
            service_call(svc, EvalCall, round=1, seed=0), Dirs(weights_in={"actor": str(global_dir)})
        )
        assert validation["metrics"]["load_reused"] == 1.0
        previous = weakref.ref(next(iter(svc._last_read["actor"][1].values())))
        assert fit(2, tmp_path / "c0", "c2")["load_reused"] == 0.0
        # invariant 24: the lane keeps one read per member, and the replaced one is released
        gc.collect()
        assert list(svc._last_read) == ["actor"] and previous() is None, "a replaced read outlived the next round"
    finally:
        svc.close()


def test_initial_weights_are_fsynced_and_a_fit_upload_is_not(env_url, model_dir, tmp_path, monkeypatch):  # noqa: F811
    """Round 0's weights are durable; a fit's upload skips the fsyncs (the server verifies it by
    digest, and a crash makes the round redo it), and still loads, verified, as the fit's result."""
    synced: list[Path] = []
    fsync_path = weights.fsync_path
    monkeypatch.setattr(weights, "fsync_path", lambda p: (synced.append(Path(p)), fsync_path(p))[1])
    cfg = small_config(model_dir, federation={"clients": 2, "clients_per_round": 1, "tasks_per_client": 20})
    svc = TrainerService(cfg, run_id=1, lane="cpu", run_dir=tmp_path)
    try:
        svc.start()
        svc.init(service_call(svc, InitCall), Dirs(weights_out={"actor": str(tmp_path / "init")}))
        assert tmp_path / "init" in synced and any(p.parent == tmp_path / "init" for p in synced)
        synced.clear()
        service_fit(svc, 0, tmp_path / "init", tmp_path / "c0")
        assert synced == []
        assert svc.trainer is not None
        exported = svc.trainer.export_weights("actor")
        assert all(torch.equal(v, exported[k]) for k, v in load_shards(tmp_path / "c0").items())
    finally:
        svc.close()


def test_the_end_of_fit_collection_scans_only_what_the_fit_created_and_memory_stays_flat(
    env_url,
    tmp_path,  # noqa: F811
):
    """The lane freezes its long-lived objects after start and after each fit, so `release_memory`'s
    full collection walks a fit's own objects, not the 400k+ of torch, transformers and the
    models (0.20 s a fit before). Freezing must not keep garbage alive (invariant 24): over 8
    fits, each from the previous fit's upload (a new global every time, so the kept read is
    replaced), the frozen objects level off after the first fits, and RSS stays flat on a model
    large enough for a leaked copy to show."""
    wide = random_model_dir(tmp_path / "wide", hidden_size=256, layers=2, heads=4)
    cfg = small_config(
        wide, federation={"clients": 8, "clients_per_round": 2, "tasks_per_client": 20}, env={"max_turns": 2}
    )
    svc = TrainerService(cfg, run_id=1, lane="cpu", run_dir=tmp_path)
    rss: list[float] = []
    frozen: list[float] = []
    try:
        svc.start()
        started = gc.get_freeze_count()
        assert started > 100_000, "the lane froze nothing after its start"
        assert svc.trainer is not None
        state = svc.trainer.export_weights("actor")
        weights_in = save_shards(state, tmp_path / "c-1", 1 << 20).root
        for client in range(8):
            frozen.append(service_fit(svc, client, weights_in, tmp_path / f"c{client}")["service_frozen_objects"])
            weights_in = tmp_path / f"c{client}"
            rss.append(psutil.Process().memory_info().rss / 2**20)
            assert len(gc.get_objects()) < started / 20, "a fit left the collector a heap to scan"
    finally:
        svc.close()
    assert gc.get_freeze_count() == 0, "a closed service must hand its frozen objects back"
    print(f"frozen objects after each fit: {frozen}")
    assert frozen[-1] - frozen[2] <= 50, f"the frozen heap grows with every fit: {frozen}"
    assert_flat(rss, warmup=2, model_mb=sum(t.numel() * 4 for t in state.values()) / 2**20)


def test_a_lane_reads_every_round_into_the_same_buffers_unless_a_tensor_still_views_them(
    env_url,  # noqa: F811
    model_dir,  # noqa: F811
    tmp_path,
):
    """The lane's read buffers (pinned on a CUDA lane) are reused round after round, so the
    pinning is paid once and one set is held; a buffer some tensor still views is never
    overwritten: that read gets fresh memory, and the old tensor keeps its values."""
    from client_app.service import ReadBuffers

    cfg = small_config(model_dir, federation={"clients": 4, "clients_per_round": 2, "tasks_per_client": 20})
    svc = TrainerService(cfg, run_id=1, lane="cpu", run_dir=tmp_path)
    try:
        svc.start()
        svc.init(service_call(svc, InitCall), Dirs(weights_out={"actor": str(tmp_path / "g0")}))
        pointers = []
        for r, global_dir in enumerate(["g0", "c0", "c1"]):  # a round: the validation's read, then a fit
            svc.evaluate(
                service_call(svc, EvalCall, round=r, seed=0), Dirs(weights_in={"actor": str(tmp_path / global_dir)})
            )
            pointers.append(sorted(t.data_ptr() for t in svc._last_read["actor"][1].values()))
            service_fit(svc, r, tmp_path / global_dir, tmp_path / f"c{r}")
        assert pointers[0] == pointers[1] == pointers[2], "a round's read did not reuse the lane's buffers"
    finally:
        svc.close()

    def model(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}

    rounds = [save_shards(model(r), tmp_path / f"round-{r}", 40_000) for r in range(2)]
    buffers = ReadBuffers(pin=False)
    first = load_shards(rounds[0], alloc=buffers.alloc("actor"))
    kept = first["w0"]  # a tensor that outlives its read: its buffer must not be overwritten
    del first
    second = load_shards(rounds[1], alloc=buffers.alloc("actor"))
    assert torch.equal(kept, model(0)["w0"]) and second["w0"].data_ptr() != kept.data_ptr()
    assert all(torch.equal(v, model(1)[k]) for k, v in second.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_lane_reads_into_pinned_memory(model_dir, tmp_path):  # noqa: F811
    """A CUDA lane's reads land in page-locked memory, which loads into the model at the link's
    speed; a CPU lane's do not (nothing to copy to)."""
    state = {f"w{i}": torch.randn(256, 256) for i in range(3)}
    manifest = save_shards(state, tmp_path / "w", 300_000)
    cuda = TrainerService(small_config(model_dir, run={"device": "cuda"}), run_id=1, lane="0", run_dir=tmp_path)
    cpu = TrainerService(small_config(model_dir, run={"device": "cpu"}), run_id=1, lane="cpu", run_dir=tmp_path)
    read = load_shards(manifest, alloc=cuda._read_buffers.alloc("actor"))
    assert all(t.is_pinned() and torch.equal(t, state[k]) for k, t in read.items())
    assert not any(t.is_pinned() for t in load_shards(manifest, alloc=cpu._read_buffers.alloc("actor")).values())
