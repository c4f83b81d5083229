"""Golden outputs of verl-agent's own GiGPO functions, for tests/trainer/test_gigpo.py.

verl-agent is not installable here and CI has no network, so the parity test reads what its
`compute_gigpo_outcome_advantage` and `compute_step_discounted_returns` returned on seeded random
batches, written by this script. Extract the module from a verl-agent checkout (it needs numpy,
torch and `verl.DataProto`, which verl 0.9.1 provides) outside this repository and point at it:

    git --git-dir=<verl-agent>.git archive d0b9724 gigpo/core_gigpo.py | tar -x -C /tmp/va
    python tools/gigpo_golden.py /tmp/va d0b97244c50f17fb43a6ef0a15bca0e95a044ff7

The batches cover several group sizes (including groups of one trajectory), anchors repeated
across and within trajectories and one anchor text in every group (step groups must not cross
episode groups), all-identical groups (zero variance at both levels), interleaved trajectories,
masks with interior zeros, invalid-action penalties that vary scores within a trajectory, both
modes, two discounts and two step weights.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gigpo_golden.json"
HORIZON = 6
GAMMAS = (0.95, 1.0)
MODES = ("mean_norm", "mean_std_norm")
STEP_WEIGHTS = (1.0, 0.5)


def _trajectory(rng: random.Random, anchors: list[str], template: dict[str, Any] | None) -> dict[str, Any]:
    """One trajectory: anchors from a small per-group vocabulary (so states repeat), mostly
    zero step rewards and an outcome on the last step; a copy of `template` when given."""
    if template is not None:
        return {k: list(v) for k, v in template.items()}
    n = rng.randint(1, 5)
    rewards = [rng.choice([0.0, 0.0, 0.0, 0.1]) for _ in range(n - 1)] + [rng.choice([0.0, 1.0, 0.5, 0.75])]
    return {"anchors": [rng.choice(anchors) for _ in range(n)], "rewards": rewards}


def make_case(seed: int) -> dict[str, Any]:
    """A batch of step rows: groups of 1..8 trajectories, one group all identical, trajectories
    interleaved with their steps in order."""
    rng = random.Random(seed)
    sizes = [8, 1, 3, 2, 5, 4][: 3 + seed % 4]
    trajectories: list[dict[str, Any]] = []
    for g, size in enumerate(sizes):
        vocab = ["home"] + [f"s{seed}-{g}-{k}" for k in range(rng.randint(0, 3))]  # "home" in every group
        identical = g == 0 and seed % 2 == 0
        first = _trajectory(rng, vocab, None)
        for k in range(size):
            t = _trajectory(rng, vocab, first if identical or k == 0 else None)
            # verl-agent scores every step row by the episode reward minus that step's penalty
            score = sum(t["rewards"])
            t.update(uid=f"u{seed}-{g}", traj=f"t{seed}-{g}-{k}", score=score)
            trajectories.append(t)
    cursors = [0] * len(trajectories)
    rows: list[dict[str, Any]] = []
    while len(rows) < sum(len(t["anchors"]) for t in trajectories):
        k = rng.choice([i for i, t in enumerate(trajectories) if cursors[i] < len(t["anchors"])])
        t, j = trajectories[k], cursors[k]
        cursors[k] += 1
        invalid = rng.random() < 0.2
        rows.append(
            {
                "uid": t["uid"],
                "traj": t["traj"],
                "anchor": t["anchors"][j],
                "reward": t["rewards"][j],
                "score": t["score"] - (0.1 if invalid and not seed % 2 == 0 else 0.0),
            }
        )
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, HORIZON + 1, (len(rows),), generator=gen)
    mask = (torch.arange(HORIZON)[None] < lengths[:, None]) & (torch.rand(len(rows), HORIZON, generator=gen) < 0.8)
    mask[:, 0] = True
    return {"rows": rows, "mask": mask.int().tolist()}


def _inputs(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """Token-level rewards (the score on the row's last masked token) and the mask."""
    mask = torch.tensor(case["mask"], dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for b, row in enumerate(case["rows"]):
        last = int(mask[b].nonzero().max())
        rewards[b, last] = row["score"]
    return rewards, mask, case["rows"]


def _rounded(values: list[float]) -> list[float]:
    """9 decimals: the file stays small, and 1e-9 is far below the test's 1e-6."""
    return [round(v, 9) for v in values]


def golden(core_gigpo: Any, case: dict[str, Any]) -> dict[str, Any]:
    rewards, mask, rows = _inputs(case)
    uid = np.array([r["uid"] for r in rows], dtype=object)
    traj = np.array([r["traj"] for r in rows], dtype=object)
    anchors = np.array([r["anchor"] for r in rows], dtype=object)
    out: dict[str, Any] = {"returns": {}, "advantages": {}, "episode": {}, "step": {}}
    for gamma in GAMMAS:
        batch = SimpleNamespace(
            non_tensor_batch={
                "rewards": np.array([r["reward"] for r in rows], dtype=np.float32),
                "traj_uid": traj,
                "active_masks": np.ones(len(rows), dtype=bool),
            },
            batch={"input_ids": torch.zeros(len(rows), 1)},
        )
        step = core_gigpo.compute_step_discounted_returns(batch, gamma)
        out["returns"][str(gamma)] = _rounded(step.tolist())
        for mode in MODES:
            # each level on its own too: verl-agent's float mean of an all-equal group leaves a
            # residue that the std division amplifies; the test needs to tell the levels apart
            remove_std = mode == "mean_norm"
            episode = core_gigpo.episode_norm_reward(rewards.clone(), mask, uid, traj, 1e-6, remove_std)
            groups = core_gigpo.build_step_group(anchors, uid)
            step_adv = core_gigpo.step_norm_reward(step.clone(), mask, groups, 1e-6, remove_std)
            out["episode"][f"{gamma}/{mode}"] = _rounded(episode[:, 0].tolist())
            out["step"][f"{gamma}/{mode}"] = _rounded(step_adv[:, 0].tolist())
            for w in STEP_WEIGHTS:
                adv, ret = core_gigpo.compute_gigpo_outcome_advantage(
                    rewards.clone(), step.clone(), mask, anchors, uid, traj, 1e-6, w, mode
                )
                assert torch.equal(adv, ret)
                out["advantages"][f"{gamma}/{mode}/{w}"] = [_rounded(row) for row in adv.tolist()]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("verl_agent", type=Path, help="a directory holding verl-agent's gigpo/core_gigpo.py")
    parser.add_argument("commit", help="the verl-agent commit the module was extracted from (recorded)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.verl_agent))
    from gigpo import core_gigpo  # verl-agent's module, from the directory given

    cases = []
    for seed in range(8):
        case = make_case(seed)
        cases.append({"seed": seed, **case, **golden(core_gigpo, case)})
    doc = {
        "source": "langfengQ/verl-agent gigpo/core_gigpo.py",
        "commit": args.commit,
        "produced_by": "tools/gigpo_golden.py",
        "horizon": HORIZON,
        "cases": cases,
    }
    args.out.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
