"""Benchmark the igpo_agent loop's own per-turn cost over 200-turn trajectories, on both scoring paths.

The LLM and the tools are instant fakes (pre-tokenized turns, a fixed observation text), so what is measured is the
loop's bookkeeping: decoding and parsing a turn, tokenizing its observation, growing the token buffers and, with
``score_on=rollout``, building and reading the answer-scoring requests. Token in / token out means this must not grow
with the history; the reference re-rendered and re-tokenized the whole conversation every turn (O(T*L),
docs/design/reference_igpo.md §10
item 23), and a scoring request that copies the context prefix costs ~1 ms per turn at 95 K tokens.

Two paths, each in its own trajectories:
  - actor:   ``score_on=actor`` (the default): the loop records boundaries; the trainer scores them.
  - rollout: ``score_on=rollout`` with every boundary scored (``ig_tool_filter`` covers the search tool): one scoring
             request per boundary to a fake engine that answers like verl's vLLM server, ``extra_fields
             ["prompt_logprobs"]`` with one ``[logprob]`` row per prompt token after the first and a dummy last row
             (``extract_prompt_logprobs``). The fake builds those rows lazily and never copies ``prompt_ids``: what a
             real engine does with the prompt (Ray pickles it, vLLM prefills it) and the O(L) rows it sends back are
             the engine's cost, shown on a line of its own (pickle round trip of both at the final context length),
             not the loop's.

Measured side by side in one run, per path:
  - per-turn cost = time between consecutive generation requests of one trajectory, median over turns 5-24
    ("turn 10") and over turns 176-195 ("turn 200") of 8 trajectories (160 turns each), run one at a time so nothing
    interleaves;
  - throughput = trajectories per second with many trajectories running concurrently in one event loop.

Usage: .venv/bin/python scripts/bench/bench_agent_loop.py [--trajectories 4] [--concurrent 16]
Every figure is measured in --rounds rounds (5), the paths alternating in order; each is printed as median (min, max)
and the last line gives the medians of the ratios, the worse path's first (goal: <= 1.5); the throughputs, which
move with the machine's speed, are on the line above it:
    agent loop: per_turn_cost_ratio_turn200_vs_turn10=<r> actor=<a> rollout=<b>
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from benchmark_report import Rounds, check_rounds, machine_line  # noqa: E402

from igpo.agent.agent_loop import IGPOAgentLoop  # noqa: E402
from igpo.demo.tiny_model import build_tiny_model  # noqa: E402

TURNS = 200
OBSERVATION = " ".join(f"Result {i}: a page about topic {i} with a few facts and a link http://e.x/{i}." for i in range(12))
GROUND_TRUTH = "Ada Lovelace"


class PromptLogprobRows(Sequence):
    """verl's ``prompt_logprobs`` for a prompt of n tokens, row i = [log p(token_{i+1})], row n-1 = [0.0], made on
    demand: the fake engine answers in O(1) whatever the prompt length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return [0.0] if i in (self.n - 1, -1) else [-0.5]


class InstantServer:
    """Returns the n-th pre-tokenized turn of a trajectory immediately and records when each generation request
    arrived; answers scoring requests (``prompt_logprobs``) in verl's format without touching the prompt."""

    def __init__(self, turns: list[list[int]], answer: list[int]):
        self.turns, self.answer = turns, answer
        self.count: dict[str, int] = {}
        self.stamps: dict[str, list[float]] = {}
        self.scoring_requests = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if sampling_params.get("prompt_logprobs") is not None:
            self.scoring_requests += 1
            return TokenOutput(token_ids=[0], log_probs=[0.0],
                               extra_fields={"global_steps": 1, "prompt_logprobs": PromptLogprobRows(len(prompt_ids))})
        self.stamps.setdefault(request_id, []).append(time.perf_counter())
        n = self.count.get(request_id, 0)
        self.count[request_id] = n + 1
        ids = self.turns[n] if n < len(self.turns) else self.answer
        return TokenOutput(token_ids=ids, log_probs=[-0.1] * len(ids), extra_fields={"global_steps": 1})


class InstantTools:
    class Result:
        ok, text, error_kind, latency_s = True, OBSERVATION, None, 0.0

    async def call(self, name, arguments):
        return self.Result()


def make_loop(tokenizer, server, score_on: str):
    igpo = {"agent": {"max_turns": TURNS, "max_tokens_per_turn": 128, "max_observation_tokens": 512,
                      "max_concurrent_trajectories": 0}}
    if score_on == "rollout":
        igpo.update(score_on="rollout", ig_tool_filter=["search", "visit"])
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": 2048, "response_length": 200_000}},
        "algorithm": {"igpo": igpo},
    })
    return IGPOAgentLoop(
        trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([]),
        tool_caller=InstantTools(),
    )


async def one(tokenizer, server, k: int, score_on: str):
    loop = make_loop(tokenizer, server, score_on)
    out = await loop.run({"logprobs": True}, raw_prompt=[{"role": "user", "content": f"Question {k}?"}], global_steps=k,
                         reward_model={"ground_truth": GROUND_TRUTH})
    ex = out.extra_fields
    assert ex["igpo_num_turns"] == TURNS, ex["igpo_stop_reason"]
    if score_on == "rollout":
        scored = ex["igpo_answer_logprobs"]
        assert len(scored) == TURNS and all(lp is not None for lp in scored) and ex["igpo_scoring_errors"] == 0
    return out


