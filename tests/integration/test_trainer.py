"""Pieces of the igpo_sync trainer mode that need no Ray: reading the agent loop's records, sharding scoring work."""

import math
import uuid

import pytest

import torch

from igpo.integration.actor_worker import shard_requests
from igpo.core.health import HealthMonitor
from igpo.integration.infra_breaker import InfraBreaker, InfraBreakerConfig
from igpo.agent.records import TurnBatch, TurnRecord
from igpo.integration.checkpoint import CheckpointState
from igpo.integration.histograms import StepHistograms
from igpo.integration.run_control import RunControl
from igpo.integration import trainer
from verl.trainer.ppo.v1 import trainer_base

import method_harness as harness


def test_turn_tensors_reads_records_and_drops_turns_cut_by_the_response_length():
    extras = [
        {"igpo_num_turns": 3, "igpo_turn_ends": [4, 9, 15], "igpo_turn_format_ok": [True, False, True],
         "igpo_tool_names": ["search", "visit", None], "igpo_answer_logprobs": [[-3.0], [-2.0], [-1.5]]},
        # Its last turn ends at token 30, beyond a response of 20 tokens: only two turns remain.
        {"igpo_num_turns": 3, "igpo_turn_ends": [5, 12, 30], "igpo_turn_format_ok": [True, True, True],
         "igpo_tool_names": ["search", "search", None], "igpo_answer_logprobs": [[-4.0], None, [-1.0]]},
        {},  # a padding row without records
    ]
    turns = TurnBatch.from_records([TurnRecord.from_extra_fields(e) for e in extras], length=20)
    num_turns, ends, format_ok, tools = turns.num_turns, turns.turn_ends, turns.format_ok, turns.tool_names
    lp = turns.answer_logprobs("first")
    assert num_turns.tolist() == [3, 2, 0]
    assert ends[0].tolist() == [4, 9, 15] and ends[1, :2].tolist() == [5, 12]
    assert format_ok[0].tolist() == [True, False, True]
    assert tools == [["search", "visit", None], ["search", "search"], []]
    assert lp[0].tolist() == [-3.0, -2.0, -1.5]
    assert lp[1, 0].item() == -4.0 and math.isnan(lp[1, 1].item())
    assert torch.isnan(lp[2]).all()


def test_turn_tensors_reduces_aliases_by_mode():
    extras = [{"igpo_num_turns": 2, "igpo_turn_ends": [3, 8], "igpo_answer_logprobs": [[-3.0, -1.0], [-2.0, -0.5]]}]
    turns = TurnBatch.from_records([TurnRecord.from_extra_fields(e) for e in extras], length=10)
    best, first = turns.answer_logprobs("max"), turns.answer_logprobs("first")
    assert best[0].tolist() == [-1.0, -0.5] and first[0].tolist() == [-3.0, -2.0]


def test_shard_requests_gives_every_rank_the_same_number_of_forwards():
    requests = [{}] * 7
    shares = [shard_requests(requests, rank, 3) for rank in range(3)]
    assert sorted(i for mine, _ in shares for i in mine) == list(range(7))
    assert {len(mine) + padding for mine, padding in shares} == {3}
    assert shard_requests([], 0, 2) == ([], 0)


# ---- IGPOTrainerSync._igpo_advantage on fake turn records -----------------------------------------------------------
# Two trajectories of one prompt group, 12 response tokens each: tool turn 0 = tokens 0-2, observation 3-5 (masked),
# tool turn 1 = tokens 6-7, observation 8-9 (masked), final answer turn = tokens 10-11 (outcome on token 11).
TURN_TOKENS = [(0, 3), (6, 8), (10, 12)]


class _Verl:
    """verl's checkpoint hooks under the mixins (tests replace them)."""

    def _save_checkpoint(self):
        pass

    def _load_checkpoint(self):
        pass


