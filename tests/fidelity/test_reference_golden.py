"""``+fidelity=reference_drvenus`` against the reference's OWN functions (issue 24).

tests/golden/drvenus_reference.json holds inputs and the outputs of DR-Venus' judge, F1/EM and turn-format code and
of its grpo_info_gain advantage estimator on random agent-loop batches (scripts/golden/golden_reference.py ran them from
a fetched snapshot; the commit id is in the file). Every case must match,
except the ones listed in DOCUMENTED, which the difference table of docs/methods/igpo.md names with the reason; a
documented case
that starts to match (or an undocumented one that differs) fails, so the table cannot go stale.
"""

from __future__ import annotations

import asyncio
import json
import runpy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import method_harness as harness
import igpo.reward as reward
from igpo.agent.agent_config import AgentLoopConfig
from igpo.config import refuse_reference_overrides
from igpo.core.ground_truth import ANSWER_SPLIT
from igpo.core.outcome import normalize_answer
from igpo.core.turn_format import check_answer_turn, check_tool_turn, reference_tag_fix, reference_turn_ok
from igpo.agent.protocol import parse_turn_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
from fake_openai import FakeOpenAI, Reply  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_ABSENT = object()
GOLDEN = json.loads((REPO / "tests" / "golden" / "drvenus_reference.json").read_text())

# (item, input, field) -> why it differs; docs/methods/igpo.md "Reference vs our default" carries the same rows.
DOCUMENTED = {
    # An empty alias ("Paris<|answer_split|>") is dropped by our parser; the reference's EM matches it against a
    # punctuation-only answer (both normalise to ""), a data error rewarded as correct.
    ("outcome", "<think>t</think><answer>!</answer>", "Paris<|answer_split|>", "em"): "empty alias",
}


@pytest.fixture(scope="module")
def preset():
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose(config_name="igpo_trainer", overrides=["+fidelity=reference_drvenus"])


def _reward_kwargs(config) -> dict:
    return dict(OmegaConf.to_container(config.reward.custom_reward_function.reward_kwargs))


def _score(final, gt, **kwargs) -> float:
    extra = {"igpo_final_turn_text": final, "question": "Which city is the capital of France?"}
    return asyncio.run(reward.compute_score(data_source="nq", solution_str="", ground_truth=gt, extra_info=extra,
                                            **kwargs))["score"]


def test_golden_file_names_its_source():
    assert GOLDEN["source"] == "github.com/inclusionAI/DR-Venus" and len(GOLDEN["commit"]) == 40
    assert len(GOLDEN["judge"]) >= 20 and len(GOLDEN["outcome"]) >= 19 and len(GOLDEN["turns"]) >= 100


def test_judge_matches_the_reference(preset, monkeypatch):
    """Each case with the judge's reply held fixed: the score, whether a request was made, and the request's
    temperature / top_p / thinking flag / raw gold string."""
    kwargs = _reward_kwargs(preset)
    differ = []
    with FakeOpenAI() as server:
        monkeypatch.setenv("JUDGE_API_BASE", server.base_url)
        monkeypatch.setenv("JUDGE_MODEL_NAME", "judge-under-test")
        for case in GOLDEN["judge"]:
            monkeypatch.setattr(reward, "_JUDGES", {})  # a fresh judge: no verdict cached from an earlier case
            server.requests.clear()
            server.default = Reply(content=case["judge_reply"])
            score = _score(case["final_turn"], case["ground_truth"], **kwargs)
            body = server.requests[0].body if server.requests else None
            ours = {
                "score": score, "requested": body is not None,
                "temperature": body and body["temperature"], "top_p": body and body.get("top_p"),
                "enable_thinking": body and body.get("chat_template_kwargs", {}).get("enable_thinking"),
                "gold_in_prompt_raw": body and case["ground_truth"] in body["messages"][0]["content"],
            }
            theirs = {k: case[k] for k in ours}
            if ours != theirs:
                differ.append((case["final_turn"], case["ground_truth"], case["judge_reply"], ours, theirs))
    assert not differ, "judge cases differing from DR-Venus' llm_judge.compute_score:\n" + "\n".join(map(str, differ))


