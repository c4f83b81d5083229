"""LoRA adapters with one factor fixed and seeded (FFA-LoRA, Sun et al. 2024, arXiv 2403.12313),
for `federation.update: lora` on both engines (builtin: on its torch models; verl: put on the
Hugging Face module before verl's FSDP2 wraps it, `verl_backend.adapters_at_build`).

Each target linear W (out x in) computes W x + s B A x with s = alpha / rank. One factor is
trained and travels: it starts at zero, so the adapted model starts as the base. The other is a
buffer drawn from a generator seeded by (run seed, member, tensor name): every node draws the same
bits, and it is never trained, exported or sent. `lora.trained: B` trains B (out x rank) over a
fixed A on every layer (FFA-LoRA); `smaller` trains, layer by layer, whichever factor has fewer
numbers (A, rank x in, where in < out: the MLP's gate and up projections) over a fixed B, which
at the same bytes doubles the tiny model's rank. Why one factor stays fixed: the server averages
what the clients send, and the mean of the products B_i A_i is not (mean B_i)(mean A_i); with
one factor shared it is exactly (mean B_i) A or B (mean A_i), so FedAvg, every robust aggregator
and every server optimizer (all linear in the trained factor, or coordinate-wise on it with the
other shared) act on the products as they act on full weights
(tests/trainer/test_lora.py::test_averaged_adapters_merge_to_the_exact_mean_of_the_products).

A small module of our own rather than PEFT: PEFT trains both factors with its own initialiser
and prefixes every name (`base_model.model.`), where we need the fixed factor out of every state
dict and optimizer by construction, drawn from our seed, and the base's names unchanged (the
reference copy, the critic's backbone and a vLLM sync address the model by its Hugging Face
names). The layer subclasses `torch.nn.Linear` and shares the base's weight and bias objects, so
`q_proj.weight` stays `q_proj.weight` and the adapter adds `q_proj.lora_B` (or `lora_A`). The
readers below (`merged_tensors`, `base_digest`) take a parameter whole, also where FSDP2 holds it
as a DTensor (the verl engine), so both engines merge and digest with the same arithmetic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from client_app.rollout import derive_seed
from fl_app.config import LoraCfg

LORA_A, LORA_B = "lora_A", "lora_B"


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's trained factor (not a weight of the model)."""
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))


def other_factor(factor: str) -> str:
    """A for B, B for A: the fixed factor of a layer that trains `factor`."""
    return LORA_A if factor == LORA_B else LORA_B


def trained_factor(trained: str, in_features: int, out_features: int) -> str:
    """The factor a layer trains under `lora.trained`: B, or the smaller of A (rank x in) and B
    (out x rank), B where they are the same size."""
    return LORA_A if trained == "smaller" and in_features < out_features else LORA_B


def _whole(t: torch.Tensor) -> torch.Tensor:
    """`t` detached and whole: a DTensor (an FSDP2 parameter) gathered, any other tensor as is."""
    t = t.detach()
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


class LoraLinear(torch.nn.Linear):
    """`base`'s weight and bias (frozen) plus s B A: the `trained` factor a parameter that starts
    at zero, the other a non-persistent buffer (`fixed`)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor

    def __init__(self, base: torch.nn.Linear, fixed: torch.Tensor, trained: str, scale: float) -> None:
        torch.nn.Module.__init__(self)  # no fresh weight: the base's own objects are reused
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        rank = fixed.shape[0] if trained == LORA_B else fixed.shape[1]
        shape = (base.out_features, rank) if trained == LORA_B else (rank, base.in_features)
        self.trained, self.fixed = trained, other_factor(trained)
        self.register_buffer(self.fixed, fixed.to(base.weight.device), persistent=False)
        self.register_parameter(trained, torch.nn.Parameter(torch.zeros(shape, device=base.weight.device)))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bf16 compute copy casts the trained factor (a parameter), not the fixed one (a buffer)
        dtype = getattr(self, self.trained).dtype
        a, b = self.lora_A.to(dtype), self.lora_B.to(dtype)
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, a), b)

    def merged_weight(self) -> torch.Tensor:
        """W + s B A in fp32: the weight this layer computes with (a vLLM sync, the reference
        of `algo.ref_anchor: round`, the tests' float64 reference in their own dtype)."""
        a, b = _whole(self.lora_A), _whole(self.lora_B)
        dtype = getattr(self, self.trained).dtype
        return _whole(self.weight) + self.scale * (b.to(dtype) @ a.to(dtype))


def fixed_factor(
    seed: int, member: str, name: str, factor: str, rank: int, in_features: int, out_features: int
) -> torch.Tensor:
    """The fixed `factor` (A: rank x in, or B: out x rank) of `member`'s adapter on tensor `name`:
    U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform default for A; a fixed B takes the same
    bound, so that the same step of the trained factor moves W alike) from a CPU generator seeded
    by (seed, member, name, factor): the same bits in every process and on every machine, and
    different for every tensor."""
    gen = torch.Generator().manual_seed(derive_seed(f"lora-{factor[-1]}", seed, member, name))
    shape = (rank, in_features) if factor == LORA_A else (out_features, rank)
    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * in_features**-0.5


def add_adapters(
    model: torch.nn.Module,
    member: str,
    targets: Sequence[str],
    rank: int,
    alpha: float,
    seed: int,
    trained: str = "B",
) -> list[str]:
    """Freeze `model` and put an adapter on every `torch.nn.Linear` whose last name part is in
    `targets` (never the LM head or the embeddings), training the factor `trained` picks
    (`trained_factor`); returns the adapted modules' names. A target that names no linear of
    the model is an error (an adapter nobody trains is a typo)."""
    model.requires_grad_(False)
    out_embed = getattr(model, "get_output_embeddings", lambda: None)()
    found: list[str] = []
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in targets or not isinstance(module, torch.nn.Linear) or module is out_embed:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        factor = trained_factor(trained, module.in_features, module.out_features)
        fixed = other_factor(factor)
        draw = fixed_factor(seed, member, f"{name}.weight", fixed, rank, module.in_features, module.out_features)
        setattr(parent, leaf, LoraLinear(module, draw, factor, alpha / rank))
        found.append(name)
    missing = sorted(set(targets) - {n.rpartition(".")[2] for n in found})
    if missing:
        raise ValueError(
            f"federation.lora.target_modules names {missing}, which match no linear layer of the {member} model "
            f"(its adapted layers end in {sorted({n.rpartition('.')[2] for n in found})}); fix target_modules"
        )
    return found


def adapt(model: torch.nn.Module, member: str, lora: LoraCfg, seed: int) -> None:
    """`member`'s adapters on `model` over its frozen weights, as every engine puts them: one
    factor of each trained, and the critic's value head (a fresh head the base has no weights
    for) trained whole (PEFT's modules_to_save)."""
    add_adapters(model, member, lora.target_modules, lora.rank, lora.alpha, seed, lora.trained)
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
        if is_adapter(name):
            continue
        yield name, (merged[name].merged_weight() if name in merged else _whole(p))


def base_digest(models: dict[str, torch.nn.Module]) -> str:
    """sha256 of every member's frozen tensors (name, dtype, shape, bytes; the adapters' trained
    factors and the trained head left out): the base the adapters are relative to. Two nodes with the same
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
