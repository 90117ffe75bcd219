"""Turn-level advantage methods, one module each, chosen by ``algorithm.adv_estimator``.

The ``igpo_sync`` trainer runs one pipeline for every method: it fetches the step's trajectories and their turn
records, applies the infra-failure policy, calls ``method.advantage(batch, scorer)``, applies ARPO's attribution and
writes the advantages back. A method gets everything it needs in ``StepBatch`` (and the actor's scoring passes in
``scorer``) and never calls back into the trainer. A new method is one module here and one ``register_method``
line; an estimator name no method claims is verl's own, wrapped as a method of the same pipeline
(``outcome.VerlEstimator``: GRPO, RLOO, ... on the outcome reward, computed by verl's advantage step).

A method:

    @register_method("my_method")
    class MyMethod(Method):
        fields = ()                       # extra TransferQueue fields it reads (e.g. "prompts", "old_log_probs")
        def __init__(self, config):       # the whole run config; parse your own section once, here
            ...
        def advantage(self, batch: StepBatch, scorer: ActorScorer) -> MethodResult:
            ...                           # [B, L] advantages and returns, metrics (logged as they are)
"""

from __future__ import annotations

import importlib
from typing import Any

from igpo.integration.methods.base import METHODS, Method, MethodResult, StepBatch, register_method
from igpo.integration.methods.outcome import VerlEstimator

__all__ = ["METHODS", "Method", "MethodResult", "StepBatch", "register_method", "load_methods", "method_for"]

# The modules that register the shipped methods, imported on first lookup.
BUILTIN = ("igpo.integration.methods.igpo", "igpo.integration.methods.infopo",
           "igpo.integration.methods.gigpo",
           "igpo.integration.methods.oracle",
           "igpo.integration.methods.ig_search",
           "igpo.integration.methods.tips")


def load_methods(config: Any) -> None:
    """Import the shipped methods and the modules ``algorithm.methods`` lists (your own, importable in the trainer's
    process: installed, or on PYTHONPATH)."""
    listed = (config.get("algorithm", None) or {}).get("methods", None) or []
    for module in (*BUILTIN, *[str(m) for m in listed]):
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(f"algorithm.methods lists {module!r}, which cannot be imported ({error}); install it or "
                              "put its folder on PYTHONPATH") from error


def method_for(config: Any) -> Method:
    """The method ``config.algorithm.adv_estimator`` names (verl's own estimator when no method claims the name)."""
    load_methods(config)
    return METHODS.get(str(config.algorithm.adv_estimator), VerlEstimator)(config)

