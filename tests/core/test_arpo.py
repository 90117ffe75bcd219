"""ARPO core (igpo.core.arpo): config, entropy, the P(branch) table, seeded branching, the budget (exactly M per
prompt), prefix identity on simulated rollouts, hard vs soft attribution, and shared-turn dedup."""

from __future__ import annotations

import math
import random

import pytest
import torch

from igpo.core.arpo import (
    ARPOConfig,
    ARPOTrajectory,
    RoundPlan,
    apply_plan,
    branch_attempts,
    branch_metadata,
    branch_probability,
    hard_attribution,
    initial_trajectories,
    may_branch_at,
    plan_round,
    prefix_identical,
    share_counts,
    shared_lengths,
    shared_turn_weights,
    soft_group_ids,
    step_entropy,
    step_metrics,
    token_entropy,
    with_initial_entropy,
)

NEG = -math.inf


# ---- config ---------------------------------------------------------------------------------------------------


def test_config_defaults_are_the_shipped_deep_search_script():
    cfg = ARPOConfig()
    assert (cfg.rollouts_per_prompt, cfg.initial_rollouts, cfg.branch_factor) == (16, 8, 2)
    # β 0.77 on this ΔH (mean normalised entropy, [−1, 1]) is the reference's 0.2 on its summed entropy
    assert (cfg.branch_probability, cfg.entropy_weight, cfg.entropy_tokens, cfg.top_k) == (0.5, 0.77, 20, 10)
    assert cfg.entropy_weight == pytest.approx(0.2 * 20 * math.log(10) / math.log(151_665), abs=0.005)


def test_one_beta_scale_the_yaml_defaults_are_the_dataclass_defaults():
    from pathlib import Path

    import yaml

    section = yaml.safe_load((Path(__file__).parents[2] / "configs" / "igpo_base.yaml").read_text())["algorithm"]["arpo"]
    cfg = ARPOConfig()
    for key in ("enabled", "branch_factor", "branch_probability", "entropy_weight", "entropy_tokens", "top_k",
                "attribution"):
        assert section[key] == getattr(cfg, key), key


