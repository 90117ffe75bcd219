"""verl's rollout correction (decoupled mode) with turn-level advantages: a known mismatch between the rollout's and
the actor's log-probabilities is injected, and the importance weights, the rejected tokens and what the actor's
policy loss then trains are checked against values computed here by hand (plain arithmetic, not verl's functions).

Four trajectories of one prompt, IGPO's three turns each (tokens 0-2, 6-7, 10-11; the observations 3-5 and 8-9 are
masked): 7 loss tokens a row. The actor's old log-probability of every loss token is the rollout's plus
``log r = DELTA[row]`` on the tokens ``TOUCHED[row]``:

    row 0: log r = 0 everywhere                     (no mismatch)
    row 1: log r = ln 3 on token 0 only             (one token three times likelier under the actor)
    row 2: log r = -1 on every loss token           (the actor finds the whole trajectory unlikely)
    row 3: log r = +0.5 on every loss token
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPActorConfig
from verl.workers.utils.padding import response_to_nested

import method_harness as harness
from igpo.config import ConfigError, check_rollout_correction
from igpo.integration.pipeline import advantage_step
from igpo.integration.rollout_correction import decoupled_section
from igpo.integration.trainer import step_fields
from igpo.launch.launch_plan import plan_off_policy_correction

TURN_TOKENS = [(0, 3), (6, 8), (10, 12)]
LOSS_TOKENS = [t for start, end in TURN_TOKENS for t in range(start, end)]  # 7 of 12
L = 12
LN3 = math.log(3.0)
DELTA = [0.0, LN3, -1.0, 0.5]
TOUCHED = [LOSS_TOKENS, [0], LOSS_TOKENS, LOSS_TOKENS]


def log_ratio(row: int, token: int) -> float:
    return DELTA[row] if token in TOUCHED[row] else 0.0


def step(infra_row: int | None = None):
    """Records, uids, stored mask, scores and the two log-probability fields of the four trajectories."""
    extras = []
    for row in range(4):
        status = ["ok", "ok", "answer"]
        if row == infra_row:
            status[0] = "infra_error"  # its first search timed out: the infra policy masks the trajectory
        extras.append({"igpo_num_turns": 3, "igpo_turn_ends": [2, 7, 11], "igpo_tool_names": ["search", "search", None],
                       "igpo_tool_status": status, "igpo_turn_format_ok": [True, True, True],
                       "igpo_answer_logprobs": [[-3.0], [-2.0 - row * 0.5], [-1.0]],
                       "igpo_answer_seen": [False, False, False]})
    mask = torch.zeros(4, L, dtype=torch.bool)
    for start, end in TURN_TOKENS:
        mask[:, start:end] = True
    scores = torch.zeros(4, L)
    scores[:, L - 1] = torch.tensor([1.0, 0.0, 0.5, 1.0])
    rollout = -1.0 - 0.1 * torch.arange(4 * L, dtype=torch.float32).reshape(4, L) / L
    old = rollout + torch.tensor([[log_ratio(r, t) for t in range(L)] for r in range(4)])
    return extras, ["q0"] * 4, mask, scores, {"old_log_probs": old, "rollout_log_probs": rollout}


def run(correction: dict | None, infra_row: int | None = None):
    extras, uids, mask, scores, fields = step(infra_row)
    method = harness.igpo_method()
    section = None if correction is None else decoupled_section({"rollout_correction": correction})
    out = advantage_step(method, harness.records(extras), uids, mask, scores, infra_failure="mask_trajectory",
                         fields=fields, step=1, total_steps=10, rollout_correction=section)
    return out, mask, fields


def hand_weights(level: str, threshold: float, lower: float | None = None, rows=range(4)) -> torch.Tensor:
    """verl's weights by hand: w = r (token) or prod r over the row's loss tokens (sequence); TIS clips at the
    threshold, IcePop (a lower bound given) zeroes weights outside [lower, threshold]; 0 off the loss tokens."""
    weights = torch.zeros(4, L)
    for row in rows:
        row_weight = math.exp(sum(log_ratio(row, t) for t in LOSS_TOKENS))
        for t in LOSS_TOKENS:
            w = math.exp(log_ratio(row, t)) if level == "token" else row_weight
            if lower is None:
                w = min(w, threshold)
            elif not lower <= w <= threshold:
                w = 0.0
            weights[row, t] = w
    return weights


def loss_gradient(out, mask, fields) -> tuple[torch.Tensor, torch.Tensor]:
    """What the actor's update does with the written-back fields: verl's policy loss (vanilla PPO clip, token-mean)
    on the fields as the actor reads them from TransferQueue (nested, then padded), at log-probabilities equal to the
    old ones (ratio 1); returns d loss / d log-prob [B, L] and the loss mask the denominator counts."""
    nested_mask = torch.nested.as_nested_tensor(list(mask.long()), layout=torch.jagged)  # as the agent loop stored it
    stored = {"response_mask": nested_mask, "loss_mask": nested_mask,
              "old_log_probs": response_to_nested(fields["old_log_probs"], nested_mask)}
    written = step_fields(out, mask.long(), nested_mask)
    data = TensorDict({**stored, **written}, batch_size=[4]).to_padded_tensor()
    config = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1)
    # The engine counts the token-mean's denominator from loss_mask (verl's FSDP engine: batch_num_tokens).
    config.global_batch_info.update(dp_size=1, batch_num_tokens=data["loss_mask"].sum(), global_batch_size=None,
                                    loss_scale_factor=None)
    log_prob = data["old_log_probs"].clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=data["old_log_probs"], log_prob=log_prob, advantages=data["advantages"],
        response_mask=data["response_mask"].bool(), loss_agg_mode="token-mean", config=config,
        rollout_is_weights=data.get("rollout_is_weights", None))
    loss.backward()
    return log_prob.grad, data["loss_mask"].bool()


def test_token_tis_with_geometric_sequence_rejection_weights_and_rejects_as_computed_by_hand():
    """The issue's setting: rollout_is=token (TIS at 2.0), rollout_rs=seq_mean_k1 with bounds 0.5_2.0."""
    out, mask, fields = run({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                             "rollout_rs_threshold": "0.5_2.0", "bypass_mode": False})
    # Weights: r clipped at 2: row 1's first token 3 -> 2; row 2 e^-1 = 0.3679; row 3 e^0.5 = 1.6487.
    expected = hand_weights("token", 2.0)
    assert expected[1, 0] == 2.0 and abs(expected[2, 0] - 0.36788) < 1e-5 and abs(expected[3, 0] - 1.64872) < 1e-5
    assert torch.allclose(out.correction.rollout_is_weights, expected, atol=1e-6)
    # seq_mean_k1 keeps a row when ln 0.5 <= mean over its loss tokens of -log r <= ln 2 (the geometric mean of r in
    # [0.5, 2]): row 0: 0; row 1: -ln3/7 = -0.157; row 2: +1 > 0.693 -> rejected; row 3: -0.5.
    means = [-sum(log_ratio(row, t) for t in LOSS_TOKENS) / 7 for row in range(4)]
    kept = [math.log(0.5) <= m <= math.log(2.0) for m in means]
    assert kept == [True, True, False, True]
    assert torch.equal(out.correction.response_mask, mask & torch.tensor(kept)[:, None])
    assert torch.equal(out.loss_mask, out.correction.response_mask) and not out.loss_mask[2].any()
    # verl's metrics, as verl names them: 1 of 4 sequences and 7 of 28 tokens rejected; kl = mean(log p_rollout -
    # log p_old) over the 28 tokens = -(ln 3 - 7 + 3.5) / 28.
    metrics = out.metrics
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.25)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(7 / 28)
    assert metrics["rollout_corr/kl"] == pytest.approx(-(LN3 - 7.0 + 3.5) / 28, abs=1e-6)
    # The rejected trajectory still counts in its group's statistics (as in verl's GRPO): the advantages are those of
    # the uncorrected step.
    plain, _, _ = run(None)
    assert plain.correction is None and not any(name.startswith("rollout_corr/") for name in plain.metrics)
    assert torch.equal(out.advantages, plain.advantages)
    # What the actor trains: at ratio 1, d loss / d log p = -A * w * m / N, N = the stored loss tokens (28: verl keeps
    # the rejected tokens in the token-mean's denominator); the rejected row gets no gradient.
    grad, loss_mask = loss_gradient(out, mask, fields)
    assert loss_mask.sum() == 28
    m = torch.tensor(kept)[:, None] & mask
    assert torch.allclose(grad, -out.advantages * expected * m / 28, atol=1e-7)
    assert grad[2].abs().max() == 0 and grad[1, 0] != 0
    assert grad[1, 0] == pytest.approx(float(-out.advantages[1, 0]) * 2.0 / 28)


