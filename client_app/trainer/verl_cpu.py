"""verl on the host CPU: the platform verl 0.9.1 does not ship.

verl resolves one platform per process through its plugin registry and, finding no
accelerator, falls back to nvidia. `arm_cpu` registers `CpuPlatform` (device "cpu", collectives
over gloo, no IPC, no profiler) through verl's own `PlatformRegistry` and `set_platform`, and
registers verl's value-model FSDP engine for device "cpu" through `EngineRegistry.register` (our
LM engine registers itself: `verl_head.register`). That is what lets the verl engine run, and
be held to the builtin one, on a CPU-only machine (tests, the embedded default).
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch


def _platform_base() -> type:
    from verl.plugin.platform import PlatformBase

    return PlatformBase


class _CpuDeviceModule(ModuleType):
    """`torch.cpu` plus the allocator statistics verl's workers log after every step (the CPU
    has no caching allocator: they read 0; host memory is measured as RSS instead)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def _zero(*args: Any, **kwargs: Any) -> int:
        return 0

    max_memory_allocated = max_memory_reserved = memory_allocated = memory_reserved = _zero

    @staticmethod
    def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
        return 0, 0


_CPU_DEVICE_MODULE = _CpuDeviceModule("fedagent_verl_cpu_device")


def make_cpu_platform() -> Any:
    """A verl platform for the host CPU (verl 0.9.1 registers nvidia, huawei and amd only)."""
    base = _platform_base()

    class CpuPlatform(base):  # type: ignore[misc, valid-type]
        """Device "cpu", collectives over gloo, no IPC, no profiler, no Ray accelerator."""

        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # used as `tensor.to(get_device_id())`
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return CpuPlatform


def arm_cpu() -> None:
    """Make verl run on the CPU in this process: the CPU platform is the current one and
    verl's FSDP engines are registered for device "cpu". Idempotent. verl resolves its platform
    once per process, falling back to nvidia when it finds no accelerator; that fallback (no
    CUDA device behind it) is replaced, a platform with a real device behind it is not: fail
    closed."""
    from verl.plugin.platform import PlatformRegistry, platform_manager, set_platform

    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(make_cpu_platform())
    current = platform_manager._current_platform
    if current is None or (current.device_name == "cuda" and not torch.cuda.is_available()):
        cpu = PlatformRegistry.get("cpu")
        if cpu is None:
            raise RuntimeError("verl's platform registry lost the cpu platform just registered")
        set_platform(cpu())
    elif current.device_name != "cpu":
        raise RuntimeError(
            f"verl already runs on {current.device_name!r} in this process; run.device=cpu needs a process of its own"
        )
    # imported only now: verl's engine modules read the platform when they are imported
    from verl.utils.device import get_device_name
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    if "cpu" not in EngineRegistry._engines["value_model"]["fsdp2"]:
        EngineRegistry.register(model_type="value_model", backend=["fsdp2"], device="cpu")(FSDPEngineWithValueHead)
    if get_device_name() != "cpu":
        raise RuntimeError(f"verl's platform is {get_device_name()!r} after arming the CPU platform")
