"""LoRA adapters with a fixed, seeded A (FFA-LoRA, Sun et al. 2024, arXiv 2403.12313), for
`federation.update: lora` on both engines (builtin: on its torch models; verl: put on the
Hugging Face module before verl's FSDP2 wraps it, `verl_backend.adapters_at_build`).

Each target linear W (out x in) computes W x + s B A x with s = alpha / rank. A (rank x in) is
a buffer drawn from a generator seeded by (run seed, member, tensor name): every node draws the
same bits, and it is never trained, exported or sent. B (out x rank) starts at zero and is the
only trained tensor of the layer. Why A stays fixed: the server averages what the clients send,
and the mean of the products B_i A_i is not (mean B_i)(mean A_i); with one shared A it is exactly
(mean B_i) A, so FedAvg of B, every robust aggregator and every server optimizer (all linear in
the clients' B, or coordinate-wise on B with A shared) act on the products as they act on full
weights (tests/trainer/test_lora.py::test_averaged_b_merges_to_the_exact_mean_of_the_products).

A small module of our own rather than PEFT: PEFT makes A a trained `Parameter` with its own
initialiser and prefixes every name (`base_model.model.`), where we need A out of every state
dict and optimizer by construction, drawn from our seed, and the base's names unchanged (the
reference copy, the critic's backbone and a vLLM sync address the model by its Hugging Face
names). The layer subclasses `torch.nn.Linear` and shares the base's weight and bias objects, so
`q_proj.weight` stays `q_proj.weight` and the adapter adds `q_proj.lora_B`. The readers below
(`merged_tensors`, `base_digest`) take a parameter whole, also where FSDP2 holds it as a
DTensor (the verl engine), so both engines merge and digest with the same arithmetic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from client_app.rollout import derive_seed
from fl_app.config import LoraCfg

LORA_B = "lora_B"


def _whole(t: torch.Tensor) -> torch.Tensor:
    """`t` detached and whole: a DTensor (an FSDP2 parameter) gathered, any other tensor as is."""
    t = t.detach()
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


class LoraLinear(torch.nn.Linear):
    """`base`'s weight and bias (frozen) plus s B A, with A a non-persistent buffer."""

    lora_A: torch.Tensor

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, scale: float) -> None:
        torch.nn.Module.__init__(self)  # no fresh weight: the base's own objects are reused
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.register_buffer("lora_A", a.to(base.weight.device), persistent=False)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, a.shape[0], device=base.weight.device))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lora_A.to(self.lora_B.dtype)  # the bf16 compute copy casts B (a parameter), not A (a buffer)
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, a), self.lora_B)

    def merged_weight(self) -> torch.Tensor:
        """W + s B A in fp32: the weight this layer computes with (a vLLM sync, the reference
        of `algo.ref_anchor: round`, the tests' float64 reference in their own dtype)."""
        b = _whole(self.lora_B)
        return _whole(self.weight) + self.scale * (b @ self.lora_A.to(b.dtype))


def fixed_a(seed: int, member: str, name: str, rank: int, in_features: int) -> torch.Tensor:
    """A for the adapter of `member`'s tensor `name`: U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    kaiming-uniform default for A) from a CPU generator seeded by (seed, member, name), so it is
    the same bits in every process and on every machine, and different for every tensor."""
    gen = torch.Generator().manual_seed(derive_seed("lora-A", seed, member, name))
    bound = in_features**-0.5
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def add_adapters(
    model: torch.nn.Module, member: str, targets: Sequence[str], rank: int, alpha: float, seed: int
) -> list[str]:
    """Freeze `model` and put an adapter on every `torch.nn.Linear` whose last name part is in
    `targets` (never the LM head or the embeddings); returns the adapted modules' names. A
    target that names no linear of the model is an error (an adapter nobody trains is a typo)."""
    model.requires_grad_(False)
    out_embed = getattr(model, "get_output_embeddings", lambda: None)()
    found: list[str] = []
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in targets or not isinstance(module, torch.nn.Linear) or module is out_embed:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        a = fixed_a(seed, member, f"{name}.weight", rank, module.in_features)
        setattr(parent, leaf, LoraLinear(module, a, alpha / rank))
        found.append(name)
    missing = sorted(set(targets) - {n.rpartition(".")[2] for n in found})
    if missing:
        raise ValueError(
            f"federation.lora.target_modules names {missing}, which match no linear layer of the {member} model "
            f"(its adapted layers end in {sorted({n.rpartition('.')[2] for n in found})}); fix target_modules"
        )
    return found


def adapt(model: torch.nn.Module, member: str, lora: LoraCfg, seed: int) -> None:
    """`member`'s adapters on `model` over its frozen weights, as every engine puts them: the
    B matrices trained, and the critic's value head (a fresh head the base has no weights for)
    trained whole (PEFT's modules_to_save)."""
    add_adapters(model, member, lora.target_modules, lora.rank, lora.alpha, seed)
    if member == "critic":
        model.get_submodule("score").requires_grad_(True)


def adapter_layers(model: torch.nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """Every adapted layer of `model`, by module name."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under their Hugging Face names with every adapted weight merged
    (W + s B A) and the adapters left out: the plain model the adapters compute."""
    merged = {f"{name}.weight": layer for name, layer in adapter_layers(model)}
    for name, p in model.named_parameters():
        if name.endswith(f".{LORA_B}"):
            continue
        yield name, (merged[name].merged_weight() if name in merged else _whole(p))


def base_digest(models: dict[str, torch.nn.Module]) -> str:
    """sha256 of every member's frozen tensors (name, dtype, shape, bytes; the adapters' B and
    the trained head left out): the base the adapters are relative to. Two nodes with the same
    digest add their adapters to the same weights."""
    h = hashlib.sha256()
    for member, model in sorted(models.items()):
        for name, p in model.named_parameters():
            if p.requires_grad:
                continue
            t = _whole(p).to("cpu").contiguous()
            h.update(f"{member}/{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