@pytest.mark.parametrize("kind, field", [("f1", "f1_multiset"), ("em", "em")])
def test_f1_and_em_match_the_reference(preset, kind, field):
    """F1 against info_gain.compute_f1 (the F1 the reference trains on when IG is on), EM against format_and_f1."""
    kwargs = dict(_reward_kwargs(preset), train_reward_type=kind)
    differ, documented = [], []
    for case in GOLDEN["outcome"]:
        ours = _score(case["final_turn"], case["ground_truth"], **kwargs)
        key = ("outcome", case["final_turn"], case["ground_truth"], kind)
        if abs(ours - case[field]) > 1e-9:
            (documented if key in DOCUMENTED else differ).append((case["final_turn"], case["ground_truth"], ours,
                                                                   case[field]))
        elif key in DOCUMENTED:
            differ.append(("documented as different but matches", key))
    assert not differ, f"{kind} cases differing from the reference (or stale DOCUMENTED rows): {differ}"
    assert len(documented) == sum(1 for key in DOCUMENTED if key[0] == "outcome" and key[3] == kind)


def test_set_f1_differs_only_on_repeated_tokens():
    """The reference's phase-1 F1 (format_and_f1, token SETS) is what a sample keeps when no IG overlay rewrites it;
    ours is the multiset F1 throughout (docs/methods/igpo.md table). The two differ only where a side repeats a
    token."""
    for case in GOLDEN["outcome"]:
        if abs(case["f1_set"] - case["f1_multiset"]) > 1e-9:
            answer = normalize_answer(case["final_turn"].split("<answer>")[1].split("</answer>")[0], "reference")
            gold = [normalize_answer(a, "reference").split() for a in case["ground_truth"].split(ANSWER_SPLIT)]
            repeated = len(set(answer.split())) < len(answer.split()) or any(len(set(a)) < len(a) for a in gold)
            assert repeated, case


def test_preset_reads_turns_the_reference_way(preset):
    agent = AgentLoopConfig.from_dict(preset.algorithm.igpo.agent)
    assert agent.turn_rules == "reference" and agent.max_generation_retries == 0 and not agent.dedup_tool_calls
    assert preset.algorithm.igpo.infra_failure == "keep"


def test_turns_match_the_reference():
    """Tag fixing, parsing (kind, tool name, arguments, answer) and the format check, case by case."""
    differ = []
    for case in GOLDEN["turns"]:
        fixed = reference_tag_fix(case["text"], case["think_prefilled"])
        parsed = parse_turn_reference(fixed)
        ours = {
            "tag_fixed": fixed, "kind": {"malformed": "error"}.get(parsed.kind, parsed.kind),
            "name": parsed.name if parsed.kind == "tool_call" else None,
            "arguments": parsed.arguments if parsed.kind == "tool_call" else None,
            "answer": parsed.answer if parsed.kind == "answer" else None,
            "format_ok": reference_turn_ok(fixed, case["final"]),
        }
        theirs = {k: case[k] for k in ours}
        if ours != theirs:
            differ.append((case["text"], ours, theirs))
    assert not differ, "turn cases differing from DR-Venus' agent loop / format_checker:\n" + "\n".join(map(str, differ))


def test_our_default_turn_check_differs_from_the_reference_where_the_readme_says():
    """Our rules on the same texts (no tag fixing; <think> optional; a <tool_response> in a turn is malformed; a
    tool name must be a non-empty string): they disagree with the reference on some cases, which is why the preset
    switches turn_rules. The count is printed for docs/methods/igpo.md, and must stay > 0 (else the option is moot)."""
    disagree = 0
    for case in GOLDEN["turns"]:
        check = check_answer_turn if case["final"] else check_tool_turn
        disagree += check(case["text"], think_prefilled=case["think_prefilled"]) != case["format_ok"]
    print(f"our default turn check disagrees with the reference on {disagree} of {len(GOLDEN['turns'])} turns")
    assert disagree > 0


@pytest.fixture(scope="module")
def ours():
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose(config_name="igpo_trainer")


