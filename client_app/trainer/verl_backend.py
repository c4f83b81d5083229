"""The verl training engine: verl 0.9.1's FSDP2 engine behind `engine.Engine`.

Built once per lane, in the lane service's own process (no Ray: verl's `TrainingWorker` is
constructed in-process over a process group this module starts: world size 1, or over a lane of
k ranks, world k, each rank's engine holding 1/k of every model and its optimizer state):

  * the actor: `verl.workers.engine_workers.TrainingWorker` over `verl_head.ResponseHeadEngine`
    (verl's `FSDPEngineWithLMHead`, the LM head applied at response positions only; strategy
    fsdp2, fp32 master weights), its loss `verl.workers.utils.losses.ppo_loss` with
    the `ActorConfig` composed from our recipe (`verl_config.py`);
  * the reference (kl_coef > 0): a second, forward-only `TrainingWorker` on the original
    backbone (`ref_anchor: base`), or overwritten with the loaded weights per fit (`round`);
  * the critic (ppo): a `TrainingWorker` over verl's `FSDPEngineWithValueHead` (the policy's
    architecture + a one-output head, as builtin's critic, so the `critic` member's weight
    names match), its loss verl's `value_loss` scaled to `algo.critic.loss_coef`; federated
    as the `critic` member, never touched by FedProx.

The fit loop is the project's own (`loop.py`, shared with the builtin engine); this engine
only scores and trains rows. `load_weights` injects our fp32 state dict into the live FSDP2
module in place (`torch.distributed.checkpoint.state_dict.set_model_state_dict`, full state
dict); `begin_fit` drops the AdamW state and rebuilds the LR schedule (invariant 3);
`export_weights` reads fp32 full tensors straight from the engine
(`engine.get_per_tensor_param()`), never through verl's model merger (it casts to bf16: field
log 2026-07-23).

Over k ranks (`run.lane_devices`, `ranks.py`; `sharded`) every call that reads or writes the
weights runs on every rank at once (the loop forwards it): a load broadcasts rank 0's full
tensors and each rank keeps its shard (`broadcast_from_rank0`), an export gathers them (rank 0
keeps them); the models are FSDP2 units per decoder layer (`verl_config`), each gathered for
its pass and freed after it, so every rank runs as many scoring and step passes as the rank
with the most micro-batches (`_padding`: the others pad with zero-weighted one-token rows, a
rank holding none of a mini-batch's rows included), while a rollout gathers the whole actor
once on every rank (`generation_model`: ranks play different numbers of decoding steps); a
step's loss is normalised by the whole mini-batch over all ranks (`PolicyBatch.norm`, verl's
`dp_size` convention against FSDP2's averaging reduce-scatter), and the clip uses the norm
over every rank's shards (`verl_head.LocalShards.clip_`).

A train step is what verl's `BaseEngine.train_batch` does for one mini-batch (zero_grad, verl's
`forward_step` and a backward per micro-batch with verl's `ppo_loss` / `value_loss`, clip +
AdamW), with the loop's FedProx gradient (policy only, invariant 4) added between the backward
and the step.
tests/trainer/test_engine_contract.py holds it to the builtin engine's updates within 1e-5.

CPU: verl 0.9.1 ships no CPU platform; `verl_cpu.arm_cpu` gives it one, and the process group
is gloo. Rollouts run the builtin's episode loop (so the context a policy acted
on is exactly the row it trains on) with one of two generators: `verl.rollout_engine: hf`,
batched Hugging Face `generate` on the engine's own FSDP2 module; `vllm` (GPU), an in-process
vLLM engine woken with the engine's full tensors before each rollout and asleep otherwise
(`vllm_rollout.py`).

`federation.update: lora`: the builtin engine's adapters (`lora.py`, the same layers, names and
A bits), put on the Hugging Face module of the actor and the critic before verl wraps it in FSDP2
(`adapters_at_build`), so verl's engine shards, steps and exports them as its own parameters:
its optimizer holds only the trained factors (+ the critic's value head), the exchanged members are those, the
starting weights load into the frozen base, and `base_sha256` is `lora.base_digest` of the same
tensors as builtin's. The reference stays the plain model; the vLLM rollout is synced the merged
weights W + s B A (`lora.merged_tensors`), the hf rollout computes with the adapters in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from client_app.algos import AggNorm
from client_app.critic import CriticStart, resolve_start_critic, seeded_value_head
from client_app.rollout import TrainRow, derive_seed
from client_app.runtime_dir import remove_at_exit
from client_app.trainer import verl_config, verl_head
from client_app.trainer.compute import compile_models
from client_app.trainer.device import avoid_cudnn_attention, cuda_autocast, release_memory, resolve_device
from client_app.trainer.engine import Batch, LossSpec, PolicyBatch, Role, StepResult, ValueBatch, micro_batches
from client_app.trainer.lora import adapt, base_digest, is_adapter, merged_tensors
from client_app.trainer.losses import loss_specs
from client_app.trainer.verl_cpu import arm_cpu
from client_app.trainer.verl_rows import no_padding_batch
from client_app.trainer.weight_check import check_loadable
from fl_app.config import Config
from fl_app.weights import load_shards

if TYPE_CHECKING:
    from client_app.trainer.ranks import Ranks

log = logging.getLogger("fedagent.trainer.verl")
# verl's per-micro-batch actor metrics -> ours (shares of the mini-batch loss are summed over
# micro-batches, fractions and ppo_kl averaged, as builtin reports them)
_METRICS = {
    "actor/pg_loss": ("pg_loss", "sum"),
    "actor/entropy_loss": ("entropy", "sum"),
    "kl_loss": ("kl_loss", "sum"),
    "actor/pg_clipfrac": ("pg_clipfrac", "mean"),
    "actor/ppo_kl": ("ppo_kl", "mean"),
    "actor/pg_clipfrac_lower": ("pg_clipfrac_lower", "mean"),
}


# ---------------------------------------------------------------------------------- runtime seams


def ensure_process_group(device: str, ranks: Ranks | None = None) -> None:
    """The process group verl's FSDP2 engine spans (gloo on CPU; gloo + nccl on CUDA): world size
    1, rendezvous through a private file (no port), an existing one reused; or this rank of a
    lane over k ranks (`ranks`), world k over the lane's rendezvous store, in a process that
    holds no other group. verl's Worker reads the rank env vars: they are set to this rank."""
    import torch.distributed as dist

    rank, world = (0, 1) if ranks is None else (ranks.rank, ranks.world)
    backend = "cpu:gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
    if dist.is_initialized():
        if world > 1 or dist.get_world_size() != 1:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} already exists in this process; the "
                f"verl engine shards over a group of world size {world} of its own (a lane's rank 0 is its "
                "trainer service's process)"
            )
    elif ranks is not None:
        if ranks.store is None:
            raise RuntimeError("the lane's ranks have not joined: the verl engine's process group forms over them")
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore("verl", ranks.store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=ranks.timeout_s),
        )
    else:
        fd, store = tempfile.mkstemp(prefix=f"fedagent-verl-pg-{os.getpid()}-")
        os.close(fd)
        os.unlink(store)  # the file store creates it; a leftover file would hold a stale rendezvous
        # torch removes the file only when the group is destroyed, which an exiting lane never does
        remove_at_exit(Path(store))
        dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=0, world_size=1)
    for key, value in (
        ("WORLD_SIZE", str(world)),
        ("RANK", str(rank)),
        ("LOCAL_RANK", str(rank)),
        ("LOCAL_WORLD_SIZE", str(world)),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "0"),
    ):
        os.environ[key] = value


