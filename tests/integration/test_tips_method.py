"""TIPS (igpo.integration.methods.tips) through the trainer's advantage pipeline: its potentials are scored on the
reference policy's weights, never the actor's (changing the actor's weights changes IGPO's gains and not TIPS's
rewards), each scored tool turn earns c·(γ·Φ_after − Φ_before) and the outcome −c·Φ_last, and what TIPS cannot do is
refused at start-up with the reason."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

import method_harness as harness
from test_igpo_actor_scoring import PROMPT, SCORED_ROWS, UIDS, RecordingScorer, batch

from igpo.config import ConfigError
from igpo.integration.methods import method_for
from igpo.integration.methods.tips import TIPSMethod


def potential(trajectory: list[int], boundary: int, weights: float) -> float:
    """A made-up answer log-probability under weights ``weights`` (values exact in float64)."""
    return -0.125 * ((sum(trajectory[:boundary]) * weights) % 17) - 0.25 * (boundary % 3)


class TwoWeightsScorer(RecordingScorer):
    """``ActorScorer``'s interface with two sets of weights: the actor's (``score_answers``) and the reference
    policy's (``score_reference_answers``), each a made-up function of the context."""

    def __init__(self, tokenizer, actor: float, reference: float):
        super().__init__(tokenizer)
        self.actor, self.reference = actor, reference
        self.reference_requests: list[dict] = []

    def _score(self, requests, weights):
        return {r: [[potential(q["trajectory_ids"], b, weights)] * len(q["probes"]) for b in q["boundaries"]]
                for r, q in enumerate(requests)}

    def score_answers(self, requests):
        self.requests += requests
        return self._score(requests, self.actor)

    def score_reference_answers(self, requests):
        self.reference_requests += requests
        return self._score(requests, self.reference)


def run_config(estimator: str = "tips", *, use_kl_loss: bool = True, **algorithm):
    config = harness.config(estimator, igpo={"ig_tool_filter": "", **algorithm.pop("igpo", {})}, **algorithm)
    OmegaConf.update(config, "actor_rollout_ref.actor.use_kl_loss", use_kl_loss)
    return config


def step(method, scorer):
    extras, prompts, responses, mask, scores = batch()
    fields = {"prompts": prompts, "responses": responses, "reward_model": [{"ground_truth": "Paris"} for _ in UIDS]}
    return harness.advantage_step(method, harness.records(extras), UIDS, mask, scores, scorer=scorer, fields=fields,
                                  infra_failure=harness.default_policy(method), step=1, total_steps=10)


def test_the_potentials_come_from_the_reference_weights_not_the_actors(tiny_tokenizer):
    tips, igpo = {}, {}
    for actor in (1.0, 3.0):  # the actor trained on, the reference did not
        scorer = TwoWeightsScorer(tiny_tokenizer, actor=actor, reference=1.0)
        tips[actor] = step(method_for(run_config("tips")), scorer)
        assert scorer.requests == [] and len(scorer.reference_requests) == len(SCORED_ROWS)
        scorer = TwoWeightsScorer(tiny_tokenizer, actor=actor, reference=1.0)
        igpo[actor] = step(method_for(run_config("igpo", igpo={"score_on": "actor"})), scorer)
        assert scorer.reference_requests == [] and len(scorer.requests) == len(SCORED_ROWS)
    assert torch.equal(tips[1.0].advantages, tips[3.0].advantages)
    assert torch.equal(tips[1.0].terms["teacher_potential"].nan_to_num(), tips[3.0].terms["teacher_potential"]
                       .nan_to_num())
    assert not torch.equal(igpo[1.0].terms["answer_logprob"].nan_to_num(), igpo[3.0].terms["answer_logprob"]
                           .nan_to_num())
    assert not torch.equal(igpo[1.0].advantages, igpo[3.0].advantages)


def test_each_scored_turn_earns_the_scaled_potential_difference_and_the_outcome_minus_the_last_potential(
        tiny_tokenizer):
    extras, prompts, responses, _, _ = batch()
    method = method_for(run_config("tips"))
    assert isinstance(method, TIPSMethod) and method.gamma == 0.95
    assert method.igpo.advantage.norm_order == "after_discount"
    out = step(method, TwoWeightsScorer(tiny_tokenizer, actor=2.0, reference=1.0))
    # By hand from the records: Φ at each scored boundary, r = γΦ_{j+1} − Φ_j, c = 0.11 / mean|r|.
    raw, last = {}, {}
    for i in SCORED_ROWS:
        trajectory = PROMPT + responses[i].tolist()
        bounds = extras[i]["igpo_boundaries"]
        phi = [potential(trajectory, b, 1.0) for b in bounds]
        tool_turns = [j for j, name in enumerate(extras[i]["igpo_tool_names"][:-1]) if name is not None]
        for j in tool_turns:
            raw[i, j] = 0.95 * phi[j + 1] - phi[j]
        last[i] = phi[tool_turns[-1] + 1]
    c = 0.11 / (sum(abs(r) for r in raw.values() if abs(r) > 1e-8) / sum(abs(r) > 1e-8 for r in raw.values()))
    shaping = out.terms["shaping_reward"]
    assert {key: shaping[key].item() for key in raw} == pytest.approx({k: c * r for k, r in raw.items()}, rel=1e-6)
    assert int(torch.isfinite(shaping).sum()) == len(raw)
    shift = out.terms["outcome_shift"]
    assert {i: shift[i].item() for i in last} == pytest.approx({i: -c * phi for i, phi in last.items()}, rel=1e-12)
    assert all(shift[i].item() == 0.0 for i in range(len(UIDS)) if i not in last)
    assert out.metrics["tips/scale"] == pytest.approx(c) and out.metrics["tips/shaped_turns"] == len(raw)
    assert out.metrics["tips/reward_abs_mean"] == pytest.approx(0.11, rel=1e-6)
    assert {"tips/gamma", "tips/shaped_rows", "tips/potential_mean", "tips/terminal_shift_mean",
            "igpo/scoring_tokens"} <= set(out.metrics)


