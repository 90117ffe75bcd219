"""GiGPO (``algorithm.adv_estimator=gigpo``; docs/methods/gigpo.md): an episode-level advantage over each prompt's
group plus a step-level advantage over the turns that acted from the same anchor state, ``igpo.core.gigpo``.

Each kept turn is one step row. Its anchor state is read from the tokens (``algorithm.gigpo.anchor``):

    last_observation      turn 0: the question; turn t > 0: the content of the observation that closed turn t−1
                          (the tool's text, without the chat template or an answer-now instruction; what verl-agent's
                          search environment puts in ``anchor``)
    observation_history   the question and the contents of every observation before turn t

With ``similarity: false`` contents are compared as token ids (the agent loop tokenizes every observation the same
way, so equal text is equal ids). With ``similarity: true`` they are decoded to text and grouped as verl-agent's
search recipe groups them (``igpo.core.anchor_similarity``): in row order (trajectory by trajectory, turn by turn), a
step row joins the first step group of its prompt group whose first text is similar enough, else starts one. The
question's text is the decoded prompt; a history anchor is its texts joined by blank lines. The question is the same
for every row of a prompt group, and step groups never cross prompt groups.

Malformed turns (``format_ok`` false: the agent loop's format check, the same flag IGPO's format penalty reads) stay
step rows; their observation is the loop's error text, which becomes the next turn's anchor, and with
``invalid_action_penalty`` > 0 they pay verl-agent's invalid-action penalty. Infrastructure failures follow
``algorithm.igpo.infra_failure`` as for IGPO and InfoPO: a masked trajectory has no step row (so it is in no
episode or step group) and a zero advantage; a masked turn (mask_turn) is no step row and its tokens train nothing,
while its trajectory's other turns keep their returns, discounted over all its turns.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from igpo.agent.agent_config import plain_section
from igpo.core.anchor_similarity import similarity_clusters
from igpo.core.gigpo import GiGPOConfig, GiGPOInputs, gigpo_advantage
from igpo.core.infopo import observation_content_span
from igpo.core.infra import token_turns
from igpo.integration.methods.base import Method, MethodResult, StepBatch, register_method

logger = logging.getLogger(__name__)


def gigpo_config_from_algorithm(algorithm: Any) -> GiGPOConfig:
    """``GiGPOConfig`` from ``algorithm.gigpo`` (unknown keys raise) and ``algorithm.gamma``."""
    gamma = algorithm.get("gamma", None)
    return GiGPOConfig.from_dict(plain_section(algorithm.get("gigpo", None)), gamma=gamma)


@register_method("gigpo")
class GiGPOMethod(Method):
    name = "gigpo"
    title = "GiGPO episode + anchor-state step groups"
    fields = ("prompts", "responses")

    def __init__(self, config: Any):
        super().__init__(config)
        self.gigpo = gigpo_config_from_algorithm(config.algorithm)

    def advantage(self, batch: StepBatch, scorer: Any) -> MethodResult:
        """GiGPO advantages [B, L] (= returns): each turn's A = A^E + ω·A^S on its generated tokens. ``scorer`` is
        read for the agent loop's chat frame (where an observation's content starts and ends) and, with similarity
        groups, its tokenizer."""
        turns, infra, cfg = batch.turns, batch.infra, self.gigpo
        B, L = batch.response_mask.shape
        T = turns.width
        kept = torch.arange(T)[None, :] < turns.num_turns[:, None]
        rows = kept & ~infra.rows[:, None] & ~infra.turns
        states, fallbacks = self.anchor_states(batch, scorer)
        if cfg.similarity:
            anchor, joined = self.similar_anchors(states, rows, batch.group, scorer)
        else:
            anchor, joined = self.exact_anchors(states, T), torch.zeros(B, T, dtype=torch.bool)
        inputs = GiGPOInputs(outcome=batch.rm_scores.sum(-1).double(), num_turns=turns.num_turns, rows=rows,
                             invalid=kept & ~turns.format_ok, anchor=anchor, group=batch.group)
        out = gigpo_advantage(inputs, cfg)
        owner = token_turns(turns.turn_ends, turns.num_turns, L)
        advantages = torch.where(infra.loss_mask, out.advantage.gather(1, owner), 0.0)
        metrics = {f"gigpo/{k}": v for k, v in out.stats.items()}
        metrics["gigpo/anchor_fallbacks"] = float(fallbacks)
        metrics["gigpo/invalid_turns"] = float((inputs.invalid & rows).sum())
        metrics["gigpo/rows_without_turns"] = float(((turns.num_turns == 0) & ~infra.rows).sum())
        if cfg.similarity:
            later = rows & (torch.arange(T)[None, :] >= 1)
            metrics["gigpo/similarity_joined_rows"] = float((joined & rows).sum())
            metrics["gigpo/similarity_joined_rows_after_first"] = float((joined & later).sum())
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        terms = {"episode_advantage": torch.where(rows, out.episode, nan),
                 "step_advantage": torch.where(rows, out.step, nan),
                 "step_return": torch.where(rows, out.returns, nan), "step_group": out.step_group.double(),
                 "similarity_joined": (joined & rows).double(), "invalid": inputs.invalid.double()}
        return MethodResult(advantages, advantages, metrics, terms=terms)

    def anchor_states(self, batch: StepBatch, scorer: Any) -> tuple[list[list[tuple]], int]:
        """Each kept turn's anchor state as a key (per row, one per turn): ``("question", *prompt ids)``, an
        observation's ``("content", *ids)`` or its whole ``("span", *ids)`` when the content span was not found, or
        ``("unknown", i, t)`` for an older loop's record without the boundary (a state of its own); a history anchor
        is ``("history", *states)``. Also how many observations fell back to span or unknown."""
        if scorer is None or getattr(scorer, "frame", None) is None:
            raise ValueError("gigpo: the anchor states are read from the observations' token ids, which needs the "
                             "agent loop's chat frame from the actor scorer; the igpo_sync trainer passes it.")
        frame = scorer.frame
        suffixes = list(frame.suffix_ids.values())
        turns = batch.turns
        prompts, responses = batch.fields["prompts"], batch.fields["responses"]
        states: list[list[tuple]] = []
        fallbacks = 0
        for i, record in enumerate(turns.records):
            n = int(turns.num_turns[i])
            P = int(prompts[i].numel())
            ids = torch.cat([prompts[i], responses[i]]).tolist()
            observations: list[tuple] = []
            for t in range(n - 1):
                after, boundary = int(turns.turn_ends[i, t]) + P + 1, None
                if t + 1 < len(record.boundaries):
                    boundary = int(record.boundaries[t + 1])
                if boundary is None:
                    observations.append(("unknown", i, t))
                    fallbacks += 1
                    continue
                try:
                    start, end = observation_content_span(ids, after, boundary, frame.eot_id, frame.prefix_ids,
                                                          suffixes)
                    observations.append(("content", *ids[start:end]))
                except ValueError as error:
                    logger.warning("gigpo: sample %d observation %d: %s; keyed by its whole token span", i, t, error)
                    observations.append(("span", *ids[after:boundary]))
                    fallbacks += 1
            question = ("question", *ids[:P])
            if self.gigpo.anchor == "last_observation":
                states.append([question if t == 0 else observations[t - 1] for t in range(n)])
            else:
                states.append([("history", question, *observations[:t]) for t in range(n)])
        return states, fallbacks

    @staticmethod
    def exact_anchors(states: list[list[tuple]], width: int) -> torch.Tensor:
        """[B, T = width] long ids, equal ids = identical states (−1 past a row's turns)."""
        ids_of: dict[tuple, int] = {}
        anchor = torch.full((len(states), width), -1, dtype=torch.long)
        for i, row in enumerate(states):
            for t, key in enumerate(row):
                anchor[i, t] = ids_of.setdefault(key, len(ids_of))
        return anchor

    def similar_anchors(self, states: list[list[tuple]], rows: torch.Tensor, group: torch.Tensor,
                        scorer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T] long ids of similarity step groups over the step ``rows``, row-major; [B, T] bool: the rows whose
        text differs from their step group's first text, i.e. that joined by similarity, not identity). A state with
        no text (``unknown``) is a step group of its own."""
        B, T = rows.shape
        decoded: dict[tuple, str] = {}

        def text(key: tuple) -> str | None:
            if key[0] == "unknown":
                return None
            if key[0] == "history":
                parts = [text(k) for k in key[1:]]
                return None if any(p is None for p in parts) else "\n\n".join(parts)
            if key not in decoded:
                decoded[key] = scorer.tokenizer.decode(list(key[1:]))
            return decoded[key]

        anchor = torch.full((B, T), -1, dtype=torch.long)
        joined = torch.zeros(B, T, dtype=torch.bool)
        places, texts, groups, lone = [], [], [], []
        for i, t in torch.nonzero(rows).tolist():  # row-major: trajectory by trajectory, turn by turn
            value = text(states[i][t])
            if value is None:
                lone.append((i, t))
            else:
                places.append((i, t))
                texts.append(value)
                groups.append(int(group[i]))
        clusters = similarity_clusters(texts, groups, self.gigpo.similarity_threshold).tolist()
        first: dict[int, str] = {}
        for (i, t), value, cluster in zip(places, texts, clusters):
            anchor[i, t] = cluster
            joined[i, t] = first.setdefault(cluster, value) != value
        for k, (i, t) in enumerate(lone, start=max(clusters, default=-1) + 1):
            anchor[i, t] = k
        return anchor, joined