@contextlib.contextmanager
def value_model_attention(flash: bool):
    """verl 0.9.1 loads every value model with flash_attention_2 (`verl.utils.model.
    load_valuehead_model`), which needs the flash-attn package (absent on CPU and on the H200
    image): while the critic is built without it, that loader is swapped for one that loads the
    same class (AutoModelForTokenClassification) with SDPA; restored on exit.
    `_check_value_model` then verifies what was built (fail closed)."""
    import verl.utils.model as verl_model

    if flash:
        yield
        return
    original = verl_model.load_valuehead_model

    def load_with_sdpa(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )

    verl_model.load_valuehead_model = load_with_sdpa
    try:
        yield
    finally:
        verl_model.load_valuehead_model = original


def _check_value_model(module: torch.nn.Module, flash: bool) -> None:
    """The critic verl built is a token-classification model with one output and the attention
    it was asked for; anything else would federate weights builtin cannot read."""
    inner = getattr(module, "_fsdp_wrapped_module", module)
    config: Any = inner.config  # a transformers config
    wanted = "flash_attention_2" if flash else "sdpa"
    if (
        not type(inner).__name__.endswith("ForTokenClassification")
        or config.num_labels != 1
        or config._attn_implementation != wanted
    ):
        raise RuntimeError(
            f"verl built the critic as {type(inner).__name__} (num_labels={config.num_labels}, "
            f"attention {config._attn_implementation!r}); expected a one-output "
            f"*ForTokenClassification with {wanted!r}"
        )


@contextlib.contextmanager
def adapters_at_build(member: str | None, cfg: Config) -> Iterator[None]:
    """While a verl worker is built: `member`'s LoRA adapters (`lora.adapt`) go on the Hugging
    Face module verl loads, after verl's own build steps and before FSDP2 wraps it, so verl
    shards the adapters with the layer they belong to and builds its optimizer over the
    parameters that still train. verl's own LoRA path (`model.lora_rank`) is PEFT's, with a
    trained, differently drawn A and prefixed names: not ours. Restored on exit; `member` None
    (full weights, or the reference) builds verl's module unchanged."""
    if member is None:
        yield
        return
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    original = FSDPEngine._build_module

    def build_adapted(engine: Any) -> torch.nn.Module:
        module = original(engine)
        adapt(module, member, cfg.federation.lora, cfg.run.seed)
        return module

    FSDPEngine._build_module = build_adapted  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPEngine._build_module = original  # type: ignore[method-assign]


def isolate_from_outer_ray() -> None:
    """The verl backend never joins a Ray cluster it did not start (Flower's simulation runs
    on one): an inherited RAY_ADDRESS is dropped before verl is imported."""
    os.environ.pop("RAY_ADDRESS", None)


# ---------------------------------------------------------------------------------- the engine


