"""CPU backend for verl 0.9.1: a platform, an HF transformers rollout, and the few patches verl needs without a GPU.

Activated only when ``VERL_PLATFORM=cpu`` (our launcher sets it on machines without a GPU, or when asked); a GPU run
never imports this package. See ``activate`` for what changes.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType

_ACTIVE = False
# verl's engine package warns once per optional engine whose library is absent (Megatron, torchtitan, ...): noise in
# every process here, where only FSDP is used.
_ENGINE_WARNING = r".* engine is not available"


def cpu_requested() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def activate(when_imported: Callable[[str, Callable[[ModuleType], None]], None] | None = None) -> None:
    """Register the CPU platform and the ``hf`` rollout, and patch verl's GPU-only assumptions. Idempotent.

    Each patch changes one verl module (``PATCHES``). ``when_imported(name, patch)`` applies it once that module is
    imported (the plugin's post-import hook: at once if it already is), so a process that never imports, say, the
    FSDP engines does not import them for a patch; without it every module is imported and patched now."""
    global _ACTIVE
    if _ACTIVE:
        return
    from igpo.cpu import platform  # noqa: F401  (registers PlatformCPU as "cpu")

    warnings.filterwarnings("ignore", message=_ENGINE_WARNING, category=UserWarning)
    for name, patch in PATCHES.items():
        if when_imported is not None:
            when_imported(name, patch)
        else:
            patch(importlib.import_module(name))
    _ACTIVE = True


def _register_rollout(base: ModuleType) -> None:
    """``rollout.name=hf``: verl's adapter registry (``verl.workers.rollout.base``) names our server adapter."""
    base._ROLLOUT_REGISTRY[("hf", "async")] = "igpo.cpu.hf_rollout.HFServerAdapter"


def _register_replica(replica: ModuleType) -> None:
    """``rollout.name=hf``: verl's replica registry (``verl.workers.rollout.replica``) builds our replica."""

    def load_replica():
        from igpo.cpu.hf_rollout import HFReplica

        return HFReplica

    replica.RolloutReplicaRegistry.register("hf", load_replica)


def _patch_process_group(distributed: ModuleType) -> None:
    """verl initialises ``cpu:gloo,<device>:<backend>``, which is a duplicate ``cpu:gloo`` on CPU: use plain gloo.

    Patched in ``verl.utils.distributed`` as soon as it is imported, before the modules that bind the function by name
    (``verl.workers.engine_workers``, ``verl.checkpoint_engine.base``) import it."""
    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_igpo_cpu", False):
        return

    @functools.wraps(original)
    def initialize(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize._igpo_cpu = True
    distributed.initialize_global_process_group_ray = initialize


def _bind_process_group(engine_workers: ModuleType) -> None:
    """The actor worker's module binds the function by name: give it the patched one (a no-op when it was imported
    after the patch, as it is under the plugin)."""
    import verl.utils.distributed as distributed

    _patch_process_group(distributed)
    engine_workers.initialize_global_process_group_ray = distributed.initialize_global_process_group_ray


def _patch_fsdp(engine: ModuleType) -> None:
    """Let the FSDP engines run on the CPU, once ``verl.workers.engine`` (whose import registers the built-in engines)
    is imported.

    * The engine registry only lists FSDP for ``cuda``/``npu``: register the same classes for ``cpu``.
    * Forward-only engines (the reference model) offload with ``pin_memory=True``, which needs an accelerator.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

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


# Each patch, keyed by the verl module it changes (in the order a process imports them).
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "verl.utils.distributed": _patch_process_group,
    "verl.workers.rollout.base": _register_rollout,
    "verl.workers.rollout.replica": _register_replica,
    "verl.workers.engine_workers": _bind_process_group,
    "verl.workers.engine": _patch_fsdp,
}