@pytest.mark.parametrize("kwargs, words", [
    ({"initial_rollouts": 17}, "initial_rollouts=17 exceeds"),
    ({"branch_probability": 1.5}, "branch_probability=1.5"),
    ({"entropy_weight": -0.1}, "entropy_weight=-0.1"),
    ({"entropy_weight": math.nan}, "entropy_weight=nan"),
    ({"top_k": 1}, "top_k=1 must be an integer >= 2"),
    ({"branch_factor": 0}, "branch_factor=0"),
    ({"rollouts_per_prompt": True}, "rollouts_per_prompt=True"),
    ({"entropy_tokens": 2.0}, "entropy_tokens=2.0"),
    ({"seed": -1}, "seed=-1"),
    ({"enabled": 1}, "enabled=1"),
])
def test_config_errors_name_the_value(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        ARPOConfig(**kwargs)


def test_config_from_dict():
    cfg = ARPOConfig.from_dict({"enabled": True, "rollouts_per_prompt": 12, "initial_rollouts": 6,
                                "branch_probability": 1, "entropy_weight": 0})
    assert cfg.enabled and cfg.rollouts_per_prompt == 12 and cfg.branch_probability == 1.0
    assert isinstance(cfg.entropy_weight, float)
    with pytest.raises(ValueError, match=r"unknown key\(s\) arpo.\['beam_size'\]"):
        ARPOConfig.from_dict({"beam_size": 2})


# ---- entropy --------------------------------------------------------------------------------------------------


def _row(*probs: float, width: int = 10) -> list[float]:
    return [math.log(p) for p in probs] + [NEG] * (width - len(probs))


def test_token_entropy_normalised_and_renormalised():
    uniform = torch.tensor(_row(*[0.1] * 10))
    assert float(token_entropy(uniform, 10)) == pytest.approx(1.0)
    assert float(token_entropy(torch.tensor(_row(1.0)), 10)) == 0.0
    assert float(token_entropy(torch.tensor(_row(0.3, 0.3)), 10)) == pytest.approx(math.log(2) / math.log(10))
    # only half the mass in the top-10: renormalised, still uniform
    assert float(token_entropy(torch.tensor(_row(*[0.05] * 10)), 10)) == pytest.approx(1.0)
    # vLLM's 11th entry (a sampled token outside the top-10) is dropped
    eleven = torch.tensor(_row(*[0.09] * 10, 0.001, width=11))
    assert float(token_entropy(eleven, 10)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive values"):
        token_entropy(torch.tensor([0.5, -1.0]), 10)
    with pytest.raises(ValueError, match="no finite log-prob"):
        token_entropy(torch.tensor([NEG, NEG]), 10)


def test_step_entropy_is_the_mean_over_the_first_k_tokens():
    cfg = ARPOConfig(entropy_tokens=2)
    u, one, two = _row(*[0.1] * 10), _row(1.0), _row(0.5, 0.5)
    x = torch.tensor([[u, one, u],      # first 2 tokens: (1 + 0) / 2; the third is beyond k
                      [two, u, u],      # (log2/log10 + 1) / 2
                      [u, one, one]])   # only 1 token generated: 1
    h = step_entropy(x, torch.tensor([3, 2, 1]), cfg)
    assert h.tolist() == pytest.approx([0.5, (math.log(2) / math.log(10) + 1) / 2, 1.0])
    # a short segment is not "low entropy": the mean does not depend on the length
    assert float(step_entropy(torch.tensor([[u] * 3]), torch.tensor([1]), ARPOConfig())) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"rows \[1\] generated no token"):
        step_entropy(x, torch.tensor([1, 0, 1]), cfg)


# ---- branching probability and draws ----------------------------------------------------------------------------


def test_branch_probability_table():
    """Spec 2.4: τ = 0.5, β = 0.2 (the formula; on the reference's summed-entropy scale)."""
    cfg = ARPOConfig(entropy_weight=0.2)
    delta = torch.tensor([0.0, 0.5, -1.0, 2.5, 3.0, -3.0])
    assert branch_probability(delta, cfg).tolist() == pytest.approx([0.5, 0.6, 0.3, 1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="NaN"):
        branch_probability(torch.tensor([math.nan]), cfg)


def test_branching_is_deterministic_under_a_seed_and_per_trajectory():
    cfg = ARPOConfig(enabled=True, branch_factor=3, seed=7)
    key = {"step": 3, "rank": 1, "prompt": 5, "round_": 2}
    delta = torch.tensor([0.0, 0.4, -0.2])
    a = branch_attempts([0, 2, 5], delta, cfg, **key)
    assert torch.equal(a, branch_attempts([0, 2, 5], delta, cfg, **key))
    assert a.shape == (3, 2)
    # trajectory 2's draw ignores which others are eligible and their entropies
    alone = branch_attempts([2], delta[1:2], cfg, **key)
    assert torch.equal(alone[0], a[1])
    other = branch_attempts([1, 2, 9], torch.tensor([1.0, 0.4, -1.0]), cfg, **key)
    assert torch.equal(other[1], a[1])
    # the key moves the draws
    draws = {tuple(branch_attempts(range(16), torch.zeros(16), ARPOConfig(enabled=True, seed=s), step=st, rank=0,
                                   prompt=0, round_=0).flatten().tolist()) for s in range(3) for st in range(3)}
    assert len(draws) == 9


def test_branch_acceptance_rate_follows_p():
    cfg = ARPOConfig(enabled=True, entropy_weight=0.2)  # P = clip(0.5 + 0.2 ΔH): 0.3 at ΔH = −1
    hits = torch.stack([branch_attempts(range(16), torch.full((16,), -1.0), cfg, step=s, rank=0, prompt=p, round_=0)
                        for s in range(25) for p in range(10)])
    assert float(hits.double().mean()) == pytest.approx(0.3, abs=0.03)
    assert not branch_attempts(range(16), torch.full((16,), -3.0), cfg, step=0, rank=0, prompt=0, round_=0).any()
    assert branch_attempts(range(16), torch.full((16,), 3.0), cfg, step=0, rank=0, prompt=0, round_=0).all()


# ---- budget -------------------------------------------------------------------------------------------------------


def _plan(cfg, m, running, eligible, accept_all=True):
    trajectories = [ARPOTrajectory(index=i, h_init=0.3) for i in range(m)]
    e = sum(eligible)
    accepted = torch.full((e, cfg.branch_factor - 1), accept_all, dtype=torch.bool)
    return plan_round(trajectories, running, eligible, accepted, cfg)


def test_plan_caps_branches_in_index_order():
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=5, initial_rollouts=2, branch_factor=3)
    assert _plan(cfg, 2, [True, True], [True, True]) == RoundPlan(branch_sources=(0, 0, 1))
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=6, initial_rollouts=2, branch_factor=3)
    assert _plan(cfg, 2, [True, True], [True, True]) == RoundPlan(branch_sources=(0, 0, 1, 1))
    assert _plan(cfg, 6, [True] * 6, [True] * 6) == RoundPlan()  # full: nothing more


