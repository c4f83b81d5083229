"""bench/gpu_pending.sh runs on scarce device time: every stage's commands are checked here, dry,
so that a bad recipe, arm or core plan fails in CI rather than on the GPU node."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from fl_app.config import load_config
from tools import sweep

ROOT = Path(__file__).resolve().parents[2]
NODE_CORES = 16  # the stages' node: bench/gpu_pending.sh refuses fewer


def dry_commands(stage: str, results: Path) -> list[list[str]]:
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_pending.sh"), str(results), stage],
        env={"GPU_PENDING_DRY": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("stage", ["arms", "vllm", "alfworld"])
def test_every_stage_names_real_recipes_valid_arms_and_cores_of_its_own(stage: str, tmp_path: Path) -> None:
    commands = dry_commands(stage, tmp_path)
    assert commands, f"stage {stage} ran no step"
    busy: dict[int, str] = {}  # core -> the step pinned there (a stage's pinned steps overlap in time)
    for argv in commands:
        module = argv[argv.index("-m") + 1] if "-m" in argv else argv[0]
        recipe = option(argv, "--recipe")
        if recipe:
            load_config(recipe)  # raises on a recipe that does not exist or does not validate
        cores: list[int] = []
        if module == "tools.sweep":
            a = sweep.parser().parse_args(argv[argv.index("-m") + 2 :])
            jobs = sweep.plan(a.arm, [int(s) for s in a.seeds.split(",")], a.run_config, a.out)
            assert jobs and all(j.run_dir.is_relative_to(tmp_path) for j in jobs)
            cores = sweep.parse_cores(a.cores)
            assert sweep.core_slots(a.jobs, a.threads, cores), f"{stage}: {a.jobs} x {a.threads} threads exceed {cores}"
        elif argv[0] == "taskset":
            cores = sweep.parse_cores(argv[2])
        for core in cores:
            assert 0 <= core < NODE_CORES, f"{stage}: core {core} is not on a {NODE_CORES}-core node"
            assert core not in busy, f"{stage}: core {core} pinned by both {busy[core]!r} and {module!r}"
            busy[core] = module


def test_a_bad_arm_is_refused_by_the_same_check(tmp_path: Path) -> None:
    a = sweep.parser().parse_args(["--out", str(tmp_path), "--arm", 'x=recipe="no-such-recipe"'])
    with pytest.raises(sweep.SweepError, match="no-such-recipe"):
        sweep.plan(a.arm, [0], a.run_config, a.out)
