"""`federation.update: lora` on the builtin engine (client_app/trainer/lora.py): the averaged
adapters merge to the exact mean of the clients' products, the fixed factor is the same seeded
draw everywhere, only the trained factor (+ the critic's value head) trains and travels, the base
stays bit for bit, generation runs the merged model, and a lane with another base is refused;
with `lora.trained` B and smaller alike."""

from __future__ import annotations

import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
import torch
from trainer_support import SMALL_ENV_PARAMS, env_url, model_dir, small_config  # noqa: F401

from client_app.service import Dirs, Refused, TrainerService
from client_app.trainer import make_engine
from client_app.trainer.base import ClientTasks
from client_app.trainer.builtin import BuiltinEngine
from client_app.trainer.loop import RLTrainer
from client_app.trainer.lora import LORA_A, LORA_B, LoraLinear, adapter_layers, fixed_factor, merged_tensors
from fl_app.aggregate import fedavg_manifests
from fl_app.calls import EvalCall, FitCall
from fl_app.config import Config, recipe_sha256
from fl_app.robust import Rule, aggregate_manifests, flagged_clients
from fl_app.weights import load_shards, save_shards

TRAIN_TASKS = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))
LORA = {"update": "lora", "lora": {"rank": 4, "alpha": 8.0}}
TRAINED = ["B", "smaller"]


def _config(model: Path, trained: str = "B", **sections: dict) -> Config:
    lora = {**LORA, "lora": {**LORA["lora"], "trained": trained}}
    return small_config(model, **{"federation": lora, **sections})


def _engine(model: Path, trained: str = "B", **sections: dict) -> BuiltinEngine:
    engine = make_engine(_config(model, trained, **sections), model)
    assert isinstance(engine, BuiltinEngine)
    return engine


def _product(layer: LoraLinear, trained: torch.Tensor, fixed: torch.Tensor | None = None) -> torch.Tensor:
    """B A in float64 with the layer's `trained` factor given (and its fixed one, or another)."""
    other = (getattr(layer, layer.fixed) if fixed is None else fixed).double()
    return trained.double() @ other if layer.trained == LORA_B else other @ trained.double()


def _random_b(engine: BuiltinEngine, member: str, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in engine.export_weights(member).items()}


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("trained", TRAINED)
def test_averaged_adapters_merge_to_the_exact_mean_of_the_products(model_dir, tmp_path, trained):  # noqa: F811
    """FedAvg of three clients' trained factors (the streaming aggregator, over shards, weighted
    by examples) loaded into the adapters gives base + s x the weighted mean of the clients'
    products, against a float64 reference; averaging both factors of clients with their own
    draw of the other (plain LoRA federated naively) misses it by orders of magnitude more.
    Under `smaller` some layers train A (B fixed) and the others B."""
    engine = _engine(model_dir, trained)
    sides = {layer.trained for _, layer in adapter_layers(engine.model)}
    assert sides == ({LORA_A, LORA_B} if trained == "smaller" else {LORA_B})
    weights = [3.0, 1.0, 2.0]
    states = [_random_b(engine, "actor", seed) for seed in range(3)]
    dirs = []
    for i, state in enumerate(states):
        save_shards(state, tmp_path / f"client-{i}", 1 << 20)
        dirs.append((tmp_path / f"client-{i}", weights[i]))
    fedavg_manifests(dirs, tmp_path / "global", 1 << 20)
    engine.load_weights(load_shards(tmp_path / "global"), "actor")
    merged = dict(merged_tensors(engine.model))
    total = sum(weights)
    worst_exact, worst_naive = 0.0, 0.0
    for name, layer in adapter_layers(engine.model):
        key = f"{name}.{layer.trained}"
        mean_product = sum(w * _product(layer, s[key]) for w, s in zip(weights, states)) / total
        want = layer.weight.detach().double() + layer.scale * mean_product
        got = merged[f"{name}.weight"].double()
        worst_exact = max(worst_exact, float((got - want).abs().max()))
        # the naive alternative: each client with its own draw of the other factor, both averaged
        rank = layer.lora_A.shape[0]
        own = [
            fixed_factor(7 + i, "actor", name, layer.fixed, rank, layer.in_features, layer.out_features)
            for i in range(3)
        ]
        own_products = sum(w * _product(layer, s[key], o) for w, s, o in zip(weights, states, own)) / total
        mean_trained = sum(w * s[key].double() for w, s in zip(weights, states)) / total
        mean_own = sum(w * o.double() for w, o in zip(weights, own)) / total
        naive = _product(layer, mean_trained, mean_own)
        worst_naive = max(worst_naive, float((layer.scale * (naive - own_products)).abs().max()))
    assert worst_exact < 1e-6, worst_exact  # fp32 rounding of the mean and of the merge only
    assert worst_naive > 1e3 * worst_exact, (worst_naive, worst_exact)


