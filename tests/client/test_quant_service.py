"""A trainer service under `federation.update: delta-int8` (fl_app.quant, issue #38): a real PPO
fit uploads a compressed update of every member (PPO's critic too) from the global model it
loaded, keeps exactly what quantization lost as the client's residual, and the client's next
fit starts from it. A real TrainerService, real fits on a real env service, CPU."""

from __future__ import annotations

import torch
from trainer_support import delta_service, env_url, model_dir, one_torch_thread, service_call  # noqa: F401

from client_app.service import Dirs
from fl_app.calls import FitCall
from fl_app.quant import UpdateMeta, decode
from fl_app.weights import Manifest, load_shards, save_shards

MEMBERS = ("actor", "critic")


def test_a_ppo_fit_uploads_each_members_update_and_keeps_what_quantization_lost(env_url, model_dir, tmp_path):  # noqa: F811
    svc = delta_service(model_dir, tmp_path, algo={"name": "ppo", "tasks_per_step": 2, "group_size": None})
    try:
        svc.start()
        assert svc.trainer is not None
        trainer = svc.trainer
        ins = {m: save_shards(trainer.export_weights(m), tmp_path / "global" / m, 1 << 20).root for m in MEMBERS}
        seen = []
        for r in (1, 2):
            outs = {m: tmp_path / f"up-{r}" / m for m in MEMBERS}
            call = service_call(svc, FitCall, members=MEMBERS, round=r, client_id=1, local_epochs=1, seed=0)
            dirs = Dirs(
                weights_in={m: str(d) for m, d in ins.items()}, weights_out={m: str(d) for m, d in outs.items()}
            )
            metrics = svc.fit(call, dirs)["metrics"]
            seen.append(metrics["ef_residual_zeros"])
            for m in MEMBERS:
                base, up = Manifest.from_dir(ins[m]), Manifest.from_dir(outs[m])
                meta = UpdateMeta.of(up, m)
                assert (meta.mode, meta.base) == ("delta-int8", base.sha256)
                assert metrics["bytes_out"] < sum(Manifest.from_dir(ins[k]).total_bytes for k in MEMBERS) / 3.5
                w, x, q = load_shards(base), trainer.master_weights(m), load_shards(up)
                residual = load_shards(svc.residuals._dir(1, m) / f"round-{r}")
                _, before = svc.residuals.read(1, m, r)
                for k, t in w.items():
                    d = torch.sub(x[k].detach().cpu(), t)
                    if before is not None:
                        d.add_(before[k])
                    sent = decode(q[k].reshape(-1), "delta-int8", 64)[: t.numel()].view(t.shape)
                    assert torch.equal(residual[k], d - sent), (m, k)  # e' = d + e - deQ(Q(d + e)), bit for bit
        assert seen == [1.0, 0.0]  # round 1 started from zeros, round 2 from round 1's residual
        assert sorted(p.name for p in svc.residuals._dir(1, "critic").iterdir()) == ["round-1", "round-2"]
    finally:
        svc.close()
