"""igpo.core.anchor_similarity against verl-agent's own similarity step groups (tests/golden/
gigpo_similarity_reference.json, written by ``scripts/golden/golden_gigpo.py --similarity`` from its
gigpo/core_gigpo.py), GiGPO's advantages on those groups against verl-agent's, the fast clustering against the plain
one, the upper bounds it prunes with against difflib, and the input checks."""

import json
import math
import random
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np
import pytest
import torch

from igpo.core import anchor_similarity as sim
from igpo.core.anchor_similarity import similarity_clusters, similarity_clusters_reference
from igpo.core.gigpo import GiGPOConfig, GiGPOInputs, gigpo_advantage

REPO = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((REPO / "tests" / "golden" / "gigpo_similarity_reference.json").read_text())
PASSAGES = [json.loads(line)["contents"] for line in
            (REPO / "data" / "wiki_passages_1000.jsonl").read_text().splitlines()]
TOLERANCE = 1e-6


def ratio(a: str, b: str) -> float:
    return SequenceMatcher(None, a, b).ratio()


def relabel(ids: list[int]) -> list[int]:
    """Dense ids by first appearance (a partition compared as such)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(i, len(seen)) for i in ids]


def step_rows(case: dict) -> tuple[list[str], list[int], list[tuple[int, int]]]:
    """The kept turns in verl-agent's row order (trajectory by trajectory, turn by turn): texts, groups, [i, t]."""
    texts, groups, rows = [], [], []
    for i, traj in enumerate(case["trajectories"]):
        for t in range(traj["num_turns"]):
            if traj["rows"][t]:
                texts.append(case["texts"][traj["anchors"][t]])
                groups.append(traj["group"])
                rows.append((i, t))
    return texts, groups, rows


def inputs_with_clusters(case: dict) -> GiGPOInputs:
    """The case's trajectories as our tensors, each kept turn's anchor its similarity cluster id."""
    trajectories = case["trajectories"]
    B, T = len(trajectories), max(t["num_turns"] for t in trajectories)
    rows = torch.zeros(B, T, dtype=torch.bool)
    invalid = torch.zeros(B, T, dtype=torch.bool)
    for i, traj in enumerate(trajectories):
        n = traj["num_turns"]
        rows[i, :n] = torch.tensor(traj["rows"])
        invalid[i, :n] = torch.tensor(traj["invalid"])
    texts, groups, kept = step_rows(case)
    anchor = torch.full((B, T), -1, dtype=torch.long)  # read only at the rows
    for (i, t), cluster in zip(kept, similarity_clusters(texts, groups, case["threshold"]).tolist()):
        anchor[i, t] = cluster
    return GiGPOInputs(outcome=torch.tensor([t["outcome"] for t in trajectories], dtype=torch.float64),
                       num_turns=torch.tensor([t["num_turns"] for t in trajectories]), rows=rows, invalid=invalid,
                       anchor=anchor, group=torch.tensor([t["group"] for t in trajectories]))


# ---- against verl-agent --------------------------------------------------------------------------------------


def test_golden_file_covers_what_the_issue_asks():
    assert GOLDEN["source"] == "github.com/my1ab/verl-agent-remote-backup" and len(GOLDEN["commit"]) == 40
    cases = GOLDEN["cases"]
    assert {c["threshold"] for c in cases} == {0.5, 0.9, 0.95}
    assert {c["config"]["mode"] for c in cases} == {"mean_norm", "mean_std_norm"}
    assert any(c["config"]["gamma"] < 1 for c in cases)
    assert any(c["config"]["invalid_action_penalty"] > 0 for c in cases)
    joined_at: dict[float, int] = {}
    for case in cases:
        texts, _, _ = step_rows(case)
        first: dict[int, str] = {}
        for text, group in zip(texts, case["expected"]["step_group"]):
            joined_at[case["threshold"]] = joined_at.get(case["threshold"], 0) + (first.setdefault(group, text) != text)
        assert len(set(texts)) < len(texts), f"{case['name']}: no exactly repeated anchor"
    assert all(joined_at[t] > 0 for t in joined_at), f"every threshold needs rows joined by similarity: {joined_at}"
    anchors = [text for case in cases for text in step_rows(case)[0]]
    assert "" in anchors and max(map(len, anchors)) > 1000 and any(0 < len(a) < 200 for a in anchors)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_partition_matches_verl_agent(case):
    texts, groups, _ = step_rows(case)
    expected = relabel(case["expected"]["step_group"])
    assert relabel(similarity_clusters(texts, groups, case["threshold"]).tolist()) == expected
    assert relabel(similarity_clusters_reference(texts, groups, case["threshold"]).tolist()) == expected


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_advantages_on_similarity_groups_match_verl_agent(case):
    out = gigpo_advantage(inputs_with_clusters(case), GiGPOConfig(**case["config"]))
    expected = case["expected"]
    rows = torch.tensor(expected["rows"], dtype=torch.long).reshape(-1, 2)
    assert int(out.step_group.ge(0).sum()) == rows.shape[0], "a different set of step rows"
    for name in ("returns", "episode", "step", "advantage"):
        ours = getattr(out, name)[rows[:, 0], rows[:, 1]]
        diff = (ours - torch.tensor(expected[name], dtype=torch.float64)).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: max |diff| {diff:.3g}"
    assert relabel(out.step_group[rows[:, 0], rows[:, 1]].tolist()) == relabel(expected["step_group"])


