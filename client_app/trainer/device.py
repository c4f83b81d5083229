"""The lane's device: which one, process settings for it, and giving memory back."""

from __future__ import annotations

import ctypes
import gc

import torch


def resolve_device(choice: str) -> torch.device:
    """`auto`: CUDA when visible, else CPU; `cuda` without a GPU is an error, not a fallback."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is visible; set run.device=auto or cpu")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def cuda_autocast(device: torch.device) -> torch.dtype | None:
    """bf16 autocast for fp32 modules on CUDA; none on the CPU, where everything stays fp32."""
    return torch.bfloat16 if device.type == "cuda" else None


def avoid_cudnn_attention(device: torch.device) -> None:
    """On CUDA, take cuDNN out of this process's scaled-dot-product attention (flash,
    memory-efficient and math kernels remain). cuDNN builds an execution plan for every new
    attention shape and keeps it in host memory; rollouts bring new (batch, length) shapes every
    fit, so a lane's RSS grew by about a tenth of a GB per fit (invariant 24; docs/benchmarks.md).
    Process-wide by necessity, which is fine: the lane service is the trainer's own process."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def freeze_survivors() -> int:
    """Collect cycles, then move every object still alive into the cyclic collector's permanent
    generation; returns how many objects it holds. A lane's long-lived objects (imported
    modules, models, compiled graphs) are then never scanned again, so the collection that ends
    each fit (`release_memory`) walks only what that fit created: 0.20 s -> ~0 per fit on a CPU
    test lane of 420k objects. Frozen objects are still freed by reference counting, but a
    garbage cycle through any of them never is: the lane freezes right after a collection, when
    what lives is meant to live, and reports the count (`service_frozen_objects`), which must
    level off after the first fits (tests/client/test_lane_overhead.py)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_memory(device: torch.device) -> None:
    """Return freed memory to the system: Python cycles, the CUDA cache, glibc's arenas (RSS)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass
