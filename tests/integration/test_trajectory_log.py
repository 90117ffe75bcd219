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