class _Trainer(RunControl, CheckpointState, _Verl):
    """The IGPO method with the step it runs at and the infra policy, plus the trainer's run-control and checkpoint
    mixins over what they read (no Ray, no workers)."""

    def __init__(self, step: int = 1, total: int = 10, **igpo):
        self.method = harness.igpo_method(**igpo)
        self.igpo = self.method.igpo
        self.policy = harness.default_policy(self.method)
        self.global_steps, self.total_training_steps = step, total
        self.health = HealthMonitor()
        self.infra_breaker = InfraBreaker(InfraBreakerConfig())
        self.histograms = StepHistograms(enabled=False)
        self._prompts_fetched = 0  # the trainer's prompt numbering (TurnLevelTrainer._fetch_one_gen_batch)

    @property
    def warmup(self):
        return self.method.warmup


def _trainer(step: int = 1, total: int = 10, **igpo) -> _Trainer:
    return _Trainer(step, total, **igpo)


def _records(logprobs, format_ok=((True, True, True), (True, True, True)), seen=((False, False, False),) * 2,
             outcome=(0.5, 0.5)):
    extras = [{"igpo_num_turns": 3, "igpo_turn_ends": [2, 7, 11], "igpo_tool_names": ["search", "search", None],
               "igpo_tool_status": ["ok", "ok", "answer"], "igpo_turn_format_ok": list(ok), "igpo_answer_logprobs": [[v] for v in lp], "igpo_answer_seen": list(s)}
              for lp, ok, s in zip(logprobs, format_ok, seen)]
    mask = torch.zeros(2, 12, dtype=torch.bool)
    for start, end in TURN_TOKENS:
        mask[:, start:end] = True
    scores = torch.zeros(2, 12)
    scores[:, 11] = torch.tensor(outcome)
    return extras, ["q0", "q0"], mask, scores


def _run(trainer, records):
    return harness.run(trainer.method, *records, policy=trainer.policy, step=trainer.global_steps,
                       total=trainer.total_training_steps, histograms=trainer.histograms)


def _turn_values(adv, row):
    """The advantage of each turn of ``row``: one value per turn (asserted), 0 on observation tokens."""
    values = []
    for start, end in TURN_TOKENS:
        segment = adv[row, start:end]
        assert torch.allclose(segment, segment[0].expand_as(segment)), segment
        values.append(float(segment[0]))
    assert adv[row, 3:6].abs().max() == 0 and adv[row, 8:10].abs().max() == 0
    return values


def test_information_gain_is_placed_on_its_turn_and_ranks_siblings():
    # Trajectory 0 gains +1 nat per tool turn, trajectory 1 loses 0.5; same outcome.
    adv, metrics = _run(_trainer(), _records([(-3.0, -2.0, -1.0), (-3.0, -3.5, -4.0)]))
    gained, lost = _turn_values(adv, 0), _turn_values(adv, 1)
    assert gained[0] > lost[0] and gained[1] > lost[1]
    assert metrics["igpo/ig_gate_active"] == 1.0 and metrics["igpo/ig_applied"] == 4.0
    assert metrics["igpo/adv_abs_mean"] > 0


def test_the_collapse_regime_gives_malformed_turns_no_credit():
    """The ingredients of the measured collapse (results/collapse/2026-12-01-collapse.md, seed 5): after one update
    every call is
    malformed (`{"name": "search", "search", ...`), so no observation comes from a tool, every sibling has the same
    outcome (0), and the outcome advantage is zero. With ig_turns=all (the reference) the answer log-probs moved by
    the model's own broken text and our error message still rank the siblings — nonzero advantages the update trains
    on; with ig_turns=reached (default) those turns carry no IG and the step trains nothing."""
    extras, uids, mask, scores = _records([(-3.0, -2.0, -4.5), (-3.0, -3.8, -1.2)], outcome=(0.0, 0.0))
    for e in extras:
        e["igpo_tool_names"], e["igpo_tool_status"] = [None, None, None], ["malformed", "malformed", "answer"]
    noise, metrics_all = _run(_trainer(ig_turns="all"), (extras, uids, mask, scores))
    assert metrics_all["igpo/ig_applied"] == 4.0 and noise.abs().max() > 0.3
    fixed, metrics = _run(_trainer(), (extras, uids, mask, scores))
    assert metrics["igpo/ig_applied"] == 0.0 and fixed.abs().max() == 0.0
    # First calls that reached the tool are credited (and rank the siblings); the malformed second turns are not.
    for e in extras:
        e["igpo_tool_names"][0], e["igpo_tool_status"][0] = "search", "ok"
    adv, metrics = _run(_trainer(), (extras, uids, mask, scores))
    assert metrics["igpo/ig_applied"] == 2.0
    assert _turn_values(adv, 0)[0] > _turn_values(adv, 1)[0]  # +1 nat vs -0.8 nat


