"""TensorBoard histograms of each step's turn-level signal (``trainer.histograms: true``; off by default).

The scalars (``igpo/ig_mean``, ``igpo/turns_mean``, ...) hide the shape: a mean IG near zero may be all zeros or a
few large gains; a mean turn count of 3 may be every trajectory at 3 or half at 1 and half at the cap. Per step:

    igpo/hist/turn_ig               IG_j of every turn whose information gain entered the advantage (after the warm-up
                                    gate, the tool filter and infra masking; before the curriculum weight). InfoPO:
                                    the counterfactual value I_j of every scored turn.
    igpo/hist/advantage             the advantage of every token in the loss (IGPO, InfoPO)
    igpo/hist/turns_per_trajectory  turns of every trajectory of the batch (every estimator)

The trainer records the tensors while it computes the advantage (``StepHistograms.record``) and writes them at the
step's number through the ``SummaryWriter`` of verl's TensorBoard logger (``trainer.logger`` must include
``tensorboard``), so they land in the run's one event file beside the scalars. Cost when on: one masked copy of the
advantage tensor to CPU and one ``numpy.histogram`` per name per step; nothing when off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TURN_IG = "igpo/hist/turn_ig"
ADVANTAGE = "igpo/hist/advantage"
TURNS = "igpo/hist/turns_per_trajectory"
NAMES = (TURN_IG, ADVANTAGE, TURNS)


def histograms_enabled(trainer_config: Any) -> bool:
    """``trainer.histograms`` (absent: false); refuses a non-boolean and a run without the TensorBoard logger."""
    value = trainer_config.get("histograms", False)
    if not isinstance(value, bool):
        raise ValueError(f"trainer.histograms={value!r} must be true or false (TensorBoard histograms of per-turn IG, "
                         "advantages and turns per trajectory each step).")
    loggers = trainer_config.get("logger", None)
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    if value and "tensorboard" not in loggers:
        raise ValueError(f"trainer.histograms=true writes TensorBoard histograms, but trainer.logger={loggers} has no "
                         "tensorboard; add it, e.g. trainer.logger=[console,tensorboard], or set "
                         "trainer.histograms=false.")
    return value


class StepHistograms:
    """The current step's values per histogram name; ``write`` empties it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._values: dict[str, np.ndarray] = {}

    def record(self, name: str, values: torch.Tensor) -> None:
        if self.enabled:
            self._values[name] = values.detach().double().cpu().numpy().ravel()

    def write(self, writer, step: int) -> list[str]:
        """``writer.add_histogram`` of every non-empty recorded name at ``step``; returns the names written."""
        written = []
        for name, values in self._values.items():
            if values.size:
                writer.add_histogram(name, values, step)
                written.append(name)
        self._values = {}
        return written
