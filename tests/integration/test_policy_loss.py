"""verl's ``bypass_mode`` policy loss as our plugin registers it (igpo/integration/policy_loss.py): a micro-batch in
which the infra policy masked every token gives a zero loss instead of verl's ValueError, and any other micro-batch
gets verl's own loss and metrics."""

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos


def _config(loss_type: str, batch_tokens: int):
    # The actor's loss config as verl's engine hands it over: the global batch's token count in global_batch_info (the
    # token-mean denominator, counted over every micro-batch of the mini-batch).
    return OmegaConf.create({
        "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0,
        "tau_neg": 1.0, "global_batch_info": {"dp_size": 1, "batch_num_tokens": batch_tokens, "global_batch_size": 8},
        "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {
            "loss_type": loss_type, "rollout_is": "sequence", "rollout_is_threshold": 2.0,
            "rollout_is_batch_normalize": False, "rollout_rs": None, "rollout_rs_threshold": None}}})


def _batch(mask_rows: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(4, 6, generator=generator) * 3
    current = (rollout + torch.randn(4, 6, generator=generator) * 0.1).requires_grad_()
    advantages = torch.randn(4, 6, generator=generator)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    for row in mask_rows:
        mask[row, : 2 + row] = True
    return rollout, current, advantages, mask


def test_the_plugin_registers_the_guarded_loss_under_verls_name():
    loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
    assert getattr(loss_fn, "igpo_guarded", False), "import verl should have loaded igpo.plugin's hook"
    assert loss_fn.verl_loss.__module__ == "verl.trainer.ppo.core_algos"


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_a_micro_batch_without_a_valid_token_gives_a_zero_loss(loss_type):
    loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
    rollout, current, advantages, mask = _batch(mask_rows=[])
    config = _config(loss_type, batch_tokens=12)  # the other micro-batches of the mini-batch hold 12 tokens
    with pytest.raises(ValueError, match="at least one valid token"):  # what verl's own function does
        loss_fn.verl_loss(old_log_prob=rollout, log_prob=current, advantages=advantages, response_mask=mask,
                          loss_agg_mode="token-mean", config=config)
    for agg in ("token-mean", "seq-mean-token-sum", "token-sum"):
        loss, metrics = loss_fn(old_log_prob=rollout, log_prob=current, advantages=advantages, response_mask=mask,
                                loss_agg_mode=agg, config=config)
        assert float(loss.detach()) == 0.0, (agg, loss)
        assert not any(name.startswith("rollout_corr/") for name in metrics)  # nothing to measure
        current.grad = None
        loss.backward()
        assert current.grad is not None and torch.count_nonzero(current.grad) == 0


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_a_micro_batch_with_valid_tokens_gets_verls_loss_unchanged(loss_type):
    loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
    rollout, current, advantages, mask = _batch(mask_rows=[0, 2])
    config = _config(loss_type, batch_tokens=int(mask.sum()))
    ours, our_metrics = loss_fn(old_log_prob=rollout, log_prob=current, advantages=advantages, response_mask=mask,
                                loss_agg_mode="token-mean", config=config)
    verls, verl_metrics = loss_fn.verl_loss(old_log_prob=rollout, log_prob=current, advantages=advantages,
                                            response_mask=mask, loss_agg_mode="token-mean", config=config)
    assert float(ours.detach()) != 0.0 and torch.equal(ours, verls)
    assert our_metrics == verl_metrics and any(name.startswith("rollout_corr/") for name in our_metrics)