def test_malformed_final_answer_replaces_the_outcome_by_the_penalty():
    records = _records([(-3.0, -2.0, -1.0)] * 2, format_ok=((True, True, True), (True, True, False)))
    adv, _ = _run(_trainer(), records)
    assert _turn_values(adv, 1)[2] < _turn_values(adv, 0)[2]


def test_closed_warmup_gate_trains_on_the_outcome_only():
    # EMA of the outcome (0.5) stays below the threshold: no IG, no format penalties; GRPO on the outcome.
    records = _records([(-3.0, -2.0, -1.0), (-3.0, -3.5, -4.0)], outcome=(1.0, 0.0))
    adv, metrics = _run(_trainer(ig_warmup_threshold=0.9), records)
    assert metrics["igpo/ig_gate_active"] == 0.0
    best, worst = _turn_values(adv, 0), _turn_values(adv, 1)
    assert min(best) > 0 > max(worst)
    # No IG reaches the advantage: every turn of a trajectory carries the same outcome-only value (with the gate open,
    # the same records give different values per turn).
    assert best == pytest.approx([best[0]] * 3) and worst == pytest.approx([worst[0]] * 3)
    open_gate, _ = _run(_trainer(), records)
    assert _turn_values(open_gate, 0) != pytest.approx([_turn_values(open_gate, 0)[0]] * 3)


def test_curriculum_moves_weight_from_information_gain_to_the_outcome():
    records = _records([(-3.0, -2.0, -1.0), (-3.0, -3.5, -4.0)], outcome=(1.0, 0.0))
    curriculum = dict(use_curriculum=True, curriculum_f1_init=0.0, curriculum_f1_final=1.0, curriculum_ig_init=1.0,
                      curriculum_ig_final=0.0)
    early, m_early = _run(_trainer(step=0, **curriculum), records)
    late, m_late = _run(_trainer(step=10, **curriculum), records)
    assert (m_early["curriculum/f1_weight"], m_early["curriculum/ig_weight"]) == (0.0, 1.0)
    assert (m_late["curriculum/f1_weight"], m_late["curriculum/ig_weight"]) == (1.0, 0.0)
    assert not torch.allclose(early, late)


def test_information_gain_is_reported_by_whether_the_observation_held_the_answer():
    seen = ((True, False, False), (False, False, False))
    _, metrics = _run(_trainer(), _records([(-3.0, -1.0, -0.5), (-3.0, -3.5, -3.0)], seen=seen))
    assert metrics["igpo/ig_count_answer_seen"] == 1.0 and metrics["igpo/ig_count_answer_unseen"] == 3.0
    assert metrics["igpo/ig_mean_answer_seen"] == pytest.approx(2.0)
    assert metrics["igpo/ig_mean_answer_unseen"] == pytest.approx((0.5 - 0.5 + 0.5) / 3)


def test_information_gain_by_hop_is_split_by_correct_and_wrong_hop_when_the_samples_name_their_chain():
    extras, *rest = _records([(-3.0, -1.0, -0.5), (-3.0, -3.5, -4.0)])  # hop-2 IG: +0.5 and -0.5
    _, plain = _run(_trainer(), (extras, *rest))
    assert "igpo/ig_hop1_right_count" not in plain
    hops = ([True, True, False], [True, False, False])  # row 1: its second search was a wrong hop
    chained = [{**e, "igpo_hop_right": list(h)} for e, h in zip(extras, hops)]
    _, metrics = _run(_trainer(), (chained, *rest))
    assert (metrics["igpo/ig_hop1_right_count"], metrics["igpo/ig_hop1_wrong_count"]) == (2.0, 0.0)
    assert metrics["igpo/ig_hop2_right_mean"] == pytest.approx(0.5)
    assert metrics["igpo/ig_hop2_wrong_mean"] == pytest.approx(-0.5)