def test_plan_topups_only_when_nothing_runs():
    cfg = ARPOConfig(enabled=True)
    # all 8 finished in the first round: every missing slot is a top-up now, in one round
    assert _plan(cfg, 8, [False] * 8, [False] * 8) == RoundPlan(topups=8)
    # one still runs (cut by length, no tool result): wait for it
    assert _plan(cfg, 8, [True] + [False] * 7, [False] * 8) == RoundPlan()
    # a branch was granted: it runs, no top-up
    assert _plan(cfg, 8, [True] + [False] * 7, [True] + [False] * 7) == RoundPlan(branch_sources=(0,))
    # rejected attempts and nothing else runs... the eligible one still runs
    assert _plan(cfg, 8, [True] + [False] * 7, [True] + [False] * 7, accept_all=False) == RoundPlan()


def test_plan_rejects_bad_inputs():
    cfg = ARPOConfig(enabled=True)
    with pytest.raises(ValueError, match="arpo.enabled is false"):
        _plan(ARPOConfig(), 2, [True, True], [True, True])
    with pytest.raises(ValueError, match=r"bool \[1, 1\]"):
        plan_round([ARPOTrajectory(0)], [True], [True], torch.ones(1, 2, dtype=torch.bool), cfg)


def test_records_inherit_h_init_and_flag_topups():
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=4, initial_rollouts=2)
    t = initial_trajectories(cfg)
    t = [with_initial_entropy(t[0], 0.4), with_initial_entropy(t[1], 0.6)]
    t = apply_plan(t, RoundPlan(branch_sources=(1,), topups=1), response_lengths=[7, 9])
    assert t[2] == ARPOTrajectory(index=2, parent=1, branch_pos=9, is_topup=False, h_init=0.6)
    assert t[3] == ARPOTrajectory(index=3, is_topup=True)
    meta = branch_metadata(t, cfg)
    assert meta["parent"].tolist() == [-1, -1, 1, -1]
    assert meta["branch_pos"].tolist() == [0, 0, 9, 0]
    assert meta["is_topup"].tolist() == [False, False, False, True]
    with pytest.raises(ValueError, match="keeps its source's H_init"):
        with_initial_entropy(t[2], 0.1)
    with pytest.raises(ValueError, match="already has H_init"):
        with_initial_entropy(t[0], 0.1)
    with pytest.raises(ValueError, match="has no H_init"):
        apply_plan([ARPOTrajectory(0)], RoundPlan(branch_sources=(0,)), [3])
    with pytest.raises(ValueError, match="ended with 3 trajectories"):
        branch_metadata(t[:3], cfg)


