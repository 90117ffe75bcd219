"""verl plugin entry point: ``import verl`` imports this module in every process of a job.

Registers the ``igpo`` advantage estimator (alias ``grpo_info_gain``), the ``igpo_agent`` and ``arpo_agent`` agent
loops, the ``igpo_sync`` trainer mode, the vLLM rollout adapter whose weight sync fails instead of hanging, verl's
``bypass_mode`` policy loss accepting a micro-batch without a valid token (igpo/integration/policy_loss.py), and — only
when ``VERL_PLATFORM=cpu`` — the CPU backend. verl swallows plugin import errors at DEBUG level, so a failure here is
logged as a WARNING with its traceback instead.

Most processes of a job use few of these (the request load balancer and the reward loop none), so each registration
waits for the verl module it writes into: a post-import hook applies it when a process imports that module, at once
if it already has. The hooks only write registry entries and patch attributes: where verl's registry takes a class
path (agent loops, the vLLM adapter), the path is registered and nothing of ours is imported — verl imports the module
where it builds the object.

The estimator (verl keeps functions) and the trainer mode (verl keeps classes) need our modules imported
(``REGISTERING_MODULES``, ~2 CPU-seconds with what they pull in). By default this hook imports them. A run started by
``igpo.main`` sets ``IGPO_LAZY_REGISTRATION=1`` for its Ray cluster: its TaskRunner
(igpo/integration/task_runner.py), the one process besides the driver that reads those two registries, imports them
before it runs, and every other process skips them. Neither module imports an agent loop, so whichever of our
modules a process imports first, they can be imported to the end.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType

from igpo.integration import LAZY_REGISTRATION_ENV, REGISTERING_MODULES

logger = logging.getLogger("igpo")

# verl's agent-loop registry maps a name to a class path (the entry its own ``register`` decorator writes).
AGENT_LOOPS = {
    "igpo_agent": "igpo.agent.agent_loop.IGPOAgentLoop",
    "arpo_agent": "igpo.agent.arpo_loop.ARPOAgentLoop",
}
# verl's vLLM rollout adapter, with a weight sync that raises the engine's error instead of hanging
# (igpo/integration/weight_sync.py). A class path: verl imports it only in the worker that builds a vLLM rollout.
VLLM_ADAPTER = "igpo.integration.weight_sync.GuardedServerAdapter"

FAILED: list[str] = []  # the parts that failed to register in this process, each logged with its traceback


def _register_agent_loops(agent_loop: ModuleType) -> None:
    for name, path in AGENT_LOOPS.items():
        agent_loop._agent_loop_registry[name] = {"_target_": path}


def _register_vllm_adapter(base: ModuleType) -> None:
    base._ROLLOUT_REGISTRY[("vllm", "async")] = VLLM_ADAPTER


def _guard_bypass_loss(core_algos: ModuleType) -> None:
    from igpo.integration.policy_loss import guard_bypass_loss

    guard_bypass_loss(core_algos)


def _apply(name: str, hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        hook(module)
    except Exception:
        logger.warning("igpo: %s on %s failed; its registration is missing in this process", hook.__qualname__, name,
                       exc_info=True)
        FAILED.append(f"{hook.__module__}.{hook.__qualname__}")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Post-import hooks: finds nothing itself; for a watched module it wraps the loader that the other finders return
    so that the hooks run right after the module's code (then the wrapper is removed)."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                execute(module)
            finally:
                vars(loader).pop("exec_module", None)
            for hook in self.waiting.pop(name, []):
                _apply(name, hook, module)
            if not self.waiting and self in sys.meta_path:
                sys.meta_path.remove(self)

        # On this loader instance only (the path finders make one per module spec), so the module keeps its own loader.
        loader.exec_module = exec_module
        return spec


_HOOKS = _AfterImport()


def when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``name`` is imported: now if it already is, else right after its code runs."""
    module = sys.modules.get(name)
    if module is not None:
        _apply(name, hook, module)
        return
    _HOOKS.waiting.setdefault(name, []).append(hook)
    if _HOOKS not in sys.meta_path:
        sys.meta_path.insert(0, _HOOKS)


def _import_registering_modules() -> None:
    """Import the modules that register the estimators and the trainer mode (each failure logged and recorded)."""
    for name in REGISTERING_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            logger.warning("igpo: %s failed to import; its registrations are missing in this process", name,
                           exc_info=True)
            FAILED.append(name)


def load() -> list[str]:
    """Register everything (hooks for what waits on a verl module); return the names of the parts that failed."""
    from igpo.cpu import activate, cpu_requested

    if cpu_requested():
        try:
            activate(when_imported)
        except Exception:
            logger.warning("igpo: the CPU backend (VERL_PLATFORM=cpu) failed to load", exc_info=True)
            FAILED.append("igpo.cpu")
    when_imported("verl.experimental.agent_loop.agent_loop", _register_agent_loops)
    when_imported("verl.workers.rollout.base", _register_vllm_adapter)
    when_imported("verl.trainer.ppo.core_algos", _guard_bypass_loss)
    if os.environ.get(LAZY_REGISTRATION_ENV) != "1":
        _import_registering_modules()
    return FAILED


load()
