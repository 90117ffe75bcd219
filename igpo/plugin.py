"""verl plugin entry point: ``import verl`` imports this module in every process of a job.

Registers the ``igpo`` advantage estimator (alias ``grpo_info_gain``), the ``igpo_agent`` and ``arpo_agent`` agent
loops, the ``igpo_sync`` trainer mode, the vLLM rollout adapter whose weight sync fails instead of hanging, and — only when ``VERL_PLATFORM=cpu`` — the CPU backend. verl swallows plugin import
errors at DEBUG level, so a failure here is logged as a WARNING with its traceback instead.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("igpo")

# Each module registers its pieces on import.
REGISTERING_MODULES = ("igpo.estimator", "igpo.agent_loop", "igpo.arpo_loop", "igpo.trainer")
# verl's vLLM rollout adapter, with a weight sync that raises the engine's error instead of hanging
# (igpo/weight_sync.py). A class path: verl imports it only in the worker that builds a vLLM rollout.
VLLM_ADAPTER = "igpo.weight_sync.GuardedServerAdapter"


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
        try:
            importlib.import_module(name)
        except Exception:
            logger.warning("igpo: %s failed to import; its registrations are missing in this process", name,
                           exc_info=True)
            failed.append(name)
    return failed


FAILED = load()