def test_sequence_tis_with_token_rejection():
    """rollout_is=sequence (TIS at 2.0) and rollout_rs=token_k1 with bounds 0.5_2.0: a token is rejected when its
    ratio leaves [0.5, 2] (row 1's first token, 3; all of row 2's, e^-1); the sequence weight is the product of the
    row's ratios clipped at 2 (row 1: 3 -> 2; row 2: e^-7 = 0.000912; row 3: e^3.5 = 33.1 -> 2)."""
    out, mask, fields = run({"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
                             "rollout_rs_threshold": "0.5_2.0", "bypass_mode": False})
    expected = hand_weights("sequence", 2.0)
    assert abs(expected[2, 0] - math.exp(-7)) < 1e-9 and expected[3, 0] == 2.0 and expected[1, 0] == 2.0
    assert torch.allclose(out.correction.rollout_is_weights, expected, rtol=1e-5, atol=1e-8)
    kept = torch.tensor([[0.5 <= math.exp(log_ratio(r, t)) <= 2.0 for t in range(L)] for r in range(4)]) & mask
    assert not kept[1, 0] and kept[1, 1] and not kept[2].any() and torch.equal(kept[3], mask[3])
    assert torch.equal(out.correction.response_mask, kept)
    grad, _ = loss_gradient(out, mask, fields)
    assert torch.allclose(grad, -out.advantages * expected * kept / 28, atol=1e-7)
    assert grad[2].abs().max() == 0 and grad[1, 0] == 0


