"""verl plugin entry point: ``import verl`` imports this module in every process of a job.

Registers the ``igpo`` advantage estimator (alias ``grpo_info_gain``), the ``igpo_agent`` and ``arpo_agent`` agent
loops and the ``igpo_sync`` trainer mode, and — only when ``VERL_PLATFORM=cpu`` — the CPU backend. verl swallows plugin import
errors at DEBUG level, so a failure here is logged as a WARNING with its traceback instead.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("igpo")

# Each module registers its pieces on import.
REGISTERING_MODULES = ("igpo.estimator", "igpo.agent_loop", "igpo.arpo_loop", "igpo.trainer")


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
    for name in REGISTERING_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            logger.warning("igpo: %s failed to import; its registrations are missing in this process", name,
                           exc_info=True)
            failed.append(name)
    return failed


FAILED = load()