@pytest.mark.parametrize("script", ["drvenus_train_igpo", "igpo_policy_optimization"])
def test_every_reference_launch_key_is_ours_or_refused(ours, script):
    """Each override key of the reference launch scripts is a key of our composed config (verl's, same meaning) or
    refused at start-up naming ours; none may be added by "+" and ignored."""
    silent = []
    for key in GOLDEN["launch"][script]:
        bare = key.lstrip("+")
        try:
            refuse_reference_overrides([f"{key}=1"])
        except ValueError as error:
            assert " -> " in str(error) and bare in str(error)
            continue
        if OmegaConf.select(ours, bare, default=_ABSENT) is _ABSENT:
            silent.append(key)
    assert not silent, f"{script} keys neither in our config nor refused (add them to REFERENCE_LAUNCH_KEYS): {silent}"


def test_fork_only_values_are_refused():
    for override in ("reward_model.reward_manager=naive_batch",
                     "actor_rollout_ref.rollout.agent.agent_loop_config_path=configs/dr_agent_loop.yaml"):
        with pytest.raises(ValueError, match="nothing:"):
            refuse_reference_overrides([override])
    refuse_reference_overrides(["reward_model.reward_manager=naive", "trainer.logger=[console]"])


@pytest.mark.parametrize("override, ours_key", [
    ("+actor_rollout_ref.rollout.agent.completion_cutoff=0.9", "algorithm.igpo.agent.completion_cutoff"),
    ("algorithm.info_gain_norm_mode=joint", "algorithm.igpo.norm_mode"),
    ("+max_turns=200", "algorithm.igpo.agent.max_turns"),
])
def test_the_entry_point_exits_2_naming_our_key(override, ours_key, monkeypatch, capsys):
    """Before Hydra composes anything: exit 2 and our key in the message. ``python -m igpo.main --dry-run <override>``
    run as runpy runs it for ``-m``, in this process (a fresh Python would only import torch again)."""
    monkeypatch.setattr(sys, "argv", ["igpo.main", "--dry-run", override])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exited:
        # another test module may have imported igpo.main already; under `python -m` nothing has
        warnings.filterwarnings("ignore", message="'igpo.main' found in sys.modules", category=RuntimeWarning)
        runpy.run_module("igpo.main", run_name="__main__", alter_sys=True)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr[-2000:]
    assert "igpo: configuration error" in stderr and ours_key in stderr


# ---- the advantage: DR-Venus' grpo_info_gain estimator on random batches --------------------------------------------
ADVANTAGE_TOL = 1e-5


def _advantage_trainer(preset, config: dict):
    """The igpo_sync trainer's advantage path with the preset's algorithm section and the batch's settings (answer
    log-probs read from the records, score_on=rollout, so no actor is needed; IG active: no warm-up gate). Built
    through the trainer's pipeline (igpo.integration.pipeline), without Ray or workers."""
    from igpo.integration.methods.igpo import IGPOMethod

    algorithm = OmegaConf.merge(preset.algorithm, {
        "gamma": config["gamma"], "norm_adv_by_std_in_grpo": config["norm_adv_by_std"],
        "igpo": {"score_on": "rollout", "ig_warmup_threshold": 0.0, "norm_mode": config["norm_mode"],
                 "ig_weight": config["ig_weight"], "adaptive_gamma_min_weight": config["adaptive_gamma_min_weight"],
                 "ig_tool_filter": config["ig_tool_filter"], "format_penalty_scale": config["format_penalty_scale"]}})
    curriculum = config["curriculum"]
    if curriculum:
        algorithm = OmegaConf.merge(algorithm, {"igpo": {"use_curriculum": True, **{
            f"curriculum_{key}": curriculum[key] for key in ("f1_init", "f1_final", "ig_init", "ig_final")}}})
    step, total = (curriculum["step"], curriculum["total"]) if curriculum else (1, 10)
    return IGPOMethod(OmegaConf.create({"algorithm": algorithm})), step, total


