"""Our env episodes as verl's agent loop `fedagent_env` (client_app/trainer/verl_agent_loop.py):
registered through verl's own plugin mechanism, instantiated the way verl's AgentLoopWorker does
(hydra, from the registry entry plus the agent-loop config's keys), and run against a real shop
env service with a stand-in generation server: verl's server-manager interface over a real
Hugging Face model (verl's vLLM / SGLang replicas need a GPU)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

import hydra  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from trainer_support import env_url, model_dir, small_config  # noqa: E402,F401
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from client_app.rollout import BatchedGenerator, derive_seed  # noqa: E402
from client_app.tiny_model import load_causal_lm  # noqa: E402
from client_app.trainer import verl_config  # noqa: E402
from fl_app.config import save_config  # noqa: E402

TARGET = "client_app.trainer.verl_agent_loop.FedAgentEnvLoop"


def test_verl_registers_the_loop_through_its_plugin_entry_point():
    """A fresh process that only imports verl finds `fedagent_env` (our pyproject entry point)."""
    code = (
        "import verl\nfrom verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r\n"
        "print(r['fedagent_env']['_target_'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == TARGET


class StandInServer:
    """verl's `LLMServerClient.generate` over a real HF model, recording every request."""

    def __init__(self, model_dir: Path) -> None:
        model, self.tokenizer = load_causal_lm(model_dir)
        self.generator = BatchedGenerator(model, self.tokenizer, max_new_tokens=64)
        self.requests: list[tuple[list[int], dict, list[int]]] = []
        self.lock = asyncio.Lock()

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        async with self.lock:
            self.generator.max_new_tokens = sampling_params["max_tokens"]
            ids = self.generator.generate([prompt_ids], sampling_params["temperature"], [derive_seed(request_id)])[0]
        self.requests.append((list(prompt_ids), dict(sampling_params), ids))
        return TokenOutput(token_ids=ids)


def _loop(server: StandInServer, model_dir: Path, recipe: Path | str, response_length: int = 384, **keys):  # noqa: F811
    """`fedagent_env` built as verl's AgentLoopWorker builds an agent loop (verl's
    response_length is the whole multi-turn response: set by the verl run's own config)."""
    cfg = small_config(model_dir)
    trainer_config = verl_config.compose(cfg, model_dir, "cpu")
    trainer_config.actor_rollout_ref.rollout.response_length = response_length
    return hydra.utils.instantiate(
        config={**_agent_loop_registry["fedagent_env"], "recipe": str(recipe), **keys},
        trainer_config=DictConfigWrap(trainer_config),
        server_manager=server,
        tokenizer=server.tokenizer,
        processor=None,
        hf_model_type="qwen2",
        dataset_cls=None,
        data_config=DictConfigWrap(trainer_config.data),
        tools=ToolListWrap([]),
    )


def test_episodes_play_against_a_real_env_service(env_url, model_dir, tmp_path):  # noqa: F811
    cfg = small_config(model_dir, rollout={"mode": "concat"}, env={"max_turns": 3})
    save_config(cfg, tmp_path / "concat.yaml")
    server = StandInServer(model_dir)
    tasks = [16, 16, 23, 23]  # two GRPO groups of two, as verl repeats rows

    async def main():
        loop = _loop(server, model_dir, tmp_path / "concat.yaml", env_url=env_url)
        return await asyncio.gather(*(loop.run({"temperature": 1.0, "top_p": 1.0}, task_index=t) for t in tasks))

    outputs = asyncio.run(main())
    assert [o.extra_fields["task_id"] for o in outputs][0::2] == [o.extra_fields["task_id"] for o in outputs][1::2]
    assert outputs[0].extra_fields["task_id"] != outputs[2].extra_fields["task_id"]
    turns = 0
    for out in outputs:
        full = out.prompt_ids + out.response_ids
        assert len(out.response_mask) == len(out.response_ids)
        # every turn the server generated for this episode sits in the sequence right after the
        # exact context it was generated from, masked 1; everything else in the response is glue
        mine = [
            (p, ids) for p, _, ids in server.requests if full[: len(p)] == p and full[len(p) : len(p) + len(ids)] == ids
        ]
        n_turns = round(out.extra_fields["episode_turns"])
        assert len(mine) == n_turns >= 1 and out.num_turns == 2 * n_turns + 1
        generated = [0] * len(out.response_ids)
        for p, ids in mine:
            for k in range(len(p) - len(out.prompt_ids), len(p) - len(out.prompt_ids) + len(ids)):
                generated[k] = 1
        assert out.response_mask == generated
        invalid = round(out.extra_fields["episode_invalid_action_rate"] * n_turns)
        assert out.reward_score == pytest.approx(
            out.extra_fields["env_reward"] - cfg.rollout.invalid_action_penalty * invalid
        )
        assert out.extra_fields["won"] == (out.extra_fields["outcome"] == "won")
        turns += n_turns
    assert len(server.requests) == turns
    assert all(
        sp["max_tokens"] == cfg.rollout.max_response_tokens and sp["temperature"] == 1.0 for _, sp, _ in server.requests
    )


def test_windowed_gigpo_or_lora_recipes_and_a_missing_env_are_refused(model_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("FEDAGENT_ENV_URL", raising=False)
    server = StandInServer(model_dir)
    save_config(small_config(model_dir), tmp_path / "windowed.yaml")
    save_config(small_config(model_dir, rollout={"mode": "concat"}), tmp_path / "concat.yaml")
    gigpo = small_config(model_dir, rollout={"mode": "concat"}, algo={"name": "gigpo"})
    save_config(gigpo, tmp_path / "gigpo.yaml")
    lora = small_config(model_dir, rollout={"mode": "concat"}, federation={"update": "lora"})
    save_config(lora, tmp_path / "lora.yaml")

    async def build(recipe, **keys):
        return _loop(server, model_dir, recipe, **keys)

    for recipe, keys, message in (
        (tmp_path / "windowed.yaml", {"env_url": "http://127.0.0.1:1"}, "concat mode"),
        (tmp_path / "concat.yaml", {}, "env_url"),
        (tmp_path / "gigpo.yaml", {"env_url": "http://127.0.0.1:1"}, "no GiGPO"),
        (tmp_path / "lora.yaml", {"env_url": "http://127.0.0.1:1"}, "federation.update='lora'"),
        ("", {}, "needs `recipe`"),
    ):
        with pytest.raises(InstantiationException, match=message) as err:  # hydra wraps the constructor's error
            asyncio.run(build(recipe, **keys))
        assert isinstance(err.value.__cause__, ValueError)


def test_an_episode_longer_than_verls_response_length_is_refused(env_url, model_dir, tmp_path):  # noqa: F811
    save_config(small_config(model_dir, rollout={"mode": "concat"}, env={"max_turns": 3}), tmp_path / "concat.yaml")
    server = StandInServer(model_dir)

    async def main():
        loop = _loop(server, model_dir, tmp_path / "concat.yaml", response_length=4, env_url=env_url)
        return await loop.run({"temperature": 1.0}, task_index=16)

    with pytest.raises(ValueError, match="response_length is 4; raise it"):
        asyncio.run(main())