def test_icepop_with_batch_normalisation_leaves_out_what_the_infra_policy_masked():
    """IcePop (rollout_is_threshold '0.5_2.0': weights outside [0.5, 2] are zeroed, the mask is kept) normalised to
    mean 1 over the batch's loss tokens. Row 2 first as an ordinary trajectory, then masked by the infra policy (its
    first search timed out): a masked trajectory is neither weighed in the normalisation nor measured."""
    correction = {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0", "rollout_is_batch_normalize": True,
                  "bypass_mode": False}
    out, mask, fields = run(correction)
    icepop = hand_weights("token", 2.0, lower=0.5)
    assert icepop[1, 0] == 0.0 and icepop[2].abs().max() == 0 and abs(icepop[3, 0] - 1.64872) < 1e-5
    mean = (7 * 1.0 + 6 * 1.0 + 7 * 0.0 + 7 * math.exp(0.5)) / 28  # 0.8765
    assert torch.allclose(out.correction.rollout_is_weights, icepop / mean, atol=1e-6)
    assert out.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert torch.equal(out.correction.response_mask, mask)  # IcePop rejects nothing from the mask
    grad, _ = loss_gradient(out, mask, fields)
    assert torch.allclose(grad, -out.advantages * icepop / mean * mask / 28, atol=1e-7)

    out, mask, _ = run(correction, infra_row=2)
    assert out.metrics["igpo/infra_masked_trajectories"] == 1.0
    mean = (7 * 1.0 + 6 * 1.0 + 7 * math.exp(0.5)) / 21
    assert out.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert torch.allclose(out.correction.rollout_is_weights, hand_weights("token", 2.0, 0.5, rows=(0, 1, 3)) / mean,
                          atol=1e-6)
    # kl over rows 0, 1, 3 only: -(ln 3 + 3.5) / 21
    assert out.metrics["rollout_corr/kl"] == pytest.approx(-(LN3 + 3.5) / 21, abs=1e-6)
    assert not out.loss_mask[2].any()


def test_bypass_mode_leaves_the_advantage_step_alone():
    """In bypass mode verl corrects in the actor's loss: nothing is applied or measured at the advantage step."""
    assert decoupled_section({"rollout_correction": {"rollout_is": "token", "bypass_mode": True}}) is None
    assert decoupled_section({}) is None
    out, _, _ = run({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2.0", "bypass_mode": True})
    assert out.correction is None and not any(name.startswith("rollout_corr/") for name in out.metrics)


def _run_config(mode: str, **correction):
    return OmegaConf.create({
        "algorithm": {"rollout_correction": {"rollout_is": None, "rollout_is_threshold": 2.0,
                                             "rollout_is_batch_normalize": False, "rollout_rs": None,
                                             "rollout_rs_threshold": None, "bypass_mode": False,
                                             "loss_type": "ppo_clip", **correction}},
        "actor_rollout_ref": {"actor": {"policy_loss": {"_target_": "verl.workers.config.PolicyLossConfig",
                                                        "loss_mode": "vanilla"}},
                              "rollout": {"calculate_log_probs": True}},
        "trainer": {"v1": {"trainer_mode": mode}}})


@pytest.mark.parametrize("mode", ["igpo_sync", "igpo_colocate_async", "igpo_separate_async"])
def test_bypass_mode_hands_the_section_to_the_actors_loss_in_every_mode(mode):
    """verl's v1 trainer never copies algorithm.rollout_correction to the actor, whose bypass_mode loss reads its own
    section (verl's defaults otherwise: rollout_rs none, so a configured rejection would be dropped). The plan copies
    it, as verl's legacy trainer does; a run that skips the plan is refused at the trainer's start."""
    preset = {"rollout_is": "sequence", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001",
              "bypass_mode": True, "loss_type": "reinforce"}  # verl's bypass_pg_geo_rs_seq_tis
    unplanned = _run_config(mode, **preset)
    with pytest.raises(ConfigError, match="loss_mode=vanilla: in bypass mode verl applies the correction in its "
                                          "bypass_mode loss"):
        check_rollout_correction(unplanned)
    config = _run_config(mode, **preset)
    notes = plan_off_policy_correction(config)
    check_rollout_correction(config)
    policy_loss = omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    assert policy_loss.loss_mode == "bypass_mode"
    assert isinstance(policy_loss.rollout_correction, RolloutCorrectionConfig)
    assert (policy_loss.rollout_correction.rollout_rs, policy_loss.rollout_correction.rollout_rs_threshold,
            policy_loss.rollout_correction.loss_type) == ("seq_mean_k1", "0.999_1.001", "reinforce")
    assert any("bypass mode" in note and "in the actor's loss" in note for note in notes), notes
    # Decoupled: the section stays at the advantage step, whatever the mode (no bypass default once configured).
    config = _run_config(mode, rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")
    notes = plan_off_policy_correction(config)
    assert not config.algorithm.rollout_correction.bypass_mode
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert any(note.startswith("rollout correction, decoupled mode") for note in notes), notes