def test_smaller_trains_the_factor_with_fewer_numbers_and_doubles_the_rank_at_the_same_bytes(model_dir):  # noqa: F811
    """`lora.trained: smaller` trains A (rank x in) exactly where in < out and B elsewhere, so
    each layer moves rank x min(in, out) numbers; on the tiny models (MLP 4x the width) rank 2r
    then moves exactly what rank r moves with B. The fixed factor is not a parameter."""
    small = _engine(model_dir, federation={**LORA, "lora": {"rank": 8, "alpha": 16.0, "trained": "smaller"}})
    plain = _engine(model_dir)
    for name, layer in adapter_layers(small.model):
        assert layer.trained == (LORA_A if layer.in_features < layer.out_features else LORA_B), name
        assert getattr(layer, layer.trained).numel() == 8 * min(layer.in_features, layer.out_features), name
        assert layer.fixed not in dict(layer.named_parameters()), name
    numbers = {e: sum(t.numel() for t in e.export_weights("actor").values()) for e in (small, plain)}
    assert numbers[plain] == sum(layer.out_features * 4 for _, layer in adapter_layers(plain.model))  # B: out x 4
    assert numbers[small] == numbers[plain], numbers


@pytest.mark.parametrize("agg", ["fedavg", "clipped", "trimmed_mean", "median"])
def test_every_aggregator_runs_over_adapters_and_flags_a_poisoned_one(model_dir, tmp_path, agg):  # noqa: F811
    """Issue #39's every aggregator in every update mode: over four clients' B (one sent 100 x its
    update), each aggregator writes adapters the lane loads, flags the poisoned client and no
    clean one, and the robust ones keep its update out (B -> s B A is linear and, A having full
    rank, one to one: a coordinate-wise rule on B is that rule on the products' row space)."""
    engine = _engine(model_dir)
    w, common = _random_b(engine, "actor", 10, scale=0.01), _random_b(engine, "actor", 11, scale=0.05)
    honest = [{k: common[k] + v for k, v in _random_b(engine, "actor", seed, scale=0.02).items()} for seed in range(4)]
    updates = honest[:3] + [{k: 100 * d for k, d in honest[3].items()}]  # clients agree, one scales x100
    inputs = []
    for i, d in enumerate(updates):
        inputs.append((save_shards({k: w[k] + d[k] for k in w}, tmp_path / f"client-{i}", 1 << 20), 1.0))
    previous = save_shards(w, tmp_path / "global", 1 << 20)
    rule = Rule(agg, trim_fraction=0.25)
    out, scores = aggregate_manifests(inputs, previous, tmp_path / "out", 1 << 20, rule)
    new = load_shards(out.root)
    engine.load_weights(new, "actor")  # the lane takes what any aggregator writes
    assert flagged_clients({"actor": scores.row([0, 1, 2, 3])}) == [3]
    step = max(float((new[k] - w[k]).abs().max()) for k in w)
    clean = max(float(d[k].abs().max()) for d in honest for k in w)
    assert step > 10 * clean if agg == "fedavg" else step <= 1.5 * clean