def simulate(cfg: ARPOConfig, finishes, *, step=0, prompt=0, rng_seed=0, max_rounds=50):
    """One prompt's rollout as the agent loop would run it, with tokens. Each round every running trajectory
    generates a segment of 3 tokens (mask 1); ``finishes(index, segments_so_far)`` ends it, else a tool result of 2
    tokens (mask 0) follows and it is eligible with a random ΔH. Returns (records, responses, masks, rounds)."""
    rng = random.Random(rng_seed)
    records = initial_trajectories(cfg)
    tokens: list[list[int]] = [[] for _ in records]
    masks: list[list[int]] = [[] for _ in records]
    segments = [0] * len(records)
    running = [True] * len(records)
    for rnd in range(max_rounds):
        if not any(running):
            return records, tokens, masks, rnd
        eligible = [False] * len(records)
        for i, r in enumerate(records):
            if not running[i]:
                continue
            tokens[i] += [rng.randrange(1, 100) for _ in range(3)]
            masks[i] += [1, 1, 1]
            if r.h_init is None:
                records[i] = with_initial_entropy(r, rng.random())
            segments[i] += 1
            if finishes(i, segments[i]):
                running[i] = False
            else:
                tokens[i] += [0, 0]
                masks[i] += [0, 0]
                eligible[i] = True
        src = [i for i in range(len(records)) if eligible[i]]
        delta = torch.tensor([rng.uniform(-1, 1) for _ in src], dtype=torch.float64)
        accepted = branch_attempts(src, delta, cfg, step=step, rank=0, prompt=prompt, round_=rnd)
        plan = plan_round(records, running, eligible, accepted, cfg)
        records = apply_plan(records, plan, [len(t) for t in tokens])
        for r in records[len(tokens):]:
            parent_tokens = tokens[r.parent][:r.branch_pos] if r.parent >= 0 else []
            tokens.append(list(parent_tokens))
            masks.append(list(masks[r.parent][:r.branch_pos]) if r.parent >= 0 else [])
            segments.append(segments[r.parent] if r.parent >= 0 else 0)
            running.append(True)
    raise AssertionError("the simulated rollout did not finish")


def _pad(rows: list[list[int]]) -> torch.Tensor:
    L = max(map(len, rows))
    return torch.tensor([r + [-1] * (L - len(r)) for r in rows])


@pytest.mark.parametrize("M, N, Z", [(16, 8, 2), (12, 6, 2), (8, 2, 4), (5, 5, 2), (6, 1, 1), (7, 3, 3)])
@pytest.mark.parametrize("calls", ["none", "one", "three", "mixed"])
def test_exactly_m_per_prompt_never_duplicated(M, N, Z, calls):
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=M, initial_rollouts=N, branch_factor=Z, seed=3)
    limit = {"none": lambda i: 1, "one": lambda i: 2, "three": lambda i: 4, "mixed": lambda i: 1 + i % 4}[calls]
    branched = 0
    for prompt in range(5):
        records, tokens, masks, _ = simulate(cfg, lambda i, s: s >= limit(i), prompt=prompt, rng_seed=prompt)
        meta = branch_metadata(records, cfg)  # raises unless exactly M
        assert meta["index"].tolist() == list(range(M))
        assert len({tuple(t) for t in tokens}) == M  # no trajectory was copied to fill M
        n_branch = int((meta["parent"] >= 0).sum())
        assert n_branch + int(meta["is_topup"].sum()) == M - N
        if Z == 1:
            assert n_branch == 0
        branched += n_branch
    assert (branched > 0) == (Z > 1 and N < M and calls != "none")


def test_all_finish_early_tops_up_in_one_round():
    cfg = ARPOConfig(enabled=True)
    records, _, _, rounds = simulate(cfg, lambda i, s: True)
    assert [r.is_topup for r in records] == [False] * 8 + [True] * 8
    assert all(r.parent == -1 for r in records)
    assert rounds == 2  # round 0: the 8 samples end and 8 top-ups start; round 1: the top-ups end


