"""igpo/eval/turn_kinds.py: what each turn of a chain question did, from hand-built turn records."""

import pytest

from igpo.agent.records import TurnRecord
from igpo.eval.turn_kinds import chain_hops, turn_kinds


def record(names, status, right):
    return TurnRecord(turn_ends=list(range(len(names))), tool_names=names, tool_status=status, hop_right=right)


def test_chain_hops_counts_the_mentor_links():
    assert chain_hops("Mentor of the mentor of @Briornquoth") == 2
    assert chain_hops("Mentor of the mentor of the mentor of @X") == 3
    assert chain_hops("Employer of @X") == 0


def test_each_turn_is_told_by_what_it_did():
    # Two-hop chain: a wrong search, the first hop, a failed call, the answer-revealing hop, a repeat, the answer.
    r = record(["search"] * 5 + [None], ["ok", "ok", "no_results", "ok", "ok", "answer"],
               [False, True, False, True, False, False])
    assert turn_kinds(r, 2) == ["wrong_call", "next_hop", "failed_call", "answer_hop", "after_chain", "answer"]
    # Three-hop chain cut off after its second hop: the second hop is not the answer's.
    r = record(["search", "search", None], ["ok", "ok", "none"], [True, True, False])
    assert turn_kinds(r, 3) == ["next_hop", "next_hop", "other"]


def test_a_record_without_hop_marks_is_refused():
    with pytest.raises(ValueError, match="only chain questions"):
        turn_kinds(record(["search"], ["ok"], []), 2)
    with pytest.raises(ValueError, match="0 chain targets"):
        turn_kinds(record(["search"], ["ok"], [True]), 0)
