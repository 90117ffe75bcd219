"""The arpo_agent loop, Ray-free: the M sessions of a prompt run as verl's v1 worker runs them (one coroutine each,
same uid, session ids 0..M-1), against a fake engine that answers top-K prompt_logprobs and fake tools."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.workers.rollout.replica import TokenOutput

from igpo.agent.arpo_loop import ARPOAgentLoop, ARPOSetupError
from igpo.agent.records import BRANCH_FIELD_KEYS as ARPO_FIELD_KEYS, TreeBatch, TurnRecord
from igpo.agent.agent_config import arpo_config_from
from igpo.core import arpo as core
from igpo.integration.rollout_metrics import arpo_metrics

QUESTION = [{"role": "user", "content": "Who wrote the book?"}]
ANSWER = "<think>enough</think>\n<answer>Ada</answer>"


def search(query: str) -> str:
    return f'<think>look</think>\n<tool_call>{{"name": "search", "arguments": {{"query": ["{query}"]}}}}</tool_call>'


class TreeServer:
    """Generation: a seeded RNG over the request count picks a search (up to ``max_calls`` observations seen) or the
    answer, so a branch samples something else than its source. Top-K prompt_logprobs: positions right after the
    prompt get a peaked distribution, later ones ``late`` (uniform: entropy 1), so ΔH is known."""

    def __init__(self, tokenizer, eot, *, seed=0, max_calls=2, answer_p=0.3, late="uniform"):
        self.tokenizer, self.eot, self.rng = tokenizer, eot, random.Random(seed)
        self.max_calls, self.answer_p, self.late = max_calls, answer_p, late
        self.generations = 0
        self.measures: list[tuple[int, int]] = []
        self.prompt_len: int | None = None

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        await asyncio.sleep(0)
        ids = list(prompt_ids)
        k = sampling_params.get("prompt_logprobs")
        if k is not None:
            self.measures.append((len(ids), k))
            peaked = [0.0] + [-30.0] * (k - 1)
            uniform = [-2.302585] * k
            # the first turn's measured positions (k = 20 tokens after the prompt) are peaked
            rows = [peaked if i < self.prompt_len + 20 or self.late == "peaked" else uniform
                    for i in range(len(ids) - 1)]
            return TokenOutput(token_ids=[0], log_probs=[0.0], extra_fields={"prompt_logprobs": rows + [[0.0] * k]})
        if self.prompt_len is None:
            self.prompt_len = len(ids)
        self.generations += 1
        calls = self.tokenizer.decode(ids[self.prompt_len:]).count("<tool_response>")  # observations so far
        if calls >= self.max_calls or self.rng.random() < self.answer_p:
            turn = ANSWER
        else:
            turn = search(f"q{self.rng.randrange(1000)}")
        out = (self.tokenizer.encode(turn, add_special_tokens=False) + [self.eot])[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=out, log_probs=[-0.5] * len(out),
                           extra_fields={"global_steps": 3, "min_global_steps": 3, "max_global_steps": 3})


class Tools:
    def __init__(self):
        self.calls = 0

    async def call(self, name, arguments):
        self.calls += 1
        await asyncio.sleep(0)

        class R:
            ok, error_kind = True, None
            text = f"found {arguments}"
        return R()


def config(m=4, **arpo):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": 1024, "response_length": 4096, "max_model_len": None,
                                          "n": m}},
        "algorithm": {"igpo": {"agent": {"max_tokens_per_turn": 128, "max_observation_tokens": 256, "max_turns": 6}},
                      "arpo": {"enabled": True, **arpo}},
    })


async def run_prompt(tokenizer, cfg, server, tools, *, uid="u0", temperature=1.0, step=3, index=5):
    """What verl's AgentLoopWorkerTQ._run_prompt does: n session coroutines of one prompt, created together."""
    n = int(cfg.actor_rollout_ref.rollout.n)

    async def session(i):
        loop = ARPOAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                             processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                             hf_model_type=None, tools=ToolListWrap([]), tool_caller=tools)
        return await loop.run({"temperature": temperature, "logprobs": True}, raw_prompt=QUESTION,
                              reward_model={"ground_truth": "Ada"}, data_source="t", extra_info={}, index=index,
                              uid=uid, global_steps=step, session_id=i)

    tasks = [asyncio.create_task(session(i)) for i in range(n)]
    return await asyncio.gather(*tasks)