class VerlEngine:
    """`engine.Engine` (both of its parts) on verl's FSDP2 training engines (policy, reference,
    critic)."""

    critic_start: CriticStart | None = None  # set when the algorithm trains a critic
    base_sha256 = ""  # federation.update: lora: the frozen base's digest (`lora.base_digest`)
    # verl's own choice for the reference: a forward-only engine under FSDP2's pinned CPU offload,
    # whose weights then cross to the GPU for every micro-batch it scores. Off (ours), the
    # reference is a training engine that never steps (its AdamW makes state only at a step),
    # resident beside the actor; `bench.engines --verl-ref-offloaded` measures the two side by side.
    offload_reference: bool = False

    def __init__(
        self,
        cfg: Config,
        model_path: Path,
        run_dir: Path | str | None = None,
        reference_path: Path | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        if cfg.backend != "verl":
            raise ValueError(f"VerlEngine needs backend=verl, got backend={cfg.backend!r}")
        self.cfg = cfg
        self.ranks = ranks  # a lane over several ranks: the engine shards its models over them
        self.sharded = ranks is not None
        self.device = resolve_device(cfg.run.device)
        self.amp_dtype = cuda_autocast(self.device)  # over FSDP's fp32 module
        avoid_cudnn_attention(self.device)
        isolate_from_outer_ray()
        self.model_path = Path(model_path)
        self.policy_loss, self.value_loss = loss_specs(cfg)
        # 1. the verl config: composed and validated before anything is built, then recorded
        self.verl_cfg = verl_config.compose(cfg, self.model_path, self.device.type)
        verl_config.check_resolved(cfg, self.verl_cfg)
        self.resolved_config_path = verl_config.write_resolved(self.verl_cfg, Path(run_dir)) if run_dir else None
        # 2. verl's runtime on this device, over this lane's ranks (one, or k)
        if self.device.type == "cpu":
            arm_cpu()
        ensure_process_group(self.device.type, ranks)
        verl_head.register(self.device.type)  # the LM engine that scores response positions only
        # 3. the workers
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import ppo_loss

        lora = cfg.federation.update == "lora"
        model_config = omega_conf_to_dataclass(self.verl_cfg.actor_rollout_ref.model)
        self.actor_config = omega_conf_to_dataclass(self.verl_cfg.actor_rollout_ref.actor)
        self.actor_config.model_config = model_config
        with adapters_at_build("actor" if lora else None, cfg):
            self.actor = self._worker(self.actor_config, model_config, forward_only=False)
        self.loss_fn = partial(ppo_loss, config=self.actor_config)
        self.actor.set_loss_fn(self.loss_fn)
        self.engine = self.actor.engine
        if not isinstance(self.engine, verl_head.engine_class()):  # e.g. VERL_ENGINE_DEVICE overrode the lookup
            raise RuntimeError(f"verl built {type(self.engine).__name__}, not the response-head engine registered")
        self.ref = self._worker(self.actor_config, model_config, forward_only=True) if cfg.algo.kl_coef > 0 else None
        # the critic: verl's value-model engine (AutoModelForTokenClassification, as builtin's)
        self.critic = None
        if cfg.algo.spec.critic:
            self.critic_start = resolve_start_critic(cfg.model.init_from, cfg.algo.critic.path)
            critic_config = omega_conf_to_dataclass(self.verl_cfg.critic)
            flash = verl_config.has_flash_attn(self.device.type)
            with value_model_attention(flash), adapters_at_build("critic" if lora else None, cfg):
                self.critic = self._worker(
                    critic_config,
                    critic_config.model,
                    forward_only=False,
                    model_type="value_model",
                    micro=cfg.algo.critic.micro,
                )
            _check_value_model(self.critic.engine.module, flash)
            # verl's value loss carries a fixed 0.5; ours is critic.loss_coef x the same reduction
            self.critic_loss_fn = partial(
                scaled_value_loss, config=critic_config, scale=cfg.algo.critic.loss_coef / VERL_VALUE_LOSS_COEF
            )
            self.critic.set_loss_fn(self.critic_loss_fn)
        if cfg.run.compile:  # each decoder layer's forward; FSDP2's gather and free stay in its eager hooks
            compile_models(w.engine.module for w in (self.actor, self.ref, self.critic) if w is not None)
        self.tokenizer = load_causal_lm_tokenizer(self.model_path)
        rows = self.engine.module.get_output_embeddings().weight.shape[0]
        if cfg.rollout.engine == "hf" and rows != len(self.tokenizer):
            # the hf rollout samples over the tokenizer's ids only; verl's engine normalises its
            # log-probs over every output row, so it would train on a distribution it did not sample from
            raise ValueError(
                f"the model has {rows} output rows and its tokenizer {len(self.tokenizer)} tokens; "
                "backend=verl with rollout.engine=hf needs them equal (verl scores over every "
                "row). Use backend: builtin for this model, or rollout.engine: vllm on a GPU"
            )
        # the exchanged weights (all, or the adapters' B + the value head) and the plain model's
        # (what a starting checkpoint and a fresh critic load into: under lora, the frozen base)
        self._names: dict[str, list[str]] = {}
        self._plain: dict[str, list[str]] = {}
        self._name_member("actor")
        if self.ref is not None and reference_path is not None and Path(reference_path) != self.model_path:
            from client_app.models import hf_parameters  # model.reference: backbone under a warm start

            _inject(self.ref.engine.module, hf_parameters(Path(reference_path)), "actor", sharded=self.sharded)
        if cfg.model.init_from:
            self._load_start(cfg.model.init_from, "actor")
        if self.critic is not None and self.critic_start is not None:
            self._name_member("critic")
            if self.critic_start.path:
                self._load_start(self.critic_start.path, "critic")
            else:
                self._load_plain(self._fresh_critic(), "critic")
            log.info(
                "critic: %s (%s)%s",
                self.critic_start.mode,
                self.critic_start.reason,
                f" from {self.critic_start.path}" if self.critic_start.path else "",
            )
        self.pad_id = self.tokenizer.pad_token_id
        if lora:
            self.base_sha256 = self._base_digest()

    def _name_member(self, member: str) -> None:
        """`member`'s exchanged and plain parameter names, and its optimizer cut to the first:
        verl builds the critic's over every parameter, frozen ones included (the actor's,
        `verl_head.LocalShards`, takes only trained ones already)."""
        engine = self._engine_of(member)
        params = list(engine.module.named_parameters())
        self._names[member] = [n for n, p in params if p.requires_grad]
        self._plain[member] = [n for n, _ in params if not is_adapter(n)]
        if self.cfg.federation.update != "lora":
            return
        frozen = {id(p) for _, p in params if not p.requires_grad}
        for group in engine.optimizer.param_groups:  # the same optimizer object: verl's checkpoint manager holds it
            group["params"] = [p for p in group["params"] if id(p) not in frozen]
        stepped = sum(len(g["params"]) for g in engine.optimizer.param_groups)
        if stepped != len(self._names[member]):
            raise RuntimeError(
                f"the verl {member} optimizer steps {stepped} tensors, not the {len(self._names[member])} "
                "trained ones (the adapters' trained factors, and the critic's value head): the frozen base would move"
            )

    def _base_digest(self) -> str:
        """`lora.base_digest` of every member's frozen tensors, gathered whole from the shards:
        the builtin engine's digest of the same base."""
        modules = {member: self._engine_of(member).module for member in self._names}
        for module in modules.values():
            _reshard(module)
        digest = base_digest(modules)
        lora = self.cfg.federation.lora
        log.info("lora: rank %d on %s; base %s", lora.rank, lora.target_modules, digest)
        return digest

    def _worker(
        self,
        role_config: Any,
        model_config: Any,
        forward_only: bool,
        model_type: str = "language_model",
        micro: int | None = None,
    ) -> Any:
        """One in-process verl TrainingWorker (fsdp2), built as verl's trainer builds its actor,
        reference and critic workers."""
        import copy

        from verl.workers.config import TrainingWorkerConfig
        from verl.workers.engine_workers import TrainingWorker

        engine_config = copy.deepcopy(role_config.engine)
        micro = micro or self.cfg.algo.micro_batch_size
        # verl offloads a forward-only FSDP2 module to pinned CPU memory (pinning needs CUDA):
        # unless `offload_reference` asks for that, the reference is a training engine that never steps
        engine_config.forward_only = forward_only and self.offload_reference and self.device.type != "cpu"
        engine_config.micro_batch_size_per_gpu = micro
        engine_config.infer_micro_batch_size_per_gpu = micro
        engine_config.use_dynamic_bsz = False
        engine_config.use_remove_padding = bool(model_config.get("use_remove_padding", False))
        config = TrainingWorkerConfig(
            model_type=model_type,
            model_config=copy.deepcopy(model_config),
            engine_config=engine_config,
            optimizer_config=role_config.optim,
            checkpoint_config=role_config.checkpoint,
        )
        worker = TrainingWorker(config=config)
        worker.reset()  # builds model (from model.path), optimizer, LR schedule once
        if getattr(worker.engine, "scaler", None) is not None:  # `_step` runs verl's forward_step without one
            raise ValueError("the verl engine's step has no loss scaler (fp16 training): train in bf16 or fp32")
        return worker

    # ------------------------------------------------------------------ weights

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._names)

    def _engine(self, member: str) -> Any:
        if member not in self._names:
            raise KeyError(f"this trainer has no {member!r} weights; its members are {list(self._names)}")
        return self._engine_of(member)

    def _engine_of(self, member: str) -> Any:
        return self.engine if member == "actor" else self._critic().engine

    def _critic(self) -> Any:
        if self.critic is None:
            raise RuntimeError(f"algo.name={self.cfg.algo.name!r} trains no critic")
        return self.critic

    def _load_start(self, weights_dir: str, member: str) -> None:
        try:
            self._load_plain(load_shards(Path(weights_dir).expanduser()), member)
        except (KeyError, ValueError, TypeError) as e:
            what = "model.init_from" if member == "actor" else "the starting critic"
            raise ValueError(f"{what} ({weights_dir}) does not fit model.path={self.cfg.model.path!r}: {e}") from None

    def _fresh_critic(self) -> dict[str, torch.Tensor]:
        """The policy's current backbone (under lora: its frozen base) under a value head seeded
        as builtin seeds it (`client_app.critic.seeded_value_head`): the same fresh critic on
        both engines."""
        actor = _export(self.engine, self._plain["actor"], sharded=self.sharded)
        critic = self._critic().engine
        shape = tuple(dict(critic.module.named_parameters())["score.weight"].shape)
        head = seeded_value_head(shape, critic.model_config.hf_config, derive_seed("value-head", self.cfg.run.seed))
        return {n: head[n] if n in head else actor[n] for n in self._plain["critic"]}

    def _load_plain(self, state: Mapping[str, torch.Tensor], member: str) -> None:
        """A plain model's weights (a starting checkpoint, a fresh critic) into `member`: under
        lora its frozen base (+ the critic's head), the adapters left as they are."""
        _inject(self._engine(member).module, state, member, self._plain[member], sharded=self.sharded)

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor], member: str = "actor") -> None:
        """Over k ranks: rank 0's `state` into every rank's shards (the others pass none)."""
        _inject(self._engine(member).module, state, member, self._names[member], sharded=self.sharded)

    def export_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        """fp32 full tensors straight from the engine (`get_per_tensor_param`), detached CPU
        copies, one per parameter (a tied LM head is exported once, as its embedding). Over k
        ranks every rank gathers them with the others, and only rank 0 keeps them (the others
        return none)."""
        return _export(self._engine(member), self._names[member], sharded=self.sharded)

    def master_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        """FSDP2 shards its masters: a full tensor exists only as `export_weights` gathers it."""
        return self.export_weights(member)

    def generation_model(self) -> torch.nn.Module:
        """The actor; it stays gathered over a rollout's decoding steps (one gather, not one a
        step) until the scoring after it, or a load, frees it (`_reshard`). Over k ranks it is
        gathered whole here, on every rank, and its layers kept so over the rollout
        (`_per_layer` off): ranks play different numbers of turns and decoding steps (one none),
        so per-layer gathers inside `generate` would not pair up. The rollout is where such a
        lane's memory peaks: the gathered model plus the KV cache."""
        module = self.engine.module.eval()
        if self.sharded:
            _per_layer(module, False)
            _gather(module)
        return module

    def policy_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, fp32 full tensor) pairs, lazily: verl's own under full weights; under lora the
        plain model's, each adapted weight merged (W + s B A, `lora.merged_tensors`, builtin's)."""
        _reshard(self.engine.module)
        if self.cfg.federation.update == "lora":
            return merged_tensors(self.engine.module)
        weights, _peft = self.engine.get_per_tensor_param()
        return weights

    def parameters(self, member: str = "actor") -> Iterable[tuple[str, torch.nn.Parameter]]:
        """The sharded fp32 masters the optimizer steps (a unit left gathered by a rollout would
        name its gathered copies instead): the exchanged ones."""
        module = self._engine(member).module
        _reshard(module)
        return ((n, p) for n, p in module.named_parameters() if p.requires_grad)

    # ------------------------------------------------------------------ fit bracket

    def _trained_engines(self) -> list[tuple[Any, float]]:
        """(engine, learning rate) of every member that trains: the policy, and the critic."""
        engines = [(self.engine, self.cfg.algo.lr)]
        if self.critic is not None:
            engines.append((self.critic.engine, self.cfg.algo.critic.lr))
        return engines

    def begin_fit(self, reference_from_policy: bool) -> None:
        """A fresh AdamW and LR schedule (invariant 3) for the policy and the critic, without a
        new optimizer object: the engine's checkpoint manager holds the old one, so replacing it
        would keep the retired state alive (field log 2026-07-22). Clearing the state is exactly
        a fresh torch AdamW (its state is created lazily at the first step)."""
        from verl.utils.torch_functional import get_constant_schedule_with_warmup

        for engine, lr in self._trained_engines():
            optimizer = engine.optimizer
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
            for group in optimizer.param_groups:
                group["lr"] = lr
                group["initial_lr"] = lr
            engine.lr_scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0)
            engine.checkpoint_manager.lr_scheduler = engine.lr_scheduler
        if reference_from_policy and self.ref is not None:
            _inject(self.ref.engine.module, self._plain_policy(), "actor", sharded=self.sharded)

    def _plain_policy(self) -> dict[str, torch.Tensor]:
        """The policy as a plain model: its weights, or under lora the adapters merged in."""
        if self.cfg.federation.update == "lora":
            return dict(self.policy_tensors())
        return self.export_weights()

    def end_fit(self) -> None:
        for engine, _ in self._trained_engines():
            engine.optimizer.zero_grad(set_to_none=True)
            engine.optimizer.state.clear()

    # ------------------------------------------------------------------ scoring

    def score(self, rows: Sequence[TrainRow], role: Role) -> list[torch.Tensor]:
        """From verl's `TrainingWorker.infer_batch` (log-probs at the rollout temperature)."""
        if role == "critic":
            if self.critic is None:
                raise RuntimeError(f"algo.name={self.cfg.algo.name!r} has no critic, so rows have no values")
            _reshard(self.engine.module)  # a rollout leaves the actor gathered: never two models at once
            return self._row_outputs(rows, self.critic, "values", self.cfg.algo.critic.micro)
        if self.sharded:
            _reshard(self.engine.module)  # k ranks: the rollout's gathered actor is freed before any pass
        worker = self.actor if role == "policy" else self.ref
        if worker is None:
            raise RuntimeError("no reference model: algo.kl_coef is 0, so nothing needs the reference's log-probs")
        return self._row_outputs(rows, worker, "log_probs", self.cfg.algo.micro_batch_size)

    def _row_outputs(self, rows: Sequence[TrainRow], worker: Any, key: str, micro: int) -> list[torch.Tensor]:
        """Each micro-batch (rows of similar length within the token budget, as builtin scores
        them) through the engine's `forward_step`, what verl's `infer_batch` runs per
        micro-batch, without its bookkeeping: a token count, a metric gather and a wait for the
        device a call, collectives that over k ranks would pair with another rank's other calls.
        Over k ranks every layer is gathered per pass, so every rank runs as many passes as the
        rank with the most micro-batches: the others pad with passes of a one-token row whose
        output is dropped (`_padding`)."""
        from verl.workers.utils.padding import no_padding_2_padding

        engine = worker.engine
        keys = {"calculate_entropy": False, "compute_loss": False}
        parts = micro_batches(rows, micro, self.cfg.algo.micro_batch_tokens)
        tds = [
            self._batch([rows[i] for i in part], engine_keys={**keys, "micro_batch_size_per_gpu": len(part)})
            for part in parts
        ]
        pads = [self._batch(self._idle_batch().rows, engine_keys=keys) for _ in range(self._padding(len(tds)))]
        scored: list[tuple[list[int], torch.Tensor]] = []
        with engine.eval_mode(), torch.no_grad(), _phase(engine.module, per_layer=self.sharded):
            for part, td in zip(parts, tds):
                _, output = engine.forward_step(td, loss_function=None, forward_only=True)
                scored.append((part, no_padding_2_padding(output["model_output"][key], td).float()))
            for td in pads:
                engine.forward_step(td, loss_function=None, forward_only=True)
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for part, padded in scored:  # to the host after the last pass: no pass waits for the device
            on_host = padded.cpu()
            for b, i in enumerate(part):
                out[i] = on_host[b, : len(rows[i].response_ids)].clone()
        return out

    # ------------------------------------------------------------------ steps

    def step(self, batch: Batch, loss: LossSpec, after_backward: Callable[[], None] | None = None) -> StepResult:
        """verl's forward_step and ppo_loss (a `PolicyBatch`) or the scaled value_loss (a
        `ValueBatch`) per micro-batch, `after_backward` (FedProx: the policy), clip + AdamW."""
        if isinstance(batch, PolicyBatch):
            self._check_loss(loss, self.policy_loss, "policy")
            return self._policy_step(batch, batch.norm, after_backward)
        if self.critic is None:
            raise RuntimeError(f"algo.name={self.cfg.algo.name!r} trains no critic")
        self._check_loss(loss, self.value_loss, "value")
        tds = [
            self._batch(part.rows, values=part.old_values, returns=part.returns)
            for part in self._micro_batches(batch, self.cfg.algo.critic.micro)
        ]
        return _step(self.critic.engine, self.critic_loss_fn, tds, _critic_metrics, after_backward)

    def _policy_step(
        self, batch: PolicyBatch, norm: AggNorm | None, after_backward: Callable[[], None] | None
    ) -> StepResult:
        """The policy's step on `batch`, normalised by `norm` (the whole mini-batch over k ranks)
        or its own rows; over k ranks the loss terms are then those of every rank's rows, and a
        rank with fewer micro-batches (or none of the mini-batch's rows) pads with zero-weighted
        ones up to the most any rank has (`_padding`), so that every rank's per-layer gathers and
        reduce-scatters pair up; `pad_micro_batches` counts them over the ranks."""
        tds = [
            self._batch(part.rows, old=part.old_log_probs, advantages=part.advantages, ref=part.ref_log_probs)
            for part in self._micro_batches(batch, self.cfg.algo.micro_batch_size)
        ]
        idle = self._idle_batch()
        pads = [
            self._batch(idle.rows, old=idle.old_log_probs, advantages=idle.advantages, ref=idle.ref_log_probs)
            for _ in range(self._padding(len(tds)))
        ]
        result = _step(self.engine, self.loss_fn, tds, _policy_metrics, after_backward, norm, pads)
        if self.ranks is None:
            return result
        return dataclasses.replace(result, metrics=self._policy_terms(result.metrics, len(tds), len(pads)))

    def _padding(self, n: int) -> int:
        """How many passes a rank of `n` micro-batches adds so that every rank of k runs as many
        as the one with the most (the counts exchanged first); 0 on one rank."""
        if self.ranks is None:
            return 0
        return max(self.ranks.all_gather(n)) - n

    def _policy_terms(self, metrics: Mapping[str, float], n: int, pads: int) -> dict[str, float]:
        """The mini-batch's loss terms over every rank (`Ranks.sum_terms`), from this rank's
        `metrics` of its `n` micro-batches: its added terms hold dp_size x its share (verl's
        normalisation), the averaged ones their mean over its micro-batches; and the `pads`
        zero-weighted micro-batches of every rank (`pad_micro_batches`)."""
        assert self.ranks is not None
        k = self.ranks.world
        terms = {"pad_micro_batches": (float(pads), 1)}
        for name, how in _METRICS.values():
            if name in metrics:
                terms[name] = (metrics[name] / k, n) if how == "sum" else (metrics[name] * n, n)
        added = ("pad_micro_batches", *(name for name, how in _METRICS.values() if how == "sum"))
        averaged = tuple(name for name, how in _METRICS.values() if how == "mean")
        return self.ranks.sum_terms(terms, added, averaged)

    def _idle_batch(self) -> PolicyBatch:
        """One one-token row (a pad after a pad) with zero advantages and log-probs: a padding
        pass (`_padding`), backpropagated at weight 0 in a step, so that FSDP2's gathers and
        reduce-scatters run as often on every rank."""
        row = TrainRow([self.pad_id], [self.pad_id], [1], 0.0, 0, 0)
        zero = [torch.zeros(1)]
        return PolicyBatch([row], zero, zero, zero if self.policy_loss.kl_coef > 0 else None)

    @staticmethod
    def _check_loss(loss: LossSpec, built: LossSpec, what: str) -> None:
        if loss != built:
            raise ValueError(
                f"verl's {what} loss is composed from the recipe when the engine is built ({built}); "
                f"it cannot train {loss}"
            )

    def _micro_batches(self, batch: _Batch, micro: int) -> list[_Batch]:
        """The mini-batch cut as builtin cuts it (`engine.micro_batches`: rows of similar length,
        at most `micro` rows and `algo.micro_batch_tokens` padded tokens a pass). verl's own
        token budget balances real tokens across its micro-batches, so each mixes long and short
        rows, and without packed sequences (no flash-attn) every row pads to the longest."""
        return [_subset(batch, part) for part in micro_batches(batch.rows, micro, self.cfg.algo.micro_batch_tokens)]

    def _batch(
        self,
        rows: Sequence[TrainRow],
        old: Sequence[torch.Tensor] | None = None,
        advantages: Sequence[torch.Tensor] | None = None,
        ref: Sequence[torch.Tensor] | None = None,
        values: Sequence[torch.Tensor] | None = None,
        returns: Sequence[torch.Tensor] | None = None,
        engine_keys: Mapping[str, Any] | None = None,
    ) -> Any:
        """Rows in verl's no-padding layout (`verl_rows.no_padding_batch`) with the engine keys
        train_batch would inject, as one micro-batch (the engine cuts its passes itself:
        `_micro_batches`); `engine_keys` overrides them (a scoring sweep: a smaller
        `micro_batch_size_per_gpu`, no entropy, no loss)."""
        from verl.utils import tensordict_utils as tu

        named = {
            "old_log_probs": old,
            "advantages": advantages,
            "ref_log_prob": ref,
            "values": values,
            "returns": returns,
        }
        td = no_padding_batch(rows, self.pad_id, {key: v for key, v in named.items() if v is not None})
        keys = {
            "temperature": float(self.cfg.rollout.temperature),
            "calculate_entropy": True,
            "global_batch_size": len(rows),
            "use_remove_padding": bool(self.engine.model_config.use_remove_padding),
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": len(rows),
            "use_fused_kernels": False,
            "pad_token_id": self.pad_id,
        }
        tu.assign_non_tensor(td, **{**keys, **(engine_keys or {})})
        return td

    def close(self) -> None:
        """Drop the engines (the process group stays: it is the process's)."""
        self.actor = self.ref = self.critic = self.engine = None
        release_memory(self.device)


