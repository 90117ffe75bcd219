"""trainer.trajectory_dir: each step's trajectories as JSON lines, read back into the same ids and turn records."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from igpo.agent.records import TurnRecord
from igpo.integration import trajectory_log


def _record(turn_ends, boundaries, logprobs):
    return TurnRecord(turn_ends=turn_ends, boundaries=boundaries, tool_names=["search", None][:len(turn_ends)],
                      tool_status=["ok", "answer"][:len(turn_ends)], format_ok=[True] * len(turn_ends),
                      answer_logprobs=logprobs, question="Employer of @Talven")


def test_a_step_is_written_and_read_back_exactly(tmp_path):
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([5, 6])]
    responses = [torch.tensor([10, 11, 12, 13]), torch.tensor([20, 21])]
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]])
    scores = torch.zeros(2, 5)
    scores[0, 3] = 0.5
    records = [_record([4, 6], [3, 6], [[-2.5], [-0.25]]), _record([4], [2], [None])]
    path = trajectory_log.write_step(tmp_path, 7, ["u0", "u1"], prompts, responses, mask, scores, records)
    assert path == tmp_path / "step_00007.jsonl" and not list(tmp_path.glob("*.partial"))
    rows = trajectory_log.read_step(path)
    assert [r["prompt_ids"] for r in rows] == [[5, 6, 7], [5, 6]]
    assert [r["response_ids"] for r in rows] == [[10, 11, 12, 13], [20, 21]]
    assert [r["response_mask"] for r in rows] == [[1, 1, 0, 1], [1, 1]]  # cut to the response, not the padding
    assert [r["score"] for r in rows] == [0.5, 0.0] and [r["step"] for r in rows] == [7, 7]
    assert rows[0]["record"].answer_logprobs == [[-2.5], [-0.25]] and rows[0]["record"].boundaries == [3, 6]
    assert rows[1]["record"].answer_logprobs == [None] and rows[1]["record"].question == "Employer of @Talven"


def test_mismatched_rows_are_refused(tmp_path):
    with pytest.raises(ValueError, match="step 1 has 2 uids, 1 prompts"):
        trajectory_log.write_step(tmp_path, 1, ["a", "b"], [torch.tensor([1])], [torch.tensor([2])] * 2,
                                  torch.ones(2, 1), torch.zeros(2, 1), [TurnRecord()] * 2)


def test_the_option_is_off_by_default_and_a_bad_value_is_named(tmp_path):
    assert trajectory_log.trajectory_dir(OmegaConf.create({})) is None
    assert trajectory_log.trajectory_dir(OmegaConf.create({"trajectory_dir": None})) is None
    made = trajectory_log.trajectory_dir(OmegaConf.create({"trajectory_dir": str(tmp_path / "a" / "b")}))
    assert made == tmp_path / "a" / "b" and made.is_dir()
    with pytest.raises(ValueError, match=r"trainer.trajectory_dir=3 must be a directory path"):
        trajectory_log.trajectory_dir(OmegaConf.create({"trajectory_dir": 3}))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"trainer.trajectory_dir=.*file/x: cannot create it"):
        trajectory_log.trajectory_dir(OmegaConf.create({"trajectory_dir": str(tmp_path / "file" / "x")}))


async def test_a_gigpo_step_logs_the_advantage_that_trained_and_it_is_recomputed_from_the_log(tiny_tokenizer, tmp_path):
    """GiGPO through the pipeline on the real agent loop's trajectories, logged with what trained: every turn's
    logged advantage equals GiGPO's formula on the logged inputs (score, uid, step group, invalid flag), and a log
    whose per-turn terms are shifted by one turn no longer does."""
    from test_gigpo_method import OUTCOMES, SCRIPTS, batch_of, gigpo_method, run

    import method_harness as harness
    from logged_advantage import max_gigpo_log_error

    extras, fields, mask, scores, frame = await batch_of(tiny_tokenizer, SCRIPTS, OUTCOMES)
    method = gigpo_method(mode="mean_std_norm")
    out = run(method, extras, fields, mask, scores, frame)
    applied = trajectory_log.Applied(out.advantages, out.infra.loss_mask, out.turns.num_turns, out.terms)
    path = trajectory_log.write_step(tmp_path, 1, ["p0"] * 5, fields["prompts"], fields["responses"], mask, scores,
                                     harness.records(extras), applied)
    rows = trajectory_log.read_step(path)
    assert [len(r["turn_spans"]) for r in rows] == [2, 2, 2, 1, 3]
    # Every trained token is in exactly one run, and no other token is.
    for i, row in enumerate(rows):
        covered = [v is not None for v in trajectory_log.token_advantages(row)]
        assert covered == mask[i, :len(row["response_ids"])].tolist()
    assert max_gigpo_log_error(rows, method.gigpo) < 1e-9
    assert {r["terms"]["step_group"][0] for r in rows} == {0.0}  # every first turn: the question's group

    def shifted(row):
        terms = {k: (v[1:] + v[:1] if isinstance(v, list) else v) for k, v in row["terms"].items()}
        return {**row, "terms": terms}

    assert max_gigpo_log_error([shifted(r) for r in rows], method.gigpo) > 1e-3
    spans_shifted = [{**r, "turn_spans": r["turn_spans"][1:] + r["turn_spans"][:1]} for r in rows]
    assert max_gigpo_log_error(spans_shifted, method.gigpo) > 1e-3


def test_advantage_runs_cover_the_mask_and_split_on_value_and_gap():
    values = torch.tensor([0.5, 0.5, 9.0, 0.5, -1.0, -1.0, 2.0, 2.0])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert trajectory_log.advantage_runs(values, mask) == [[0, 2, 0.5], [3, 4, 0.5], [4, 6, -1.0], [7, 8, 2.0]]
    assert trajectory_log.advantage_runs(values, torch.zeros(8, dtype=torch.bool)) == []


def test_a_term_of_another_shape_is_refused(tmp_path):
    applied = trajectory_log.Applied(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([1]),
                                     {"bad": torch.zeros(1, 1, 1)})
    with pytest.raises(ValueError, match=r"term 'bad' is \(1, 1, 1\)"):
        trajectory_log.write_step(tmp_path, 1, ["u"], [torch.tensor([1])], [torch.tensor([2, 3])],
                                  torch.ones(1, 2), torch.zeros(1, 2), [_record([1], [1], [None])], applied)
