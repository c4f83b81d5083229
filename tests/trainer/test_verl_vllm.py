"""vLLM as the rollout engine of either training engine (`rollout.engine: vllm`,
client_app/trainer/rollouts.py and vllm_rollout.py).

The GPU tests (`pytest -m gpu tests/trainer/test_verl_vllm.py -k on_builtin`, then `-k on_verl` in a
second process: vLLM's allocator serves one engine per process; vLLM 0.24 on a CUDA machine,
verl 0.9.1 for the verl engine: docs/offline-gpu.md) build a real trainer with its in-process
vLLM engine on a random-weight
Qwen2 policy, for the builtin and the verl training engine (and verl under `federation.update:
lora`, `-k on_verl_lora`, a third process), and check invariant 25 (asleep before every weight
sync, refused otherwise), that a sync puts the training engine's current weights into vLLM
(bf16 of the fp32 masters, bit for bit; under lora the merged W + s B A, to bf16's rounding),
and invariant 24 across fits. The CPU
tests check what fails before any engine exists."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_engine_contract import build
from trainer_support import env_url, random_model_dir  # noqa: F401

from client_app.models import hf_parameters
from client_app.trainer.lora import LORA_B, fixed_factor, other_factor
from fl_app.config import ConfigError, load_config


def test_vllm_rollouts_need_a_gpu():
    with pytest.raises(ConfigError, match="rollout.engine=vllm needs a GPU"):
        load_config(dotlist=["rollout.engine=vllm", "run.device=cpu"])
    with pytest.raises(ConfigError, match="only applies to rollout.engine=vllm"):
        load_config(dotlist=["rollout.gpu_memory_utilization=0.3"])


def test_vllm_engine_without_vllm_installed_names_the_fix(tmp_path, monkeypatch):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from client_app.trainer.vllm_rollout import VllmGenerator

    with pytest.raises(RuntimeError, match="needs vLLM .*rollout.engine: hf"):
        VllmGenerator(tmp_path, None, 8, 64, 0.4, 0)


def test_multiprocess_vllm_engine_is_refused(monkeypatch):
    """The sync hands vLLM's model the engine's tensors by reference: a vLLM engine core in
    another process cannot take them, so an environment asking for one fails closed."""
    from client_app.trainer.vllm_rollout import arm_vllm_env

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        arm_vllm_env()


def _held(gpu: str) -> bool:
    """Whether another open file holds `engine_start_lock(gpu)`'s flock (flock conflicts between
    open files, in one process as across processes)."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / f"fedagent-vllm-start-{gpu}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_vllm_engines_start_one_at_a_time_on_a_gpu_across_processes(tmp_path, monkeypatch):
    """A lane's vLLM start waits for another process's start on the same GPU (vLLM's memory
    profiling fails when a neighbour frees memory meanwhile), and not for one on another GPU."""
    import subprocess
    import sys
    import tempfile
    import time

    from client_app.trainer.vllm_rollout import engine_start_lock

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    log = tmp_path / "times"
    script = (
        "import sys, time\n"
        "from client_app.trainer.vllm_rollout import engine_start_lock\n"
        "out = open(sys.argv[1], 'a', buffering=1)\n"
        "with engine_start_lock('gpu-b'):\n"
        "    out.write(f'b {time.time()}\\n')\n"
        "    with engine_start_lock('gpu-a'):\n"
        "        out.write(f'a {time.time()}\\n')\n"
    )
    root = Path(__file__).resolve().parents[2]
    with engine_start_lock("gpu-a"):
        p = subprocess.Popen([sys.executable, "-c", script, str(log)], cwd=root)  # TMPDIR: tmp_path
        try:
            deadline = time.monotonic() + 120
            while not (log.exists() and log.read_text().startswith("b ")):  # another GPU: no wait
                assert p.poll() is None and time.monotonic() < deadline, "the other GPU's lock never came"
                time.sleep(0.05)
            time.sleep(0.5)
            assert _held("gpu-a") and "a " not in log.read_text()  # still waiting for this GPU's
            released = time.time()
        except BaseException:
            p.kill()
            raise
    assert p.wait(timeout=60) == 0
    got = float(log.read_text().split("a ")[1])
    assert got >= released, (got, released)
    assert not _held("gpu-a") and not _held("gpu-b")