def test_unknown_estimator_is_a_configuration_error():
    from igpo.config import ConfigError
    from igpo.integration.estimator import check_estimator

    check_estimator("grpo")
    check_estimator("igpo")
    check_estimator("infopo")
    with pytest.raises(ConfigError, match="adv_estimator='arpo' is not a registered"):
        check_estimator("arpo")


def _fake_checkpointed_parts(trainer):
    """The dataloader and actor workers the checkpoint report reads, without Ray."""
    from types import SimpleNamespace

    trainer.train_dataloader = SimpleNamespace(state_dict=lambda: {"_num_yielded": 3})
    trainer.actor_rollout_wg = SimpleNamespace(
        igpo_worker_report=lambda with_digest: [{"rank": 0, "node_id": "n0", "digest": "d0"}])


def test_igpo_state_is_complete_before_verl_points_resume_at_the_step(tmp_path, monkeypatch):
    import json

    from omegaconf import OmegaConf

    from igpo.integration.checkpoint import STATE_FILE

    trainer = _trainer()
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}})
    trainer.global_steps = 3
    trainer.warmup.update(0.25)
    trainer._prompts_fetched = 12  # three steps of four prompts
    _fake_checkpointed_parts(trainer)
    seen = {}

    def verl_save(self):  # verl writes latest_checkpointed_iteration.txt last; our state must already be there
        path = tmp_path / "global_step_3" / STATE_FILE
        seen["state"] = json.loads(path.read_text()) if path.is_file() else None
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")

    monkeypatch.setattr(_Verl, "_save_checkpoint", verl_save)
    trainer._save_checkpoint()
    assert seen["state"]["warmup_gate"] == trainer.warmup.state_dict()
    assert seen["state"]["health"] == trainer.health.state()
    assert seen["state"]["infra_breaker"] == {"strikes": 0}
    assert seen["state"]["saved"]["global_step"] == 3
    assert seen["state"]["prompts_fetched"] == seen["state"]["saved"]["prompts_fetched"] == 12
    assert not list(tmp_path.rglob("*.tmp"))


def test_health_warnings_stop_the_run_with_a_checkpoint_after_the_configured_streak(monkeypatch, capsys):
    """trainer.health.stop_after=2: the second consecutive warning step saves a checkpoint (save_freq did not), flags
    training/stopped_on_health and ends verl's loop after this step; the first only warns."""
    from omegaconf import OmegaConf

    from igpo.core.health import HealthConfig

    trainer = _trainer(step=1, total=10)
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": "/ckpt", "save_freq": -1}})
    trainer.health = HealthMonitor(HealthConfig(warmup_steps=1, stop_after=2))
    saved = []
    monkeypatch.setattr(type(trainer), "_save_checkpoint", lambda self: saved.append(self.global_steps))
    for step, share in enumerate([0.5, 0.1, 0.1], start=1):
        trainer.global_steps, metrics = step, {"health/wellformed_call_share": share, "actor/entropy": 0.1}
        trainer._check_health(metrics)
    out = capsys.readouterr().out
    assert out.count("igpo: warning: well-formed tool calls fell") == 2
    assert "igpo: warning: stopping after step 3/10" in out and "/ckpt/global_step_3" in out
    assert saved == [3] and trainer.total_training_steps == 3 and metrics["training/stopped_on_health"] == 1.0
    assert metrics["health/warning_streak"] == 2.0


