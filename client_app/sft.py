"""Supervised warm starts, shared by the tiny build and the warm start of any model: expert
demonstrations rendered with the RL prompts, reply-only SFT, and a build-once content-hash cache.

- `collect_demonstrations`: the env's oracle (`Env.expert_action()`) on TRAINING tasks only
  (never the validation tasks `[0, val_size)`), imperfect on purpose (`noise`, `shortcut`);
- `demo_rows`: (prompt ids, reply ids) through `prompts.prompt_ids` / `prompts.response_ids`,
  the functions (and truncation) the rollouts generate from, so SFT trains exactly the context
  RL acts in (invariant 15);
- `supervised_finetune`: cross-entropy on reply tokens only, AdamW with linear warmup and decay,
  batches of similar length in a seeded order;
- `cached_build`: build into a temporary directory next to the cache, rename into place under
  an exclusive file lock, so concurrent first runs build once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from client_app import prompts
from envs.registry import make_env, system_prompt
from fl_app.config import EnvCfg, RolloutCfg
from fl_app.host import cpu_model, usable_cores

log = logging.getLogger(__name__)

# An admissible entry whose argument is a <placeholder> (`search[<your query>]`) is a template.
PLACEHOLDER = re.compile(r"\[<[^\]]*>\]$")
# The shortcut habit: buy at once; never taken where the expert navigates (wrong item, paging).
SHORTCUT_ACTION = "click[buy now]"
NAVIGATION = ("click[< prev]", "click[back to search]", "click[next >]")

SFT_WARMUP_FRACTION = 0.05
MAX_BUILD_THREADS = 4  # torch intra-op threads during a CPU build: the usable cores, 1 to 4

Row = tuple[list[int], list[int]]  # (prompt ids, reply ids)


@dataclass(frozen=True)
class Demo:
    """One demonstrated turn: the windowed prompt and the action the policy should emit."""

    task: int  # env task index the episode played
    messages: list[dict[str, str]]
    action: str  # what the policy is trained to emit (and was played)
    expert: str  # the oracle's action in that state (== action unless noised)


# ----------------------------------------------------------------------------- demonstrations


def collect_demonstrations(
    env_cfg: EnvCfg, history_length: int, episodes: int, noise: float, seed: int, shortcut: float = 0.0
) -> list[Demo]:
    """Windowed (prompt, action) turns of the expert on training tasks, imperfect on purpose.

    Two kinds of imperfection, both played (so the expert's recoveries are demonstrated too):
    - `noise`: each action is replaced by a random valid one with this probability. Sampling at
      a low validation temperature mostly hides it: the mass is spread over many actions.
    - `shortcut`: this fraction of the episodes buys as soon as the target's page is open,
      skipping the goal's options. A coherent habit survives low-temperature decoding, costs
      reward on every goal with options, and is the kind of defect RL fixes from reward alone.
    Template entries such as `search[<your query>]` are never drawn as the random action.
    """
    env, system = make_env(env_cfg.name, **env_cfg.params), system_prompt(env_cfg.name)
    if env.num_tasks <= env.val_size:
        raise ValueError(
            f"env has {env.num_tasks} tasks and val_size={env.val_size}: no training task "
            "is left for the SFT warm start; raise the task count or lower val_size"
        )
    rng = random.Random(f"tiny-sft-{seed}")  # the tiny build's stream since tiny-model-1: keep it
    demos: list[Demo] = []
    for _ in range(episodes):
        task = rng.randrange(env.val_size, env.num_tasks)
        hasty = rng.random() < shortcut
        obs, info = env.reset(task)
        history: list[tuple[str, str]] = []
        for _turn in range(env_cfg.max_turns):
            expert = action = env.expert_action()
            others = [a for a in info["valid_actions"] if a != expert and not PLACEHOLDER.search(a)]
            if hasty and SHORTCUT_ACTION in info["valid_actions"] and expert not in NAVIGATION:
                action = SHORTCUT_ACTION
            elif others and rng.random() < noise:
                action = rng.choice(others)
            messages = prompts.build_messages(
                info["instruction"], history, obs, info["valid_actions"], history_length, system
            )
            demos.append(Demo(task, messages, action, expert))
            history.append((obs, action))
            obs, _reward, done, info = env.step(action)
            if done:
                break
    return demos


def demo_rows(tokenizer: Any, demos: list[Demo], rollout_cfg: RolloutCfg) -> list[Row]:
    """(prompt ids, reply ids) of every demonstrated turn, rendered and cut as the rollouts cut them."""
    return [
        (
            prompts.prompt_ids(tokenizer, d.messages, rollout_cfg.max_prompt_tokens),
            prompts.response_ids(tokenizer, d.action)[: rollout_cfg.max_response_tokens],
        )
        for d in demos
    ]


# ----------------------------------------------------------------------------- fine-tuning


def supervised_finetune(
    model: Any,
    rows: list[Row],
    epochs: int,
    seed: int,
    lr: float,
    batch_size: int,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Cross-entropy on reply tokens only; seeded data order. Returns the last epoch's mean loss.

    Only the reply positions go through the LM head, so a large vocabulary never materialises a
    [batch, sequence, vocab] tensor. `autocast_dtype` (bf16 on CUDA) leaves the master weights fp32.
    """
    if not rows or epochs == 0:
        return float("nan")
    gen = torch.Generator().manual_seed(seed + 1)
    steps = epochs * math.ceil(len(rows) / batch_size)
    warmup = max(1, int(SFT_WARMUP_FRACTION * steps))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup)))
    )
    pad, device = model.config.pad_token_id, next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    model.train()
    epoch_loss = float("nan")
    for _epoch in range(epochs):
        total, count = 0.0, 0
        for batch in length_bucketed_batches(rows, batch_size, gen):
            ids, mask, targets = (t.to(device) for t in sft_batch([rows[i] for i in batch], pad))
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
                picked = targets != -100
                loss = F.cross_entropy(head(hidden[picked]).float(), targets[picked])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total, count = total + loss.item() * len(batch), count + len(batch)
        epoch_loss = total / count
        log.info("SFT epoch %d/%d loss %.4f", _epoch + 1, epochs, epoch_loss)
    opt.zero_grad(set_to_none=True)
    model.eval()
    return epoch_loss


