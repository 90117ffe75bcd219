"""The oracle (``algorithm.adv_estimator=oracle``; docs/methods/oracle.md): the demo world's own truth as the turn
reward, an upper reference for turn-level credit on the task, not a method (a real task has no such truth).

It is IGPO's pipeline with the information gain replaced: ``OracleMethod`` overrides only ``turn_gains``. Each tool
turn's reward is the change of the hop potential Φ (``igpo.core.oracle``: correct hops made so far, minus
``algorithm.oracle.wrong_call_penalty`` per other tool call) between the scored boundaries around it, at the
positions IGPO would give its information gain (``algorithm.igpo``'s tool filter, ``ig_compute_freq``, ``ig_turns``).
Format penalty, warm-up gate, curriculum, infrastructure masking, ARPO pool weights, normalisation and discounting
are IGPO's, read from ``algorithm.igpo``. No scoring pass runs and no prompt or response is fetched: the truth is in
the agent loop's turn records (``TurnBatch.hop_right``, written where a sample names its chain, ``hop_targets``).

Rows whose sample names no chain get no turn reward (their outcome still counts, as for a trajectory IGPO could not
score); a step in which no row names one is refused, since the oracle would silently be GRPO.
"""

from __future__ import annotations

from typing import Any

import torch

from igpo.agent.agent_config import plain_section
from igpo.core.info_gain import turn_information_gain
from igpo.core.oracle import OracleConfig, hop_potential, turn_truth
from igpo.integration.methods.base import StepBatch, register_method
from igpo.integration.methods.igpo import IGPOMethod, TurnGains


@register_method("oracle")
class OracleMethod(IGPOMethod):
    name = "oracle"
    title = "oracle (the world's truth as turn reward; an upper reference, not a method)"
    gain_term = "oracle_reward"
    default_state_anchor = "hops"  # norm_mode=state_grouped: a state is the correct hops made so far

    def __init__(self, config: Any):
        super().__init__(config)
        self.oracle = OracleConfig.from_dict(plain_section(config.algorithm.get("oracle", None)))
        # Settings of IGPO's answer scoring that the oracle cannot honour: refused, not ignored.
        self.refuse_rollout_scoring_and_prob_diff(
            "the rollout would score answer probes that the oracle never reads; set algorithm.igpo.score_on=actor and "
            "verify_scoring=false (the defaults; the oracle runs no scoring pass at all).",
            "the oracle's turn reward is a difference of hop counts, not of probabilities; remove the key "
            "(log_prob_diff, the default, takes the difference as it is).")
        self.fields = ()

    def turn_gains(self, batch: StepBatch, scorer: Any, metrics: dict) -> TurnGains:
        """Φ_s − Φ_prev at IGPO's scored boundaries, on the rows whose sample names its chain (``scorer`` unused)."""
        turns = batch.turns
        known = turns.hop_known
        if len(turns.records) and not bool(known.any()):
            raise ValueError(
                f"algorithm.adv_estimator=oracle: no trajectory of step {batch.step} names its chain (the dataset's "
                "extra_info.hop_targets, which the demo world writes: igpo/demo/world.py), so there is no truth to "
                "reward turns with and the oracle would be plain GRPO. Train on a demo-world dataset, or choose "
                "another estimator (igpo, grpo).")
        called = torch.zeros(turns.hop_right.shape, dtype=torch.bool)
        for i, names in enumerate(turns.tool_names):
            called[i, :len(names)] = torch.tensor([name is not None for name in names], dtype=torch.bool)
        unit = None
        if self.oracle.progress_unit == "chain":
            lengths = turns.hop_total if turns.hop_total is not None else torch.zeros(len(turns.records), dtype=torch.long)
            if bool((known & (lengths <= 0)).any()):
                raise ValueError("algorithm.oracle.progress_unit=chain: a trajectory names its chain but its record has "
                                 "no chain length (igpo_hop_total, written by the agent loop since this option "
                                 "exists); records from an older loop cannot use it: set progress_unit=hop.")
            unit = torch.where(known, 1.0 / lengths.clamp(min=1).double(), 1.0)
        truth = turn_truth(turns.hop_right, called, self.oracle.wrong_call_penalty, unit)
        potential = hop_potential(truth, known)
        # IGPO's reward positions, less the rows without truth (they then need no baseline and count in no statistic).
        scored = self.scored_boundaries(batch) & known[:, None]
        gain, mask, stats = turn_information_gain(potential.float(), scored, turns.num_turns, self.igpo.info_gain)
        metrics["oracle/rows_without_chain"] = float((~known).sum())
        metrics["oracle/right_hop_turns"] = float(turns.hop_right[known].sum())
        metrics["oracle/wrong_call_turns"] = float((called & ~turns.hop_right)[known].sum())
        return TurnGains(gain, mask, stats, {"hop_potential": potential})
