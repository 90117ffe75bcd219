"""The actor worker of ``igpo_separate_async``: our scoring methods and verl's save/restore of the weights in one class.

verl's ``separate_async`` trainer runs its actor roles as ``DetachActorWorker``, whose ``save_model_to_cpu`` /
``restore_model_from_cpu`` / ``clear_cpu_model`` keep the weights that computed a cycle's old log-probs
(``parameter_sync_step`` updates per weight sync). Our pipeline calls ``igpo_score_answers``,
``infopo_score_counterfactuals`` and ``igpo_worker_report`` on the actor (``IGPOActorRolloutRefWorker``). Both
classes extend verl's ``ActorRolloutRefWorker`` without touching the same method, so one class has both sets.
"""

from __future__ import annotations

from verl.experimental.separation.engine_workers import DetachActorWorker

from igpo.integration.actor_worker import IGPOActorRolloutRefWorker


class IGPODetachActorWorker(IGPOActorRolloutRefWorker, DetachActorWorker):
    """``IGPOActorRolloutRefWorker``'s scoring methods on verl's ``DetachActorWorker`` (its ``__init__`` runs)."""
