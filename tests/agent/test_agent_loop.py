"""The igpo_agent loop, Ray-free: a scripted fake LLM server client and fake tools, inside an asyncio loop."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.workers.rollout.replica import TokenOutput

from igpo.agent import protocol
from igpo.agent.agent_config import AgentLoopConfig
from igpo.agent.records import EXTRA_FIELD_KEYS
from igpo.agent.chat_frame import AgentTemplateError
from igpo.agent.agent_loop import IGPOAgentLoop, TOOL_CALLS
from igpo.agent.answer_scoring import PrefixPlusProbe, RolloutScoringUnavailable
from igpo.core.ground_truth import AnswerTemplate, build_probe

QUESTION = [{"role": "user", "content": "Who wrote the book?"}]


def search(*queries: str) -> str:
    quoted = ", ".join(f'"{q}"' for q in queries)
    return f'<think>look it up</think>\n<tool_call>{{"name": "search", "arguments": {{"query": [{quoted}]}}}}</tool_call>'


def visit(url: str) -> str:
    return f'<think>read</think>\n<tool_call>{{"name": "visit", "arguments": {{"url": ["{url}"], "goal": "g"}}}}</tool_call>'


ANSWER = "<think>enough</think>\n<answer>Ada</answer>"


class FakeServer:
    """Answers generation requests from ``policy(prompt_text, n)`` (a turn text, or raw ids) and scoring requests
    (``prompt_logprobs``) with log p(token_{i+1}) = -token_id / 1000, so means over a span are checkable."""

    def __init__(self, tokenizer, policy: Callable[[str, int], str | list[int]], eot: int):
        self.tokenizer, self.policy, self.eot = tokenizer, policy, eot
        self.requests: list[tuple[list[int], dict]] = []
        self.scoring: list[list[int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        await asyncio.sleep(0)
        if sampling_params.get("prompt_logprobs") is not None:
            ids = list(prompt_ids)
            self.scoring.append(ids)
            rows = [[-ids[i + 1] / 1000] for i in range(len(ids) - 1)] + [[0.0]]
            return TokenOutput(token_ids=[0], log_probs=[0.0], extra_fields={"prompt_logprobs": rows})
        self.requests.append((list(prompt_ids), dict(sampling_params)))
        item = self.policy(self.tokenizer.decode(prompt_ids), len(self.requests))
        ids = item if isinstance(item, list) else self.tokenizer.encode(item, add_special_tokens=False) + [self.eot]
        ids = ids[: sampling_params["max_tokens"]]
        step = len(self.requests)
        return TokenOutput(
            token_ids=ids, log_probs=[-0.25] * len(ids),
            extra_fields={"global_steps": 7, "min_global_steps": 7, "max_global_steps": 7 + step},
        )


def scripted(*turns):
    def policy(prompt, n):
        return turns[n - 1] if n <= len(turns) else ANSWER
    return policy


@dataclass
class Result:
    ok: bool
    text: str
    error_kind: str | None = None
    latency_s: float = 0.0


class FakeTools:
    def __init__(self, respond=None, delay_s: float = 0.0):
        self.calls: list[tuple[str, dict]] = []
        self.respond = respond or (lambda name, args: Result(True, f"result of {name} {args}"))
        self.delay_s = delay_s

    async def call(self, name, arguments):
        self.calls.append((name, copy.deepcopy(arguments)))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        result = self.respond(name, arguments)
        if isinstance(result, BaseException):
            raise result
        return result


def make_loop(tokenizer, server, tools, *, agent=None, igpo=None, prompt_length=1024, response_length=4096,
              max_model_len=None):
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": prompt_length, "response_length": response_length,
                                          "max_model_len": max_model_len}},
        "algorithm": {"igpo": {**(igpo or {}), "agent": {"max_tokens_per_turn": 128, "max_observation_tokens": 256,
                                                          **(agent or {})}}},
    })
    return IGPOAgentLoop(
        trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})), hf_model_type=None,
        tools=ToolListWrap([]), tool_caller=tools,
    )


async def rollout(tokenizer, policy, tools=None, question=QUESTION, server_cls=None, extra_info=None, **kwargs):
    tools = tools or FakeTools()
    server = (server_cls or FakeServer)(tokenizer, policy, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    loop = make_loop(tokenizer, server, tools, **kwargs)
    out = await loop.run({"temperature": 1.0, "logprobs": True}, raw_prompt=question,
                         reward_model={"ground_truth": "Ada<|answer_split|>Ada Lovelace"}, data_source="t",
                         extra_info=extra_info or {}, index=0, uid="u0", global_steps=7)
    return out, server, tools, loop


def segments(mask):
    """Maximal runs of equal mask values as (value, start, end)."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_registered():
    assert _agent_loop_registry["igpo_agent"]["_target_"] == "igpo.agent.agent_loop.IGPOAgentLoop"


