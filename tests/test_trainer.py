"""Pieces of the igpo_sync trainer mode that need no Ray: reading the agent loop's records, sharding scoring work."""

import math

import pytest

import torch

from igpo.actor_worker import shard_requests
from igpo.trainer import _turn_tensors


def test_turn_tensors_reads_records_and_drops_turns_cut_by_the_response_length():
    extras = [
        {"igpo_num_turns": 3, "igpo_turn_ends": [4, 9, 15], "igpo_turn_format_ok": [True, False, True],
         "igpo_tool_names": ["search", "visit", None], "igpo_answer_logprobs": [[-3.0], [-2.0], [-1.5]]},
        # Its last turn ends at token 30, beyond a response of 20 tokens: only two turns remain.
        {"igpo_num_turns": 3, "igpo_turn_ends": [5, 12, 30], "igpo_turn_format_ok": [True, True, True],
         "igpo_tool_names": ["search", "search", None], "igpo_answer_logprobs": [[-4.0], None, [-1.0]]},
        {},  # a padding row without records
    ]
    num_turns, ends, format_ok, tools, lp = _turn_tensors(extras, length=20, alias_mode="first")
    assert num_turns.tolist() == [3, 2, 0]
    assert ends[0].tolist() == [4, 9, 15] and ends[1, :2].tolist() == [5, 12]
    assert format_ok[0].tolist() == [True, False, True]
    assert tools == [["search", "visit", None], ["search", "search"], []]
    assert lp[0].tolist() == [-3.0, -2.0, -1.5]
    assert lp[1, 0].item() == -4.0 and math.isnan(lp[1, 1].item())
    assert torch.isnan(lp[2]).all()


def test_turn_tensors_reduces_aliases_by_mode():
    extras = [{"igpo_num_turns": 2, "igpo_turn_ends": [3, 8], "igpo_answer_logprobs": [[-3.0, -1.0], [-2.0, -0.5]]}]
    _, _, _, _, best = _turn_tensors(extras, length=10, alias_mode="max")
    _, _, _, _, first = _turn_tensors(extras, length=10, alias_mode="first")
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


def _trainer(step: int = 1, total: int = 10, **igpo):
    from omegaconf import OmegaConf

    from igpo.config import IGPOConfig
    from igpo.core.advantage import WarmupGate
    from igpo.trainer import IGPOTrainerSync

    algorithm = OmegaConf.create({"adv_estimator": "igpo", "gamma": 0.95, "norm_adv_by_std_in_grpo": True,
                                  "igpo": {"score_on": "rollout", "ig_tool_filter": "", **igpo}})
    trainer = object.__new__(IGPOTrainerSync)  # only what _igpo_advantage reads; no Ray, no workers
    trainer.igpo = IGPOConfig.from_algorithm(algorithm)
    trainer.warmup = WarmupGate(trainer.igpo.ig_warmup_threshold, trainer.igpo.ig_warmup_ema_alpha)
    trainer.global_steps, trainer.total_training_steps = step, total
    return trainer


def _records(logprobs, format_ok=((True, True, True), (True, True, True)), seen=((False, False, False),) * 2,
             outcome=(0.5, 0.5)):
    extras = [{"igpo_num_turns": 3, "igpo_turn_ends": [2, 7, 11], "igpo_tool_names": ["search", "search", None],
               "igpo_turn_format_ok": list(ok), "igpo_answer_logprobs": [[v] for v in lp], "igpo_answer_seen": list(s)}
              for lp, ok, s in zip(logprobs, format_ok, seen)]
    mask = torch.zeros(2, 12, dtype=torch.bool)
    for start, end in TURN_TOKENS:
        mask[:, start:end] = True
    scores = torch.zeros(2, 12)
    scores[:, 11] = torch.tensor(outcome)
    return extras, ["q0", "q0"], mask, scores


def _run(trainer, records):
    metrics = {}
    adv, _ = trainer._igpo_advantage(*records, metrics, score_on_actor=None)
    return adv, metrics


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


def test_unknown_estimator_is_a_configuration_error():
    from igpo.launch_plan import ConfigError, check_estimator

    check_estimator("grpo")
    check_estimator("igpo")
    check_estimator("infopo")
    with pytest.raises(ConfigError, match="adv_estimator='arpo' is not a registered"):
        check_estimator("arpo")


def test_igpo_state_is_complete_before_verl_points_resume_at_the_step(tmp_path, monkeypatch):
    import json

    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from igpo.trainer import STATE_FILE

    trainer = _trainer()
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}})
    trainer.global_steps = 3
    trainer.warmup.update(0.25)
    seen = {}

    def verl_save(self):  # verl writes latest_checkpointed_iteration.txt last; our state must already be there
        path = tmp_path / "global_step_3" / STATE_FILE
        seen["state"] = json.loads(path.read_text()) if path.is_file() else None
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")

    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", verl_save)
    trainer._save_checkpoint()
    assert seen["state"] == {"warmup_gate": trainer.warmup.state_dict()}
    assert not list(tmp_path.rglob("*.tmp"))
