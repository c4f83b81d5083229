"""Batched multi-turn rollouts against env-service sessions, and the rows they train on.

One call plays a set of episodes together: every turn, all live episodes are generated in one
left-padded `model.generate` batch (KV cache) and stepped in one `step_batch` request, so the
cost of a turn is one forward pass per generated token and one HTTP round trip, whatever the
number of episodes.

Task addressing (envs/base.py): an episode is reset with the env task index as its seed, so the
served task is a pure function of that index; a GRPO group is `group_size` episodes of one task,
and the served `task_id`s are checked per group before any token is generated (invariant 9).

Training rows hold exactly the context the policy generated from and the ids it generated, plus
the episode's scalar score. Windowed mode (verl-agent, invariant 15): one row per turn, its
windowed prompt and reply. Concat mode (invariant 16): one row per episode, its first prompt and
then every reply with the observation glue between them, the glue masked out of the loss; the
context of every generation is a prefix of that row. The invalid-action penalty enters the
training score only (`training_rows`); validation reads the raw env reward (invariant 10).
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from client_app.prompts import build_messages, concat_glue_ids, observation_message, parse_action, prompt_ids
from fl_app.outcomes import outcome_key

RolloutMode = Literal["windowed", "concat"]


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of `parts` (sha256: stable across processes and
    machines, unlike Python's salted `hash`)."""
    digest = hashlib.sha256(repr(tuple(parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def row_seed(seed: int, round: int, client: int, epoch: int, index: int) -> int:
    """Seed of training row `index` of local epoch `epoch` (invariant 8)."""
    return derive_seed("row", seed, round, client, epoch, index)


def draw_tasks(shard: Sequence[int], n: int, seed: int, round: int, client: int, epoch: int) -> list[int]:
    """`n` task indices from `shard` for one local epoch, fresh every epoch (invariant 8).

    Shard position j gets the key `row_seed(seed, round, client, epoch, j)`; the draw is the
    shard ordered by key, so it is a pure function of the tuple, has no repeats while
    n <= len(shard), and cycles through the shard again when n is larger.
    """
    if not shard:
        raise ValueError("the client's task shard is empty; ClientTasks.task_indices must list at least one task")
    ranked = sorted(range(len(shard)), key=lambda j: row_seed(seed, round, client, epoch, j))
    return [int(shard[ranked[i % len(shard)]]) for i in range(n)]


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: the env task index (its reset seed) and its GRPO group."""

    task_index: int
    group: int


def group_specs(tasks: Sequence[int], group_size: int) -> list[EpisodeSpec]:
    """`group_size` episodes of each task; group g = tasks[g]."""
    return [EpisodeSpec(int(t), g) for g, t in enumerate(tasks) for _ in range(group_size)]


@dataclass
class Turn:
    observation: str  # the state the action was taken in ...
    valid_actions: list[str]  # ... and what was admissible there
    prompt_ids: list[int]  # windowed: the exact context the response was generated from;
    # concat: the ids added since the previous response (the first
    # prompt, then the observation glue), so the context is the sum
    response_ids: list[int]  # generated ids, ending at (and including) eos when one was emitted
    action: str  # what was sent to the env ("" when nothing parseable was generated)
    valid_action: bool  # the env accepted the action in that state
    reward: float  # the env's reward for this step (GiGPO's step-level returns)


@dataclass
class Episode:
    spec: EpisodeSpec
    task_id: str  # served task identity (from the env's reset info)
    instruction: str
    mode: RolloutMode  # how `turns[*].prompt_ids` are to be read (see Turn)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0  # env return (sum of step rewards), never penalised
    won: bool = False
    done: bool = False  # the env ended it (False: the rollout's turn or context budget did)
    outcome: str = "timeout"  # the env's `outcome` once done; `timeout` (turns) or `context_full` (concat) if not

    @property
    def invalid_actions(self) -> int:
        return sum(not t.valid_action for t in self.turns)


@dataclass
class RolloutStats:
    generate_s: float = 0.0
    env_s: float = 0.0
    tokens: int = 0  # generated tokens
    steps: int = 0  # env steps (turns over all episodes)
    wall_s: float = 0.0

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}generate_s": self.generate_s,
            f"{prefix}env_s": self.env_s,
            f"{prefix}tokens": float(self.tokens),
            f"{prefix}steps": float(self.steps),
            f"{prefix}tokens_per_s": self.tokens / max(self.generate_s, 1e-9),
            f"{prefix}steps_per_s": self.steps / max(self.wall_s, 1e-9),
        }


class _VocabLimit(LogitsProcessor):
    """Mask ids the tokenizer cannot decode (embedding rows padded beyond the vocabulary)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.size :] = -float("inf")
        return scores


class _RowSeededSampler(LogitsProcessor):
    """Sample every row from softmax(scores / T) with its OWN generator (Gumbel-max trick).

    `model.generate(do_sample=True)` draws a whole batch from one global stream, so what an
    episode samples would depend on which other episodes share its batch (pool size, length
    grouping, scheduling). Here row b's noise comes only from seed b; the processor leaves just
    the sampled token finite and greedy decoding picks it.
    """

    def __init__(self, generators: Sequence[torch.Generator], temperature: float) -> None:
        self.temperature = temperature
        self.generators = generators  # one per row, already seeded

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=1e-20)))
        choice = (scores.float() / self.temperature + gumbel).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, -float("inf")).scatter_(1, choice, 0.0)  # type: ignore[return-value]