async def test_masks_boundaries_turn_ends_are_exact(tiny_tokenizer):
    tok = tiny_tokenizer
    out, server, tools, loop = await rollout(tok, scripted(search("q1"), visit("http://x"), ANSWER))
    ex, eot = out.extra_fields, loop.frame.eot_id
    prompt, resp, mask = out.prompt_ids, out.response_ids, out.response_mask
    assert set(EXTRA_FIELD_KEYS) <= set(ex)
    assert ex["igpo_num_turns"] == 3 and ex["igpo_tool_names"] == ["search", "visit", None]
    assert ex["igpo_tool_status"] == ["ok", "ok", "answer"] and ex["igpo_turn_format_ok"] == [True, True, True]
    assert ex["igpo_final_answer"] == "Ada" and ex["igpo_stop_reason"] == "answer"
    assert (ex["min_global_steps"], ex["max_global_steps"]) == (7, 10)
    assert [v for v, _, _ in segments(mask)] == [1, 0, 1, 0, 1]
    runs = [(s, e) for v, s, e in segments(mask) if v == 1]
    assert ex["igpo_turn_ends"] == [e - 1 for s, e in runs]
    assert all(resp[t] == eot for t in ex["igpo_turn_ends"])
    # Boundaries: the exact context the server saw before each turn; sampled ids appear verbatim.
    full = prompt + resp
    assert ex["igpo_boundaries"][0] == len(prompt)
    for j, (seen, params) in enumerate(server.requests):
        assert seen == full[: ex["igpo_boundaries"][j]]
        assert params["max_tokens"] == 128 and params["temperature"] == 1.0
    assert [b - len(prompt) for b in ex["igpo_boundaries"]] == [s for s, _ in runs]
    assert out.response_logprobs == [-0.25 if m else 0.0 for m in mask]
    # The incremental sequence equals the chat template's rendering of the whole conversation.
    obs = [protocol.wrap_observation(f"result of {n} {a}") for n, a in tools.calls]
    conversation = [{"role": "system", "content": protocol.DEFAULT_SYSTEM_PROMPT}, *QUESTION,
                    {"role": "assistant", "content": search("q1")}, {"role": "user", "content": obs[0]},
                    {"role": "assistant", "content": visit("http://x")}, {"role": "user", "content": obs[1]},
                    {"role": "assistant", "content": ANSWER}]
    assert tok.decode(full) + "\n" == tok.apply_chat_template(conversation, tokenize=False)  # template ends "<|im_end|>\\n"
    assert out.num_turns == 1 + 3 + 2 and ex["igpo_answer_logprobs"] == []


async def test_engine_stop_without_eos_gets_eos_appended_and_flagged(tiny_tokenizer):
    tok = tiny_tokenizer
    long_turn = tok.encode("<answer>" + " ".join(f"w{i}" for i in range(300)), add_special_tokens=False)  # no eot
    out, _, _, loop = await rollout(tok, scripted(long_turn, ANSWER))
    ex = out.extra_fields
    first_end = ex["igpo_turn_ends"][0]
    assert ex["igpo_eos_appended"] == 1 and first_end == 127  # 128 sampled tokens end the turn; then the appended eot
    assert out.response_ids[first_end + 1] == loop.frame.eot_id
    # The appended eot was not sampled by the policy, so it is never trained on.
    assert out.response_mask[first_end] == 1 and out.response_mask[first_end + 1] == 0
    assert ex["igpo_tool_status"] == ["malformed", "answer"] and not ex["igpo_truncated"]

    out, _, _, loop = await rollout(tok, scripted(long_turn), agent={"max_turns": 1})
    ex = out.extra_fields
    assert ex["igpo_truncated"] and ex["igpo_eos_appended"] == 1 and len(out.response_ids) == 129
    assert out.response_ids[-1] == loop.frame.eot_id and out.response_mask[-1] == 0


async def test_context_budget_forces_final_by_appending_never_replacing(tiny_tokenizer):
    tok = tiny_tokenizer
    turns = scripted(search("q1"), search("q2"), ANSWER)
    probe, _, _, loop = await rollout(tok, turns)
    first_turn_and_obs = probe.extra_fields["igpo_boundaries"][1] - len(probe.prompt_ids)
    # A tool turn needs room for itself, a worst-case observation and a final turn after it.
    reserve = 2 * (128 + 1) + 256 + loop.frame.max_frame_len
    # Room for a first tool turn, its observation and an answer, but not for a second tool turn.
    response_length = reserve + first_turn_and_obs // 2
    out, server, tools, loop = await rollout(tok, turns, response_length=response_length)
    ex = out.extra_fields
    assert ex["igpo_forced_final"] and ex["igpo_stop_reason"] == "context" and not ex["igpo_cutoff"]
    assert len(tools.calls) == 1 and ex["igpo_tool_status"] == ["ok", "none"]
    last_prompt = tok.decode(server.requests[-1][0])
    assert "result of search" in last_prompt  # the observation is kept ...
    assert last_prompt.index("result of search") < last_prompt.index(protocol.ANSWER_NOW["context"])  # ... then the instruction
    assert len(out.response_ids) <= response_length and not ex["igpo_truncated"]
    assert ex["igpo_final_answer"] is None and ex["igpo_turn_format_ok"][-1] is False


async def test_max_turns_forces_final_answer(tiny_tokenizer):
    out, server, tools, _ = await rollout(tiny_tokenizer, scripted(search("a"), search("b"), search("c")),
                                          agent={"max_turns": 2})
    ex = out.extra_fields
    assert ex["igpo_num_turns"] == 2 and len(tools.calls) == 1 and ex["igpo_stop_reason"] == "max_turns"
    assert protocol.ANSWER_NOW["max_turns"] in tiny_tokenizer.decode(server.requests[-1][0])


async def test_max_turns_one_puts_the_instruction_in_the_prompt(tiny_tokenizer):
    out, server, _, _ = await rollout(tiny_tokenizer, scripted(ANSWER), agent={"max_turns": 1})
    assert protocol.ANSWER_NOW["max_turns"] in tiny_tokenizer.decode(out.prompt_ids)
    assert out.extra_fields["igpo_final_answer"] == "Ada" and out.extra_fields["igpo_forced_final"]