def test_the_vllm_engine_is_built_and_put_to_sleep_under_the_start_lock(tmp_path, monkeypatch):
    import sys
    import tempfile
    import types

    from client_app.trainer import vllm_rollout

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: list[tuple[str, bool]] = []

    class LLM:  # vLLM needs a GPU: this records whether the start lock is held at each step
        def __init__(self, **kwargs):
            seen.append(("start", _held(vllm_rollout.gpu_key())))

        def sleep(self, level=1):
            seen.append(("sleep", _held(vllm_rollout.gpu_key())))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    gen = vllm_rollout.VllmGenerator(tmp_path, types.SimpleNamespace(eos_token_id=2), 8, 64, 0.4, 0)
    assert seen == [("start", True), ("sleep", True)] and not gen.awake
    assert not _held(vllm_rollout.gpu_key())  # released once asleep


class RecordingLLM:
    """Stands in for `vllm.LLM` (vLLM needs a GPU) to record the order of sleep-mode calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def apply_model(self, fn):
        self.calls.append(("apply_model",))
        raise KeyError("model.layers.0.foo.weight")  # a weight the model does not have


def test_a_failed_weight_sync_puts_the_engine_back_to_sleep():
    """vLLM only sleeps a fully awake engine: a sync that fails half-way wakes the KV cache and
    drops everything again, so the update never runs beside stale vLLM weights (invariant 25)."""
    from client_app.trainer.vllm_rollout import VllmGenerator

    gen = VllmGenerator.__new__(VllmGenerator)
    gen.llm, gen.awake = RecordingLLM(), False
    with pytest.raises(KeyError, match="foo"):
        gen.load_weights(iter(()))
    assert gen.llm.calls == [("wake_up", ("weights",)), ("apply_model",), ("wake_up", ("kv_cache",)), ("sleep", 2)]
    assert not gen.awake


_VLLM_BUILT: list[str] = []


@pytest.fixture(scope="module", params=["builtin", "verl", "verl-lora"], ids=["on_builtin", "on_verl", "on_verl_lora"])
def gpu_trainer(request, env_url, tmp_path_factory):  # noqa: F811
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        pytest.skip("needs a CUDA device and vLLM")
    if _VLLM_BUILT:  # vLLM's CuMem allocator serves one engine per process, even after the first closed
        pytest.skip(
            f"this process already built a vLLM engine (on {_VLLM_BUILT[0]}); run the other training "
            f"engine's tests in a process of their own: pytest -m gpu {__file__} -k on_{request.param}"
        )
    if request.param.startswith("verl") and importlib.util.find_spec("verl") is None:
        pytest.skip("needs verl")
    # head_dim 64: a size every vLLM attention backend takes
    model = random_model_dir(tmp_path_factory.mktemp("models") / "wide", hidden_size=256, layers=2, heads=4)
    _VLLM_BUILT.append(request.param)
    backend, _, lora = request.param.partition("-")
    trainer = build(
        f"{backend}-cuda" + ("-lora" if lora else ""),
        model,
        env_url,
        tmp_path_factory.mktemp("run"),
        rollout={"max_response_tokens": 16, "engine": "vllm", "gpu_memory_utilization": 0.3},
    )
    yield trainer
    trainer.close()


def _plain(t, exchanged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model the exchanged weights stand for: themselves, or under lora the model
    directory's weights with s B A added, the fixed factor drawn again here from its seed (not
    the engine's)."""
    if t.cfg.federation.update != "lora":
        return exchanged
    lora = t.cfg.federation.lora
    plain = hf_parameters(Path(t.cfg.model.path))
    for name, trained in exchanged.items():
        module, _, factor = name.rpartition(".")
        w = f"{module}.weight"
        out_features, in_features = plain[w].shape
        other = fixed_factor(t.cfg.run.seed, "actor", w, other_factor(factor), lora.rank, in_features, out_features)
        product = trained @ other if factor == LORA_B else other @ trained
        plain[w] = plain[w] + lora.alpha / lora.rank * product
    return plain


