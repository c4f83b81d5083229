"""A lane over k ranks (invariant 43): the builtin engine's fit, data parallel over 2 gloo ranks on
the CPU, is the 1-rank fit of the same episodes up to fp32 summation order, the same bits every
time, and a rank that dies fails the fit naming it, leaves no process behind, and the lane refuses
every later call (its service exits: tests/client/test_lane_ranks_service.py). Real env service,
real (random-weight) Qwen2 policy, real rank processes.

Tolerances (the 2-core CPU box, 2026-12-06): the 2-rank fit's weights were within 4e-6 (1 local
epoch) and 1.0e-5 (2) of the 1-rank fit's, which moved them by up to 4.8e-3 and 9.2e-3; its
mean gradient norm within 7e-6 relative. AdamW's first steps are about lr x sign(gradient) per
weight, so a weight whose gradient is near 0 moves by a summation-order difference times up to
lr / eps: the weights are held to 1e-4 (2% of their move), the gradient norm and the loss terms,
which a wrong loss normalisation moves by tens of percent, to 1e-4 relative."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
from trainer_support import (  # noqa: F401
    LANE_CALL,
    LANE_SHARD,
    PLAYED,
    env_url,
    lane_config,
    max_diff,
    model_dir,
    one_torch_thread,
    random_rows,
    rel,
    small_config,
)

from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from client_app.trainer.builtin import BuiltinEngine
from client_app.trainer.loop import RLTrainer, policy_pass
from client_app.trainer.losses import loss_specs
from client_app.trainer.ranks import Lead, RankFailure, Ranks, RowLayout

WEIGHT_TOL = 1e-4
RANK_TIMEOUT_S = 10  # the lanes' collective timeout here: ranks wait < 1 s for each other's rollouts
REL_TOL = 1e-4


# ---------------------------------------------------------------- one pass over the same rows


def pass_on_rank(rank: int, world: int, port: int, model_dir: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Rank `rank`'s part of one policy pass over `pass_rows()`: its block of the rows, the
    layout of every rank's, the 1-rank mini-batches (rank 0 is the test's process)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    ranks = Ranks(rank, world, torch.device("cpu"))
    ranks.connect(store, 60)
    try:
        return one_pass(small_config(model_dir, run={"lane_devices": world}), model_dir, ranks)
    finally:
        ranks.disconnect()


def pass_rows(vocab: int) -> tuple[list[Any], list[torch.Tensor]]:
    rows = random_rows(11, vocab, seed=5)
    advantages = [
        torch.randn(len(rw.response_ids), generator=torch.Generator().manual_seed(i)) for i, rw in enumerate(rows)
    ]
    return rows, advantages


def one_pass(cfg: Any, model_dir: Path, ranks: Ranks | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    engine = BuiltinEngine(cfg, model_dir, ranks=ranks)
    rows, advantages = pass_rows(engine.vocab_size)
    lo, hi = (0, len(rows)) if ranks is None else ranks.share(len(rows))
    mine = rows[lo:hi]
    layout: RowLayout | None = None if ranks is None else ranks.layout([sum(rw.mask) for rw in mine])
    engine.begin_fit(reference_from_policy=False)
    policy, _ = loss_specs(cfg)
    metrics = policy_pass(engine, policy, mine, advantages[lo:hi], cfg.algo.mini_batch_size, 7, None, layout)
    engine.end_fit()
    return metrics, engine.export_weights()


def test_a_pass_over_two_ranks_with_unequal_rows_steps_as_one_rank_on_the_same_rows(model_dir):  # noqa: F811
    """Random advantages on 11 rows of random widths, 6 on rank 0 and 5 on rank 1 (unequal
    tokens), mini-batches of 4 that each rank holds a different part of: every step's loss is
    normalised by the whole mini-batch, so the loss terms and gradient norms are the 1-rank
    pass's (a token mean per rank would miss them by tens of percent)."""
    cfg = small_config(model_dir)
    alone, w1 = one_pass(cfg, model_dir, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_1 = multiprocessing.get_context("spawn").Process(target=pass_on_rank, args=(1, 2, port, model_dir))
    rank_1.start()
    try:
        spread, w2 = pass_on_rank(0, 2, port, model_dir)
    finally:
        rank_1.join(60)
        if rank_1.is_alive():
            rank_1.kill()
    assert rank_1.exitcode == 0
    assert spread["optimizer_steps"] == alone["optimizer_steps"] == 3
    for key in ("pg_loss", "entropy", "kl_loss", "grad_norm"):
        assert rel(spread[key], alone[key]) <= REL_TOL, (key, alone[key], spread[key])
    print(f"pass over 2 ranks vs 1: max abs weight diff {max_diff(w2, w1):.2e}")
    assert max_diff(w2, w1) <= WEIGHT_TOL


# ---------------------------------------------------------------- fits of a lane over 2 ranks


@pytest.fixture(scope="module")
def one_rank(env_url, model_dir):  # noqa: F811
    """The 1-rank lane's fit: (initial weights, fitted weights, metrics)."""
    trainer = make_trainer(lane_config(model_dir, 1), env_url)
    try:
        initial = trainer.export_weights()
        result = trainer.fit(LANE_CALL, ClientTasks(LANE_SHARD))
        return initial, trainer.export_weights(), result
    finally:
        trainer.close()


def two_rank_lane(env_url: str, model_dir: Path) -> Iterator[RLTrainer]:  # noqa: F811
    trainer = make_trainer(lane_config(model_dir, 2), env_url, rank_timeout_s=RANK_TIMEOUT_S)
    yield trainer
    pids = trainer.ranks.pids if isinstance(trainer.ranks, Lead) else []
    trainer.close()
    assert not [p for p in pids if psutil.pid_exists(p)], "closing the lane left a rank running"


@pytest.fixture(scope="module")
def two_ranks(env_url, model_dir):  # noqa: F811
    yield from two_rank_lane(env_url, model_dir)


@pytest.fixture
def fresh_two_ranks(env_url, model_dir):  # noqa: F811
    """A lane of its own: a failure spends a lane (`Lead.lost`)."""
    yield from two_rank_lane(env_url, model_dir)


def fit(trainer: RLTrainer, initial: dict[str, torch.Tensor], on_iteration: Any = None) -> Any:
    trainer.load_weights(initial)
    result = trainer.fit(LANE_CALL, ClientTasks(LANE_SHARD), on_iteration)
    return trainer.export_weights(), result


def test_a_fit_over_two_gloo_ranks_is_the_one_rank_fit_and_the_same_bits_every_time(one_rank, two_ranks):
    initial, w1, r1 = one_rank
    w2, r2 = fit(two_ranks, initial)
    assert r2.num_examples == r1.num_examples == 2 * 3 * 2
    for key in PLAYED:  # the ranks played the 1-rank fit's episodes: same seeds per episode
        assert r2.metrics[key] == r1.metrics[key], key
    assert r2.metrics["rank_wait_s"] >= 0 and "rank_wait_s" not in r1.metrics
    moved, diff = max_diff(w1, initial), max_diff(w2, w1)
    print(f"2 ranks vs 1: max abs weight diff {diff:.2e} (moved {moved:.2e})")
    assert moved > 1e-3 and diff <= WEIGHT_TOL
    for key in ("grad_norm", "entropy", "kl_loss", "pg_loss"):
        assert rel(r2.metrics[key], r1.metrics[key]) <= REL_TOL, (key, r1.metrics[key], r2.metrics[key])
    again, r3 = fit(two_ranks, initial)
    assert all(torch.equal(again[n], w2[n]) for n in w2), "two 2-rank fits from the same weights differ"
    assert {k: v for k, v in r3.metrics.items() if not k.endswith("_s") and "per_s" not in k} == {
        k: v for k, v in r2.metrics.items() if not k.endswith("_s") and "per_s" not in k
    }


def test_a_rank_killed_mid_fit_fails_the_fit_naming_it_and_the_lane_refuses_every_later_call(one_rank, two_ranks):
    initial = one_rank[0]
    assert isinstance(two_ranks.ranks, Lead)
    (victim,) = two_ranks.ranks.pids
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def kill_rank_1(epoch: int, _metrics: dict[str, float]) -> None:
        if epoch == 0:  # rank 1 is playing iteration 1 now; rank 0 meets its death at the next collective
            os.kill(victim, signal.SIGKILL)

    named = rf"lane rank 1 of 2 \(pid {victim}\) was killed by SIGKILL"
    with pytest.raises(RankFailure, match=named + r".* serves no more calls: the trainer service exits"):
        fit(two_ranks, initial, kill_rank_1)
    assert two_ranks.ranks.pids == [] and not psutil.pid_exists(victim)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before - {victim}, "a rank was left behind"
    assert two_ranks.lost is not None and re.search(named, two_ranks.lost)
    with pytest.raises(RankFailure, match=r"this lane lost its 2 ranks at an earlier failure \(" + named):
        fit(two_ranks, initial)  # no fresh ranks: the service restarts instead
    assert two_ranks.ranks.pids == [], "a lost lane started ranks again"


def test_a_rank_that_stops_answering_fails_the_fit_at_the_collective_timeout_and_is_killed(one_rank, fresh_two_ranks):
    two_ranks = fresh_two_ranks
    assert isinstance(two_ranks.ranks, Lead)
    (victim,) = two_ranks.ranks.pids

    def freeze_rank_1(epoch: int, _metrics: dict[str, float]) -> None:
        if epoch == 0:
            os.kill(victim, signal.SIGSTOP)  # alive, holding its sockets, answering nothing

    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"the gather across the ranks failed .* within the collective timeout"):
        fit(two_ranks, one_rank[0], freeze_rank_1)
    waited = time.monotonic() - started
    print(f"a silent rank failed the fit after {waited:.1f} s (collective timeout {RANK_TIMEOUT_S} s)")
    assert waited < RANK_TIMEOUT_S + 30
    assert two_ranks.ranks.pids == [] and not psutil.pid_exists(victim), "the silent rank was left behind"
    assert two_ranks.lost is not None and "within the collective timeout" in two_ranks.lost
