"""The builtin backend: a persistent torch + transformers GRPO trainer.

Built once per lane: model, tokenizer, reference model and env client live for the whole run.
Per client fit it only swaps weights in (`load_weights`, in place), builds a fresh AdamW
(invariant 3), runs E RL iterations on fresh tasks from the client's shard (invariant 8), and
exports fp32 copies. Everything a fit allocates (optimizer state, grads, FedProx anchor,
rollout buffers) is released explicitly before it returns, so a trainer serving hundreds of
fits keeps a flat RSS (invariant 24).

One RL iteration: tasks_per_step x group_size episodes (one batched rollout); GRPO advantages
over each group's episode scores, broadcast to every turn row of the episode; old (and
reference) log-probs recomputed on the rows; then one pass of PPO-clip + KL + entropy,
token-mean over each mini-batch, split into micro-batches for gradient accumulation, FedProx
gradient (policy only, invariant 4) added once per optimizer step before clipping.
"""
from __future__ import annotations

import copy
import ctypes
import gc
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from client_app.algos import ActorLossSpec, AggNorm, FedProxAnchor, actor_loss, entropy_from_logits, \
    grpo_outcome_advantage, token_log_probs
from client_app.rollout import BatchedGenerator, Episode, RolloutSettings, TrainRow, autocast, derive_seed, \
    draw_tasks, episode_metrics, group_specs, run_episodes, training_rows
from client_app.tiny_model import build_tiny_model, load_causal_lm
from client_app.trainer.base import EvalRequest, EvalResult, FitRequest, FitResult
from envs.client import SyncEnvClient
from envs.registry import system_prompt
from fl_app.config import Config

log = logging.getLogger("fedagent.trainer")

IterationCallback = Callable[[int, dict[str, float]], None]
CPU_MAX_PADDING = 0.25
# Fit metrics that add up over local epochs (with every `*_s` timing); the rest are averaged.
_SUMMED = frozenset({"rows", "rollout_tokens", "rollout_steps", "optimizer_steps", "skipped_steps"})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def resolve_device(choice: str) -> torch.device:
    """`auto`: CUDA when visible, else CPU; `cuda` without a GPU is an error, not a fallback."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is visible; set run.device=auto or cpu")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def release_memory(device: torch.device) -> None:
    """Return freed memory to the system: Python cycles, the CUDA cache, glibc's arenas (RSS)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:       # not glibc: nothing to trim
        pass


