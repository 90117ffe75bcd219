"""A verl platform for machines without an accelerator.

verl 0.9.1 ships CUDA, NPU and ROCm platforms only; with no GPU it falls back to CUDA and fails on NCCL and on
``cuda:0``. ``PlatformCPU`` keeps verl's placement logic unchanged: Ray's "GPU" resource is faked by the launcher
(``ray_init.num_gpus``), each worker computes on the CPU and talks to its peers over gloo.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _noop(*_args, **_kwargs) -> None:
    return None


def _zero(*_args, **_kwargs) -> int:
    return 0


def _mem_get_info(*_args) -> tuple[int, int]:
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


class _CPUDeviceModule(SimpleNamespace):
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module, as CPU equivalents."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


CPU_DEVICE_MODULE = _CPUDeviceModule(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: "cpu",
    set_device=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    synchronize=_noop,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda *_: torch.get_rng_state(),
    set_rng_state=lambda state, *_: torch.set_rng_state(state),
    mem_get_info=_mem_get_info,
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    reset_peak_memory_stats=_noop,
    set_per_process_memory_fraction=_noop,
    get_device_name=lambda *_: "cpu",
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """Runs verl's workers on the CPU; selected with ``VERL_PLATFORM=cpu`` (set by our launcher without GPUs)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a GPU run must not pick this platform by accident.
        return False

    def current_device(self):
        # verl builds tensors with device=get_device_id(); "cpu" keeps them off a non-existent cuda:0.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # Placement groups ask for "GPU" bundles; the CPU launcher registers fake GPU resources with Ray.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
