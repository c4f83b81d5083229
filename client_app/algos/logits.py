"""Per-token quantities from a causal LM's logits: log-prob of the sampled token, and entropy.

Both compute in fp32 (bf16 logits from autocast are upcast: a bf16 logsumexp over a 150k vocab
loses the digits the PPO ratio depends on). The caller divides logits by the rollout temperature
first, as verl's actor does, so the trained distribution is the one that was sampled from.
Semantics match verl 0.9.1 `verl.utils.torch_functional.logprobs_from_logits` (its CPU path) and
`entropy_from_logits`.
"""

from __future__ import annotations

import torch


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for logits [..., V] and labels [...] -> [...]."""
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) for logits [..., V] -> [...].

    H = logsumexp(z) - sum_i softmax(z)_i z_i, which needs no log of a tiny probability. Measured
    against fp64 on 4k-150k vocabularies this form stays within ~2e-5 in fp32, where
    exp(z - logsumexp(z)) in place of softmax drifted ten times further on peaked logits.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
