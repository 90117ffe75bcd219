"""CPU backend for verl 0.9.1: a platform, an HF transformers rollout, and the few patches verl needs without a GPU.

Activated only when ``VERL_PLATFORM=cpu`` (our launcher sets it on machines without a GPU, or when asked); a GPU run
never imports this package. See ``activate`` for what changes.
"""

from __future__ import annotations

import functools
import os
import warnings

_ACTIVE = False


def cpu_requested() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def activate() -> None:
    """Register the CPU platform and the ``hf`` rollout, and patch verl's GPU-only assumptions. Idempotent."""
    global _ACTIVE
    if _ACTIVE:
        return
    from igpo.cpu import platform  # noqa: F401  (registers PlatformCPU as "cpu")

    _register_rollout()
    _patch_process_group()
    _patch_fsdp()
    _ACTIVE = True


def _register_rollout() -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def load_replica():
        from igpo.cpu.hf_rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register("hf", load_replica)
    base._ROLLOUT_REGISTRY[("hf", "async")] = "igpo.cpu.hf_rollout.HFServerAdapter"


def _patch_process_group() -> None:
    """verl initialises ``cpu:gloo,<device>:<backend>``, which is a duplicate ``cpu:gloo`` on CPU: use plain gloo."""
    import verl.utils.distributed as distributed
    import verl.workers.engine_workers as engine_workers

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_igpo_cpu", False):
        return

    @functools.wraps(original)
    def initialize(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize._igpo_cpu = True
    distributed.initialize_global_process_group_ray = initialize
    engine_workers.initialize_global_process_group_ray = initialize


def _patch_fsdp() -> None:
    """Let the FSDP engines run on the CPU.

    * The engine registry only lists FSDP for ``cuda``/``npu``: register the same classes for ``cpu``.
    * Forward-only engines (the reference model) offload with ``pin_memory=True``, which needs an accelerator.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    # Importing the engine package registers the built-in engines and warns once per optional engine whose library
    # is absent (Megatron, torchtitan, ...): noise in every process here, where only FSDP is used.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
        import verl.workers.engine  # noqa: F401
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    from verl.workers.engine.base import EngineRegistry

    for backends in EngineRegistry._engines.values():
        for backend, by_device in backends.items():
            if backend.startswith("fsdp") and "cpu" not in by_device and "cuda" in by_device:
                by_device["cpu"] = by_device["cuda"]

    class UnpinnedCPUOffloadPolicy(CPUOffloadPolicy):
        def __init__(self, pin_memory: bool = False, **kwargs):
            super().__init__(pin_memory=False, **kwargs)

    fsdp_impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy
