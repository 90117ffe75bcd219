"""Pieces of the igpo_sync trainer mode that need no Ray: reading the agent loop's records, sharding scoring work."""

import math

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