# ---------------------------------------------------------------------------------- helpers


def load_causal_lm_tokenizer(path: Path) -> Any:
    """The model directory's tokenizer, checked as the builtin backend checks it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None) or tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {path} needs a chat template and an eos token (see load_causal_lm)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _inject(
    module: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    member: str,
    names: Sequence[str] | None = None,
    sharded: bool = False,
) -> None:
    """Copy full fp32 tensors of `member`'s architecture into an FSDP2 module in place
    (set_model_state_dict; a tied LM head follows its embedding): every parameter, or exactly
    `names` (the adapters, or a plain model's under them), the others left as they are. Over k
    ranks (`sharded`, every rank at once) rank 0's `state` is broadcast and each rank keeps its
    shard; the others' `state` is not read."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, Any] = {}
    if not sharded or torch.distributed.get_rank() == 0:
        wanted = None if names is None else set(names)
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters() if wanted is None or n in wanted}
        check_loadable(state, shapes, member)
        full = dict(state)
        for key, alias in _tied_aliases(module).items():
            if alias in full:
                full[key] = full[alias]
    _reshard(module)  # into the shards (gathered copies are plain tensors, not DTensors)
    options = StateDictOptions(full_state_dict=True, strict=True, broadcast_from_rank0=sharded)
    set_model_state_dict(module, full, options=options)


