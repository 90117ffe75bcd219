"""What a turn-level method is: the step it reads (``StepBatch``), what it returns (``MethodResult``), its base class
(``Method``) and the registry ``algorithm.adv_estimator`` names select from (``register_method``). The package's
``__init__`` re-exports these names and finds the method of a run (``method_for``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor

from igpo.agent.records import TurnBatch
from igpo.core.infra import InfraMask


@dataclass
class StepBatch:
    """One training step's trajectories, as a method reads them.

    ``turns``: the agent loop's typed turn records as [B, T] tensors; ``uids`` and ``group`` [B] (dense ids, one per
    prompt); ``response_mask`` [B, L] bool as the rollout stored it; ``rm_scores`` [B, L] (the outcome reward on the
    last response token); ``infra``: what the infra-failure policy takes out (rows, turns and the loss mask without
    them; a masked row must get no signal and a zero advantage); ``fields``: the method's own ``fields``, padded
    tensors or per-row lists (a field TransferQueue does not hold is left out); ``keys``: each row's TransferQueue key
    (``{uid}_{session}_{index}``); ``step``, ``total_steps``, ``epoch``: where the run is.
    """

    turns: TurnBatch
    uids: list
    group: Tensor
    response_mask: Tensor
    rm_scores: Tensor
    infra: InfraMask
    fields: dict[str, Any] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    step: int = 0
    total_steps: int = 0
    epoch: int = 0


@dataclass
class MethodResult:
    """[B, L] advantages and returns (float), step metrics (logged as given), the per-turn values the method
    credited (for the ``igpo/hist/turn_ig`` histogram; empty when it credits none), and ``terms``: what the advantage
    was made of, by name, each a [B] tensor (one value per trajectory) or a [B, T] tensor (one per turn, T =
    ``batch.turns.width``), NaN where a term has no value for that row or turn. ``trainer.trajectory_dir`` writes them
    beside the applied advantage (``igpo.integration.trajectory_log``), so a term's name is the key a user reads."""

    advantages: Tensor
    returns: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    turn_values: Tensor | None = None
    terms: dict[str, Tensor] = field(default_factory=dict)


class Method:
    """Base of a turn-level method. ``fields``: TransferQueue fields read beyond ``uid``, ``response_mask``,
    ``rm_scores`` and ``extra_fields``, handed over per row (a tensor per row, or the stored objects);
    ``response_fields``: fields aligned with the response, handed over padded [B, L]. ``masks_infra``: the method can leave a trajectory out of its statistics, so
    ``algorithm.igpo.infra_failure`` may mask (default ``mask_trajectory``); otherwise only ``keep`` is allowed."""

    name = "method"
    title = "a turn-level method"  # how the trainer's log names it
    fields: tuple[str, ...] = ()
    response_fields: tuple[str, ...] = ()
    masks_infra = True

    def __init__(self, config: Any):
        self.config = config

    def advantage(self, batch: StepBatch, scorer: Any) -> MethodResult:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """State saved in ``igpo_state.json`` beside verl's checkpoint and restored on resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def report(self, step: int, total_steps: int) -> dict[str, Any]:
        """What the checkpoint line shows of this method's state."""
        return {}


METHODS: dict[str, type[Method]] = {}


def register_method(*names: str) -> Callable[[type[Method]], type[Method]]:
    """Class decorator: ``algorithm.adv_estimator=<name>`` selects the class. A name taken by another class raises."""

    def decorate(cls: type[Method]) -> type[Method]:
        if "name" not in cls.__dict__:  # metric prefixes (timing_s/<name>_advantage) use the first registered name
            cls.name = names[0]
        for name in names:
            if METHODS.get(name, cls) is not cls:
                raise ValueError(f"method name {name!r} is taken by {METHODS[name].__module__}.{METHODS[name].__name__}")
            METHODS[name] = cls
        return cls

    return decorate