def test_infra_breaker_stops_the_run_with_a_checkpoint_naming_the_upstream(monkeypatch, capsys):
    """tools.infra_breaker (max_share 0.2, steps 2): two consecutive steps with more than 20% of the tool calls failing
    for infrastructure reasons save a checkpoint and end the run, naming the upstream and its failure classes; a
    step under the limit in between resets the count."""
    from omegaconf import OmegaConf

    trainer = _trainer(step=1, total=10, agent={"tool_server_url": "http://127.0.0.1:1"})
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": "/ckpt", "save_freq": -1}})
    saved = []
    monkeypatch.setattr(type(trainer), "_save_checkpoint", lambda self: saved.append(self.global_steps))
    steps = [(10, 5), (10, 1), (10, 3), (12, 6)]  # 50% (strike), 10% (reset), 30% (strike), 50% (second strike)
    for step, (calls, failed) in enumerate(steps, start=1):
        trainer.global_steps = step
        metrics = {"igpo/tool_calls": float(calls), "igpo/infra_errors": float(failed),
                   "igpo/infra_masked_trajectories": float(failed), "tools/upstream_failures/retriever/http_503": 9.0,
                   "tools/upstream_failures/retriever/timeout": 2.0}
        trainer._check_infra(metrics)
        assert ("training/stopped_on_infra_errors" in metrics) == (step == 4)
    out = capsys.readouterr().out
    assert saved == [4] and trainer.total_training_steps == 4 and metrics["igpo/infra_error_share"] == 0.5
    assert ("igpo: infra breaker: 2 consecutive steps with more than 20% of tool calls failing for infrastructure "
            "reasons (this step: 6 of 12, 6 trajectories masked); failing: retriever: http_503 x9, timeout x2 (failed "
            "requests to the upstream since the previous step, each retry counted). "
            "Stopped after step 4/10; checkpoint /ckpt/global_step_4.") in out
    # steps: 0 turns it off; without upstream failure classes the line names the tool server itself
    trainer = _trainer(step=1, total=10, agent={"tool_server_url": "http://127.0.0.1:1"})
    trainer.infra_breaker = InfraBreaker(InfraBreakerConfig(steps=0))
    for step in (1, 2, 3):
        trainer.global_steps, metrics = step, {"igpo/tool_calls": 4.0, "igpo/infra_errors": 4.0}
        trainer._check_infra(metrics)
        assert "training/stopped_on_infra_errors" not in metrics
    from igpo.integration.infra_breaker import describe_failures
    assert describe_failures({}, "http://h:1").startswith("the tool server at http://h:1 (no upstream failed")


# ---- infrastructure failures out of the learning signal (algorithm.igpo.infra_failure) ------------------------------
# Trajectory 1's first search timed out (tool status infra_error): an outage, not the policy's mistake.

def _with_outage(records, row: int = 1, turn: int = 0):
    extras, uids, mask, scores = records
    extras = [dict(e, igpo_tool_status=["ok", "ok", "answer"]) for e in extras]
    extras[row]["igpo_tool_status"][turn] = "infra_error"
    return extras, uids, mask, scores


def _solo(records, row: int):
    extras, uids, mask, scores = records
    return [extras[row]], [uids[row]], mask[row:row + 1], scores[row:row + 1]


def _three_rollouts():
    """Three rollouts of one prompt, so that a sibling's group statistics exist without the masked one."""
    extras, uids, mask, scores = _records([(-3.0, -2.0, -1.0), (-3.0, -3.5, -4.0)], outcome=(1.0, 0.0))
    third, _, _, third_scores = _records([(-3.0, -2.5, -2.0)] * 2, outcome=(0.2, 0.2))
    return (extras + third[:1], uids + ["q0"], torch.cat([mask, mask[:1]]), torch.cat([scores, third_scores[:1]]))


def test_default_policy_masks_a_failed_trajectory_out_of_loss_and_group_statistics():
    records = _with_outage(_three_rollouts())
    trainer = _trainer()
    metrics = {}
    infra = harness.infra(records[0], records[2], trainer.policy, metrics)
    assert infra.rows.tolist() == [False, True, False]
    assert not infra.loss_mask[1].any() and torch.equal(infra.loss_mask[[0, 2]], records[2][[0, 2]])
    assert metrics["igpo/infra_masked_trajectories"] == 1.0 and metrics["igpo/infra_masked_turns"] == 0.0
    adv, metrics = _run(trainer, records)
    assert adv[1].abs().max() == 0  # no advantage, and no loss token either (loss_mask above)
    # No group weight: the siblings' advantages are those of a group without the masked trajectory.
    extras, uids, mask, scores = records
    alone, _ = _run(_trainer(), ([extras[0], extras[2]], ["q0", "q0"], mask[[0, 2]], scores[[0, 2]]))
    assert torch.allclose(adv[[0, 2]], alone)
    assert metrics["igpo/infra_masked_trajectories"] == 1.0