def _tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """state_dict keys that are not parameter names, mapped to the parameter they share (a tied LM head)."""
    params = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if params.get(id(p), name) != name:
            aliases[name] = params[id(p)]
    return aliases


def _export(engine: Any, names: Sequence[str], sharded: bool = False) -> dict[str, torch.Tensor]:
    """`names`' full fp32 tensors, gathered (over k ranks, `sharded`, on every rank at once:
    only rank 0 keeps them, the others return none)."""
    wanted = set(names)
    keep = not sharded or torch.distributed.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    _reshard(engine.module)
    generator, _peft = engine.get_per_tensor_param()
    for name, tensor in generator:  # every rank takes part in every tensor's gather
        if name not in wanted or not keep:
            continue  # a tied alias: exported once under the parameter's own name
        if tensor.dtype != torch.float32:
            raise TypeError(f"verl engine returned {name} as {tensor.dtype}; the export must be fp32 (invariant 1)")
        out[name] = tensor.detach().to("cpu", copy=True)
    if not keep:
        return {}
    missing = wanted - set(out)
    if missing:
        raise RuntimeError(f"verl engine did not export {sorted(missing)[:5]}")
    return {n: out[n] for n in names}


def _step(
    engine: Any,
    loss_fn: Any,
    tds: Sequence[Any],
    metrics: Callable[[Mapping[str, Any]], dict[str, float]],
    after_backward: Callable[[], None] | None = None,
    norm: AggNorm | None = None,
    pads: Sequence[Any] = (),
) -> StepResult:
    """One optimizer step on one mini-batch given as its micro-batches, what verl's
    `BaseEngine.train_batch` does (zero_grad, verl's `forward_step` and a backward per
    micro-batch with the gradients reduced after the last, clip + AdamW, a non-finite norm
    skipped), with `after_backward` (FedProx) between the last backward and the step. verl
    normalises a loss by the batch it is handed, so each micro-batch's loss is normalised by the
    whole mini-batch's tokens and rows instead (`_over_mini_batch`): the gradients add up to the
    mini-batch's. That count is the host's, so the step calls `forward_step` itself rather than
    `forward_backward_batch`, which would count the tokens again on the device and wait for the
    sum (one all-reduce and one synchronisation a micro-batch). The LR is constant, so the
    schedule is never stepped. `norm`: the denominators of a mini-batch spread over k ranks
    (each holds part of its rows), with verl's dp_size k, against which FSDP2's reduce-scatter
    averages: the gradients add up to the whole mini-batch's.

    One rank (one unit): the unit stays gathered over the micro-batches and its gradients are
    reduced once, after the last backward. k ranks (`dp_size` > 1: per-layer units): each
    layer is gathered for its forward and its backward, and its gradient reduce-scattered into
    the shards as each backward ends (the whole model's gathered weights or unsharded gradient
    never exist); `pads`, zero-weighted micro-batches without metrics, then run after this
    rank's own so that its gathers and reduce-scatters pair with every other rank's."""
    from verl.utils.py_functional import append_to_dict

    whole = partial(
        _over_mini_batch,
        loss_fn,
        # on the host: the rows are still there
        num_tokens=sum(int(td["loss_mask"].sum()) for td in tds) if norm is None else int(norm.num_tokens),
        num_rows=sum(len(td) for td in tds) if norm is None else int(norm.num_seqs),
        dp_size=engine.get_data_parallel_size(),
    )
    raw: dict[str, Any] = {}
    module = engine.module
    per_layer = engine.get_data_parallel_size() > 1
    passes = [(td, whole, True) for td in tds] + [(td, partial(_zero_weighted, whole), False) for td in pads]
    with engine.train_mode():
        engine.optimizer_zero_grad()
        try:
            with _phase(module, per_layer=per_layer):  # the step updates the shards
                for i, (td, loss_fn, reported) in enumerate(passes):
                    if not per_layer:
                        # FSDP2 reduces the gradients once, after the last backward, as verl defers it
                        # over the micro-batches of one call, and keeps the parameters gathered until then
                        last = i == len(passes) - 1
                        module.set_requires_gradient_sync(last)
                        module.set_reshard_after_backward(last)
                    loss, out = engine.forward_step(td, loss_function=loss_fn, forward_only=False)
                    loss.backward()
                    if reported:
                        append_to_dict(raw, out["metrics"])
        finally:
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
        if after_backward is not None:
            after_backward()
        grad_norm = float(engine.optimizer_step())
    engine.optimizer_zero_grad()
    return StepResult(metrics(raw), grad_norm, math.isfinite(grad_norm))