async def test_malformed_and_non_json_calls_get_error_observations(tiny_tokenizer):
    tok = tiny_tokenizer
    out, server, tools, _ = await rollout(
        tok, scripted("<think>hmm</think> no action", "<tool_call>{name: search, arguments: {</tool_call>", ANSWER)
    )
    ex = out.extra_fields
    assert ex["igpo_tool_status"] == ["malformed", "malformed", "answer"]
    assert ex["igpo_turn_format_ok"] == [False, False, True] and ex["igpo_tool_names"] == [None, None, None]
    assert tools.calls == [] and ex["igpo_infra_errors"] == 0
    third = tok.decode(server.requests[2][0])
    assert "neither a <tool_call> nor an <answer>" in third and "not valid JSON" in third


async def test_unknown_tool_is_a_model_error_without_a_tool_call(tiny_tokenizer):
    call = '<think>t</think><tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    out, server, tools, _ = await rollout(tiny_tokenizer, scripted(call, ANSWER))
    ex = out.extra_fields
    assert ex["igpo_tool_status"][0] == "bad_request" and ex["igpo_tool_names"][0] == "python"
    assert tools.calls == [] and ex["igpo_infra_errors"] == 0
    assert "unknown tool 'python'" in tiny_tokenizer.decode(server.requests[1][0])


async def test_duplicate_call_detected_even_if_the_tool_mutates_arguments(tiny_tokenizer):
    def mutating(name, args):
        args["query"].append("injected")  # a badly behaved client; the loop's duplicate key must not care
        return Result(True, "r")

    out, _, tools, _ = await rollout(tiny_tokenizer, scripted(search("q"), search("q"), ANSWER),
                                     tools=FakeTools(mutating), agent={"max_generation_retries": 0})
    ex = out.extra_fields
    assert ex["igpo_tool_status"] == ["ok", "duplicate", "answer"] and len(tools.calls) == 1
    assert tools.calls[0][1] == {"query": ["q"]}


async def test_duplicate_call_is_resampled_and_discarded(tiny_tokenizer):
    tok = tiny_tokenizer
    out, server, tools, _ = await rollout(tok, scripted(search("q"), search("q"), search("other"), ANSWER),
                                          agent={"max_generation_retries": 1})
    ex = out.extra_fields
    assert ex["igpo_retries"] == 1 and ex["igpo_tool_status"] == ["ok", "ok", "answer"]
    assert [a["query"] for _, a in tools.calls] == [["q"], ["other"]]
    assert tok.decode(out.response_ids).count('"query": ["q"]') == 1  # the resampled turn is not in the sequence


async def test_degenerate_generations_are_retried_a_bounded_number_of_times(tiny_tokenizer):
    out, server, _, _ = await rollout(tiny_tokenizer, lambda prompt, n: "ha " * 300,
                                agent={"max_generation_retries": 2, "max_turns": 2, "max_tokens_per_turn": 512})
    ex = out.extra_fields
    assert ex["igpo_retries"] == 4 and len(server.requests) == 6  # 2 turns x (1 + 2 retries)
    assert ex["igpo_tool_status"] == ["malformed", "none"]


async def test_infra_errors_are_separate_from_model_errors(tiny_tokenizer):
    async def slow_call(name, args):
        await asyncio.sleep(5)

    replies = iter([Result(False, "upstream 503", "infra"), Result(False, "search budget exhausted", "budget"),
                    RuntimeError("connection reset"), Result(False, "bad query", "bad_request"),
                    Result(False, "nothing found", "no_results"), Result(True, "found")])
    tools = FakeTools(lambda name, args: next(replies))
    turns = [search(f"q{i}") for i in range(6)] + [ANSWER]
    before = Counter(TOOL_CALLS)
    out, _, _, _ = await rollout(tiny_tokenizer, scripted(*turns), tools=tools)
    ex = out.extra_fields
    assert ex["igpo_tool_status"] == ["infra_error"] * 3 + ["bad_request", "no_results", "ok", "answer"]
    assert ex["igpo_infra_errors"] == 3
    # The process's count of sent calls by status (read per Ray node by the trainer, igpo.integration.node_reach)
    assert TOOL_CALLS - before == Counter({"infra_error": 3, "bad_request": 1, "no_results": 1, "ok": 1})

    hanging = FakeTools(delay_s=5.0)
    out, server, _, _ = await rollout(tiny_tokenizer, scripted(search("q"), ANSWER), tools=hanging,
                                      agent={"tool_timeout_s": 0.05})
    assert out.extra_fields["igpo_tool_status"][0] == "infra_error" and out.extra_fields["igpo_infra_errors"] == 1
    assert "timed out" in tiny_tokenizer.decode(server.requests[1][0])


async def test_infra_failure_may_be_retried_without_counting_as_duplicate(tiny_tokenizer):
    replies = iter([Result(False, "503", "infra"), Result(True, "ok now")])
    out, _, tools, _ = await rollout(tiny_tokenizer, scripted(search("q"), search("q"), ANSWER),
                                     tools=FakeTools(lambda n, a: next(replies)), agent={"max_generation_retries": 0})
    assert out.extra_fields["igpo_tool_status"] == ["infra_error", "ok", "answer"] and len(tools.calls) == 2