def test_keep_policy_trains_on_the_failed_trajectory():
    records = _with_outage(_three_rollouts())
    trainer = _trainer(infra_failure="keep")
    infra = harness.infra(records[0], records[2], trainer.policy, {})
    assert not infra.changed and torch.equal(infra.loss_mask, records[2])
    adv, metrics = _run(trainer, records)
    assert adv[1].abs().max() > 0 and metrics["igpo/infra_masked_trajectories"] == 0.0
    extras, uids, mask, scores = records
    alone, _ = _run(_trainer(), ([extras[0], extras[2]], ["q0", "q0"], mask[[0, 2]], scores[[0, 2]]))
    assert not torch.allclose(adv[[0, 2]], alone)  # the failed trajectory weighs in its siblings' statistics


def test_mask_turn_drops_only_the_failed_turn():
    records = _with_outage(_records([(-3.0, -2.0, -1.0), (-3.0, -3.5, -4.0)]), row=1, turn=0)
    trainer = _trainer(infra_failure="mask_turn")
    metrics = {}
    infra = harness.infra(records[0], records[2], trainer.policy, metrics)
    assert metrics["igpo/infra_masked_turns"] == 1.0 and metrics["igpo/infra_masked_trajectories"] == 0.0
    assert not infra.loss_mask[1, 0:3].any() and infra.loss_mask[1, 6:8].all() and infra.loss_mask[1, 10:12].all()
    assert torch.equal(infra.loss_mask[0], records[2][0])
    adv, metrics = _run(trainer, records)
    assert adv[1, 0:3].abs().max() == 0 and adv[1, 6:8].abs().min() > 0  # turn 1 still carries its (discounted) IG


def test_a_failed_last_kept_turn_masks_its_trajectory_under_mask_turn():
    # The response was cut after turn 1, whose search failed: that turn carries the outcome, so the row goes.
    extras, uids, mask, scores = _with_outage(_records([(-3.0, -2.0, -1.0)] * 2), row=1, turn=1)
    extras[1]["igpo_num_turns"] = 2
    infra = harness.infra(extras, mask, _trainer(infra_failure="mask_turn").policy, {})
    assert infra.rows.tolist() == [False, True] and not infra.turns.any() and not infra.loss_mask[1].any()


def test_infra_masking_with_a_stock_estimator_is_refused_and_its_default_is_keep():
    from igpo.integration.methods.outcome import VerlEstimator
    from igpo.integration.pipeline import resolve_infra_policy

    grpo = VerlEstimator(harness.config("grpo"))
    with pytest.raises(ValueError, match="infra_failure=mask_trajectory is not supported with "
                                         "algorithm.adv_estimator=grpo.*infra_failure=keep"):
        resolve_infra_policy(grpo, "mask_trajectory", "grpo")
    assert resolve_infra_policy(grpo, None, "grpo") == "keep"
    with pytest.raises(ValueError, match="infra_failure='mask_all' is unknown"):
        _trainer(infra_failure="mask_all")


# Sampled validation repeats with the seed: verl names each validation prompt with a uuid4 and the agent loop seeds
# each request by its prompt's uid, so the trainer makes those names depend on the step and the prompt's place only.
def test_validation_draws_uids_from_the_step_and_the_prompts_place_and_only_while_validating():
    with trainer.validation_uids(3):
        drawn = [str(trainer_base.uuid.uuid4()) for _ in range(3)]
        assert uuid.uuid4() != uuid.uuid4()  # the uuid module itself is untouched
    assert drawn == ["v0000003q000000000", "v0000003q000000001", "v0000003q000000002"]
    assert all("_" not in uid for uid in drawn)  # verl splits trajectory keys on '_'
    assert trainer_base.uuid is uuid  # restored
    with trainer.validation_uids(3):
        assert str(trainer_base.uuid.uuid4()) == drawn[0]  # the same step validates on the same names again


def test_the_trainers_validate_runs_verls_inside_the_deterministic_names(monkeypatch):
    seen = []

    def verls_validate(self):
        seen.append([str(trainer_base.uuid.uuid4()) for _ in range(2)])
        return {"val-core/all/f1": 0.5}

    monkeypatch.setattr(trainer.PPOTrainerSync, "_validate", verls_validate)
    runner = object.__new__(trainer.IGPOTrainerSync)
    runner.global_steps = 10
    assert runner._validate() == {"val-core/all/f1": 0.5}
    assert seen == [["v0000010q000000000", "v0000010q000000001"]]
    assert trainer_base.uuid is uuid