def _agent_loop_batch(records: list[dict]):
    """What the trainer reads for a batch: the agent loop's extra_fields, the uids, the loss mask (generated tokens;
    observations untrained; an empty turn ends on the untrained end-of-turn token the loop appends) and rm_scores
    (the outcome on the last response token)."""
    masks, extras = [], []
    for rec in records:
        mask, ends = [], []
        for gen, obs, *_ in rec["turns"]:
            mask += [True] * gen if gen else [False]
            ends.append(len(mask) - 1)
            mask += [False] * obs
        masks.append(mask)
        turns = rec["turns"]
        extras.append({"igpo_num_turns": len(turns), "igpo_turn_ends": ends,
                       "igpo_tool_names": [t[2] for t in turns], "igpo_tool_status": [t[3] for t in turns],
                       "igpo_turn_format_ok": [bool(t[4]) for t in turns],
                       "igpo_answer_logprobs": [None if t[5] is None else [t[5]] for t in turns],
                       "igpo_empty_turns": sum(t[0] == 0 for t in turns)})
    length = max(len(m) for m in masks)
    response_mask = torch.zeros(len(records), length, dtype=torch.bool)
    rm_scores = torch.zeros(len(records), length)
    for i, (rec, mask) in enumerate(zip(records, masks)):
        response_mask[i, :len(mask)] = torch.tensor(mask)
        rm_scores[i, len(mask) - 1] = rec["outcome"]
    return extras, [f"q{rec['g']}" for rec in records], response_mask, rm_scores


def _our_advantage(preset, case) -> list[list[float]]:
    extras, uids, response_mask, rm_scores = _agent_loop_batch(case["records"])
    method, step, total = _advantage_trainer(preset, case["config"])
    advantages, _ = harness.run(method, extras, uids, response_mask, rm_scores, step=step, total=total)
    return [advantages[i][response_mask[i]].double().tolist() for i in range(len(extras))]


def _expand(runs) -> list[float]:
    return [value for value, count in runs for _ in range(count)]


def test_golden_advantage_batches_cover_what_the_estimator_must_handle():
    cases = GOLDEN["advantage"]["cases"]
    turns = [t for case in cases for rec in case["records"] for t in rec["turns"]]
    assert len(cases) >= 40 and {c["config"]["norm_mode"] for c in cases} == {"joint", "separate", "scaled_separate",
                                                                               "raw_ig"}
    assert sum(t[3] == "infra_error" for t in turns) >= 20  # tool timeouts
    assert sum(t[5] is None for t in turns) >= 20  # failed scorings (failed boundaries)
    assert sum(not t[4] for t in turns) >= 20  # format penalties
    assert sum(t[3] == "malformed" for t in turns) >= 20
    assert sum(t[0] == 0 for t in turns) >= 20  # empty turns (aborted generations)
    assert sum(1 for c in cases if c["config"]["curriculum"]) >= 10
    repeated = sum(a[5] is not None and a[5] == b[5] for c in cases for r in c["records"]
                   for a, b in zip(r["turns"], r["turns"][1:]))
    assert repeated >= 10  # an IG of exactly 0 (the reference writes it as 1e-10 to keep the position)


@pytest.mark.parametrize("case", GOLDEN["advantage"]["cases"], ids=lambda c: f"seed{c['seed']}-{c['config']['norm_mode']}")
def test_advantage_matches_the_reference_estimator(preset, case):
    """Each batch through the trainer's own advantage path under the preset against the reference's pipeline
    (KV-cache IG lists, tool-filter expansion, format penalty in the IG slot, token rewards on <|im_end|>,
    grpo_info_gain): the advantage of every generated token."""
    ours = _our_advantage(preset, case)
    differ = []
    for i, (row, theirs) in enumerate(zip(ours, case["advantages"])):
        theirs = _expand(theirs)
        assert len(row) == len(theirs), (i, len(row), len(theirs))
        worst = max((abs(a - b) for a, b in zip(row, theirs)), default=0.0)
        if worst > ADVANTAGE_TOL:
            differ.append((i, worst, case["records"][i]))
    assert not differ, f"trajectories differing from DR-Venus' grpo_info_gain: {differ}"