@pytest.mark.gpu
def test_engine_is_asleep_outside_rollouts_and_a_sync_into_an_awake_engine_fails(gpu_trainer):
    """Invariant 25."""
    gen = gpu_trainer.rollouts.generator

    def used_mb() -> float:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**20

    assert not gen.awake and gen.llm.llm_engine.is_sleeping(), "the vLLM engine must be built asleep"
    with pytest.raises(RuntimeError, match="sleeping"):
        gen.generate([[1, 2, 3]], 0.0, [0])
    asleep = used_mb()
    gen.load_weights(gpu_trainer.engine.policy_tensors())
    try:
        assert gen.awake and not gen.llm.llm_engine.is_sleeping()
        awake = used_mb()
        assert len(gen.generate([[1, 2, 3]], 1.0, [7])[0]) >= 1
        with pytest.raises(RuntimeError, match="invariant 25"):
            gen.load_weights(iter(()))
    finally:
        gen.sleep()
    assert not gen.awake and gen.llm.llm_engine.is_sleeping()
    # asleep, vLLM's weights and KV cache (gpu_memory_utilization 0.3 of the GPU) are released
    assert awake - asleep > 1024 and used_mb() < awake - 1024, (asleep, awake, used_mb())


@pytest.mark.gpu
def test_sync_puts_the_engines_current_weights_into_vllm(gpu_trainer):
    """After new global weights are loaded into the training engine, a sync makes vLLM's
    weights the bf16 rounding of exactly those fp32 values (fused qkv / gate_up included);
    under lora, of the merged W + s B A (computed on the GPU there, on the CPU here: to bf16's
    rounding), well away from the base's."""
    t, gen = gpu_trainer, gpu_trainer.rollouts.generator
    base = t.export_weights()
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    t.load_weights(new)
    gen.load_weights(t.engine.policy_tensors())
    try:
        ours = gen.named_parameters()
    finally:
        gen.sleep()
        t.load_weights(base)
    lora = t.cfg.federation.update == "lora"

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        if lora:  # one bf16 rounding step at most, where GPU and CPU fp32 sums round apart
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)
        else:
            assert torch.equal(got, want)

    bf16 = {k: v.to(torch.bfloat16).float() for k, v in _plain(t, new).items()}
    vocab = bf16["model.embed_tokens.weight"].shape[0]  # vLLM pads its embedding to a multiple of 64 rows
    same(ours["model.embed_tokens.weight"][:vocab], bf16["model.embed_tokens.weight"])
    same(ours["model.layers.1.mlp.down_proj.weight"], bf16["model.layers.1.mlp.down_proj.weight"])
    qkv = torch.cat([bf16[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    same(ours["model.layers.0.self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat([bf16[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    same(ours["model.layers.0.mlp.gate_up_proj.weight"], gate_up)
    if lora:  # the adapters reached vLLM: the merged weights are not the base's
        base = _plain(t, base)["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float()
        assert float((ours["model.layers.1.mlp.down_proj.weight"] - base).abs().max()) > 1e-3


@pytest.mark.gpu
def test_fits_with_vllm_rollouts_keep_memory_flat(gpu_trainer):
    """Invariant 24 with vLLM: allocated device memory and RSS at the phase point after export
    over 6 fits of different clients from different weights; vLLM asleep at that point."""
    import psutil

    from client_app.trainer.base import ClientTasks
    from fl_app.calls import FitCall

    t = gpu_trainer
    initial = t.export_weights()
    model_mb = sum(v.numel() * 4 for v in _plain(t, initial).values()) / 2**20
    allocated, used, rss = [], [], []
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        t.load_weights({k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in initial.items()})
        res = t.fit(
            FitCall(round=1 + i // 2, client_id=i, local_epochs=1, seed=0, proximal_mu=0.01),
            ClientTasks(list(range(16 + 3 * i, 56))),
        )
        assert res.metrics["rollout_sync_s"] > 0 and res.metrics["rollout_tokens"] > 0
        del res
        t.export_weights()
        assert not t.rollouts.generator.awake
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated() / 2**20)  # counts vLLM's sleeping pool too
        free, total = torch.cuda.mem_get_info()
        used.append((total - free) / 2**20)  # what is physically held
        rss.append(psutil.Process().memory_info().rss / 2**20)
    print(
        f"\n{t.cfg.backend}+vLLM after export: allocated MB {[round(x, 1) for x in allocated]}, device used MB "
        f"{[round(x) for x in used]}, RSS MB {[round(x) for x in rss]}, model {model_mb:.1f} MB"
    )
    assert max(allocated[2:]) - min(allocated[2:]) < 0.25 * model_mb, f"allocated memory moves: {allocated}"
    assert max(used[2:]) - min(used[2:]) < 64, f"device memory moves: {used}"
    assert (rss[-1] - rss[2]) / 3 < 10.0, f"host RSS grows: {rss}"