def test_simulation_is_reproducible_under_the_seed():
    cfg = ARPOConfig(enabled=True, seed=11)
    runs = [simulate(cfg, lambda i, s: s >= 1 + i % 4, step=4, prompt=2)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    other = simulate(ARPOConfig(enabled=True, seed=12), lambda i, s: s >= 1 + i % 4, step=4, prompt=2)[0]
    assert [r.parent for r in other] != [r.parent for r in runs[0]]


# ---- prefix identity and the tree ------------------------------------------------------------------------------


def _batch(cfg, prompts=3, seed=5):
    """Several simulated prompts in one batch, rows shuffled as verl's balance_batch would."""
    rows = []
    for g in range(prompts):
        records, tokens, masks, _ = simulate(cfg, lambda i, s: s >= 1 + i % 4, prompt=g, rng_seed=g)
        meta = branch_metadata(records, cfg)
        for k in range(len(records)):
            rows.append((g, int(meta["index"][k]), int(meta["parent"][k]),
                         int(meta["branch_pos"][k]), tokens[k], masks[k]))
    random.Random(seed).shuffle(rows)
    group, index, parent, pos = (torch.tensor([r[c] for r in rows]) for c in range(4))
    responses = _pad([r[4] for r in rows])
    mask = _pad([r[5] for r in rows]).clamp(min=0)
    return group, index, parent, pos, responses, mask


def test_prefix_identity_on_simulated_rollouts():
    cfg = ARPOConfig(enabled=True, seed=1)
    group, index, parent, pos, responses, mask = _batch(cfg)
    assert int((parent >= 0).sum()) > 0
    assert prefix_identical(responses, group, index, parent, pos).all()
    assert prefix_identical(mask, group, index, parent, pos).all()
    # every pair agrees on its shared length, and shared prefixes end right after a tool result (mask 0)
    D = shared_lengths(group, index, parent, pos, responses.shape[1])
    for i in range(len(group)):
        for j in range(len(group)):
            d = int(D[i, j])
            if i != j and d:
                assert torch.equal(responses[i, :d], responses[j, :d])
                assert int(mask[i, d - 1]) == 0
    branch = int((parent >= 0).nonzero()[0])
    corrupt = responses.clone()
    corrupt[branch, int(pos[branch]) - 1] += 1
    assert prefix_identical(corrupt, group, index, parent, pos).tolist().count(False) == 1


# ---- attribution ------------------------------------------------------------------------------------------------


def test_soft_groups_are_the_prompts():
    assert soft_group_ids(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def test_hard_equals_soft_when_nothing_branched():
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=6, initial_rollouts=3, branch_factor=1)
    group, index, parent, pos, responses, mask = _batch(cfg)
    assert (parent < 0).all()
    adv = torch.randn(responses.shape, generator=torch.Generator().manual_seed(0)) * mask
    assert torch.equal(hard_attribution(adv, mask.bool(), group, index, parent, pos), adv)


def _hand_tree():
    """Group 0 (rows shuffled): 0 root; 1 branch of 0 at 2; 2 branch of 1 at 4; 3 a top-up. Group 1: 0 root, 1 branch
    of 0 at 3. Rows: [g0/2, g1/1, g0/0, g0/3, g1/0, g0/1]."""
    group = torch.tensor([0, 1, 0, 0, 1, 0])
    index = torch.tensor([2, 1, 0, 3, 0, 1])
    parent = torch.tensor([1, 0, -1, -1, -1, 0])
    pos = torch.tensor([4, 3, 0, 0, 0, 2])
    return group, index, parent, pos


def test_hard_attribution_hand_case():
    group, index, parent, pos = _hand_tree()
    L = 6
    adv = torch.tensor([3.0, 5.0, 1.0, -6.0, -5.0, 2.0])[:, None].expand(6, L).clone()
    mask = torch.ones(6, L, dtype=torch.bool)
    hard = hard_attribution(adv, mask, group, index, parent, pos)
    t = 1 / 3
    expect = torch.tensor([
        [2 * t, 2 * t, 1.25, 1.25, 3, 3],   # g0/2: mean(1, 2, 3) / 3 on [0, 2), mean(2, 3) / 2 on [2, 4)
        [0, 0, 0, 5, 5, 5],                 # g1/1: mean(5, -5) / 2 on [0, 3)
        [2 * t, 2 * t, 1, 1, 1, 1],         # g0/0
        [-6] * 6,                           # g0/3: a top-up shares nothing
        [0, 0, 0, -5, -5, -5],              # g1/0
        [2 * t, 2 * t, 1.25, 1.25, 2, 2],   # g0/1
    ])
    assert torch.allclose(hard, expect)
    # the copies of a shared token sum to ONE token with its sharers' mean advantage (soft: |S| tokens, their sum)
    assert float(hard[[0, 2, 5], 0].sum()) == pytest.approx((3 + 1 + 2) / 3)
    assert float(hard[[0, 5], 2].sum()) == pytest.approx((3 + 2) / 2)
    assert float(hard[[1, 4], 1].sum()) == pytest.approx(0.0)
    assert share_counts(group, index, parent, pos, L).tolist() == [
        [3, 3, 2, 2, 1, 1], [2, 2, 2, 1, 1, 1], [3, 3, 1, 1, 1, 1], [1] * 6, [2, 2, 2, 1, 1, 1], [3, 3, 2, 2, 1, 1]]


def test_hard_attribution_checks_masks_and_tree():
    group, index, parent, pos = _hand_tree()
    adv, mask = torch.zeros(6, 6), torch.ones(6, 6, dtype=torch.bool)
    mask[0, 1] = False  # g0/2 differs from its parent inside the shared prefix
    with pytest.raises(ValueError, match=r"rows \[0\] differ from their parent's response mask"):
        hard_attribution(adv, mask, group, index, parent, pos)
    with pytest.raises(ValueError, match="earlier index"):
        hard_attribution(adv, torch.ones(6, 6, dtype=torch.bool), group, index, torch.tensor([3, 0, -1, -1, -1, 0]),
                         pos)
    with pytest.raises(ValueError, match="must be 0 for roots"):
        hard_attribution(adv, torch.ones(6, 6, dtype=torch.bool), group, index, parent,
                         torch.tensor([4, 3, 1, 0, 0, 2]))
    with pytest.raises(ValueError, match="has index 0 twice"):
        hard_attribution(adv, torch.ones(6, 6, dtype=torch.bool), group, torch.tensor([2, 1, 0, 0, 0, 1]), parent,
                         pos)


def test_shared_turns_count_once():
    """Hand tree; turn ends (exclusive, through the tool result): g0/0 [2, 5]; g0/1 and g0/2 [2, 4, 6]; g0/3 [3];
    g1/0 [3, 6] and g1/1 [3, 5]."""
    group, index, parent, pos = _hand_tree()
    ends = torch.tensor([[2, 4, 6], [3, 5, 0], [2, 5, 0], [3, 0, 0], [3, 6, 0], [2, 4, 6]])
    valid = ends > 0
    weight, first = shared_turn_weights(ends, valid, group, index, parent, pos, L=6)
    third, half = 1 / 3, 0.5
    assert torch.allclose(weight, torch.tensor([[third, half, 1], [half, 1, 0], [third, 1, 0], [1, 0, 0],
                                                [half, 1, 0], [third, half, 1]], dtype=torch.float64))
    assert first.tolist() == [[False, False, True], [False, True, False], [True, True, False], [True, False, False],
                              [True, True, False], [False, True, True]]
    # pooling with either gives each distinct turn once: 9 distinct turns
    assert float(weight.sum()) == pytest.approx(9) and int(first.sum()) == 9
    with pytest.raises(ValueError, match=r"in \[1, L=6\]"):
        shared_turn_weights(ends + 1, valid, group, index, parent, pos, L=6)


def test_a_source_that_answered_after_the_measured_tool_result_can_still_branch():
    # The branch point is the tool result before the measured turn: the source's own continuation may have ended.
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=4, initial_rollouts=2)
    assert _plan(cfg, 2, [False, True], [True, True]) == RoundPlan(branch_sources=(0, 1))
    assert _plan(cfg, 2, [False, False], [True, False]) == RoundPlan(branch_sources=(0,))  # no top-up: it runs