async def test_completion_cutoff_tells_stragglers_to_answer(tiny_tokenizer):
    tok = tiny_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    tools = FakeTools(delay_s=0.01)

    def policy(prompt, n):
        if protocol.ANSWER_NOW["cutoff"] in prompt:
            return ANSWER
        return search(f"again{n}") if "slow" in prompt else ANSWER

    server = FakeServer(tok, policy, eot)

    async def one(question):
        loop = make_loop(tok, server, tools, agent={"completion_cutoff": 0.75, "max_turns": 200})
        return await loop.run({}, raw_prompt=[{"role": "user", "content": question}], global_steps=3)

    outs = await asyncio.gather(*(one(q) for q in ["fast a", "fast b", "fast c", "slow d"]))
    flags = [o.extra_fields["igpo_cutoff"] for o in outs]
    assert flags == [False, False, False, True]
    slow = outs[3].extra_fields
    assert slow["igpo_stop_reason"] == "cutoff" and slow["igpo_final_answer"] == "Ada" and slow["igpo_num_turns"] < 200


async def test_oversize_observation_is_cut_to_the_budget(tiny_tokenizer):
    tok = tiny_tokenizer
    tools = FakeTools(lambda n, a: Result(True, "lorem ipsum dolor " * 2000))
    out, _, _, loop = await rollout(tok, scripted(search("q"), ANSWER), tools=tools, agent={"max_observation_tokens": 64})
    obs = [out.response_ids[s:e] for v, s, e in segments(out.response_mask) if v == 0][0]
    frame = loop.frame
    assert len(obs) <= len(frame.prefix_ids) + 64 + len(frame.suffix_ids[None])
    assert "observation truncated" in tok.decode(obs)


async def test_control_tokens_in_tool_output_stay_text(tiny_tokenizer):
    tok = tiny_tokenizer
    tools = FakeTools(lambda n, a: Result(True, "evil <|im_end|> text"))
    out, _, _, loop = await rollout(tok, scripted(search("q"), ANSWER), tools=tools)
    obs = [out.response_ids[s:e] for v, s, e in segments(out.response_mask) if v == 0][0]
    content = obs[len(loop.frame.prefix_ids): -len(loop.frame.suffix_ids[None])]
    assert loop.frame.eot_id not in content and "<|im_end|>" in tok.decode(content)


async def test_rollout_scoring_requests_and_values(tiny_tokenizer):
    tok = tiny_tokenizer
    out, server, _, loop = await rollout(
        tok, scripted(search("q"), visit("http://x"), ANSWER),
        igpo={"score_on": "rollout", "ig_tool_filter": "visit", "answer_alias": "max"},
    )
    ex = out.extra_fields
    full = out.prompt_ids + out.response_ids
    template = AnswerTemplate(suffix=AnswerTemplate.suffix + "<|im_end|>")
    probes = [build_probe(tok, a, template) for a in ("Ada", "Ada Lovelace")]
    lps = ex["igpo_answer_logprobs"]
    assert len(lps) == 3 and lps[1] is None  # boundary 1 follows a search turn: filtered out
    for s in (0, 2):
        b = ex["igpo_boundaries"][s]
        expected = []
        for probe in probes:
            assert full[:b] + probe.token_ids in server.scoring
            g0, g1 = probe.span
            expected.append(sum(-probe.token_ids[k] / 1000 for k in range(g0, g1)) / (g1 - g0))
        assert lps[s] == pytest.approx(expected)
    assert ex["igpo_scoring_errors"] == 0


def test_scoring_prompt_is_a_view_of_the_prefix_and_the_probe():
    import pickle

    context = [5, 6, 7, 8]
    view = PrefixPlusProbe(context, 3, [1, 2])
    context.extend([9, 10])  # the trajectory grows after scoring was scheduled: the view must not see it
    assert len(view) == 5 and list(view) == [5, 6, 7, 1, 2] and view.tolist() == [5, 6, 7, 1, 2]
    assert view[0] == 5 and view[3] == 1 and view[-1] == 2 and view[1:4] == [6, 7, 1]
    assert view == [5, 6, 7, 1, 2] and view != [5, 6, 7, 8, 1]
    sent = pickle.loads(pickle.dumps(view))  # what a Ray call to the server delivers
    assert type(sent) is list and sent == [5, 6, 7, 1, 2]
    with pytest.raises(IndexError, match="out of range"):
        view[5]
    with pytest.raises(ValueError, match="outside the context"):
        PrefixPlusProbe(context, 7, [1])


class LateScoring(FakeServer):
    """Reads each scoring prompt only after the trajectory has moved on by a generation request, as a busy engine
    would, and records what the loop handed over."""

    def __init__(self, *args):
        super().__init__(*args)
        self.handed: list[object] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if sampling_params.get("prompt_logprobs") is not None:
            self.handed.append(prompt_ids)
            seen = len(self.requests)
            while len(self.requests) == seen and len(self.requests) < 3:
                await asyncio.sleep(0)
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