def _reshard(module: torch.nn.Module, aborted: bool = False) -> None:
    """Free every FSDP2 unit's gathered parameters. On one rank the engine's unit keeps them
    gathered after a forward (`reshard_after_forward: false`: there a gather per pass buys
    nothing), so a phase of passes (a rollout, a scoring sweep, a step's micro-batches) gathers
    once; over k ranks a rollout gathers every layer once (`generation_model`). That ends here,
    before the shards are read or written (a load, an export, an optimizer step).

    A pass that raised (`aborted`, or a unit FSDP2 will not reshard: a forward it still thinks
    is running, e.g. an interrupted rollout) leaves FSDP2 mid-iteration: a gathered unit that
    ignores `reshard()`, or a backward state under which later passes send their gradients
    nowhere. torch's own recovery (`reset_iter_state`) resets it and drops the aborted pass's
    gradients; a torch without it is an error, never a lane that trains on stale state."""
    from torch.distributed.fsdp import FSDPModule

    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        unit.reshard()
    if aborted or not all(_sharded(unit) for unit in units):
        _reset_iteration(module)  # reshards every unit itself


def _sharded(unit: Any) -> bool:
    """The unit holds only its shards (a unit without parameters has none to gather)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is None or bool(group.is_sharded)


def _reset_iteration(module: torch.nn.Module) -> None:
    reset = getattr(module, "reset_iter_state", None)
    if reset is None:
        raise RuntimeError(
            f"a pass of the verl engine was aborted mid-way, and torch {torch.__version__} cannot reset FSDP2 "
            "after that (FSDPModule.reset_iter_state, torch 2.13): this lane cannot go on; rerun the run, "
            "which resumes after its last complete round"
        )
    reset()
    # it leaves the aborted backward's gradients on the gathered parameters, which FSDP2 reuses:
    # the next backward would add to them
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            param.unsharded_accumulated_grad = None
            gathered = getattr(param, "_unsharded_param", None)
            if gathered is not None:
                gathered.grad = None


def _gather(module: torch.nn.Module) -> None:
    """All-gather every FSDP2 unit of `module` now (a no-op for a gathered one): over k ranks a
    rollout begins so on every rank, so a rank with no decoding step still joins the gathers."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()


