"""The builtin training engine: torch + transformers on the CPU or one GPU.

Holds the policy (fp32 master weights, computing as `run.precision` says: by default on a bf16
copy on CUDA, `compute.ComputeCopy`), the KL reference, the PPO critic (the policy's
architecture with a value head, `client_app.critic`) and one AdamW per trained member over the
fp32 masters, rebuilt for every fit (invariant 3; fused on CUDA). Its losses are the project's own
(`client_app.algos`, held to verl's `core_algos` by tests/trainer/test_algos_parity.py).

Scoring reads the backbone's hidden states only at the positions that predict a response token,
so the [tokens, vocab] logits stay small for 150k vocabularies, and the policy's log-probs and
the critic's values are read at the same positions: the state each token was generated from.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from client_app.algos import (
    ActorLossSpec,
    ValueLossSpec,
    actor_loss,
    clipped_value_loss,
    entropy_from_logits,
    token_log_probs,
)
from client_app.critic import CriticStart, build_critic, resolve_start_critic
from client_app.rollout import TrainRow, autocast, derive_seed
from client_app.tiny_model import load_causal_lm
from client_app.trainer.advantages import pad_rows
from client_app.trainer.compute import (
    ComputeCopy,
    autocast_dtype,
    bf16_parameters,
    compile_models,
    resolve_precision,
)
from client_app.trainer.device import avoid_cudnn_attention, release_memory, resolve_device
from client_app.trainer.engine import (
    Batch,
    LossSpec,
    PolicyBatch,
    Role,
    StepResult,
    ValueBatch,
    micro_batches,
    mini_batch_norm,
)
from client_app.trainer.lora import adapt, base_digest, merged_tensors
from client_app.trainer.ranks import Ranks
from client_app.trainer.weight_check import check_loadable
from fl_app.config import Config
from fl_app.weights import load_shards

log = logging.getLogger("fedagent.trainer.builtin")

# A policy step's loss terms, which add up over micro-batches (shares of the mini-batch loss);
# the others (fractions, ppo_kl) are averaged over them.
_ADDED = ("pg_loss", "entropy", "kl_loss")
_AVERAGED = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


class BuiltinEngine:
    """`engine.Engine` (both of its parts) on torch + transformers."""

    sharded = False  # every rank of a lane holds whole weights

    def __init__(
        self, cfg: Config, model_path: Path, reference_path: Path | None = None, ranks: Ranks | None = None
    ) -> None:
        self.cfg = cfg
        self.ranks = ranks  # a lane over several ranks: policy gradients are summed over them
        if ranks is not None and cfg.algo.spec.critic:
            raise ValueError(f"algo.name={cfg.algo.name!r} trains a critic, which a lane over several ranks does not")
        self._compute: dict[str, ComputeCopy] = {}  # built once the starting weights are in (below)
        self.device = resolve_device(cfg.run.device)
        avoid_cudnn_attention(self.device)
        self.model, self.tokenizer = load_causal_lm(model_path, self.device)
        self.model.requires_grad_(True)
        self.params = dict(self.model.named_parameters())  # the exchanged names (tied weights once)
        self._members: dict[str, dict[str, torch.nn.Parameter]] = {"actor": self.params}
        for name, p in self.params.items():
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; the trainer keeps fp32 master weights")
        rows = self.model.get_output_embeddings().weight.shape[0]
        if rows < len(self.tokenizer):
            raise ValueError(
                f"the model's output layer has {rows} rows but the tokenizer has {len(self.tokenizer)} "
                "tokens; model and tokenizer do not belong together"
            )
        # Scored over what the rollout engine samples from: the tokenizer's ids (hf masks padded
        # embedding rows) or every output row (vLLM samples over all of them).
        self.vocab_size = rows if cfg.rollout.engine == "vllm" else len(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        self.precision = resolve_precision(cfg.run.precision, self.device)
        self.amp_dtype = autocast_dtype(self.precision)
        # Reference: the ORIGINAL starting model for `base` (also under model.init_from; the
        # backbone instead of a warm start with model.reference: backbone), overwritten per fit
        # for `round`, none at kl_coef 0.
        self.ref = None
        if cfg.algo.kl_coef > 0:
            if reference_path is None or Path(reference_path) == Path(model_path):
                ref = copy.deepcopy(self.model)
            else:
                ref = load_causal_lm(reference_path, self.device)[0]
            self.ref = ref.requires_grad_(False).eval()
            if self.precision == "bf16":
                bf16_parameters(self.ref)
        if cfg.model.init_from:
            self._load_start("actor", cfg.model.init_from, "model.init_from")
        # The critic: the policy's architecture and current backbone plus a value head, replaced by
        # the resolved starting critic when there is one (client_app.critic).
        self.critic = None
        self.critic_start: CriticStart | None = None
        if cfg.algo.spec.critic:
            self.critic_start = resolve_start_critic(cfg.model.init_from, cfg.algo.critic.path)
            self.critic = build_critic(self.model, derive_seed("value-head", cfg.run.seed)).requires_grad_(True)
            self._members["critic"] = dict(self.critic.named_parameters())
            if self.critic_start.path:
                self._load_start("critic", self.critic_start.path, "the starting critic")
            log.info(
                "critic: %s (%s)%s",
                self.critic_start.mode,
                self.critic_start.reason,
                f" from {self.critic_start.path}" if self.critic_start.path else "",
            )
        # federation.update: lora: every weight loaded so far is the frozen base; the members
        # become their adapters (+ the critic's value head) from here on (client_app/trainer/lora.py).
        self.base_sha256 = self._adapt() if cfg.federation.update == "lora" else ""
        # Built last, from the loaded masters: what forward and backward passes run on.
        self._compute = {"actor": ComputeCopy(self.model, self.precision)}
        if self.critic is not None:
            self._compute["critic"] = ComputeCopy(self.critic, self.precision)
        if cfg.run.compile:
            compile_models([c.module for c in self._compute.values()] + ([self.ref] if self.ref is not None else []))
        log.info("computing in %s on %s (fp32 master weights)", self.precision, self.device)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    def _adapt(self) -> str:
        """Adapters on the policy (and the critic) over their frozen loaded weights; each member's
        exchanged, trained tensors become its B matrices (+ the critic's value head, trained
        whole). Returns the frozen base's digest."""
        lora, models = self.cfg.federation.lora, {"actor": self.model}
        if self.critic is not None:
            models["critic"] = self.critic
        for member, model in models.items():
            adapt(model, member, lora, self.cfg.run.seed)
            self._members[member] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.params = self._members["actor"]
        digest = base_digest(models)
        trained = sum(p.numel() for ps in self._members.values() for p in ps.values())
        log.info("lora: rank %d on %s, %d trained numbers; base %s", lora.rank, lora.target_modules, trained, digest)
        return digest

    # ------------------------------------------------------------------ weights

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._members)

    def _member(self, member: str) -> dict[str, torch.nn.Parameter]:
        if member not in self._members:
            raise KeyError(f"this trainer has no {member!r} weights; its members are {list(self._members)}")
        return self._members[member]

    def _load_start(self, member: str, weights_dir: str, what: str) -> None:
        try:
            self.load_weights(load_shards(Path(weights_dir).expanduser()), member)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{what} ({weights_dir}) does not fit model.path={self.cfg.model.path!r}: {e}") from None

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor], member: str = "actor") -> None:
        params = self._member(member)
        check_loadable(state, {name: tuple(p.shape) for name, p in params.items()}, member)
        for name, t in state.items():
            params[name].copy_(t)
        if member in self._compute:
            self._compute[member].refresh()

    def export_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        return {name: p.to("cpu", copy=True) for name, p in self.master_weights(member).items()}

    def master_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self._member(member).items()}

    def generation_model(self) -> torch.nn.Module:
        return self._compute["actor"].module.eval()

    def policy_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return merged_tensors(self.model)

    def parameters(self, member: str = "actor") -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self._member(member).items()

    # ------------------------------------------------------------------ fit bracket

    def begin_fit(self, reference_from_policy: bool) -> None:
        """Fresh optimizers; over several ranks every rank first takes rank 0's weights (what the
        service loaded there), so a fit starts on every rank from the same bits."""
        if self.ranks is not None:
            with torch.no_grad():
                self.ranks.broadcast_weights({m: self.master_weights(m) for m in self.members})
            for compute in self._compute.values():
                compute.refresh()
        a = self.cfg.algo
        fused = True if self.device.type == "cuda" else None  # one kernel per step on CUDA; the CPU's default
        self.optimizers = {
            "actor": torch.optim.AdamW(self.params.values(), lr=a.lr, weight_decay=a.weight_decay, fused=fused)
        }
        if self.critic is not None:
            self.optimizers["critic"] = torch.optim.AdamW(
                self._members["critic"].values(), lr=a.critic.lr, weight_decay=a.critic.weight_decay, fused=fused
            )
        if reference_from_policy and self.ref is not None:
            policy = dict(merged_tensors(self.model))  # the plain policy (adapters merged in under lora)
            with torch.no_grad():
                for name, p_ref in self.ref.named_parameters():
                    p_ref.copy_(policy[name])

    def end_fit(self) -> None:
        for opt in self.optimizers.values():
            opt.state.clear()
        self.optimizers = {}
        for params in self._members.values():
            for p in params.values():
                p.grad = None
        for compute in self._compute.values():
            compute.drop_grads()

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def score(self, rows: Sequence[TrainRow], role: Role) -> list[torch.Tensor]:
        if role == "critic":
            return _per_row(
                rows,
                self.cfg.algo.critic.micro,
                self.cfg.algo.micro_batch_tokens,
                lambda part: self._response_values(part)[0],
            )
        model = self._compute["actor"].module if role == "policy" else self.ref
        if model is None:
            raise RuntimeError("no reference model: algo.kl_coef is 0, so nothing needs the reference's log-probs")

        def one(part: Sequence[TrainRow]) -> torch.Tensor:
            logits, labels, _mask = self._response_logits(model, part)
            return token_log_probs(logits, labels)

        return _per_row(rows, self.cfg.algo.micro_batch_size, self.cfg.algo.micro_batch_tokens, one)

    # ------------------------------------------------------------------ steps

    def step(self, batch: Batch, loss: LossSpec, after_backward: Callable[[], None] | None = None) -> StepResult:
        """The policy's step on a `PolicyBatch`, the critic's on a `ValueBatch`."""
        if isinstance(batch, PolicyBatch) and isinstance(loss, ActorLossSpec):
            return self._policy_step(batch, loss, after_backward)
        if isinstance(batch, ValueBatch) and isinstance(loss, ValueLossSpec):
            return self._critic_step(batch, loss, after_backward)
        raise TypeError(f"a {type(batch).__name__} steps with its own member's loss, not a {type(loss).__name__}")

    def _policy_step(
        self, batch: PolicyBatch, loss: ActorLossSpec, after_backward: Callable[[], None] | None
    ) -> StepResult:
        """Policy gradients micro-batch by micro-batch, every micro loss normalised by the whole
        mini-batch (so the sum is the mini-batch loss whatever the micro size), summed over the
        lane's ranks when it spans several (`_across_ranks`), then the step."""
        rows = batch.rows
        norm = batch.norm if batch.norm is not None else mini_batch_norm([sum(rw.mask) for rw in rows], loss.horizon)
        sums: dict[str, float] = defaultdict(float)
        parts = micro_batches(rows, self.cfg.algo.micro_batch_size, self.cfg.algo.micro_batch_tokens)
        # over ranks the averaged terms are divided by every rank's micro-batch count, later
        share = len(parts) if self.ranks is None else 1
        compute = self._compute["actor"]
        for part in parts:
            logits, labels, mask = self._response_logits(compute.module, [rows[i] for i in part])
            log_prob = token_log_probs(logits, labels)
            entropy = entropy_from_logits(logits)
            if loss.entropy_coeff == 0:
                entropy = entropy.detach()
            out = actor_loss(
                loss,
                log_prob,
                _pad([batch.old_log_probs[i] for i in part], mask),
                _pad([batch.advantages[i] for i in part], mask),
                mask,
                entropy=entropy,
                norm=norm,
                ref_log_prob=(
                    _pad([batch.ref_log_probs[i] for i in part], mask) if batch.ref_log_probs is not None else None
                ),
            )
            out.loss.backward()
            compute.fold_grads()
            for k, v in out.metrics.items():
                if k not in _ADDED + _AVERAGED:
                    raise KeyError(f"policy loss term {k!r} is neither added nor averaged over micro-batches")
                sums[k] += float(v) if k in _ADDED else float(v) / share
        if self.ranks is not None:
            sums = self._across_ranks(sums, len(parts))
        if after_backward is not None:
            after_backward()
        return self._optimizer_step("actor", self.cfg.algo.grad_clip, dict(sums))

    def _across_ranks(self, sums: Mapping[str, float], parts: int) -> defaultdict[str, float]:
        """The policy gradients and loss terms of the whole mini-batch: every rank's summed (a
        rank may hold none of its rows), the averaged terms over every rank's micro-batches.
        The loss terms a 1-rank step reports are those some micro-batch produced."""
        assert self.ranks is not None
        terms = {k: (v, parts) for k, v in sums.items()}
        return defaultdict(float, self.ranks.sum_terms(terms, _ADDED, _AVERAGED, list(self.params.values())))

    def _critic_step(
        self, batch: ValueBatch, loss: ValueLossSpec, after_backward: Callable[[], None] | None
    ) -> StepResult:
        """Critic gradients of one mini-batch: coef x the clipped squared error reduced over the
        WHOLE mini-batch (micro-batch invariant: the field log's 2026-07-22 critic-loss drift
        cannot happen here), then the step. FedProx never touches it (invariant 4)."""
        if self.critic is None:
            raise RuntimeError(f"algo.name={self.cfg.algo.name!r} trains no critic")
        rows = batch.rows
        norm = mini_batch_norm([sum(rw.mask) for rw in rows], loss.horizon)
        sums: dict[str, float] = defaultdict(float)
        parts = micro_batches(rows, self.cfg.algo.critic.micro, self.cfg.algo.micro_batch_tokens)
        for part in parts:
            values, mask = self._response_values([rows[i] for i in part])
            value_loss, clipfrac = clipped_value_loss(
                values,
                _pad([batch.returns[i] for i in part], mask),
                _pad([batch.old_values[i] for i in part], mask),
                mask,
                loss.value_clip,
                loss.loss_agg_mode,
                norm,
                coef=loss.coef,
            )
            value_loss.backward()
            self._compute["critic"].fold_grads()
            sums["loss"] += float(value_loss.detach())  # shares of the mini-batch loss add up
            sums["clipfrac"] += float(clipfrac) / len(parts)
        if after_backward is not None:
            after_backward()
        return self._optimizer_step("critic", self.cfg.algo.critic.grad_clip, dict(sums))

    def _optimizer_step(self, member: str, grad_clip: float, metrics: dict[str, float]) -> StepResult:
        """Global-norm clip and an AdamW step (skipped on a non-finite norm), grads cleared."""
        if member not in self.optimizers:
            raise RuntimeError("a train step outside a fit: call begin_fit() first (fresh optimizers, invariant 3)")
        params = list(self._members[member].values())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        stepped = bool(torch.isfinite(grad_norm))
        if stepped:
            self.optimizers[member].step()
            self._compute[member].refresh()
        self.optimizers[member].zero_grad(set_to_none=True)
        return StepResult(metrics, float(grad_norm), stepped)

    # ------------------------------------------------------------------ forward passes

    def _response_hidden(
        self, model: PreTrainedModel, rows: Sequence[TrainRow]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backbone's hidden states at the positions that predict each response token
        [B, T, H], the labels [B, T] and the generated-token mask [B, T] (call under autocast).

        Rows are right-padded (positions 0..n-1 for the real tokens, as in generation), so no
        attention mask is needed: under the causal mask a real token never sees the pads after
        it, and without a padding mask SDPA takes its causal kernel instead of materialising a
        [B, heads, L, L] mask (same values bit for bit, tested; the pad positions' outputs are
        never read).
        """
        width = max(len(rw.prompt_ids) + len(rw.response_ids) for rw in rows)
        t_max = max(len(rw.response_ids) for rw in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), t_max), dtype=torch.long)
        labels = torch.zeros((len(rows), t_max), dtype=torch.long)
        mask = torch.zeros((len(rows), t_max), dtype=torch.bool)
        for b, rw in enumerate(rows):
            seq = rw.prompt_ids + rw.response_ids
            n_p, n_r = len(rw.prompt_ids), len(rw.response_ids)
            ids[b, : len(seq)] = torch.tensor(seq)
            pos[b, :n_r] = torch.arange(n_p - 1, n_p - 1 + n_r)  # position t predicts token t+1
            labels[b, :n_r] = torch.tensor(rw.response_ids)
            mask[b, :n_r] = torch.tensor(rw.mask, dtype=torch.bool)
        ids, pos, labels, mask = (t.to(self.device) for t in (ids, pos, labels, mask))
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        picked = torch.gather(hidden, 1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))
        return picked, labels, mask

    def _response_logits(
        self, model: PreTrainedModel, rows: Sequence[TrainRow]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tempered logits at the response positions [B, T, V] (V: the tokenizer's ids), plus
        labels and mask [B, T]."""
        with autocast(self.device, self.amp_dtype):
            picked, labels, mask = self._response_hidden(model, rows)
            logits = model.get_output_embeddings()(picked)[..., : self.vocab_size]
        return logits.float() / self.cfg.rollout.temperature, labels, mask

    def _response_values(self, rows: Sequence[TrainRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's values at the response positions [B, T] (fp32), and the mask [B, T]."""
        if self.critic is None:
            raise RuntimeError(f"algo.name={self.cfg.algo.name!r} has no critic, so rows have no values")
        with autocast(self.device, self.amp_dtype):
            critic = self._compute["critic"].module
            picked, _labels, mask = self._response_hidden(critic, rows)
            values = critic.score(picked).squeeze(-1)
        return values.float(), mask

    def close(self) -> None:
        self.end_fit()
        self.model = self.ref = self.critic = None
        self.params = {}
        self._members = {}
        self._compute = {}
        release_memory(self.device)


def _per_row(
    rows: Sequence[TrainRow],
    micro: int,
    max_tokens: int | None,
    compute: Callable[[Sequence[TrainRow]], torch.Tensor],
) -> list[torch.Tensor]:
    """`compute` ([B, T] per micro-batch of length-sorted rows), cut back to one 1-D CPU tensor per row."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for part in micro_batches(rows, micro, max_tokens):
        batch = compute([rows[i] for i in part]).detach().float().cpu()  # one device sync per micro-batch
        for k, i in enumerate(part):
            out[i] = batch[k, : len(rows[i].response_ids)].clone()
    return out


def _pad(seqs: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Right-pad 1-D per-row tensors to mask's [B, T] (pad values are never read: masked)."""
    return pad_rows(seqs, mask.shape[1], mask.device)