class Generator(Protocol):
    """What `run_episodes` needs of a rollout engine: `BatchedGenerator` (Hugging Face), the
    vLLM rollout, verl's server-backed generator."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_ids(self) -> Sequence[int]: ...

    def generate(self, prompts: Sequence[Sequence[int]], temperature: float, seeds: Sequence[int]) -> list[list[int]]:
        """One reply per prompt (token ids, cut at the first eos), row i sampled with seeds[i]."""
        ...


class BatchedGenerator:
    """Left-padded batched sampling with `model.generate` (KV cache).

    Each prompt comes with its own seed, and what a row samples depends on that seed alone, never
    on the batch it shares (`_RowSeededSampler`); the process-global RNG is never touched.
    Sampling is from the full tempered distribution over the tokenizer's ids (no top-k/top-p;
    padded embedding rows cut, as the trainer's log-probs do), so the training log-probabilities
    (same temperature) describe the policy that acted. `max_batch` splits a call into sequential
    batches (1 = a per-sequence loop); `max_padding` groups prompts of similar length (`_batches`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_new_tokens: int,
        autocast_dtype: torch.dtype | None = None,
        max_batch: int | None = None,
        max_padding: float | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.autocast_dtype = autocast_dtype
        self.max_batch = max_batch
        self.max_padding = max_padding
        self.device = next(model.parameters()).device
        self._generators: list[torch.Generator] = []  # reused and reseeded per call (see _seeded_generators)
        self.eos_ids = list(turn_end_ids(tokenizer.eos_token_id, model.generation_config.eos_token_id))
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.vocab_size = len(tokenizer)
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < self.vocab_size:
            raise ValueError(
                f"the model's output layer has {rows} rows but the tokenizer has {self.vocab_size} "
                "tokens; model and tokenizer do not belong together"
            )
        self._limit: list[LogitsProcessor] = [_VocabLimit(self.vocab_size)] if rows > self.vocab_size else []

    def generate(self, prompts: Sequence[Sequence[int]], temperature: float, seeds: Sequence[int]) -> list[list[int]]:
        """Response ids per prompt, cut after the first eos; row i samples with `seeds[i]`
        (greedy when temperature == 0)."""
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt")
        out: list[list[int]] = [[] for _ in prompts]
        for part in self._batches(prompts):
            responses = self._generate_batch([prompts[i] for i in part], temperature, [seeds[i] for i in part])
            for i, response in zip(part, responses):
                out[i] = response
        return out

    def _batches(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompt indices per generate call: at most `max_batch` each and, with `max_padding`,
        longest first with a new batch whenever padding would exceed that fraction of a row
        (on CPU, padded tokens cost as much as real ones; on GPU one wide batch is cheaper)."""
        if self.max_padding is None:
            order = list(range(len(prompts)))
        else:
            order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        batches: list[list[int]] = []
        for i in order:
            b = batches[-1] if batches else None
            if (
                b is None
                or len(b) == (self.max_batch or len(prompts))
                or (self.max_padding is not None and len(prompts[i]) < (1 - self.max_padding) * len(prompts[b[0]]))
            ):
                batches.append([i])
            else:
                b.append(i)
        return batches

    def _seeded_generators(self, seeds: Sequence[int]) -> list[torch.Generator]:
        """One generator per row, reseeded: the same streams as fresh generators, without
        creating B device generators on every turn of every rollout."""
        while len(self._generators) < len(seeds):
            self._generators.append(torch.Generator(device=self.device))
        return [g.manual_seed(s) for g, s in zip(self._generators, seeds)]

    @torch.no_grad()
    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], temperature: float, seeds: Sequence[int]
    ) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        processors = list(self._limit)
        if temperature > 0:
            processors.append(_RowSeededSampler(self._seeded_generators(seeds), temperature))
        with autocast(self.device, self.autocast_dtype):
            seqs = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids,
                use_cache=True,
                logits_processor=LogitsProcessorList(processors),
                # transformers would sync the decoding steps of an FSDP module's ranks (an
                # all-reduce a step, paired with whatever the other ranks call): a lane's ranks
                # play different episodes, and their forwards need no collective (`verl_backend._gather`)
                synced_gpus=False,
            )
        return [cut_at_eos(row, self.eos_ids) for row in seqs[:, width:].tolist()]


def turn_end_ids(tokenizer_eos: int | None, generation_eos: int | list[int] | None) -> tuple[int, ...]:
    """Every id that ends a turn: the tokenizer's eos and the generation config's (Qwen: both
    <|im_end|> and <|endoftext|>), for every generator alike."""
    ids = set(
        generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos is not None else []
    )
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    if not ids:
        raise ValueError(
            "neither the model's generation_config nor the tokenizer defines an eos token; "
            "set tokenizer.eos_token so generated turns can end"
        )
    return tuple(sorted(ids))


@functools.lru_cache(maxsize=16)
def turn_end_ids_of(tokenizer_eos: int | None, model_path: str) -> tuple[int, ...]:
    """`turn_end_ids` for a model directory, its generation config read once per model (verl
    builds an agent loop per trajectory)."""
    from transformers import GenerationConfig

    try:
        generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is the only one
        generation_eos = None
    return turn_end_ids(tokenizer_eos, generation_eos)


def cut_at_eos(ids: list[int], eos_ids: Sequence[int]) -> list[int]:
    """`ids` up to and including the first eos (all of them when none ends the turn)."""
    for k, t in enumerate(ids):
        if t in eos_ids:
            return ids[: k + 1]
    return ids


def autocast(device: torch.device, dtype: torch.dtype | None):
    """bf16 autocast on CUDA (fp32 master weights stay fp32); a no-op context otherwise."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


@dataclass(frozen=True)
class RolloutSettings:
    max_turns: int
    history_length: int
    max_prompt_tokens: int
    system_prompt: str  # the env's (envs.registry.system_prompt)
    mode: RolloutMode = "windowed"


@dataclass
class _Live:
    """A session's episode in progress."""

    episode: int  # index into the episodes list
    observation: str  # the current state ...
    valid_actions: list[str]  # ... and its admissible actions
    history: list[tuple[str, str]]  # windowed: every earlier (observation, action)
    conversation: list[dict[str, str]]  # concat: the chat so far (for the glue's template render)
    context: list[int]  # concat: the episode's token sequence so far
    new_ids: list[int]  # concat: what `context` gained since the last reply


def check_groups(episodes: Sequence[Episode]) -> None:
    """Every episode of a GRPO group must have been served the same task (invariant 9)."""
    served: dict[int, str] = {}
    for ep in episodes:
        first = served.setdefault(ep.spec.group, ep.task_id)
        if first != ep.task_id:
            raise RuntimeError(
                f"GRPO group {ep.spec.group} was served different tasks ({first!r} and {ep.task_id!r}, "
                f"task index {ep.spec.task_index}); group advantages would compare unrelated tasks. "
                "Check that the env service maps reset seeds to tasks deterministically (envs/base.py)"
            )


def _checked(results: list[dict], verb: str, sids: Sequence[str]) -> list[dict]:
    """Batched verbs answer per item; an item error is a bug or a lost session: fail loudly."""
    for sid, res in zip(sids, results):
        if "error" in res:
            raise RuntimeError(f"env service {verb} failed for session {sid!r}: {res['error']}")
    return results


def run_episodes(
    generator: Generator,
    env: Any,
    specs: Sequence[EpisodeSpec],
    settings: RolloutSettings,
    temperature: float,
    seed: int,
    max_sessions: int,
    desc: str = "rollout",
    first_episode: int = 0,
) -> tuple[list[Episode], RolloutStats]:
    """Play `specs` to the end (done, `settings.max_turns`, or in concat mode a sequence that would
    outgrow `settings.max_prompt_tokens`) on env-service sessions.

    `env` is an `envs.client.SyncEnvClient`. At most `max_sessions` sessions are held (the
    service's pool blocks /create beyond its size); a session whose episode ends is reset with
    the next pending spec, so the generation batch stays full. Sessions are closed on every
    path. Episode i samples turn t with `derive_seed(seed, first_episode + i, t)`: what an episode
    does depends on its own seed and the weights only, never on the pool size or on which
    episodes share a batch (so a rank of a lane playing episodes i.. of an iteration passes
    `first_episode` = i and plays them as the whole iteration would).
    """
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    stats = RolloutStats()
    t_start = time.perf_counter()
    slots = [f"ro-{uuid.uuid4().hex[:12]}-{k}" for k in range(min(max_sessions, len(specs)))]
    episodes: list[Episode] = []
    pending = iter(range(len(specs)))
    busy: dict[int, _Live] = {}
    tok = generator.tokenizer
    concat = settings.mode == "concat"

    def start(free: list[int]) -> None:
        pairs = list(zip(free, pending))
        if not pairs:
            return
        t0 = time.perf_counter()
        items = [(slots[k], specs[i].task_index) for k, i in pairs]
        resets = _checked(env.reset_batch(items), "reset", [sid for sid, _ in items])
        stats.env_s += time.perf_counter() - t0
        for (k, i), r in zip(pairs, resets):
            info = r["info"]
            episodes.append(Episode(specs[i], str(info["task_id"]), str(info["instruction"]), settings.mode))
            live = _Live(len(episodes) - 1, r["observation"], list(info["valid_actions"]), [], [], [], [])
            if concat:
                live.conversation = build_messages(
                    episodes[-1].instruction, [], live.observation, live.valid_actions, 0, settings.system_prompt
                )
                live.context = prompt_ids(tok, live.conversation, settings.max_prompt_tokens)
                live.new_ids = list(live.context)
            busy[k] = live
        check_groups(episodes)

    def context(live: _Live) -> list[int]:
        if concat:
            return live.context
        return prompt_ids(
            tok,
            build_messages(
                episodes[live.episode].instruction,
                live.history,
                live.observation,
                live.valid_actions,
                settings.history_length,
                settings.system_prompt,
            ),
            settings.max_prompt_tokens,
        )

    def advance(live: _Live, response: list[int], text: str, res: dict) -> bool:
        """Move `live` to the state `res` describes; False when the context budget is spent (concat)."""
        live.observation, live.valid_actions = res["observation"], list(res["info"]["valid_actions"])
        if not concat:
            return True
        reply = {"role": "assistant", "content": _strip_end_markers(text, tok.eos_token)}
        user = observation_message(live.observation, live.valid_actions)
        ended = bool(response) and response[-1] in generator.eos_ids
        glue = concat_glue_ids(tok, live.conversation, user, ended)
        if len(live.context) + len(response) + len(glue) > settings.max_prompt_tokens:
            return False
        live.conversation += [reply, user]
        live.context = live.context + response + glue
        live.new_ids = glue
        return True

    t0 = time.perf_counter()
    env.create_many(slots)
    stats.env_s += time.perf_counter() - t0
    try:
        with tqdm(total=len(specs), desc=desc, unit="ep", disable=None, leave=False) as bar:
            start(list(range(len(slots))))
            while busy:
                live_slots = sorted(busy)
                prompts = [context(busy[k]) for k in live_slots]
                t0 = time.perf_counter()
                seeds = [
                    derive_seed(seed, first_episode + busy[k].episode, len(episodes[busy[k].episode].turns))
                    for k in live_slots
                ]
                responses = generator.generate(prompts, temperature, seeds)
                stats.generate_s += time.perf_counter() - t0
                stats.tokens += sum(len(r) for r in responses)
                texts = tok.batch_decode(responses, skip_special_tokens=False)
                actions = [parse_action(text) for text in texts]
                t0 = time.perf_counter()
                results = _checked(
                    env.step_batch([(slots[k], a) for k, a in zip(live_slots, actions)]),
                    "step",
                    [slots[k] for k in live_slots],
                )
                stats.env_s += time.perf_counter() - t0
                stats.steps += len(live_slots)
                freed = []
                for k, prompt, response, text, action, res in zip(
                    live_slots, prompts, responses, texts, actions, results
                ):
                    live = busy[k]
                    ep, info = episodes[live.episode], res["info"]
                    ep.turns.append(
                        Turn(
                            live.observation,
                            live.valid_actions,
                            live.new_ids if concat else prompt,
                            response,
                            action,
                            bool(info["valid_action"]),
                            float(res["reward"]),
                        )
                    )
                    ep.reward += float(res["reward"])
                    live.history.append((live.observation, action))
                    finished = res["done"] or len(ep.turns) >= settings.max_turns
                    if res["done"]:
                        ep.done, ep.won, ep.outcome = True, bool(info["won"]), _outcome(info, slots[k])
                    elif not finished and not advance(live, response, text, res):
                        ep.outcome, finished = "context_full", True
                    if finished:
                        del busy[k]
                        freed.append(k)
                        bar.update(1)
                start(freed)
    finally:
        t0 = time.perf_counter()
        env.close_many(slots)
        stats.env_s += time.perf_counter() - t0
    stats.wall_s = time.perf_counter() - t_start
    return episodes, stats  # episodes[i] plays specs[i]: `pending` is consumed in order


def _strip_end_markers(text: str, eos: str) -> str:
    """A decoded reply as an assistant message: everything before its end-of-turn token."""
    return text.split(eos, 1)[0] if eos else text


def training_score(episode: Episode, invalid_action_penalty: float) -> float:
    """The scalar a TRAINING episode is scored with: env return minus the per-invalid-action
    penalty. Validation never calls this (invariant 10)."""
    return episode.reward - invalid_action_penalty * episode.invalid_actions


@dataclass(frozen=True)
class Step:
    """One action of a training row, for step-level credit (GiGPO): where its reply sits among the
    row's response tokens, the state it was taken in, the env's reward for it and its share of
    the invalid-action penalty (training only, invariant 10)."""

    start: int
    end: int
    anchor: str  # the env observation the action was taken in (no history, no prompt)
    reward: float
    penalty: float  # rollout.invalid_action_penalty if the action was invalid, else 0


@dataclass(frozen=True)
class TrainRow:
    """A sequence trained on exactly the context it was generated from: one windowed turn, or one
    concat-mode episode. `mask[t]` is 1 where response token t was generated by the policy and 0
    on observation glue (concat), which no loss, advantage or value target is computed on."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    score: float  # its episode's training score (same on every turn)
    group: int  # its episode's GRPO group
    episode: int  # index of its episode in the rollout
    steps: tuple[Step, ...] = ()  # the actions it holds, in order (training_rows fills them)


def _step(t: Turn, start: int, invalid_action_penalty: float) -> Step:
    return Step(
        start, start + len(t.response_ids), t.observation, t.reward, 0.0 if t.valid_action else invalid_action_penalty
    )


def _concat_row(ep: Episode, score: float, k: int, invalid_action_penalty: float) -> TrainRow:
    """The episode's one sequence: first prompt, then every reply with the glue between."""
    response: list[int] = []
    mask: list[int] = []
    steps = []
    for j, t in enumerate(ep.turns):
        if j:
            response += t.prompt_ids
            mask += [0] * len(t.prompt_ids)
        steps.append(_step(t, len(response), invalid_action_penalty))
        response += t.response_ids
        mask += [1] * len(t.response_ids)
    return TrainRow(ep.turns[0].prompt_ids, response, mask, score, ep.spec.group, k, tuple(steps))


def training_rows(episodes: Sequence[Episode], invalid_action_penalty: float) -> list[TrainRow]:
    """Rows of every episode (one per turn when windowed, one per episode in concat mode),
    carrying the episode's penalised score and group, and the actions each holds."""
    rows = []
    for k, ep in enumerate(episodes):
        score = training_score(ep, invalid_action_penalty)
        if ep.mode == "concat":
            rows.append(_concat_row(ep, score, k, invalid_action_penalty))
        else:
            rows.extend(
                TrainRow(
                    t.prompt_ids,
                    t.response_ids,
                    [1] * len(t.response_ids),
                    score,
                    ep.spec.group,
                    k,
                    (_step(t, 0, invalid_action_penalty),),
                )
                for t in ep.turns
            )
    return rows


def _outcome(info: dict, session: str) -> str:
    if "outcome" not in info:
        raise RuntimeError(
            f"env session {session} ended an episode without info['outcome'] (the envs/base.py "
            "contract: `won`, or why it did not win); an env service from an older version of this "
            "project? Restart it from this checkout"
        )
    return str(info["outcome"])


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """Success, raw reward, turns and invalid-action rate of a set of episodes (unpenalised)."""
    n = max(len(episodes), 1)
    turns = sum(len(e.turns) for e in episodes)
    return {
        f"{prefix}success": sum(e.won for e in episodes) / n,
        f"{prefix}reward": sum(e.reward for e in episodes) / n,
        f"{prefix}turns": turns / n,
        f"{prefix}invalid_action_rate": sum(e.invalid_actions for e in episodes) / max(turns, 1),
    }


def outcome_shares(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """The share of episodes per outcome (fl_app/outcomes.py); a label no episode had is absent,
    and readers take it as 0 (which outcomes exist depends on the env and the policy)."""
    n = max(len(episodes), 1)
    return {outcome_key(prefix, k): v / n for k, v in sorted(Counter(e.outcome for e in episodes).items())}