def _per_layer(module: Any, on: bool) -> None:
    """Whether every FSDP2 unit of `module` (the root included: verl asks it to reshard too, so
    FSDP2 does not keep it gathered after a forward) frees its parameters after each forward (on:
    training passes over k ranks) or keeps them gathered (off: a rollout)."""
    module.set_reshard_after_forward(on)


@contextlib.contextmanager
def _phase(module: torch.nn.Module, per_layer: bool = False) -> Iterator[None]:
    """A phase of passes: on one rank `module` is gathered once (by its first pass) and freed at
    the end; over k ranks (`per_layer`) a rollout's gathered copy is freed first and each layer
    is gathered per pass (`_per_layer`). Reset if a pass raised."""
    try:
        if per_layer:
            _reshard(module)
            _per_layer(module, True)
        yield
    except BaseException:
        _reshard(module, aborted=True)
        raise
    _reshard(module)


def _zero_weighted(loss_fn: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """`loss_fn`'s loss times 0: an idle rank's row, whose gradient is exactly zero."""
    loss, metrics = loss_fn(*args, **kwargs)
    return loss * 0.0, metrics


def _over_mini_batch(
    loss_fn: Any, model_output: Any, data: Any, dp_group: Any = None, *, num_tokens: int, num_rows: int, dp_size: int
) -> Any:
    """verl's loss of one micro-batch, normalised by its mini-batch's loss tokens and rows
    (verl's loss reads both, and the rank count, from the batch)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, batch_num_tokens=num_tokens, global_batch_size=num_rows, dp_size=dp_size)
    return loss_fn(model_output=model_output, data=data, dp_group=dp_group)


_Batch = TypeVar("_Batch", PolicyBatch, ValueBatch)


def _subset(batch: _Batch, indices: Sequence[int]) -> _Batch:
    """The batch's rows at `indices`, with their per-row tensors (a policy batch's `norm` is the
    whole mini-batch's, not per row: kept)."""
    picked: dict[str, Any] = {
        f.name: [value[i] for i in indices]
        for f in dataclasses.fields(batch)
        if (value := getattr(batch, f.name)) is not None and f.name != "norm"
    }
    return dataclasses.replace(batch, **picked)


def _policy_metrics(raw: Mapping[str, Any]) -> dict[str, float]:
    """verl's metrics of one mini-batch, in builtin's names. A verl `Metric` aggregates its
    micro-batch values itself (SUM for the loss shares, MEAN for fractions: verl's ppo_loss
    declares which), which is builtin's convention; plain lists follow `_METRICS`."""
    return {name: _aggregate(raw[key], how) for key, (name, how) in _METRICS.items() if key in raw}


def _critic_metrics(raw: Mapping[str, Any]) -> dict[str, float]:
    """verl's value-loss metrics of one mini-batch, in builtin's names."""
    return {"loss": _aggregate(raw["critic/vf_loss"], "sum"), "clipfrac": _aggregate(raw["critic/vf_clipfrac"], "mean")}


def _aggregate(value: Any, how: str) -> float:
    """One verl metric over a mini-batch's micro-batches: a `Metric` aggregates itself, a list
    is summed ("sum") or averaged ("mean")."""
    if hasattr(value, "aggregate"):
        return float(value.aggregate())
    values = [float(getattr(v, "item", lambda v=v: v)()) for v in (value if isinstance(value, list) else [value])]
    return sum(values) if how == "sum" else sum(values) / len(values)


VERL_VALUE_LOSS_COEF = 0.5  # verl 0.9.1's compute_value_loss: 0.5 * agg(max(...))


def scaled_value_loss(
    config: Any, model_output: Any, data: Any, dp_group: Any = None, *, scale: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's `value_loss` times `scale`, its loss metric scaled with it (our critic loss is
    critic.loss_coef x the token mean; verl's is 0.5 x it)."""
    from verl.workers.utils.losses import value_loss

    loss, metrics = value_loss(config, model_output, data, dp_group)
    metric = metrics["critic/vf_loss"]
    metric.values = [v * scale for v in metric.values]  # a verl Metric holds its micro-batch values
    return loss * scale, metrics
