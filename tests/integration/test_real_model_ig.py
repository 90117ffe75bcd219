"""Golden information gain with a real language model: SmolLM2-135M-Instruct (igpo/demo/real_model.py), whose tokenizer
splits every demo name into several tokens and whose ChatML template is its own.

Real trajectories of the raw model come from ``IGPOAgentLoop`` through our HF rollout server (float32) and the
local tool service on the demo world. Every boundary's teacher-forced answer log-probability is then recomputed
(tests/support/golden_ig.py) with one plain ``AutoModelForCausalLM`` forward per (boundary, probe) over the exact token ids, with the answer span
located by decoding token prefixes (not by the tokenizer's offsets, which our ``build_probe`` uses), and compared
with (a) the actor-side packed scorer (``igpo.core.scoring``, fp32) and (b) the rollout-side values the loop got from
the server's ``prompt_logprobs``; IG is recomputed by the recurrence of igpo/core/info_gain.py written as a loop.

Cases: multi-token answers (every name: `#Quorvane` is 5 tokens), an answer whose first token merges with the text
before it (`"Vesk"` after `<answer>`: `>"` is one token), a leading space (`<answer> ` + name: `Ġ#`), and turns cut
by the length limit (max_tokens_per_turn=24: the raw model writes prose, never a call). Also: the ids the loop
trains on against the model's chat template applied to the same conversation (token-in-token-out). The same
comparison on trajectories through verl's vLLM rollout in the real trainer: tests/e2e/test_e2e_real_model.py.

Cost: the model is materialised into .cache/smollm2 once (~25 s); the rollout and the reference forwards take about
a minute on two busy cores.
"""

from __future__ import annotations

import asyncio
import difflib
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from golden_ig import EOT, PROBES, TOL, Trajectory, probes_for, reference_logprob, worst_differences
from igpo.agent.records import TurnRecord
from igpo.core.scoring import ScoringConfig, score_answer_logprobs
from igpo.demo import world as demo_world

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "wiki_passages_1000.jsonl"
MAX_TURNS, MAX_TOKENS_PER_TURN = 3, 24  # short turns: the raw model's prose is cut by the length limit
QUESTIONS = 3


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from igpo.demo.real_model import materialise

    return materialise(REPO / ".cache" / "smollm2")[0]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollouts(model_dir, tokenizer, tmp_path_factory):
    """(question, AgentLoopOutput) of the raw model on the first training questions of the demo world, every
    boundary scored on the rollout side (``ig_turns=all``: its malformed turns reach no tool)."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    from igpo.agent.agent_loop import IGPOAgentLoop
    from igpo.cpu.hf_rollout import HFRolloutServer
    from igpo.demo.warmstart import LocalTools

    paths = demo_world.write_world(tmp_path_factory.mktemp("world"), CORPUS)
    questions = demo_world.build_world().questions("train")[:QUESTIONS]
    tools = LocalTools(paths["corpus"], demo_world.TOPK)
    prompt_length, response_length = demo_world.PROMPT_LENGTH, demo_world.SMOLLM2_RESPONSE_LENGTH
    server = HFRolloutServer(str(model_dir), max_model_len=prompt_length + response_length,
                             response_length=response_length, dtype="float32", seed=0)
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": prompt_length, "response_length": response_length,
                                          "max_model_len": prompt_length + response_length}},
        "algorithm": {"igpo": {
            "score_on": "rollout", "ig_tool_filter": "", "ig_turns": "all",
            "answer_template_prefix": PROBES[0][1], "answer_template_suffix": PROBES[0][2],
            "agent": {"system_prompt": demo_world.SYSTEM_PROMPT, "tool_names": ["search"], "max_turns": MAX_TURNS,
                      "max_tokens_per_turn": MAX_TOKENS_PER_TURN,
                      "max_observation_tokens": demo_world.SMOLLM2_MAX_OBSERVATION_TOKENS}}},
    })

    async def run_all():
        loops = [IGPOAgentLoop(trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer,
                               processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                               hf_model_type="llama", tools=ToolListWrap([]), tool_caller=tools)
                 for _ in questions]
        return await asyncio.gather(*(
            loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
                     raw_prompt=[{"role": "user", "content": q.question}], reward_model={"ground_truth": q.answer},
                     data_source="demo_world", extra_info={}, index=i, uid=f"golden-{i}", global_steps=0)
            for i, (loop, q) in enumerate(zip(loops, questions))))

    try:
        outputs = tools.run(run_all)
    finally:
        tools.close()
    return list(zip(questions, outputs))


# ---- the tests ------------------------------------------------------------------------------------------------------


def test_the_cases_are_what_they_claim(tokenizer, rollouts):
    answer = rollouts[0][0].answer
    cases = {name: (ours, ref) for name, ours, ref in probes_for(tokenizer, answer)}
    ids, (gs, ge) = cases["demo"][1]
    assert ge - gs >= 3, tokenizer.convert_ids_to_tokens(ids[gs:ge])                  # a multi-token answer
    ids, (gs, _) = cases["merge"][1]
    assert tokenizer.convert_ids_to_tokens(ids[gs]) == '>"'                          # merged with the prefix's ">"
    ids, (gs, _) = cases["space"][1]
    assert tokenizer.convert_ids_to_tokens(ids[gs]).startswith("Ġ")                  # the leading space
    for ours, (ref_ids, ref_span) in cases.values():
        assert (ours.token_ids, ours.span) == (ref_ids, ref_span)
    cut = [TurnRecord.from_extra_fields(out.extra_fields).eos_appended for _, out in rollouts]
    assert sum(cut) >= 1, cut                                                       # turns cut by the length limit


def test_packed_and_rollout_scores_and_ig_match_plain_transformers(tokenizer, reference_model, rollouts):
    trajectories = [Trajectory(question.answer, list(out.prompt_ids), list(out.response_ids),
                               TurnRecord.from_extra_fields(out.extra_fields)) for question, out in rollouts]
    worst, boundaries = worst_differences(tokenizer, reference_model, trajectories)
    print(f"golden IG: {len(rollouts)} trajectories, {boundaries} boundaries x {len(PROBES)} probes; "
          "max |diff| " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert all(math.isfinite(v) and v <= TOL for v in worst.values()), worst


def test_a_span_shifted_by_one_token_fails_the_comparison(tokenizer, reference_model, rollouts):
    """The tolerance is not vacuous: scoring the demo probe with its span moved one token right (the answer's
    second token to the first suffix token) moves the score by far more than TOL at every boundary."""
    from igpo.core.ground_truth import Probe

    question, out = rollouts[0]
    record = TurnRecord.from_extra_fields(out.extra_fields)
    ids = list(out.prompt_ids) + list(out.response_ids)
    _, ours, (ref_ids, ref_span) = probes_for(tokenizer, question.answer)[0]
    shifted = Probe(ours.token_ids, (ours.span[0] + 1, ours.span[1] + 1))
    packed = score_answer_logprobs(reference_model, torch.tensor(ids), record.boundaries, [shifted],
                                   ScoringConfig(strategy="packed"))[:, 0]
    golden = torch.tensor([reference_logprob(reference_model, ids[:b], ref_ids, ref_span) for b in record.boundaries])
    assert float((packed.double() - golden.double()).abs().min()) > 100 * TOL


def conversation_of(tokenizer, out, record: TurnRecord) -> list[dict]:
    """The chat the loop held, as messages: its system and user messages, then each turn's decoded text (without
    the end-of-turn token) and each observation's content (between the frame's user header and its end-of-turn)."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    response, prompt_len = list(out.response_ids), len(out.prompt_ids)
    prompt_text = tokenizer.decode(out.prompt_ids)
    system = prompt_text.split("<|im_start|>system\n", 1)[1].split(EOT, 1)[0]
    user = prompt_text.split("<|im_start|>user\n", 1)[1].split(EOT, 1)[0]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for j, end in enumerate(record.turn_ends):
        turn = response[record.boundaries[j] - prompt_len:end + 1]
        messages.append({"role": "assistant", "content": tokenizer.decode(turn[:-1] if turn[-1:] == [eot] else turn)})
        following = record.boundaries[j + 1] - prompt_len if j + 1 < record.num_turns else len(response)
        observation = tokenizer.decode(response[end + 1:following])
        if "<|im_start|>user\n" in observation:
            messages.append({"role": "user",
                             "content": observation.split("<|im_start|>user\n", 1)[1].rsplit(EOT, 1)[0]})
    return messages