def test_golden_max_abs_diff_overall():
    """One figure for the whole file (printed with -s): the largest |ours - verl-agent| over every case and field."""
    worst, count = 0.0, 0
    for case in GOLDEN["cases"]:
        out = gigpo_advantage(inputs_with_clusters(case), GiGPOConfig(**case["config"]))
        rows = torch.tensor(case["expected"]["rows"], dtype=torch.long).reshape(-1, 2)
        for name in ("returns", "episode", "step", "advantage"):
            theirs = torch.tensor(case["expected"][name], dtype=torch.float64)
            worst = max(worst, (getattr(out, name)[rows[:, 0], rows[:, 1]] - theirs).abs().max().item())
            count += len(rows)
    print(f"gigpo similarity golden: {len(GOLDEN['cases'])} cases, {count} values, max |diff| {worst:.3g}")
    assert worst <= TOLERANCE


# ---- the fast clustering against the plain one -------------------------------------------------------------------


def edited(rng: random.Random, text: str, edits: int, alphabet: str = "abcxyz .,T1é") -> str:
    chars = list(text)
    for _ in range(edits):
        k, op = rng.randrange(len(chars) + 1), rng.random()
        if op < 0.4 and k < len(chars):
            chars[k] = rng.choice(alphabet)
        elif op < 0.7:
            chars.insert(k, rng.choice(alphabet))
        elif k < len(chars):
            del chars[k]
    return "".join(chars)


