"""IG-Search's random documents and paired copies (igpo.core.ig_search) and its config section."""

import pytest

from igpo.core.ground_truth import Probe
from igpo.core.ig_search import IGSearchConfig, draw_documents, paired_copies


def test_a_turn_gets_a_document_of_another_prompt_group_or_none():
    donors = [0, 0, 1, 1, 2]
    wanted = [(g, (g, k)) for g in (0, 1, 2) for k in range(30)]
    drawn = draw_documents(wanted, donors, seed=3, step=5)
    for (group, _), d in zip(wanted, drawn):
        assert d is not None and donors[d] != group
    # Every document of another group is drawn at some point (uniform over them, not the first one found).
    assert {d for (group, _), d in zip(wanted, drawn) if group == 2} == {0, 1, 2, 3}
    assert draw_documents([(0, "a")], [0, 0], seed=0, step=1) == [None]


def test_draws_repeat_for_a_seed_and_step_and_equal_keys_share_a_document():
    donors = list(range(40))
    wanted = [(100, k) for k in range(20)]
    first = draw_documents(wanted, donors, seed=1, step=7)
    assert draw_documents(wanted, donors, seed=1, step=7) == first
    assert draw_documents(wanted, donors, seed=1, step=8) != first
    assert draw_documents(wanted, donors, seed=2, step=7) != first
    shared = draw_documents([(100, "turn"), (100, "other"), (100, "turn")], donors, seed=1, step=7)
    assert shared[0] == shared[2]


def test_the_copies_put_the_document_in_place_of_the_content_and_keep_the_gold_span():
    ids = [1, 2, 3, 40, 41, 42, 5, 6, 7, 8]  # content [3, 6); the template token 5, 6 after it; boundary 8
    probe = Probe(token_ids=[90, 91, 92, 93], span=(1, 3))
    (factual, f_span), (counter, c_span) = paired_copies(ids, (3, 6), 8, [70, 71], probe)
    assert ids[:3] + factual == ids[:8] + probe.token_ids
    assert ids[:3] + counter == [1, 2, 3, 70, 71, 5, 6] + probe.token_ids
    assert factual[f_span[0]:f_span[1]] == counter[c_span[0]:c_span[1]] == [91, 92]
    same = paired_copies(ids, (3, 6), 8, [40, 41, 42], probe)
    assert same[0] == same[1]  # the real content as its own document: the same copy, a gain of exactly 0
    with pytest.raises(ValueError, match="not ordered"):
        paired_copies(ids, (6, 3), 8, [70], probe)


def test_config_refuses_unknown_keys_and_bad_seeds():
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.ig_search.\['sed'\].*known keys are \['seed'\]"):
        IGSearchConfig.from_dict({"sed": 1})
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="algorithm.ig_search.seed"):
            IGSearchConfig.from_dict({"seed": bad})
    assert IGSearchConfig.from_dict({"seed": None}) == IGSearchConfig()