async def measure(tokenizer, turns, answer, args, score_on: str) -> dict[str, float]:
    await one(tokenizer, InstantServer(turns, answer), -1, score_on)  # warm-up: template frame, caches
    early, late, lengths = [], [], []
    server = InstantServer(turns, answer)
    for k in range(args.trajectories):
        out = await one(tokenizer, server, k, score_on)
        lengths.append(len(out.prompt_ids) + len(out.response_ids))
    for stamps in server.stamps.values():
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # gaps[j]: the loop's work for turn j (after sampling)
        early.extend(gaps[5:25])
        late.extend(gaps[176:196])
    if score_on == "rollout":
        assert server.scoring_requests == args.trajectories * TURNS, server.scoring_requests

    server = InstantServer(turns, answer)
    start = time.perf_counter()
    await asyncio.gather(*(one(tokenizer, server, 1000 + k, score_on) for k in range(args.concurrent)))
    per_s = args.concurrent / (time.perf_counter() - start)
    return {"t10": statistics.median(early), "t200": statistics.median(late), "per_s": per_s,
            "length": statistics.mean(lengths)}


def engine_side_cost(length: int) -> tuple[float, float]:
    """Seconds per scoring request, at this context length, of what a real engine round trip adds and the loop does
    not control: (in the agent-loop process: pickling the prompt for Ray and unpickling verl's prompt_logprobs rows;
    in the server: the reverse). Best of 3."""
    prompt = list(range(length))
    rows = [[-0.5] for _ in range(length - 1)] + [[0.0]]
    sent, answered = pickle.dumps(prompt), pickle.dumps(rows)
    best_loop = best_server = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        pickle.dumps(prompt)
        pickle.loads(answered)
        middle = time.perf_counter()
        pickle.loads(sent)
        pickle.dumps(rows)
        best_loop, best_server = min(best_loop, middle - start), min(best_server, time.perf_counter() - middle)
    return best_loop, best_server


async def main(args) -> None:
    model_dir = build_tiny_model(REPO / ".cache" / "tiny_model", REPO / "data" / "wiki_passages_1000.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [
        tokenizer.encode(
            f"<think>step {i}: I should look for more evidence.</think>\n<tool_call>"
            f'{{"name": "search", "arguments": {{"query": ["fact {i}", "source {i}"]}}}}</tool_call>',
            add_special_tokens=False,
        ) + [eot]
        for i in range(TURNS)
    ]
    answer = tokenizer.encode("<think>done</think><answer>x</answer>", add_special_tokens=False) + [eot]

    paths = ("actor", "rollout")
    runs = {path: [] for path in paths}
    for r in range(args.rounds):  # rounds alternate the paths' order, so drifting load falls on both
        for path in (paths if r % 2 == 0 else paths[::-1]):
            runs[path].append(await measure(tokenizer, turns, answer, args, path))
    ratio = {path: Rounds(m["t200"] / m["t10"] for m in runs[path]) for path in paths}
    per_s = {path: Rounds(m["per_s"] for m in runs[path]) for path in paths}
    length = statistics.mean(m["length"] for m in runs["rollout"])
    print(f"context at the end of a trajectory: {length:.0f} tokens over {TURNS} turns")
    for path in paths:
        t10 = Rounds(m["t10"] * 1e6 for m in runs[path])
        t200 = Rounds(m["t200"] * 1e6 for m in runs[path])
        print(f"{path:7s} per-turn loop cost: turn~10 {t10.describe('.0f', ' us')}; turn~200 "
              f"{t200.describe('.0f', ' us')}; ratio {ratio[path].describe('.3f')}; {args.concurrent} concurrent "
              f"trajectories: {per_s[path].describe('.2f', '/s')}")
    worst = max(ratio[path].median for path in paths)
    in_loop, in_server = engine_side_cost(int(length))
    print(f"engine round trip, not timed above (per scoring request at {length:.0f} tokens, Ray pickling of the "
          f"prompt and of verl's prompt_logprobs rows): {in_loop * 1e3:.2f} ms in the agent-loop process, "
          f"{in_server * 1e3:.2f} ms in the server")
    print(f"absolute (this machine, moves with its speed): trajectories_per_s_actor={per_s['actor'].median:.2f} "
          f"trajectories_per_s_rollout={per_s['rollout'].median:.2f}")
    print(f"agent loop: per_turn_cost_ratio_turn200_vs_turn10={worst:.3f} actor={ratio['actor'].median:.3f} "
          f"rollout={ratio['rollout'].median:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=8, help="sequential trajectories for the per-turn cost")
    parser.add_argument("--concurrent", type=int, default=16, help="concurrent trajectories for the throughput")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of both paths (>= 3); medians reported")
    args = parser.parse_args()
    check_rounds(args.rounds)
    print(machine_line("1 (one asyncio event loop; tokenizer calls on it)"))
    asyncio.run(main(args))
