"""The actor's scoring passes, as the trainer hands them to a method: the IGPO answer probes
(``IGPOActorRolloutRefWorker.igpo_score_answers``) and InfoPO's counterfactual continuations
(``infopo_score_counterfactuals``), both with the packed scorer at the rollout's temperature, plus what a method needs
to build their requests (tokenizer, the agent loop's chat frame, the policy's context window). The answer probes can
also be scored on verl's reference policy (``score_reference_answers``: TIPS's frozen teacher)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from igpo.agent.chat_frame import ChatFrame, encode_content, frame_for


class ActorScorer:
    def __init__(self, workers: Any, tokenizer: Any, config: Any):
        self.workers = workers
        self.tokenizer = tokenizer
        self.template_kwargs = dict(config.data.get("apply_chat_template_kwargs", {}) or {})
        self.model_path = str(config.actor_rollout_ref.model.path)
        self.scoring = {"strategy": "packed", "temperature": float(config.actor_rollout_ref.rollout.temperature)}

    @property
    def frame(self) -> ChatFrame:
        """The agent loop's cached chat frame: probes and counterfactuals use the rollout's own turn template."""
        return frame_for(self.tokenizer, self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of untrusted text, as the agent loop encodes tool output."""
        return encode_content(self.tokenizer, text)

    @cached_property
    def max_positions(self) -> int | None:
        """The policy's context window, to refuse requests that do not fit before they reach the workers (None when
        the config cannot be read here: the workers check it when they score)."""
        try:
            from transformers import AutoConfig  # heavy; only when a method asks

            return getattr(AutoConfig.from_pretrained(self.model_path), "max_position_embeddings", None)
        except (OSError, ValueError):
            return None

    def score_answers(self, requests: list[dict]) -> dict[int, list]:
        """Per request index: [K boundaries][P probes] log-probabilities of the gold answer."""
        return self._gather(self.workers.igpo_score_answers(requests, self.scoring))

    def score_reference_answers(self, requests: list[dict]) -> dict[int, list]:
        """``score_answers`` on the reference policy's weights (the initial ones, never trained) instead of the
        actor's (``IGPOActorRolloutRefWorker.tips_score_reference_answers``)."""
        return self._gather(self.workers.tips_score_reference_answers(requests, self.scoring))

    def score_counterfactuals(self, requests: list[dict]) -> dict[int, list]:
        """Per request index: the scores of its continuations (factual and counterfactual copies)."""
        return self._gather(self.workers.infopo_score_counterfactuals(requests, self.scoring))

    @staticmethod
    def _gather(parts: list[dict]) -> dict[int, list]:
        results: dict[int, list] = {}
        for part in parts:
            results.update(part)
        return results
