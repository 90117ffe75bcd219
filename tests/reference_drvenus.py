"""Slow loop reference of the DR-Venus training signal from turn records, written from its code (igpo.md §1.3-§2,
RL/verl/trainer/ppo/ray_trainer.py, RL/verl/utils/reward_score/info_gain.py) for tests/test_reference_fidelity.py.

One trajectory at a time, in the reference's own representation: a list of IG entries (float or None) per turn, the
format penalty written INTO that list, a dense token reward row with 0.0 encoded as 1e-10, every response token in
the estimator's mask, and the policy loss masked to the assistant's tokens afterwards. Not part of the package.
"""

from __future__ import annotations

import torch

from reference_advantage import reference_advantage, reference_info_gain


class ReferenceGate:
    """The reference's warm-up gate and curriculum hand-off (ray_trainer.py): decide from the EMA of earlier steps,
    then fold in this step's mean outcome; the EMA starts at the first observed mean."""

    def __init__(self, threshold: float, alpha: float):
        self.threshold, self.alpha, self.ema, self.graduated = threshold, alpha, None, False

    def step(self, outcomes: list[float]) -> bool:
        if self.threshold <= 0:
            active = True
        else:
            if not self.graduated and self.ema is not None and self.ema >= self.threshold:
                self.graduated = True
            active = self.graduated
            mean = sum(outcomes) / len(outcomes)
            self.ema = mean if self.ema is None else self.alpha * mean + (1 - self.alpha) * self.ema
        return active


def reference_step(records, length, *, tool_filter=("visit",), ig_active=True, penalty_scale=1.0,
                   curriculum=(1.0, 1.0), gamma=0.95, norm_mode="scaled_separate"):
    """Advantages [B, L] (float64, 0 outside each row's loss mask) of one step.

    ``records``: per trajectory a dict with ``group``, ``logprobs`` (one per turn, NaN = not scored / failed),
    ``tools`` (tool per turn, None for the answer turn), ``format_ok`` (per turn), ``ends`` (token of each turn's
    end), ``outcome`` (the reward function's score), ``loss_mask`` (list of 0/1 over the response), ``valid`` (number
    of response tokens).
    """
    B = len(records)
    rewards = torch.zeros(B, length, dtype=torch.float64)
    valid = torch.zeros(B, length, dtype=torch.bool)
    loss = torch.zeros(B, length, dtype=torch.float64)
    for i, rec in enumerate(records):
        n = len(rec["ends"])
        valid[i, :rec["valid"]] = True
        loss[i, :len(rec["loss_mask"])] = torch.tensor(rec["loss_mask"], dtype=torch.float64)
        outcome = rec["outcome"]
        ig = [None] * (n - 1)
        if ig_active:
            scored = [s == 0 or (rec["tools"][s - 1] or "").lower() in tool_filter for s in range(n)]
            # A NaN log-prob is a failed boundary: no IG at all for a failed baseline, IG 0.0 at a later one.
            ig = reference_info_gain(rec["logprobs"], scored, n, "log_prob_diff")
            for j in range(n - 1):  # the format penalty overrides the IG entry, also where it was None
                if not rec["format_ok"][j]:
                    ig[j] = -1.0 * penalty_scale
            if not rec["format_ok"][n - 1]:
                outcome = -1.0 * penalty_scale
        for j, value in enumerate(ig):
            if value is None:
                continue
            rewards[i, rec["ends"][j]] = 1e-10 if value == 0.0 else value
        rewards[i, rec["valid"] - 1] = outcome
    # grpo_info_gain's masks from values (§2.1), with every response token in the mask.
    last = valid.long().cumsum(1).argmax(1)
    F = torch.zeros_like(valid)
    F[torch.arange(B), last] = valid.any(1)
    I = valid & ~F & (rewards != 0)
    group = torch.tensor([rec["group"] for rec in records])
    w_f1, w_ig = curriculum
    # The curriculum multiplies the normalized rewards (§2.4), which the loop reference's weights do.
    adv = reference_advantage(rewards, F, I, valid, group, norm_mode=norm_mode, gamma=gamma, outcome_weight=w_f1,
                              ig_weight_schedule=w_ig)
    return adv * loss