def sft_batch(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, targets); targets are -100 except where the
    next token is a reply token, so the loss never trains on prompt text."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), -100, dtype=torch.long)
    for k, (prompt, reply) in enumerate(rows):
        n = len(prompt) + len(reply)
        ids[k, :n] = torch.tensor(prompt + reply)
        mask[k, :n] = 1
        targets[k, len(prompt) - 1 : n - 1] = torch.tensor(reply)  # position t predicts token t+1
    return ids, mask, targets


def length_bucketed_batches(rows: list[Row], batch_size: int, gen: torch.Generator) -> list[list[int]]:
    """Seeded shuffle, then batches of similar length (less padding), in a seeded batch order."""
    order = torch.randperm(len(rows), generator=gen).tolist()
    chunk = 8 * batch_size
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: len(rows[i][0]) + len(rows[i][1]))
        batches += [part[j : j + batch_size] for j in range(0, len(part), batch_size)]
    return [batches[k] for k in torch.randperm(len(batches), generator=gen).tolist()]


# ----------------------------------------------------------------------------- building and caching


def build_threads() -> int:
    """Torch threads for a CPU build: the cores this process may use, 1 to MAX_BUILD_THREADS, and
    never the load of the moment, because on some CPUs the count changes the bits (Intel Xeon:
    MKL splits a weight gradient's reduction across threads). Slower beside busy processes than
    one thread would be; docs/tiny-model.md has the measurements."""
    return max(1, min(MAX_BUILD_THREADS, usable_cores()))


def build_host() -> dict[str, object]:
    """What a CPU build's bits depend on besides its inputs (its thread count, the CPU's model and
    the kernels torch picked for it), recorded beside the weights it built."""
    return {
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


@contextlib.contextmanager
def cpu_build_settings(what: str) -> Iterator[None]:
    """Deterministic CPU kernels and a bounded thread count, restored afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(build_threads())
    log.info("%s: building with %d torch thread(s)", what, torch.get_num_threads())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes, so concurrent first runs build once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_build(final: Path, build: Callable[[Path], None], what: str) -> Path:
    """`final` if it holds a model already; else `build(tmp)` into a fresh directory next to it,
    renamed into place. Logs `<what>: cached at ...` or `<what>: built in N s -> ...`."""
    if (final / "config.json").exists():
        log.info("%s: cached at %s", what, final)
        return final
    with _file_lock(final.parent / f"{final.name}.lock"):
        if (final / "config.json").exists():  # another process built it while we waited
            log.info("%s: cached at %s", what, final)
            return final
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:16]}.building-", dir=final.parent))
        try:
            build(tmp)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    log.info("%s: built in %.0f s -> %s", what, time.perf_counter() - t0, final)
    return final