def grow(tokenizer, m=4, seed=0, arpo_seed=0, **kw):
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    server_kw = {k: kw.pop(k) for k in ("max_calls", "answer_p", "late") if k in kw}
    server, tools = TreeServer(tokenizer, eot, seed=seed, **server_kw), Tools()
    outs = asyncio.run(run_prompt(tokenizer, config(m, seed=arpo_seed, **kw), server, tools))
    return outs, server, tools


def meta(outs):
    return [(o.extra_fields["arpo_index"], o.extra_fields["arpo_parent"], o.extra_fields["arpo_branch_pos"],
             o.extra_fields["arpo_is_topup"]) for o in outs]


def tree_metrics(outs):
    """The step's arpo/* metrics of these outputs, read back as the trainer reads them."""
    return arpo_metrics(TreeBatch.from_records([TurnRecord.from_extra_fields(o.extra_fields) for o in outs]))


def test_registered():
    assert _agent_loop_registry["arpo_agent"]["_target_"] == "igpo.agent.arpo_loop.ARPOAgentLoop"


def test_exactly_m_outputs_with_tree_metadata_and_prefix_identity(tiny_tokenizer):
    outs, server, tools = grow(tiny_tokenizer, m=6, branch_probability=1.0, entropy_weight=0.0, answer_p=0.0)
    assert len(outs) == 6
    assert [o.extra_fields["arpo_index"] for o in outs] == list(range(6))  # session i gets trajectory i
    assert all(set(ARPO_FIELD_KEYS) <= set(o.extra_fields) for o in outs)
    rows = meta(outs)
    assert [r[1] for r in rows[:3]] == [-1, -1, -1]  # N = M // 2 roots
    branches = [r for r in rows if r[1] >= 0]
    assert branches, rows  # tau = 1: every trajectory that reached a tool result can branch
    for index, parent, pos, topup in branches:
        assert parent < index and not topup and pos > 0
        src, br = outs[parent], outs[index]
        assert br.response_ids[:pos] == src.response_ids[:pos] and br.response_mask[:pos] == src.response_mask[:pos]
        # the branch point is right after a tool result (masked), and the branch's own turn follows (trained)
        assert br.response_mask[pos - 1] == 0 and br.response_mask[pos] == 1
        assert br.prompt_ids == src.prompt_ids
    # every branch resumed after an observation: ΔH measured on that turn, H_init inherited
    for o in outs:
        f = o.extra_fields
        if f["arpo_parent"] >= 0:
            assert f["arpo_h_init"] == outs[f["arpo_parent"]].extra_fields["arpo_h_init"]
    # the shared prefixes were replayed, not re-run: each tool call happened once
    shared_calls = sum(sum(1 for end, name in zip(outs[p].extra_fields["igpo_turn_ends"],
                                                  outs[p].extra_fields["igpo_tool_names"]) if name and end < pos)
                       for _, p, pos, _ in branches)
    total_calls = sum(sum(1 for name in o.extra_fields["igpo_tool_names"] if name) for o in outs)
    assert tools.calls == total_calls - shared_calls


def test_tool_results_are_masked_and_no_unsampled_eos_is_trained(tiny_tokenizer):
    outs, *_ = grow(tiny_tokenizer, m=4, branch_probability=1.0, entropy_weight=0.0)
    tok = tiny_tokenizer
    for o in outs:
        text_masked = tok.decode([t for t, m in zip(o.response_ids, o.response_mask) if m == 0])
        text_trained = tok.decode([t for t, m in zip(o.response_ids, o.response_mask) if m == 1])
        assert "found" not in text_trained and "<tool_response>" not in text_trained
        if any(name for name in o.extra_fields["igpo_tool_names"]):
            assert "found" in text_masked
        assert o.extra_fields["igpo_eos_appended"] == 0  # the engine's EOS ends every turn here; none was added


def test_branching_is_deterministic_under_a_fixed_seed(tiny_tokenizer):
    kw = dict(m=8, branch_probability=0.5, entropy_weight=0.3, answer_p=0.2)
    a, _, _ = grow(tiny_tokenizer, seed=1, arpo_seed=7, **kw)
    b, _, _ = grow(tiny_tokenizer, seed=1, arpo_seed=7, **kw)
    assert meta(a) == meta(b)
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    trees = {tuple(meta(grow(tiny_tokenizer, seed=1, arpo_seed=s, **kw)[0])) for s in range(6)}
    assert len(trees) > 1  # the seed drives the draws