def test_terminal_none_leaves_the_outcome_and_a_fixed_scale_is_used_as_it_is(tiny_tokenizer):
    method = method_for(run_config("tips", tips={"terminal": "none", "scale_mode": "fixed", "scale": 1.0,
                                                 "gamma": 1.0}))
    out = step(method, TwoWeightsScorer(tiny_tokenizer, actor=2.0, reference=1.0))
    assert "outcome_shift" not in out.terms and out.metrics["tips/scale"] == 1.0
    extras, _, responses, _, _ = batch()
    trajectory = PROMPT + responses[0].tolist()
    phi = [potential(trajectory, b, 1.0) for b in extras[0]["igpo_boundaries"]]
    assert out.terms["shaping_reward"][0, :2].tolist() == pytest.approx([phi[1] - phi[0], phi[2] - phi[1]],
                                                                        rel=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"tips": {"teacher": "refreshed", "refresh_every": 10}}, "teacher=refreshed is not implemented"),
    ({"use_kl_loss": False}, "use_kl_loss=false: TIPS's frozen teacher is verl's reference policy"),
    ({"igpo": {"score_on": "rollout"}}, "score_on=rollout"),
    ({"lora_rank": 8}, "with LoRA"),
    ({"trainer_mode": "igpo_separate_async"}, "igpo_separate_async"),
])
def test_what_tips_cannot_do_is_refused_with_the_reason(change, message):
    change = dict(change)
    lora, mode = change.pop("lora_rank", 0), change.pop("trainer_mode", None)
    config = run_config("tips", **change)
    OmegaConf.update(config, "actor_rollout_ref.model.lora_rank", lora)
    if mode is not None:
        OmegaConf.update(config, "trainer.v1.trainer_mode", mode)
    with pytest.raises(ConfigError, match=message):
        method_for(config)


def test_the_batch_scale_is_kept_with_the_checkpoint_state(tiny_tokenizer):
    method = method_for(run_config("tips"))
    step(method, TwoWeightsScorer(tiny_tokenizer, actor=1.0, reference=1.0))
    resumed = method_for(run_config("tips"))
    resumed.load_state_dict(method.state_dict())
    assert resumed.scale == method.scale != 0.11 and math.isfinite(resumed.scale)


def worker_with(actor_module, ref_module):
    """The actor worker's scoring methods bound to an object holding an actor and (or not) a reference engine, as
    verl's ``ActorRolloutRefWorker`` holds them (``self.actor.engine``, ``self.ref.engine``): no Ray, no FSDP."""
    import types

    from igpo.integration.actor_worker import IGPOActorRolloutRefWorker as Worker

    def engine(module):
        return types.SimpleNamespace(module=module, is_param_offload_enabled=False)

    worker = types.SimpleNamespace(actor=types.SimpleNamespace(engine=engine(actor_module)), role="actor_rollout_ref",
                                   ref=None if ref_module is None else types.SimpleNamespace(engine=engine(ref_module)))
    for name in ("_score_answer_share", "_reference_engine", "_scoring_module"):
        setattr(worker, name, types.MethodType(getattr(Worker, name), worker))
    return worker, Worker


def test_the_worker_scores_the_reference_requests_on_the_reference_module(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in actor.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    probe = tiny_tokenizer.encode("Paris", add_special_tokens=False)
    requests = [{"trajectory_ids": list(range(5, 25)), "boundaries": [6, 14, 20],
                 "probes": [{"token_ids": probe, "span": [0, len(probe)]}]}]
    scoring = {"strategy": "packed", "temperature": 1.0}
    worker, Worker = worker_with(actor, reference)
    on_reference = Worker.tips_score_reference_answers(worker, requests, scoring)
    on_actor = Worker.igpo_score_answers(worker, requests, scoring)
    worker_ref, _ = worker_with(reference, None)
    expected = Worker.igpo_score_answers(worker_ref, requests, scoring)  # the reference's weights as an actor's
    assert on_reference == expected and on_reference != on_actor
    assert actor.training is False and reference.training is False
    with pytest.raises(RuntimeError, match="holds none: verl builds it here only with "
                                           "actor_rollout_ref.actor.use_kl_loss=true"):
        Worker.tips_score_reference_answers(worker_ref, requests, scoring)
