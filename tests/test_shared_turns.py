"""ARPO's shared turns counted once in the group statistics of IGPO and InfoPO (issue 27): a branched group, where
the turns a branch copied from its source appear in both, gives the statistics of its de-duplicated equivalent, where
each such turn appears once; without branches nothing changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from igpo.core.advantage import AdvantageConfig, advantage_at_boundaries
from igpo.core.token_passes import Boundaries

L = 10


def _bounds(entries, mask, weight=None):
    rows, pos, rew, is_f, is_i = (np.array([e[k] for e in entries]) for k in range(5))
    return Boundaries.at(rows, pos, rew.astype(float), is_f.astype(bool), is_i.astype(bool), None, mask,
                         weight=None if weight is None else np.array(weight, dtype=float))


# One prompt: row 0 a root with IG turns ending on tokens 2 and 6; row 1 branched from row 0 after token 3 (the tool
# result of turn 0), so its turn 0 (IG 0.8 on token 2) is row 0's, then its own IG turn on 5; row 2 a root (IG on 4).
# Outcomes on token 9. Entries: (row, token, reward, is_outcome, is_ig).
BRANCHED = [(0, 2, 0.8, 0, 1), (0, 6, -0.3, 0, 1), (0, 9, 1.0, 1, 0),
            (1, 2, 0.8, 0, 1), (1, 5, 0.1, 0, 1), (1, 9, 0.0, 1, 0),
            (2, 4, 0.5, 0, 1), (2, 9, 0.0, 1, 0), (3, 3, -0.2, 0, 1), (3, 9, 1.0, 1, 0)]
SHARED_WEIGHT = [0.5, 1, 1, 0.5, 1, 1, 1, 1, 1, 1]
# De-duplicated: row 1's copy of the shared turn is no IG position (its value is row 0's, pooled once).
DEDUP = [e for e in BRANCHED if (e[0], e[1]) != (1, 2)]


@pytest.mark.parametrize("norm_mode", ["joint", "separate", "scaled_separate", "raw_ig"])
def test_igpo_branched_group_equals_its_deduplicated_equivalent(norm_mode):
    """The paper's order (before_discount) pools rewards, which the copies share. (after_discount pools returns, which
    differ between the copies: there the weights make a shared turn one position at its sharers' mean return;
    group_turn pools by turn ordinal, which removing a copy would shift: weighted the same way, not compared here.)"""
    mask = torch.ones(4, L, dtype=torch.bool)
    group = torch.tensor([0, 0, 0, 1])
    cfg = AdvantageConfig(norm_mode=norm_mode)
    branched, _, _ = advantage_at_boundaries(_bounds(BRANCHED, mask, SHARED_WEIGHT), mask, group, cfg,
                                             dtype=torch.float64)
    dedup, _, _ = advantage_at_boundaries(_bounds(DEDUP, mask), mask, group, cfg, dtype=torch.float64)
    assert torch.allclose(branched[[0, 2, 3]], dedup[[0, 2, 3]], rtol=0, atol=1e-12)
    assert torch.allclose(branched[1, 3:], dedup[1, 3:], rtol=0, atol=1e-12)  # row 1 after the shared turn
    # counted twice (no weights), the shared turn moves the group's statistics
    counted_twice, _, _ = advantage_at_boundaries(_bounds(BRANCHED, mask), mask, group, cfg, dtype=torch.float64)
    assert not torch.allclose(counted_twice[0], dedup[0], atol=1e-6)


def test_pool_weights_of_one_are_the_unweighted_pool_bit_for_bit():
    mask = torch.ones(4, L, dtype=torch.bool)
    group = torch.tensor([0, 0, 0, 1])
    for mode in ("joint", "separate", "scaled_separate", "raw_ig"):
        cfg = AdvantageConfig(norm_mode=mode)
        plain = advantage_at_boundaries(_bounds(BRANCHED, mask), mask, group, cfg, dtype=torch.float64)
        ones = advantage_at_boundaries(_bounds(BRANCHED, mask, [1.0] * len(BRANCHED)), mask, group, cfg,
                                       dtype=torch.float64)
        assert torch.equal(plain[0], ones[0]) and plain[2] == ones[2]
    with pytest.raises(ValueError, match=r"pool weights must lie in \(0, 1\]"):
        _bounds(BRANCHED, mask, [0.0] + [1.0] * (len(BRANCHED) - 1))
