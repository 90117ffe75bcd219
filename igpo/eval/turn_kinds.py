"""What each turn of a chain question did, from its turn record: the classes the per-turn tables of a comparison
are split by (``scripts/experiments/summarize_turn_credit.py``).

A chain question of the demo world ("Mentor of the mentor of @X", ``demo.task=chain``) names its chain's entities in
``extra_info.hop_targets``: one per "mentor of", the asked person first. The agent loop marks each turn that made the
chain's next correct hop (``TurnRecord.hop_right``: a tool call that returned results and named the next entity not
reached yet). From that and the turn's tool status, every turn is one of:

    next_hop      a correct hop that is not the chain's last (it finds the next entity)
    answer_hop    the chain's last correct hop: its passage names the answer
    wrong_call    a tool call, before the chain is complete, that did not make the next hop
    after_chain   a tool call after the chain was complete (redundant: the answer was already shown)
    failed_call   a tool call that returned no results or failed
    answer        the answer turn
    other         a turn with no parsable call or answer (malformed, cut off)

"wrong" in the trainer's ``hop/call<k>_wrong`` metrics mixes ``wrong_call`` with ``after_chain`` and
``failed_call``; this split keeps them apart.
"""

from __future__ import annotations

import re

from igpo.agent.records import TurnRecord

KINDS = ("next_hop", "answer_hop", "wrong_call", "after_chain", "failed_call", "answer", "other")
_HOP = re.compile(r"\bmentor of\b", re.IGNORECASE)


def chain_hops(question: str) -> int:
    """The number of entities a chain question's calls must name (its ``hop_targets``): one per "mentor of". Zero
    for a question that is not a chain question."""
    return len(_HOP.findall(question or ""))


def turn_kinds(record: TurnRecord, hops: int) -> list[str]:
    """One kind (``KINDS``) per turn of ``record``, for a chain of ``hops`` targets. A record without ``hop_right``
    (the sample named no chain) or ``hops`` < 1 is refused: its turns cannot be told apart."""
    if hops < 1 or len(record.hop_right) != record.num_turns:
        raise ValueError(f"turn_kinds: a record with {record.num_turns} turns, {len(record.hop_right)} hop marks and "
                         f"{hops} chain targets; only chain questions (demo.task=chain) with the loop's hop marks "
                         "can be classified")
    kinds, reached = [], 0
    for name, status, right in zip(record.tool_names, record.tool_status, record.hop_right):
        if name is None:
            kinds.append("answer" if status == "answer" else "other")
        elif right:
            reached += 1
            kinds.append("answer_hop" if reached == hops else "next_hop")
        elif status != "ok":
            kinds.append("failed_call")
        else:
            kinds.append("after_chain" if reached >= hops else "wrong_call")
    return kinds
