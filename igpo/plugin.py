"""verl plugin entry point: ``import verl`` imports this module in every process of a job.

Registers the ``igpo`` advantage estimator (alias ``grpo_info_gain``), the ``igpo_agent`` and ``arpo_agent`` agent
loops, the ``igpo_sync`` trainer mode, the vLLM rollout adapter whose weight sync fails instead of hanging, and — only when ``VERL_PLATFORM=cpu`` — the CPU backend. verl swallows plugin import
errors at DEBUG level, so a failure here is logged as a WARNING with its traceback instead. When verl is first
imported from inside one of the registering modules, the rest wait until that module's body has run (``DEFERRED``).
"""

from __future__ import annotations

import importlib
import logging
import sys

logger = logging.getLogger("igpo")

# Each module registers its pieces on import.
REGISTERING_MODULES = ("igpo.integration.estimator", "igpo.agent.agent_loop", "igpo.agent.arpo_loop", "igpo.integration.trainer")
# verl's vLLM rollout adapter, with a weight sync that raises the engine's error instead of hanging
# (igpo/integration/weight_sync.py). A class path: verl imports it only in the worker that builds a vLLM rollout.
VLLM_ADAPTER = "igpo.integration.weight_sync.GuardedServerAdapter"


def _register_vllm_adapter() -> None:
    from verl.workers.rollout import base

    base._ROLLOUT_REGISTRY[("vllm", "async")] = VLLM_ADAPTER


def load() -> list[str]:
    """Import the registering modules; return the names of those that failed (each logged with a traceback)."""
    from igpo.cpu import activate, cpu_requested

    failed = []
    if cpu_requested():
        try:
            activate()
        except Exception:
            logger.warning("igpo: the CPU backend (VERL_PLATFORM=cpu) failed to load", exc_info=True)
            failed.append("igpo.cpu")
    try:
        _register_vllm_adapter()
    except Exception:
        logger.warning("igpo: registering the guarded vLLM rollout adapter failed", exc_info=True)
        failed.append(VLLM_ADAPTER)
    for name in REGISTERING_MODULES:
        importing = _half_imported()
        if importing:
            # verl was imported from inside ``importing`` (e.g. ``import igpo.agent.agent_loop`` as a process's first
            # import): what depends on its names cannot import yet; that module calls ``load_deferred`` at its end.
            DEFERRED.append(name)
            continue
        if not _import(name):
            failed.append(name)
    return failed


def _half_imported() -> str | None:
    """A registering module whose import is under way in this process (its body not yet run to the end)."""
    for name in REGISTERING_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) \
                and not getattr(module, "_IGPO_BODY_DONE", False):
            return name
    return None


def _import(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:
        logger.warning("igpo: %s failed to import; its registrations are missing in this process", name,
                       exc_info=True)
        return False


def load_deferred(done: str) -> None:
    """Called at the end of a registering module's body: import what ``load`` had to put off while it was half
    imported."""
    sys.modules[done]._IGPO_BODY_DONE = True
    while DEFERRED and not _half_imported():
        name = DEFERRED.pop(0)
        if not _import(name):
            FAILED.append(name)


DEFERRED: list[str] = []
FAILED = load()