def test_the_fixed_factor_is_the_same_draw_in_every_process_and_differs_per_tensor_member_seed_and_side():
    args = ("model.layers.0.self_attn.q_proj.weight", LORA_A, 4, 32, 64)
    here = fixed_factor(0, "actor", *args)
    code = (
        "import sys; from client_app.trainer.lora import fixed_factor; a = fixed_factor(0, 'actor', "
        f"{', '.join(map(repr, args))}); sys.stdout.buffer.write(a.numpy().tobytes())"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    assert there == here.numpy().tobytes() and here.shape == (4, 32)
    b = fixed_factor(0, "actor", "model.layers.0.self_attn.q_proj.weight", LORA_B, 4, 32, 64)
    assert b.shape == (64, 4) and float(b.abs().max()) <= 32**-0.5
    for other in (
        fixed_factor(0, "actor", "model.layers.0.self_attn.k_proj.weight", LORA_A, 4, 32, 64),
        fixed_factor(0, "critic", *args),
        fixed_factor(1, "actor", *args),
        b.T,
    ):
        assert not torch.equal(other, here)
    assert float(here.abs().max()) <= 32**-0.5


@pytest.mark.parametrize("trained", TRAINED)
def test_generation_runs_the_merged_model(model_dir, trained):  # noqa: F811
    """With the trained factors at 0 the adapted policy's logits are the base's bit for bit;
    with non-zero ones they are those of the plain model holding the merged weights W + s B A
    (float64, so the two orders of the same sums agree to rounding), and they moved."""
    engine = _engine(model_dir, trained)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 9, 100, 3, 77]])
    with torch.no_grad():
        base_logits = plain(ids).logits
        assert torch.equal(engine.generation_model()(ids).logits, base_logits)
        engine.load_weights(_random_b(engine, "actor", 0, scale=0.5), "actor")
        engine.model.double()
        missing, unexpected = plain.double().load_state_dict(dict(merged_tensors(engine.model)), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
        adapted, merged = engine.generation_model()(ids).logits, plain(ids).logits
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-10)
    assert float((adapted - base_logits.double()).abs().max()) > 1e-3


@pytest.mark.parametrize("trained", TRAINED)
def test_the_bf16_compute_copy_runs_the_adapters_of_the_fp32_masters(model_dir, trained):  # noqa: F811
    """On the bf16 compute copy (the CUDA default, here on the CPU) the copy's trained factor is
    the masters' rounded, the fixed one stays the fp32 draw and is cast at use, and the adapted
    logits follow fp32's."""
    bf16_run = {"device": "cpu", "seed": 0, "precision": "bf16"}
    fp32, bf16 = _engine(model_dir, trained), _engine(model_dir, trained, run=bf16_run)
    ids = torch.tensor([[5, 17, 42, 9, 100, 3, 77]])
    for engine in (fp32, bf16):
        engine.load_weights(_random_b(fp32, "actor", 0, scale=0.5), "actor")
    copy = dict(adapter_layers(bf16.generation_model()))
    for name, master in adapter_layers(bf16.model):
        trained_copy, fixed_copy = getattr(copy[name], master.trained), getattr(copy[name], master.fixed)
        assert trained_copy.dtype == torch.bfloat16 and fixed_copy.dtype == torch.float32
        assert torch.equal(trained_copy, getattr(master, master.trained).detach().to(torch.bfloat16))
    assert fp32.ref is not None and bf16.ref is not None  # the frozen base (kl_coef > 0), in each precision
    with torch.no_grad():
        want = fp32.generation_model()(ids).logits - fp32.ref(ids).logits
        got = (bf16.generation_model()(ids).logits - bf16.ref(ids).logits).float()
    assert float(want.abs().max()) > 0.1  # the adapters move the logits
    assert float((got - want).norm()) < 0.1 * float(want.norm())  # and by what fp32 moves them, to bf16's rounding