def test_token_in_token_out_against_the_chat_template(tokenizer, rollouts):
    """The ids the loop trains on vs the template applied to the same conversation and tokenised whole. Every
    difference is printed; the only ones allowed are a sampled turn that the tokenizer would split otherwise
    (the loop keeps the ids the policy sampled, as it must) — never in the prompt or an observation frame."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    total = 0
    for question, out in rollouts:
        record = TurnRecord.from_extra_fields(out.extra_fields)
        ids = list(out.prompt_ids) + list(out.response_ids)
        messages = conversation_of(tokenizer, out, record)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=ids[-1] != eot)
        templated = tokenizer.encode(text, add_special_tokens=False)
        if ids[-1] == eot:  # the template closes the last turn with "<|im_end|>\n"; the loop stops at <|im_end|>
            assert tokenizer.decode(templated[-1:]) == "\n"
            templated = templated[:-1]
        trained = [0] * len(out.prompt_ids) + list(out.response_mask)
        matcher = difflib.SequenceMatcher(a=ids, b=templated, autojunk=False)
        for tag, i0, i1, j0, j1 in matcher.get_opcodes():
            if tag == "equal":
                continue
            total += 1
            print(f"TITO difference ({question.question}): {tag} loop[{i0}:{i1}] "
                  f"{tokenizer.convert_ids_to_tokens(ids[i0:i1])} vs template[{j0}:{j1}] "
                  f"{tokenizer.convert_ids_to_tokens(templated[j0:j1])}")
            assert i1 > i0 and all(trained[i] for i in range(i0, i1)), \
                "a difference outside the sampled tokens: the loop's prompt or observation frame drifted"
            assert tokenizer.decode(ids[i0:i1]) == tokenizer.decode(templated[j0:j1])
    print(f"TITO: {total} difference(s) over {len(rollouts)} trajectories")