def test_config_defaults_n_to_half_of_m_and_checks_attribution():
    assert ARPOConfig.from_dict({"rollouts_per_prompt": 16, "initial_rollouts": None}).initial_rollouts == 8
    assert ARPOConfig.from_dict({"rollouts_per_prompt": 3, "initial_rollouts": None}).initial_rollouts == 1
    assert ARPOConfig.from_dict({"attribution": "hard"}).attribution == "hard"
    with pytest.raises(ValueError, match="arpo.attribution='shared' is unknown"):
        ARPOConfig(attribution="shared")


# ---- one round of branching per tool result ----------------------------------------------------------------------


def test_a_branch_is_no_source_at_its_own_branch_point():
    """Nested tree: 0 root; 1 branch of 0 at 5; 2 branch of 1 at 9 (1's own later tool result) is fine; 1 at 5 is
    not (its first turn starts at the tool result 0 already branched from)."""
    cfg = ARPOConfig(enabled=True, rollouts_per_prompt=4, initial_rollouts=1)
    root = ARPOTrajectory(index=0, h_init=0.2)
    t = apply_plan([root], RoundPlan(branch_sources=(0,)), response_lengths=[5])
    assert t[1] == ARPOTrajectory(index=1, parent=0, branch_pos=5, h_init=0.2)
    assert may_branch_at(root, 5) and may_branch_at(root, 0)  # a root has no branch point of its own
    assert not may_branch_at(t[1], 5) and may_branch_at(t[1], 9)
    with pytest.raises(ValueError, match="asked to branch at that same tool result"):
        apply_plan(t, RoundPlan(branch_sources=(1,)), response_lengths=[12, 5])
    t = apply_plan(t, RoundPlan(branch_sources=(1, 0)), response_lengths=[12, 9])
    assert [(r.parent, r.branch_pos) for r in t] == [(-1, 0), (0, 5), (1, 9), (0, 12)]
    assert branch_metadata(t, cfg)["parent"].tolist() == [-1, 0, 1, 0]