@pytest.mark.parametrize("trained", TRAINED)
def test_a_ppo_fit_trains_and_exports_only_the_trained_factors_and_the_value_head(
    model_dir,
    env_url,
    tmp_path,
    trained,  # noqa: F811
):
    """The exchanged members are the adapters' trained factors (+ the critic's value head,
    trained whole); a fit moves them, the base (every frozen tensor of both models) and the
    fixed factors stay bit for bit, the optimizers saw only them, FedProx anchors exactly them,
    and load then export is the identity."""
    cfg = _config(model_dir, trained, algo={"name": "ppo", "group_size": None, "tasks_per_step": 2, "lr": 1e-3})
    with closing(RLTrainer(cfg, make_engine(cfg, model_dir), model_dir, env_url)) as trainer:
        engine = trainer.engine
        assert isinstance(engine, BuiltinEngine) and engine.critic is not None and engine.base_sha256
        models = {"actor": engine.model, "critic": engine.critic}
        for member, model in models.items():
            exported = trainer.export_weights(member)
            want = {f"{n}.{layer.trained}" for n, layer in adapter_layers(model)}
            want |= {"score.weight", "score.bias"} if member == "critic" else set()
            assert set(exported) == want == {n for n, _ in engine.parameters(member)}
            assert all(not p.requires_grad for n, p in model.named_parameters() if n not in want)
        start = {m: trainer.export_weights(m) for m in models}
        base = {m: _frozen(model) for m, model in models.items()}
        fixed = {m: {n: getattr(a, a.fixed).clone() for n, a in adapter_layers(model)} for m, model in models.items()}
        call = FitCall(round=1, client_id=3, local_epochs=1, seed=0, proximal_mu=0.01)
        res = trainer.fit(call, ClientTasks(TRAIN_TASKS))
        assert res.metrics["optimizer_steps"] > 0 and res.metrics["critic_optimizer_steps"] > 0
        for member, model in models.items():
            after = trainer.export_weights(member)
            assert any(not torch.equal(after[k], start[member][k]) for k in after), member
            assert all(torch.equal(t, base[member][n]) for n, t in _frozen(model).items()), member
            assert all(torch.equal(getattr(a, a.fixed), fixed[member][n]) for n, a in adapter_layers(model))
            weights = _random_b(engine, member, 5)
            trainer.load_weights(weights, member)
            assert all(torch.equal(trainer.export_weights(member)[k], w) for k, w in weights.items())


def test_a_lane_with_another_base_is_refused_naming_both_digests(model_dir, tmp_path):  # noqa: F811
    cfg = _config(model_dir)
    svc = TrainerService(cfg, run_id=1, lane="cpu", run_dir=tmp_path)
    svc.trainer = RLTrainer(cfg, make_engine(cfg, model_dir), model_dir, None)
    try:
        own = svc.trainer.base_sha256
        header = {"run_id": 1, "recipe_sha256": recipe_sha256(cfg), "weights": {}}
        dirs = Dirs(weights_in={"actor": str(tmp_path / "in")}, weights_out={})
        from fl_app.channel import WeightsRef

        refs = {"weights": {"actor": WeightsRef(inline=True, nbytes=0)}}
        for other in ("f" * 64, ""):
            call = EvalCall(**{**header, **refs}, seed=0, base_sha256=other)
            with pytest.raises(Refused) as err:
                svc.check(call, dirs, ("actor",))
            assert own in str(err.value) and (other or "none recorded") in str(err.value)
        svc.check(EvalCall(**{**header, **refs}, seed=0, base_sha256=own), dirs, ("actor",))
    finally:
        svc.trainer.close()


def test_a_target_that_names_no_linear_is_an_error(model_dir):  # noqa: F811
    with pytest.raises(ValueError, match=r"target_modules names \['qkv'\]"):
        _engine(model_dir, federation={**LORA, "lora": {"target_modules": ["q_proj", "qkv"]}})