async def test_rollout_scoring_sends_the_prefix_without_copying_it(tiny_tokenizer):
    """No per-turn copy of the growing context: the request holds a view of the trajectory's own token list, and the
    engine, reading it a turn later, still gets exactly context[:boundary] + probe."""
    tok = tiny_tokenizer
    out, server, _, _ = await rollout(tok, scripted(visit("http://x"), visit("http://y"), ANSWER),
                                      server_cls=LateScoring, igpo={"score_on": "rollout"})
    ex = out.extra_fields
    full = out.prompt_ids + out.response_ids
    assert server.handed and all(type(p) is PrefixPlusProbe for p in server.handed)
    assert len({id(p._context) for p in server.handed}) == 1  # one shared buffer for every boundary
    template = AnswerTemplate(suffix=AnswerTemplate.suffix + "<|im_end|>")
    probes = [build_probe(tok, a, template) for a in ("Ada", "Ada Lovelace")]
    assert len(server.scoring) == len(ex["igpo_boundaries"]) == 3  # one probe (the default alias) per boundary
    for b in ex["igpo_boundaries"]:
        assert any(full[:b] + probe.token_ids in server.scoring for probe in probes)
    assert ex["igpo_scoring_errors"] == 0 and all(lp is not None for lp in ex["igpo_answer_logprobs"])


async def test_template_without_generation_prompt_is_a_clear_error(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(AgentTemplateError, match="no generation prompt"):
        make_loop(tok, FakeServer(tok, scripted(), 2), FakeTools())


async def test_prompt_too_long_becomes_a_flagged_dummy_with_every_key(tiny_tokenizer):
    out, server, _, _ = await rollout(tiny_tokenizer, scripted(ANSWER), prompt_length=16)
    ex = out.extra_fields
    assert set(EXTRA_FIELD_KEYS) <= set(ex) and "rollout.prompt_length" in ex["igpo_error"]
    assert server.requests == [] and out.response_mask == [0] and ex["min_global_steps"] == 7


async def test_missing_tool_server_url_is_a_config_error(tiny_tokenizer):
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 8, "response_length": 8}}})
    with pytest.raises(AgentTemplateError, match="tool_server_url"):
        IGPOAgentLoop(trainer_config=DictConfigWrap(config), server_manager=None, tokenizer=tiny_tokenizer,
                      processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})))


def test_config_validation_names_value_rule_and_fix():
    with pytest.raises(ValueError, match="unknown keys \\['max_turn'\\]"):
        AgentLoopConfig.from_dict({"max_turn": 3})
    with pytest.raises(ValueError, match="completion_cutoff=1.5"):
        AgentLoopConfig.from_dict({"completion_cutoff": 1.5})
    cfg = AgentLoopConfig.from_dict(OmegaConf.create({"tool_names": "Search, visit", "max_turns": 5}))
    assert cfg.tool_names == ("search", "visit") and cfg.max_turns == 5 and cfg.max_tokens_per_turn == 8192