def _tree_metrics(rows):
    """step_metrics of (prompt, index, parent, branch_pos) rows, no top-ups, no ΔH measured."""
    group, index, parent, pos = (torch.tensor([r[c] for r in rows]) for c in range(4))
    return step_metrics(group, index, parent, pos, torch.zeros(len(rows), dtype=torch.bool),
                        torch.zeros(len(rows), dtype=torch.long), [])


def test_rebranch_metric_counts_branches_of_branches_at_the_same_point():
    # prompt 0: 1 = branch of 0 at 5; 2 = branch of 1 at 5 (a rebranch); 3 = branch of 2 at 9 (nested, fine)
    # prompt 1: the same indices, 1 = branch of 0 at 5, 2 = branch of 1 at 7: no rebranch (a different point)
    rows = [(0, 0, -1, 0), (0, 1, 0, 5), (0, 2, 1, 5), (0, 3, 2, 9),
            (1, 0, -1, 0), (1, 1, 0, 5), (1, 2, 1, 7), (1, 3, 0, 5)]
    stats = _tree_metrics(rows[::-1])  # rows in any order (verl's balance_batch)
    assert stats["arpo/rebranch_same_point"] == 1.0 and stats["arpo/nested_branches"] == 3.0
    assert stats["arpo/branches_per_prompt"] == 3.0
    assert _tree_metrics(rows[4:])["arpo/rebranch_same_point"] == 0.0