def test_delta_h_is_measured_after_the_current_tool_result(tiny_tokenizer):
    # first turn peaked (H_init ~ 0), turns after an observation uniform (H = 1): every ΔH is ~ +1
    outs, server, _ = grow(tiny_tokenizer, m=4, branch_probability=0.0, entropy_weight=1.0, answer_p=0.0, max_calls=1)
    deltas = [d for o in outs for d in o.extra_fields["arpo_delta_h"]]
    assert deltas and all(d == pytest.approx(1.0, abs=1e-3) for d in deltas)
    assert all(o.extra_fields["arpo_h_init"] == pytest.approx(0.0, abs=1e-3) for o in outs)
    assert all(k == 10 for _, k in server.measures)  # top-K = 10 requested
    assert sum(o.extra_fields["arpo_parent"] >= 0 for o in outs) > 0  # P = clip(0 + 1 * 1) = 1
    # the same with a flat entropy: ΔH = 0 and τ = 0 never branches; the slots become top-ups
    outs, *_ = grow(tiny_tokenizer, m=4, branch_probability=0.0, entropy_weight=1.0, answer_p=0.0, max_calls=1,
                    late="peaked")
    assert [r[1] for r in meta(outs)] == [-1] * 4 and [r[3] for r in meta(outs)] == [False, False, True, True]


def test_prompts_that_finish_at_once_are_topped_up_in_one_round_without_duplicates(tiny_tokenizer):
    outs, server, tools = grow(tiny_tokenizer, m=6, initial_rollouts=2, answer_p=1.0)
    assert [r[3] for r in meta(outs)] == [False, False, True, True, True, True]
    assert {o.extra_fields["arpo_rounds"] for o in outs} == {2}  # round 1: the roots; round 2: all four top-ups
    assert server.generations == 6 and tools.calls == 0


def test_greedy_sampling_runs_plain_trajectories(tiny_tokenizer):
    eot = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    server = TreeServer(tiny_tokenizer, eot)
    outs = asyncio.run(run_prompt(tiny_tokenizer, config(3, branch_probability=1.0), server, Tools(), temperature=0))
    assert meta(outs) == [(0, -1, 0, False), (1, -1, 0, False), (2, -1, 0, False)]
    assert server.measures == []


def test_metrics_of_a_grown_batch(tiny_tokenizer):
    outs, *_ = grow(tiny_tokenizer, m=6, branch_probability=1.0, entropy_weight=0.0, answer_p=0.0)
    stats = tree_metrics(outs)
    n_branches = sum(o.extra_fields["arpo_parent"] >= 0 for o in outs)
    assert stats["arpo/branches_per_prompt"] == n_branches > 0
    assert stats["arpo/measured_turns"] > 0 and stats["arpo/delta_h_mean"] == pytest.approx(1.0, abs=1e-3)
    assert arpo_metrics(TreeBatch.from_records([TurnRecord(tool_names=["search"])])) == {}  # ARPO off: nothing logged


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"algorithm.arpo.rollouts_per_prompt=8 differs from actor_rollout_ref"):
        arpo_config_from(config(4, rollouts_per_prompt=8))
    with pytest.raises(ValueError, match=r"algorithm.arpo.initial_rollouts=5 exceeds"):
        arpo_config_from(config(4, initial_rollouts=5))
    with pytest.raises(ValueError, match=r"unknown key\(s\) algorithm.arpo.\['beam'\]"):
        arpo_config_from(config(4, beam=2))
    with pytest.raises(ValueError, match="algorithm.arpo.attribution='tree' is unknown"):
        arpo_config_from(config(4, attribution="tree"))
    cfg = arpo_config_from(config(16))
    assert (cfg.rollouts_per_prompt, cfg.initial_rollouts) == (16, 8)


def test_the_loop_refuses_a_completion_cutoff_and_the_legacy_trainer(tiny_tokenizer):
    cfg = config(2)
    cfg.algorithm.igpo.agent.completion_cutoff = 0.9
    with pytest.raises(ARPOSetupError, match="completion_cutoff=1.0"):
        asyncio.run(run_prompt(tiny_tokenizer, cfg, None, Tools()))

    async def legacy():
        loop = ARPOAgentLoop(trainer_config=DictConfigWrap(config(2)), server_manager=None, tokenizer=tiny_tokenizer,
                             processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                             hf_model_type=None, tools=ToolListWrap([]), tool_caller=Tools())
        return await loop.run({"temperature": 1.0}, raw_prompt=QUESTION, uid="u", global_steps=1)

    with pytest.raises(ARPOSetupError, match="trainer.use_v1=true"):
        asyncio.run(legacy())