class BuiltinTrainer:
    """`client_app.trainer.base.Trainer` on torch + transformers (CPU or one GPU)."""

    def __init__(self, cfg: Config, env_url: str) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.run.device)
        path = build_tiny_model(cfg.model.tiny, cfg.env, cfg.rollout) if cfg.model.path == "tiny" \
            else Path(cfg.model.path)
        self.model, self.tokenizer = load_causal_lm(path, self.device)
        self.model.eval()                 # no dropout: rollout and update score the same policy
        self.model.requires_grad_(True)
        self.params = dict(self.model.named_parameters())     # the exchanged names (tied weights once)
        for name, p in self.params.items():
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; the trainer keeps fp32 master weights")
        # Reference: the ORIGINAL backbone for `base`, overwritten per fit for `round`, none at kl_coef 0.
        self.ref = None
        if cfg.algo.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.amp_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        # On CPU a padded token costs as much as a real one: group prompts of similar length.
        self.generator = BatchedGenerator(self.model, self.tokenizer, cfg.rollout.max_response_tokens,
                                          self.amp_dtype, max_padding=CPU_MAX_PADDING if self.device.type == "cpu" else None)
        self.settings = RolloutSettings(cfg.env.max_turns, cfg.rollout.history_length, cfg.rollout.max_prompt_tokens,
                                        system_prompt(cfg.env.name))
        a = cfg.algo
        self.loss_spec = ActorLossSpec(clip_ratio_low=a.clip_ratio, clip_ratio_high=a.clip_ratio,
                                       clip_ratio_c=a.clip_ratio_c, entropy_coeff=a.entropy_coeff,
                                       kl_coef=a.kl_coef, kl_type=a.kl_type, loss_agg_mode="token-mean")
        self.env = SyncEnvClient(env_url)
        try:
            self.max_sessions = int(self.env.info()["pool_size"])   # the service blocks /create beyond it
        except BaseException:
            self.env.close()
            raise

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy fp32 tensors into the live parameters in place; names, shapes, dtypes must match."""
        missing = sorted(set(self.params) - set(state))
        unexpected = sorted(set(state) - set(self.params))
        if missing or unexpected:
            raise KeyError(f"weights do not match the model: missing {missing[:5]} ({len(missing)}), "
                           f"unexpected {unexpected[:5]} ({len(unexpected)}); they must come from "
                           "export_weights() of the same architecture")
        for name, t in state.items():
            p = self.params[name]
            if t.shape != p.shape:
                raise ValueError(f"weight {name}: shape {tuple(t.shape)} != model {tuple(p.shape)}")
            if t.dtype != torch.float32:
                raise TypeError(f"weight {name} is {t.dtype}; weights travel as fp32 (invariant 1), "
                                "never cast them on the way")
        for name, t in state.items():
            self.params[name].copy_(t)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master weights as detached CPU copies (load(W) then export() gives W bit for bit)."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.params.items()}

    # ------------------------------------------------------------------ fit

    def fit(self, req: FitRequest, on_iteration: IterationCallback | None = None) -> FitResult:
        """E RL iterations from the loaded weights with a fresh optimizer.

        `on_iteration(epoch, metrics)` runs after each iteration (the central trainer validates
        there without resetting the optimizer).
        """
        if req.local_epochs < 1:
            raise ValueError(f"local_epochs must be >= 1, got {req.local_epochs}")
        a = self.cfg.algo
        anchor = FedProxAnchor.snapshot(self.model.named_parameters()) if req.proximal_mu > 0 else None
        if self.ref is not None and a.ref_anchor == "round":
            with torch.no_grad():
                for p_ref, p in zip(self.ref.parameters(), self.model.parameters()):
                    p_ref.copy_(p)
        optimizer = torch.optim.AdamW(self.params.values(), lr=a.lr, weight_decay=a.weight_decay)
        per_epoch: list[dict[str, float]] = []
        episodes_trained = 0
        try:
            for epoch in range(req.local_epochs):
                metrics, n_episodes = self._iteration(req, epoch, optimizer, anchor)
                episodes_trained += n_episodes
                per_epoch.append(metrics)
                if on_iteration is not None:
                    on_iteration(epoch, metrics)
        finally:
            optimizer.state.clear()
            del optimizer
            for p in self.params.values():
                p.grad = None
            if anchor is not None:
                anchor.release()
            release_memory(self.device)
        metrics = {k: (sum if k in _SUMMED or k.endswith("_s") else _mean)([m[k] for m in per_epoch])
                   for k in per_epoch[0]}
        metrics["tokens_per_s"] = metrics["rollout_tokens"] / max(metrics["rollout_generate_s"], 1e-9)
        metrics["rollout_tokens_per_s"] = metrics["tokens_per_s"]
        metrics["rollout_steps_per_s"] = metrics["rollout_steps"] / max(metrics["rollout_s"], 1e-9)
        return FitResult(num_examples=episodes_trained, metrics=metrics)

    def _iteration(self, req: FitRequest, epoch: int, optimizer: torch.optim.Optimizer,
                   anchor: FedProxAnchor | None) -> tuple[dict[str, float], int]:
        a, r = self.cfg.algo, self.cfg.rollout
        tasks = draw_tasks(req.task_indices, a.tasks_per_step, req.seed, req.round, req.client_id, epoch)
        t0 = time.perf_counter()
        episodes, stats = run_episodes(
            self.generator, self.env, group_specs(tasks, a.group_size), self.settings, r.temperature,
            derive_seed("sample", req.seed, req.round, req.client_id, epoch), self.max_sessions,
            desc=f"r{req.round} c{req.client_id} e{epoch}")
        rollout_s = time.perf_counter() - t0
        rows = training_rows(episodes, r.invalid_action_penalty)
        advantages = self.episode_advantages(episodes, rows)
        t0 = time.perf_counter()
        update = self.update(rows, advantages, optimizer, anchor, req.proximal_mu,
                             derive_seed("minibatch", req.seed, req.round, req.client_id, epoch))
        update_s = time.perf_counter() - t0
        metrics = {
            **episode_metrics(episodes, "train_"),
            "train_score": sum(rw.score for rw in rows) / max(len(rows), 1),
            "rows": float(len(rows)),
            "rollout_s": rollout_s, "update_s": update_s,
            "tokens_per_s": stats.tokens / max(stats.generate_s, 1e-9),
            **stats.as_metrics("rollout_"), **update,
        }
        del rows, episodes, advantages
        return metrics, a.tasks_per_step * a.group_size

    @staticmethod
    def episode_advantages(episodes: Sequence[Episode], rows: Sequence[TrainRow]) -> list[float]:
        """GRPO advantage per row: computed over each group's EPISODE scores (one per episode, so
        long episodes do not weigh more in the group statistics), broadcast to the episode's rows."""
        scores = torch.zeros(len(episodes), 1, dtype=torch.float32)
        groups = [0] * len(episodes)
        for rw in rows:
            scores[rw.episode, 0] = rw.score
            groups[rw.episode] = rw.group
        adv, _ = grpo_outcome_advantage(scores, torch.ones_like(scores), groups)
        return [float(adv[rw.episode, 0]) for rw in rows]

    # ------------------------------------------------------------------ update

    def update(self, rows: Sequence[TrainRow], advantages: Sequence[float], optimizer: torch.optim.Optimizer,
               anchor: FedProxAnchor | None, mu: float, seed: int) -> dict[str, float]:
        """One PPO pass over `rows`: seeded shuffle, mini-batches of algo.mini_batch_size rows."""
        a = self.cfg.algo
        old = self.row_log_probs(self.model, rows)
        ref = self.row_log_probs(self.ref, rows) if self.ref is not None else None
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        for start in range(0, len(order), a.mini_batch_size):
            idx = order[start:start + a.mini_batch_size]
            stats = self.accumulate_gradients(rows, advantages, old, ref, idx, anchor, mu)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params.values(), a.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                sums["skipped_steps"] += 1.0
                log.warning("non-finite gradient norm; optimizer step skipped")
            optimizer.zero_grad(set_to_none=True)
            stats["grad_norm"] = float(grad_norm)
            for k, v in stats.items():
                sums[k] += v
            steps += 1
        out = {k: v / max(steps, 1) for k, v in sums.items() if k != "skipped_steps"}
        out["optimizer_steps"] = float(steps)
        out["skipped_steps"] = sums["skipped_steps"]
        return out

    def accumulate_gradients(self, rows: Sequence[TrainRow], advantages: Sequence[float],
                             old: Sequence[torch.Tensor], ref: Sequence[torch.Tensor] | None, idx: Sequence[int],
                             anchor: FedProxAnchor | None, mu: float) -> dict[str, float]:
        """Gradients of one mini-batch (rows `idx`) into `.grad`, micro-batch by micro-batch.

        Every micro loss is normalised by the token count of the whole mini-batch, so the sum
        is the token-mean loss of the mini-batch whatever the micro-batch size. The FedProx
        gradient mu * (w - anchor) is added once, on the policy parameters only.
        """
        norm = AggNorm(num_tokens=float(sum(len(rows[i].response_ids) for i in idx)), num_seqs=float(len(idx)))
        sums: dict[str, float] = defaultdict(float)
        micro = self.cfg.algo.micro_batch_size
        idx = sorted(idx, key=lambda i: _row_len(rows[i]))    # similar lengths share a micro-batch: less padding
        n_micro = math.ceil(len(idx) / micro)
        for start in range(0, len(idx), micro):
            part = idx[start:start + micro]
            logits, labels, mask = self._response_logits(self.model, [rows[i] for i in part])
            log_prob = token_log_probs(logits, labels)
            entropy = entropy_from_logits(logits)
            if self.loss_spec.entropy_coeff == 0:
                entropy = entropy.detach()
            adv = torch.tensor([advantages[i] for i in part], device=self.device)[:, None].expand_as(log_prob)
            loss = actor_loss(self.loss_spec, log_prob, _pad([old[i] for i in part], mask), adv, mask,
                              entropy=entropy, norm=norm,
                              ref_log_prob=_pad([ref[i] for i in part], mask) if ref is not None else None)
            loss.loss.backward()
            for k, v in loss.metrics.items():
                # shares of the mini-batch loss add up; fractions and ppo_kl are averaged
                sums[k] += float(v) if k in ("pg_loss", "entropy", "kl_loss") else float(v) / n_micro
        if anchor is not None:
            anchor.add_grad_(self.model.named_parameters(), mu)
        return dict(sums)

    @torch.no_grad()
    def row_log_probs(self, model: torch.nn.Module, rows: Sequence[TrainRow]) -> list[torch.Tensor]:
        """Log-probs of each row's response tokens under `model` (one 1-D tensor per row)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: _row_len(rows[i]))
        micro = self.cfg.algo.micro_batch_size
        for start in range(0, len(order), micro):
            part = order[start:start + micro]
            logits, labels, _mask = self._response_logits(model, [rows[i] for i in part])
            lp = token_log_probs(logits, labels)
            for k, i in enumerate(part):
                out[i] = lp[k, :len(rows[i].response_ids)].clone()
        return out

    def _response_logits(self, model: torch.nn.Module, rows: Sequence[TrainRow]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tempered logits at the response positions only, [B, T, V], plus labels and mask [B, T].

        V is the tokenizer's vocabulary: padded embedding rows are cut, as in generation.
        Rows are right-padded (positions 0..n-1 for the real tokens, as in generation); only the
        hidden states that predict response tokens go through the LM head, which keeps the
        [tokens, vocab] tensor small for 150k vocabularies.
        """
        width = max(len(rw.prompt_ids) + len(rw.response_ids) for rw in rows)
        t_max = max(len(rw.response_ids) for rw in rows)
        ids = torch.full((len(rows), width), self.generator.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        pos = torch.zeros((len(rows), t_max), dtype=torch.long)
        labels = torch.zeros((len(rows), t_max), dtype=torch.long)
        mask = torch.zeros((len(rows), t_max), dtype=torch.bool)
        for b, rw in enumerate(rows):
            seq = rw.prompt_ids + rw.response_ids
            n_p, n_r = len(rw.prompt_ids), len(rw.response_ids)
            ids[b, :len(seq)] = torch.tensor(seq)
            attn[b, :len(seq)] = 1
            pos[b, :n_r] = torch.arange(n_p - 1, n_p - 1 + n_r)   # position t predicts token t+1
            labels[b, :n_r] = torch.tensor(rw.response_ids)
            mask[b, :n_r] = True
        ids, attn, pos, labels, mask = (t.to(self.device) for t in (ids, attn, pos, labels, mask))
        with autocast(self.device, self.amp_dtype):
            hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
            picked = torch.gather(hidden, 1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))
            logits = model.get_output_embeddings()(picked)[..., :self.generator.vocab_size]
        return logits.float() / self.cfg.rollout.temperature, labels, mask

    # ------------------------------------------------------------------ evaluate

    def evaluate(self, req: EvalRequest) -> EvalResult:
        """One episode per validation task at rollout.val_temperature, decoding seed from req.seed.

        Scores are the raw env rewards: the training-only invalid-action penalty never applies.
        """
        if not req.task_indices:
            raise ValueError("EvalRequest.task_indices is empty; pass the fixed validation tasks")
        specs = group_specs(req.task_indices, 1)
        episodes, stats = run_episodes(self.generator, self.env, specs, self.settings, self.cfg.rollout.val_temperature,
                                       derive_seed("eval", req.seed), self.max_sessions, desc="validate")
        metrics = {**episode_metrics(episodes, ""), "eval_s": stats.wall_s, **stats.as_metrics("rollout_")}
        return EvalResult(num_examples=len(episodes), metrics=metrics)

    def close(self) -> None:
        """Close the env client and drop the models (the env service is owned by whoever started it)."""
        self.env.close()
        self.model = self.ref = None
        self.params = {}
        release_memory(self.device)


def _row_len(row: TrainRow) -> int:
    return len(row.prompt_ids) + len(row.response_ids)


def _pad(seqs: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Right-pad 1-D per-row tensors to mask's [B, T] (pad values are never read: masked)."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out