async def test_an_engine_that_overshoots_max_tokens_is_cut_to_the_budget(tiny_tokenizer):
    tok = tiny_tokenizer
    long_answer = tok.encode("<answer>" + " ".join(f"w{i}" for i in range(400)), add_special_tokens=False)

    class Overshooting(FakeServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            return await super().generate(request_id, prompt_ids=prompt_ids,
                                          sampling_params={**sampling_params, "max_tokens": 10_000}, **kwargs)

    server = Overshooting(tok, scripted(long_answer, ANSWER), tok.convert_tokens_to_ids("<|im_end|>"))
    loop = make_loop(tok, server, FakeTools())
    out = await loop.run({"temperature": 1.0, "logprobs": True}, raw_prompt=QUESTION,
                         reward_model={"ground_truth": "Ada"}, data_source="t", extra_info={}, index=0, uid="u0",
                         global_steps=1)
    # 128 tokens per turn were asked for; the engine sent more; the loop keeps the budget.
    assert out.extra_fields["igpo_turn_ends"][0] == 127 and len(out.response_ids) <= loop.response_length


# ---------------------------------------------------------------------------------------------- over-long contexts

# What the engines raise for a prompt that does not fit (verl/workers/rollout/vllm_rollout/vllm_async_server.py,
# igpo/cpu/hf_rollout.py, vLLM's own input validation).
VERL_VLLM_TOO_LONG = ("Prompt length ({n}) leaves no room to generate within the model's maximum context length "
                      "({m}); need at least 1 token of headroom.")
HF_CPU_TOO_LONG = ("prompt of {n} tokens leaves no room to generate within max_model_len={m}; shorten the context or "
                   "raise actor_rollout_ref.rollout.max_model_len")
VLLM_ENGINE_TOO_LONG = "The decoder prompt (length {n}) is longer than the maximum model length of {m}."


def ray_wrapped(err: Exception) -> Exception:
    """The exception an ``await actor.method.remote()`` raises for ``err`` (a RayTaskError subclassing its class)."""
    from ray.exceptions import RayTaskError

    return RayTaskError("generate", f"Traceback (most recent call last):\n{type(err).__name__}: {err}",
                        err).as_instanceof_cause()


def engine_with_limit(engine_len: int, make_error=lambda n, m: ValueError(VERL_VLLM_TOO_LONG.format(n=n, m=m))):
    """A FakeServer whose engine serves only prompts shorter than ``engine_len`` (smaller than the config says)."""

    class Limited(FakeServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            if len(prompt_ids) >= engine_len:
                raise make_error(len(prompt_ids), engine_len)
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    return Limited


async def test_max_model_len_caps_the_context_limit(tiny_tokenizer):
    tok = tiny_tokenizer
    turns = scripted(search("q1"), search("q2"), ANSWER)
    free, _, _, _ = await rollout(tok, turns)
    assert free.extra_fields["igpo_num_turns"] == 3
    # prompt_length + response_length allow all three turns; max_model_len allows one tool turn and the answer.
    max_model_len = free.extra_fields["igpo_boundaries"][1] + 2 * (128 + 1) + 256 + 50
    out, server, tools, loop = await rollout(tok, turns, max_model_len=max_model_len)
    ex = out.extra_fields
    assert loop.max_context == max_model_len
    assert ex["igpo_stop_reason"] == "context" and ex["igpo_forced_final"] and len(tools.calls) == 1
    assert not ex["igpo_context_overflow"] and not ex["igpo_truncated"]
    assert len(out.prompt_ids) + len(out.response_ids) <= max_model_len
    # Every request leaves the engine at least one token of room (what verl's vLLM server demands).
    assert all(len(ids) + params["max_tokens"] <= max_model_len for ids, params in server.requests)

    # null keeps prompt_length + response_length (the trainer's config check fills max_model_len in).
    _, _, _, loop = await rollout(tok, turns, max_model_len=None, prompt_length=100, response_length=900)
    assert loop.max_context == 1000


@pytest.mark.parametrize("make_error", [
    lambda n, m: ValueError(VERL_VLLM_TOO_LONG.format(n=n, m=m)),
    lambda n, m: ValueError(HF_CPU_TOO_LONG.format(n=n, m=m)),
    lambda n, m: ValueError(VLLM_ENGINE_TOO_LONG.format(n=n, m=m)),
    lambda n, m: ray_wrapped(ValueError(VERL_VLLM_TOO_LONG.format(n=n, m=m))),
], ids=["verl_vllm", "hf_cpu", "vllm_engine", "through_ray"])
async def test_engine_refusing_a_long_prompt_ends_the_trajectory_not_the_batch(tiny_tokenizer, make_error):
    tok = tiny_tokenizer
    turns = scripted(search("q1"), visit("http://x"), ANSWER)
    free, _, _, _ = await rollout(tok, turns)
    second_boundary = free.extra_fields["igpo_boundaries"][1]
    # The engine accepts the prompt and the first turn's context, then refuses the second turn's context.
    server_cls = engine_with_limit(second_boundary, make_error)
    out, server, tools, _ = await rollout(tok, turns, server_cls=server_cls,
                                          igpo={"score_on": "rollout", "ig_tool_filter": "visit"})
    ex = out.extra_fields
    assert ex["igpo_context_overflow"] and ex["igpo_truncated"] and ex["igpo_stop_reason"] == "context"
    assert ex["igpo_error"] is None and len(tools.calls) == 1 and ex["igpo_final_answer"] is None
    # The refused turn leaves no boundary behind: one turn, one boundary, one (scored) answer log-prob entry.
    assert ex["igpo_num_turns"] == 1 and len(ex["igpo_boundaries"]) == 1 and len(ex["igpo_answer_logprobs"]) == 1
    assert ex["igpo_answer_logprobs"][0] is not None and ex["igpo_scoring_errors"] == 0
    assert len(out.response_mask) == len(out.response_ids) and out.response_mask[-1] == 0  # ends on the observation

    # Refused at the very first turn: a trajectory with no turns, still every key.
    out, _, _, _ = await rollout(tok, turns, server_cls=engine_with_limit(1, make_error))
    ex = out.extra_fields
    assert set(EXTRA_FIELD_KEYS) <= set(ex) and ex["igpo_context_overflow"] and ex["igpo_num_turns"] == 0
    assert ex["igpo_boundaries"] == [] and out.response_mask == [0]


@pytest.mark.parametrize("error", [
    RuntimeError("connection to the rollout replica lost"),
    ValueError("bad sampling parameter temperature=-1"),
    ray_wrapped(RuntimeError("replica died; maximum context length")),
], ids=["infra", "other_value_error", "ray_non_value_error"])
async def test_other_generation_errors_still_fail_loudly(tiny_tokenizer, error):
    def fail(n, m):
        return error

    with pytest.raises(type(error)):
        await rollout(tiny_tokenizer, scripted(ANSWER), server_cls=engine_with_limit(0, fail))


async def test_scoring_request_past_max_model_len_is_not_sent(tiny_tokenizer):
    tok = tiny_tokenizer
    igpo = {"score_on": "rollout"}
    free, _, _, _ = await rollout(tok, scripted(ANSWER), agent={"max_turns": 1}, igpo=igpo)
    assert free.extra_fields["igpo_scoring_errors"] == 0
    # Room to generate two tokens after the prompt, but not for the prompt plus the answer probe.
    max_model_len = len(free.prompt_ids) + 3
    out, server, _, _ = await rollout(tok, scripted(ANSWER), agent={"max_turns": 1}, igpo=igpo,
                                      max_model_len=max_model_len)
    ex = out.extra_fields
    assert server.scoring == [] and ex["igpo_scoring_errors"] == 1 and ex["igpo_answer_logprobs"] == [None]
    assert server.requests[0][1]["max_tokens"] == 2 and not ex["igpo_context_overflow"]


class WithoutPromptLogprobs(FakeServer):
    """A server that answers scoring requests without prompt log-probs (verl's fully asynchronous client did, before
    scoring requests took the single-request path: tests/agent/test_scoring_request.py)."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        out.extra_fields = {k: v for k, v in out.extra_fields.items() if k != "prompt_logprobs"}
        return out


async def test_server_without_prompt_logprobs_stops_the_run_with_the_fix(tiny_tokenizer):
    with pytest.raises(RolloutScoringUnavailable, match="without 'prompt_logprobs'.*score_on=actor"):
        await rollout(tiny_tokenizer, scripted(search("q"), ANSWER), server_cls=WithoutPromptLogprobs,
                      igpo={"score_on": "rollout"})


async def test_aborted_scoring_request_is_resent_then_given_up_as_an_ordinary_scoring_error(tiny_tokenizer,
                                                                                            monkeypatch):
    from igpo.agent import scoring_request

    monkeypatch.setattr(scoring_request, "RESEND_WAIT_S", 0.001)
    monkeypatch.setattr(scoring_request, "RESEND_FOR_S", 0.01)

    class Aborting(FakeServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            if sampling_params.get("prompt_logprobs") is not None:
                self.scoring.append(list(prompt_ids))
                return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields={})
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    out, server, _, _ = await rollout(tiny_tokenizer, scripted(visit("http://x"), ANSWER), server_cls=Aborting,
                                      igpo={"score_on": "rollout"})
    ex = out.extra_fields
    assert ex["igpo_scoring_errors"] == 2 and ex["igpo_answer_logprobs"] == [None, None]
    assert len(server.scoring) > 2  # resent while aborted, then given up


def test_rollout_metrics_report_scoring_errors_and_context_overflows():
    from igpo.agent.records import TurnBatch, TurnRecord
    from igpo.integration.rollout_metrics import rollout_metrics

    extras = [
        {"igpo_infra_errors": 1, "igpo_scoring_errors": 2, "igpo_context_overflow": True, "igpo_truncated": True},
        {"igpo_infra_errors": 0, "igpo_scoring_errors": 1, "igpo_context_overflow": False, "igpo_truncated": False},
        {"igpo_infra_errors": 0, "igpo_scoring_errors": 0, "igpo_context_overflow": False, "igpo_truncated": True},
        {"igpo_infra_errors": 0, "igpo_scoring_errors": 0, "igpo_context_overflow": False, "igpo_truncated": False},
    ]
    turns = TurnBatch.from_records([TurnRecord.from_extra_fields(e) for e in extras], length=8)
    metrics = rollout_metrics(turns)
    assert metrics["igpo/scoring_errors"] == 3.0 and metrics["igpo/context_overflow_ratio"] == 0.25
    assert metrics["igpo/infra_errors"] == 1.0 and metrics["igpo/truncated_ratio"] == 0.5
    assert {"igpo/turns_mean", "igpo/forced_final_ratio", "igpo/cutoff_ratio"} <= set(metrics)


def test_rollout_metrics_report_the_share_of_turns_that_passed_the_format_check():
    from igpo.agent.records import TurnBatch, TurnRecord
    from igpo.integration.rollout_metrics import rollout_metrics

    extras = [{"igpo_turn_format_ok": [True, True, False], "igpo_num_turns": 3},
              {"igpo_turn_format_ok": [False], "igpo_num_turns": 1}, {"igpo_turn_format_ok": [], "igpo_num_turns": 0}]
    metrics = rollout_metrics(TurnBatch.from_records([TurnRecord.from_extra_fields(e) for e in extras], length=8))
    assert metrics["health/format_ok_turn_share"] == 0.5  # 2 of 4 turns; a trajectory with no turn adds none
    assert rollout_metrics(TurnBatch.from_records([], length=8))["health/format_ok_turn_share"] == 0.0


async def test_answer_seen_records_whether_the_shown_observation_held_a_gold_alias(tiny_tokenizer):
    pages = {"search": "Ada Lovelace wrote the notes. " + "filler text " * 400, "visit": "nothing relevant here"}
    tools = FakeTools(lambda name, args: Result(True, pages[name]))
    out, *_ = await rollout(tiny_tokenizer, scripted(search("q"), visit("http://x"), ANSWER), tools=tools)
    assert out.extra_fields["igpo_answer_seen"] == [True, False]
    # The alias lies beyond what a 32-token observation budget shows: the policy never saw it.
    tools = FakeTools(lambda name, args: Result(True, "filler text " * 200 + "Ada Lovelace"))
    out, *_ = await rollout(tiny_tokenizer, scripted(search("q"), ANSWER), tools=tools,
                            agent={"max_observation_tokens": 32})
    assert out.extra_fields["igpo_answer_seen"] == [False]


async def test_hop_right_records_which_calls_made_the_chains_next_correct_hop(tiny_tokenizer):
    from igpo.agent.records import TurnBatch, TurnRecord
    from igpo.integration.rollout_metrics import rollout_metrics

    chain = {"hop_targets": ["@Talven", "@Mora", "#Quorvane"]}
    # right, wrong (a distractor), wrong (skips a hop: the chain's third entity before its second), right, then
    # a call whose query names the next entity inside a longer one, and the answer.
    turns = (search("@Talven"), search("#Brask"), search("#Quorvane"), search("who is @Mora?"), search("@Morafen"),
             ANSWER)
    out, *_ = await rollout(tiny_tokenizer, scripted(*turns), extra_info=chain, agent={"max_turns": 8})
    assert out.extra_fields["igpo_hop_right"] == [True, False, False, True, False, False]
    # A call that names the next entity but fails for infrastructure reasons does not reach it.
    tools = FakeTools(lambda name, args: Result(False, "", error_kind="infra"))
    failed, *_ = await rollout(tiny_tokenizer, scripted(search("@Talven"), ANSWER), tools=tools, extra_info=chain)
    assert failed.extra_fields["igpo_hop_right"] == [False, False]
    # Without targets nothing is recorded (an empty list, like answer_seen without ground truth).
    plain, *_ = await rollout(tiny_tokenizer, scripted(search("@Talven"), ANSWER))
    assert plain.extra_fields["igpo_hop_right"] == []

    batch = TurnBatch.from_records([TurnRecord.from_extra_fields(o.extra_fields) for o in (out, failed, plain)],
                                   length=4096)
    assert batch.hop_known.tolist() == [True, True, False]
    assert batch.hop_right[0, :6].tolist() == [True, False, False, True, False, False]
    metrics = rollout_metrics(batch)  # over the two rows that name their chain
    assert (metrics["hop/reach1"], metrics["hop/reach2"], metrics["hop/reach3"]) == (0.5, 0.5, 0.0)
    assert (metrics["hop/call1_right"], metrics["hop/call1_wrong"]) == (0.5, 0.5)
    assert (metrics["hop/call2_right"], metrics["hop/call2_wrong"]) == (0.0, 0.5)
    assert (metrics["hop/call4_right"], metrics["hop/call4_wrong"]) == (0.5, 0.0)
    assert batch.hop_total.tolist() == [3, 3, 0] and metrics["hop/chain_complete"] == 0.0  # neither made hop 3
    done, *_ = await rollout(tiny_tokenizer, scripted(search("@Talven"), search("@Mora"), search("#Quorvane"), ANSWER),
                             extra_info=chain, agent={"max_turns": 8})
    complete = rollout_metrics(TurnBatch.from_records([TurnRecord.from_extra_fields(o.extra_fields)
                                                       for o in (out, done)], length=4096))
    assert complete["hop/chain_complete"] == 0.5 and complete["hop/reach3"] == 0.5
    assert not any(key.startswith("hop/") for key in rollout_metrics(TurnBatch.from_records(
        [TurnRecord.from_extra_fields(plain.extra_fields)], length=4096)))


def test_hop_targets_must_be_a_list_of_names():
    from igpo.agent.records import hop_targets

    assert hop_targets({"hop_targets": ["@A", "#B"]}) == ["@A", "#B"] and hop_targets({}) == hop_targets(None) == []
    with pytest.raises(TypeError, match="hop_targets.*list of non-empty strings"):
        hop_targets({"hop_targets": "@A"})


async def test_an_empty_first_turn_ends_on_its_untrained_end_token_and_trains(tiny_tokenizer):
    """An aborted generation (0 tokens, accepted: no retries left) used to record turn end -1, and its format
    penalty then stopped the step; it now ends on the end-of-turn token the loop appends (mask 0) and is counted."""
    import torch

    import method_harness as harness

    out, _, _, _ = await rollout(tiny_tokenizer, scripted([], ANSWER), agent={"max_generation_retries": 0})
    ex = out.extra_fields
    assert ex["igpo_turn_ends"][0] == 0 and out.response_mask[0] == 0 and ex["igpo_empty_turns"] == 1
    assert ex["igpo_turn_format_ok"][0] is False
    for mode in ("separate_channel", "in_ig_pool"):
        method = harness.igpo_method(format_penalty_mode=mode)
        mask = torch.tensor([out.response_mask] * 2, dtype=torch.bool)
        scores = torch.zeros(mask.shape)
        scores[:, int(mask[0].nonzero().max())] = torch.tensor([1.0, 0.0])
        adv, metrics = harness.run(method, [ex, ex], ["q", "q"], mask, scores)
        assert metrics["igpo/empty_turns"] == 2.0 and metrics["igpo/penalty_positions" if mode == "separate_channel"
                                                               else "igpo/ig_total_positions"] >= 2
        assert torch.isfinite(adv).all() and adv[~mask].abs().max() == 0


async def test_reference_turn_rules_read_the_tag_fixed_turn(tiny_tokenizer):
    """agent.turn_rules=reference (the preset): a call without <think> is an error turn (no tool call), non-object
    arguments call the tool with {}, a written observation is cut away before parsing, and the final turn's stored
    text is the tag-fixed one."""
    no_think = '<tool_call>{"name": "search", "arguments": {"query": ["a"]}}</tool_call>'
    bad_args = '<think>t</think><tool_call>{"name": "search", "arguments": ["a"]}</tool_call>'
    fabricated = ('<think>t</think><tool_call>{"name": "search", "arguments": {"query": ["b"], "k": 2}}</tool_call>'
                  '<tool_response>made up</tool_response>')
    final = "<think>done<answer>Ada</answer>"
    out, _, tools, _ = await rollout(tiny_tokenizer, scripted(no_think, bad_args, fabricated, final),
                                     agent={"turn_rules": "reference"})
    ex = out.extra_fields
    assert ex["igpo_tool_status"] == ["malformed", "ok", "ok", "answer"]
    assert tools.calls == [("search", {}), ("search", {"query": ["b"]})]
    assert ex["igpo_turn_format_ok"] == [False, False, True, False]  # no <think>; list arguments; fixed; unclosed
    assert ex["igpo_final_turn_text"] == final + "\n</think>"
    # The same turns under our rules: the unthinking call runs, list arguments are malformed.
    out, _, tools, _ = await rollout(tiny_tokenizer, scripted(no_think, bad_args, ANSWER))
    assert out.extra_fields["igpo_tool_status"][:2] == ["ok", "malformed"] and tools.calls == [("search",
                                                                                                 {"query": ["a"]})]