def test_hf_server_returns_top_k_prompt_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from igpo.cpu.hf_rollout import HFRolloutServer

    server = HFRolloutServer(str(tiny_model_dir), max_model_len=64, response_length=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 300, 42, 9]
    out = asyncio.run(server.generate(prompt, {"max_tokens": 1, "prompt_logprobs": 10}, request_id="r"))
    rows, ids = out.extra_fields["prompt_logprobs"], out.extra_fields["prompt_ids"]
    assert len(rows) == len(prompt) and all(len(r) == 10 for r in rows) and rows[-1] == [0.0] * 10
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits.float().log_softmax(-1)[0, :-1]
    top = logp.topk(10, dim=-1)
    assert torch.allclose(torch.tensor(rows[:-1]), top.values, atol=1e-4)
    assert ids[:-1] == top.indices.tolist()
    h = core.step_entropy(torch.tensor([rows[:-1]]), torch.tensor([4]), core.ARPOConfig())
    assert 0.0 < float(h[0]) <= 1.0


class FlakyTools(Tools):
    """The first call times out (the loop's deadline), the second raises: a branch must replay both outcomes."""

    async def call(self, name, arguments):
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(5)
        if self.calls == 2:
            raise ConnectionError("upstream down")
        self.calls -= 1  # counted again by Tools.call
        return await super().call(name, arguments)


def test_branches_replay_tool_timeouts_and_failures_without_calling_again(tiny_tokenizer):
    eot = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    server, tools = TreeServer(tiny_tokenizer, eot, answer_p=0.0, max_calls=2), FlakyTools()
    cfg = config(4, initial_rollouts=2, branch_probability=1.0, entropy_weight=0.0)
    cfg.algorithm.igpo.agent.tool_timeout_s = 0.2
    outs = asyncio.run(run_prompt(tiny_tokenizer, cfg, server, tools))
    status = [o.extra_fields["igpo_tool_status"] for o in outs]
    assert [s[0] for s in status[:2]] == ["infra_error", "infra_error"]  # the roots' first calls failed
    for o in outs[2:]:
        parent = o.extra_fields["arpo_parent"]
        assert parent in (0, 1)  # a branch from the first tool result of a root: it inherits that failure
        assert o.extra_fields["igpo_tool_status"][0] == "infra_error" == status[parent][0]
    live = sum(len([s for s in st if s != "answer"]) for st in status) - sum(
        1 for o in outs[2:] for end, name in zip(outs[o.extra_fields["arpo_parent"]].extra_fields["igpo_turn_ends"],
                                                  status[o.extra_fields["arpo_parent"]])
        if name != "answer" and end < o.extra_fields["arpo_branch_pos"])
    assert tools.calls == live


@pytest.mark.parametrize("z", [2, 3])
def test_each_tool_result_gets_one_round_of_at_most_z_minus_1_branches(tiny_tokenizer, z):
    """Nested trees (branches of branches at later tool results): a branch's first turn, which starts at its branch
    point, is neither measured nor a branch point, so no tool result gets a second round through its own branch
    (before the fix: 13 of 36 branches over these seeds at z = 2 were such rebranches)."""
    nested = 0
    for seed in range(6):
        outs, server, _ = grow(tiny_tokenizer, m=8, seed=seed, initial_rollouts=2, branch_factor=z,
                               branch_probability=1.0, entropy_weight=0.0, answer_p=0.2, max_calls=3)
        rows = {r[0]: r for r in meta(outs)}
        per_point: dict[tuple[int, int], int] = {}
        for index, parent, pos, _ in rows.values():
            if parent < 0:
                continue
            assert not (rows[parent][1] >= 0 and rows[parent][2] == pos), (seed, rows)
            nested += rows[parent][1] >= 0
            per_point[(parent, pos)] = per_point.get((parent, pos), 0) + 1
        assert max(per_point.values(), default=0) <= z - 1, (seed, rows)
        assert tree_metrics(outs)["arpo/rebranch_same_point"] == 0.0
        # a branch measures only the turns after its own later tool results: one ΔH fewer than its turns after the prompt
        for o in outs:
            f = o.extra_fields
            if f["arpo_parent"] >= 0:
                after_branch = sum(end >= f["arpo_branch_pos"] for end in f["igpo_turn_ends"])
                assert len(f["arpo_delta_h"]) <= max(after_branch - 1, 0)
    assert nested > 0  # branches of branches happen, at later tool results