def random_texts(rng: random.Random, n: int) -> list[str]:
    """Texts built to meet every path: exact repeats, edits of a few and of many characters, passages reordered or
    sharing one part, tiny alphabets (seeds everywhere), lengths around autojunk's 200, non-ASCII characters, lone
    surrogates, empty strings."""
    kind = rng.choice(["passages", "alphabet", "periodic", "unicode"])
    if kind == "passages":
        parts = [p[rng.randrange(100):][:rng.randint(60, 400)] for p in rng.sample(PASSAGES, 5)]
        bases = ["\n".join(rng.sample(parts, rng.randint(1, 3))) for _ in range(4)]
    elif kind == "alphabet":
        alphabet = rng.choice(["ab", "abc ", "aaab", "abcdefghijklmnopqrstuvwxyz "])
        bases = ["".join(rng.choice(alphabet) for _ in range(rng.choice([5, 150, 199, 200, 201, 260])))
                 for _ in range(3)]
    elif kind == "periodic":
        bases = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 9))) * rng.randint(3, 60) for _ in range(3)]
    else:
        bases = ["".join(rng.choice("aé中\U0001f600\ud800 b") for _ in range(rng.randint(0, 240))) for _ in range(3)]
    texts: list[str] = []
    for _ in range(n):
        u = rng.random()
        if texts and u < 0.2:
            texts.append(rng.choice(texts))
        elif u < 0.3:
            texts.append("")
        else:
            base = rng.choice(bases + texts[-3:])
            texts.append(edited(rng, base, rng.choice([0, 1, 2, 5, 20, len(base) // 3 + 1])))
    return texts


@pytest.mark.parametrize("seed", range(12))
def test_fast_equals_reference_on_random_texts(seed):
    rng = random.Random(seed)
    for _ in range(6):
        n = rng.randint(0, 40)
        texts = random_texts(rng, n)
        groups = [rng.choice([3, 0, 7]) for _ in range(n)]  # interleaved, not dense
        for threshold in (0.3, 0.5, 0.8, 0.9, 0.95, 0.99):
            fast = similarity_clusters(texts, groups, threshold)
            assert torch.equal(fast, similarity_clusters_reference(texts, groups, threshold)), (seed, threshold)


def test_search_results_sharing_passages():
    """Results sharing one or two of three passages (the pairs that only the seed cover prunes), near copies of them,
    in two prompt groups, at the recipe's threshold and around it."""
    rng = random.Random(5)
    pool = rng.sample(PASSAGES, 8)
    texts = []
    for _ in range(50):
        if texts and rng.random() < 0.3:
            texts.append(edited(rng, rng.choice(texts), rng.randint(1, 4)))
        else:
            texts.append(f"A search for 'q{rng.randrange(9)}' found 3 results:\n\n" + "\n\n".join(rng.sample(pool, 3)))
    groups = [k % 2 for k in range(len(texts))]
    for threshold in (0.5, 0.6, 0.9, 0.95):
        assert torch.equal(similarity_clusters(texts, groups, threshold),
                           similarity_clusters_reference(texts, groups, threshold))


def test_the_first_similar_cluster_wins_and_membership_is_not_transitive():
    base = PASSAGES[3][:400]
    x = base
    y = base[:150] + PASSAGES[4][:250]  # far from x
    z = base[:150] + PASSAGES[4][:130] + base[280:]  # close to both
    w = y[:-30] + PASSAGES[5][:60]  # close to y, not to x
    threshold = 0.6
    assert ratio(y, x) < threshold <= min(ratio(z, x), ratio(z, y)) and ratio(w, x) < threshold <= ratio(w, y)
    # z could join x's cluster or y's: the first created wins. w is close to y only.
    assert similarity_clusters([x, y, z, w], [0] * 4, threshold).tolist() == [0, 1, 0, 1]
    assert similarity_clusters([y, x, z, w], [0] * 4, threshold).tolist() == [0, 1, 0, 0]
    # Close to z, a member of x's cluster, is not enough: only the representative counts.
    v = z[:-60] + PASSAGES[6][:60]
    assert ratio(v, z) >= threshold > ratio(v, x)
    assert similarity_clusters([x, z, v], [0] * 3, threshold).tolist() == [0, 0, 1]


def test_a_match_exactly_at_the_threshold_is_not_pruned():
    """τ = ratio(a, b) exactly: the pair must join (>=), through every bound, behind representatives the bounds
    prune; for pairs of each kind the bounds must pass."""
    rng = random.Random(1)
    checked = 0
    for _ in range(40):
        p = rng.sample(PASSAGES, 3)
        a = rng.choice([p[0], p[0] + "\n\n" + p[1], "\n\n".join(p)])
        b = rng.choice([edited(rng, a, rng.randint(1, 60)), a[len(a) // 3:] + a[:len(a) // 3],
                        a.replace(p[0][:200], p[2][:200])])
        threshold = ratio(b, a)
        if not 0.0 < threshold < 1.0:
            continue
        decoys = [PASSAGES[rng.randrange(len(PASSAGES))] for _ in range(3)]
        decoys = [d for d in decoys if max(ratio(b, d), ratio(a, d)) < threshold]
        texts = decoys + [a, b]
        ids = similarity_clusters(texts, [0] * len(texts), threshold).tolist()
        assert ids[-1] == ids[-2] == max(ids[:-2], default=-1) + 1, (threshold, ratio(b, a))
        checked += 1
    assert checked >= 30


def test_work_limits_only_skip_the_seed_cover(monkeypatch):
    """Past its work limits the seed cover is skipped (difflib decides); in small chunks it gives the same bounds."""
    rng = random.Random(4)
    pool = rng.sample(PASSAGES, 6)
    texts = ["\n\n".join(rng.sample(pool, 2)) for _ in range(14)] + [edited(rng, pool[0], 3), pool[0]]
    groups = [0] * len(texts)
    expected = similarity_clusters_reference(texts, groups, 0.6)
    for chunk, seeds in ((1, 1 << 23), (1 << 22, 0)):
        monkeypatch.setattr(sim, "_CHUNK", chunk)
        monkeypatch.setattr(sim, "_MAX_SEEDS", seeds)
        assert torch.equal(similarity_clusters(texts, groups, 0.6), expected)


def test_a_text_against_itself_has_ratio_one():
    """What the shortcut for identical texts relies on, on strings that make autojunk drop characters."""
    rng = random.Random(2)
    texts = ["", "a", "a" * 300, "ab" * 150, "ba" + "a" * 400, PASSAGES[0] * 3,
             "".join(rng.choice("ab") for _ in range(500)), "".join(rng.choice("abc \n") for _ in range(1999))]
    for text in texts:
        assert SequenceMatcher(None, text, text).ratio() == 1.0


def test_upper_bounds_hold():
    """Bounds (b), (c) and (d) of the module docstring never fall below difflib's M when M reaches m_τ, on pairs
    of every kind (bound (d) with the band of m_τ = M, its tightest); the autojunk rule matches difflib's."""
    rng = random.Random(3)
    for _ in range(300):
        texts = random_texts(rng, 4)
        a, b = rng.choice(texts), rng.choice(texts)
        if rng.random() < 0.3:
            p = rng.sample(PASSAGES, 3)
            a, b = "\n".join(p), "\n".join([p[1], p[0], rng.choice(PASSAGES)])
        matcher = SequenceMatcher(None, a, b)
        matches = sum(block.size for block in matcher.get_matching_blocks())
        ca, cb = sim._codes(a), sim._codes(b)
        assert {chr(k >> 32) for k in sim._seed_index(cb).tolist()} == set(b) - matcher.bpopular
        columns_a, columns_b = sim._char_columns(ca), sim._char_columns(cb)
        chars_b = np.bincount(columns_b, minlength=sim._CHAR_COLUMNS)
        chars = np.minimum(np.bincount(columns_a, minlength=sim._CHAR_COLUMNS), chars_b).sum()
        trigrams = np.minimum(sim._trigram_counts(ca), sim._trigram_counts(cb)).sum()
        assert chars >= matches and (trigrams + 2 * (len(a) + len(b) + 1)) // 5 >= matches
        for need in {matches, max(1, matches - 3), max(1, matches // 2)}:
            if 0 < need <= min(len(a), len(b)):
                maybe = sim._may_seed(columns_a, chars_b[None, :], np.array([len(b)]))
                cover = sim._seed_cover(ca, [cb], [sim._seed_index(cb)], np.array([need]), maybe)[0]
                assert cover >= matches, (need, matches, cover)


def test_needed_matches_is_difflibs_threshold():
    total = np.arange(0, 3000)
    for threshold in (0.1, 0.5, 0.9, 0.95, 1 / 3, 0.999999):
        need = sim._needed_matches(total, threshold)
        for n, m in zip(total[1:].tolist(), need[1:].tolist()):
            assert 2.0 * m / n >= threshold and (m == 0 or 2.0 * (m - 1) / n < threshold)
        assert need[0] == 0


# ---- edge cases and errors -----------------------------------------------------------------------------------


def test_edge_cases():
    assert similarity_clusters([], [], 0.9).tolist() == []
    assert similarity_clusters(["only"], [4], 0.9).tolist() == [0]
    assert similarity_clusters(["", "", "x", ""], [0, 0, 0, 1], 0.9).tolist() == [0, 0, 1, 2]  # ratio('', '') = 1
    # Clusters never cross groups, ids count by first appearance, the group may be a tensor of any integers.
    texts = ["same text", "same text", "other words", "same text"]
    got = similarity_clusters(texts, torch.tensor([9, -2, 9, 9]), 0.9).tolist()
    assert got == [0, 1, 2, 0] == similarity_clusters_reference(texts, np.array([9, -2, 9, 9]), 0.9).tolist()
    assert similarity_clusters(np.array(["ab", "ab"], dtype=object), (1, 1), 0.5).dtype == torch.long


@pytest.mark.parametrize("function", [similarity_clusters, similarity_clusters_reference])
def test_errors_name_the_input(function):
    for threshold in (0, 1, 1.5, -0.1, math.nan, True, "0.9"):
        with pytest.raises(ValueError, match="threshold=.* must be a number in \\(0, 1\\)"):
            function(["a"], [0], threshold)
    with pytest.raises(ValueError, match="group has shape \\(1,\\) but texts has 2 entries"):
        function(["a", "b"], [0], 0.9)
    with pytest.raises(ValueError, match="group has shape \\(1, 2\\)"):
        function(["a", "b"], [[0, 0]], 0.9)
    with pytest.raises(TypeError, match="texts\\[1\\] is a list, not a str: .* decode token ids"):
        function(["a", [1, 2]], [0, 0], 0.9)
    with pytest.raises(ValueError, match="integer prompt-group ids; got dtype float"):
        function(["a"], [0.5], 0.9)
