"""How the engines compute (`client_app.trainer.compute`): compiled decoder layers
(`run.compile`, builtin and verl) score and train as the eager ones do while generation stays eager, the modes
that cannot be armed are refused before anything starts, and micro-batches respect their row
cap and token budget. The bf16 compute copy is held to
the engine contract in tests/trainer/test_engine_contract.py (`builtin-cpu-bf16`, and against fp32)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from trainer_support import model_dir, one_torch_thread, random_rows, small_config  # noqa: F401

from client_app.algos import ActorLossSpec
from client_app.rollout import TrainRow
from client_app.trainer.builtin import BuiltinEngine
from client_app.trainer.compute import RECOMPILE_LIMIT, compile_layers
from client_app.trainer.engine import PolicyBatch, micro_batches
from fl_app.config import ConfigError, load_config


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_compiled_layers_score_and_train_as_eager_layers_and_generation_stays_eager(model_dir):  # noqa: F811
    engines = {c: BuiltinEngine(small_config(model_dir, run={"compile": c}), model_dir) for c in (False, True)}
    eager, compiled = engines[False], engines[True]
    rows = random_rows(6, len(eager.tokenizer), seed=0)
    graphs = _graphs()
    got, want = compiled.score(rows, "policy"), eager.score(rows, "policy")
    assert _graphs() > graphs, "run.compile must run the scoring pass through compiled layers"
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT  # past 8 graphs new shapes ran eager
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    loss = ActorLossSpec(entropy_coeff=0.01)
    advantages = [torch.full((len(r.response_ids),), a) for r, a in zip(rows, (1.0, -1.0, 0.5, -0.5, 2.0, 0.0))]
    grads: dict[bool, dict[str, torch.Tensor]] = {}
    for c, engine in engines.items():

        def keep(c: bool = c, engine: BuiltinEngine = engine) -> None:
            grads[c] = {n: p.grad.clone() for n, p in engine.parameters() if p.grad is not None}

        engine.begin_fit(reference_from_policy=False)
        engine.step(PolicyBatch(rows, engine.score(rows, "policy"), advantages, None), loss, after_backward=keep)
        engine.end_fit()
    assert grads[False] and grads[False].keys() == grads[True].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-6)
    # a cached pass (Hugging Face generate) takes the eager layers: no new graph, the same tokens
    prompt = torch.tensor([rows[0].prompt_ids])
    graphs = _graphs()
    out = {
        c: e.generation_model().generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for c, e in engines.items()
    }
    assert _graphs() == graphs and torch.equal(out[True], out[False])
    for engine in engines.values():
        engine.close()


@pytest.mark.slow  # ~40 s of compiling on 2 cores; the builtin engine's compiled layers are tested by default
@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl not installed")
def test_verl_compiles_its_layers_and_scores_and_trains_as_eager_layers(model_dir, tmp_path):  # noqa: F811
    """`run.compile` on the verl engine: its FSDP2 modules' decoder layers run compiled (the
    gather and free stay in FSDP2's eager hooks), and a policy pass with the reference's KL ends
    where the eager engine's does."""
    from client_app.trainer import make_engine
    from client_app.trainer.loop import policy_pass
    from client_app.trainer.losses import loss_specs

    algo = {"kl_coef": 0.05, "mini_batch_size": 3, "micro_batch_size": 2}
    cfgs = {
        c: small_config(model_dir, run={"compile": c}, algo=algo).model_copy(update={"backend": "verl"})
        for c in (False, True)
    }
    rows = None
    out = {}
    # verl's decoder layers are plain modules inside its one FSDP2 unit, so the same layers this
    # module compiled for builtin would be a cache hit: start from an empty cache, so that a
    # compiled pass shows as new graphs
    torch._dynamo.reset()
    for c, cfg in cfgs.items():
        engine = make_engine(cfg, model_dir, tmp_path / f"compile-{c}")
        try:
            rows = rows or random_rows(6, len(engine.tokenizer), seed=0)
            start = engine.export_weights()
            graphs = _graphs()
            scores = engine.score(rows, "policy")
            assert (_graphs() > graphs) == c, "run.compile must run verl's scoring through compiled layers"
            advantages = [torch.full((len(r.response_ids),), a) for r, a in zip(rows, (1.0, -1.0, 0.5, -0.5, 2.0, 0.0))]
            engine.begin_fit(reference_from_policy=False)
            policy_pass(engine, loss_specs(cfg)[0], rows, advantages, cfg.algo.mini_batch_size, seed=3)
            engine.end_fit()
            out[c] = (scores, engine.export_weights())
        finally:
            engine.close()
    for g, w in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    moved = max(float((out[False][1][k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4  # the pass trains, so the tolerance below means something
    for k, w in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], w, rtol=1e-4, atol=moved * 0.05)


def test_compile_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="run.compile"):
        compile_layers(torch.nn.Linear(4, 4))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["backend=verl", "run.precision=fp32"], "run.precision=fp32 is a builtin-engine mode"),
        (["backend=verl", "run.precision=bf16", "run.device=cpu"], "needs a GPU"),
    ],
)
def test_modes_verl_would_not_honour_are_refused_before_anything_starts(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny-shop-grpo", dotlist=overrides)


@given(
    widths=st.lists(st.integers(1, 60), min_size=1, max_size=40),
    micro=st.integers(1, 12),
    budget=st.one_of(st.none(), st.integers(1, 200)),
)
def test_micro_batches_hold_every_row_once_within_the_row_cap_and_token_budget(widths, micro, budget):
    """algo.micro_batch_tokens: every row in exactly one micro-batch, rows in length order, at
    most `micro` rows and (unless a row alone exceeds it) at most `budget` padded tokens each;
    a micro-batch is closed only when the next row would break a limit."""
    rows = [TrainRow([0] * (w - 1), [0], [1], 0.0, 0, i) for i, w in enumerate(widths)]
    batches = micro_batches(rows, micro, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(rows)))
    assert [widths[i] for i in flat] == sorted(widths)
    for b, nxt in zip(batches, batches[1:] + [None]):
        padded = len(b) * max(widths[i] for i in b)
        assert len(b) <= micro and (len(b) == 1 or budget is None or padded <= budget)
        if nxt is not None:  # closed because the next row broke a limit
            assert len(b) == micro or (budget is not None and (len(b) + 1) * widths[nxt[0]] > budget)


def test_a_token_budget_lets_short_rows_share_a_pass_and_spares_long_rows_the_padding():
    rows = [TrainRow([0] * (w - 1), [0], [1], 0.0, 0, i) for i, w in enumerate([10, 10, 10, 10, 100, 100])]
    assert micro_batches(rows, 4) == [[0, 1, 2, 3], [4, 5]]
    assert micro_batches(rows, 6) == [[0, 1, 2, 3, 4, 5]]  # 600 padded tokens for 240 real ones
    assert micro_batches(rows, 6, 200) == [[0, 1, 2, 3], [4, 5]]  # 240 padded tokens
    assert micro_batches(rows, 6, 150) == [[0, 1, 2, 3], [4], [5]]
