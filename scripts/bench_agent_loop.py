"""Benchmark the igpo_agent loop's own per-turn cost over 200-turn trajectories.

The LLM and the tools are instant fakes (pre-tokenized turns, a fixed observation text), so what is measured is the
loop's bookkeeping: decoding and parsing a turn, tokenizing its observation, growing the token buffers. Token in /
token out means this must not grow with the history; the reference re-rendered and re-tokenized the whole
conversation every turn (O(T*L), igpo.md §10 item 23).

Measured side by side in one run:
  - per-turn cost = time between consecutive generation requests of one trajectory, median over turns 5-14
    ("turn 10") and over turns 185-194 ("turn 200"), trajectories run one at a time so nothing interleaves;
  - throughput = trajectories per second with many trajectories running concurrently in one event loop.

Usage: .venv/bin/python scripts/bench_agent_loop.py [--trajectories 4] [--concurrent 16]
Last line: ``agent loop: per_turn_cost_ratio_turn200_vs_turn10=<r> trajectories_per_s=<t>`` (goal: ratio <= 1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from igpo.agent_loop import IGPOAgentLoop  # noqa: E402
from igpo.tiny_model import build_tiny_model  # noqa: E402

TURNS = 200
OBSERVATION = " ".join(f"Result {i}: a page about topic {i} with a few facts and a link http://e.x/{i}." for i in range(12))


class InstantServer:
    """Returns the n-th pre-tokenized turn of a trajectory immediately and records when each request arrived."""

    def __init__(self, turns: list[list[int]], answer: list[int]):
        self.turns, self.answer = turns, answer
        self.count: dict[str, int] = {}
        self.stamps: dict[str, list[float]] = {}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
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


def make_loop(tokenizer, server):
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": 2048, "response_length": 200_000}},
        "algorithm": {"igpo": {"agent": {"max_turns": TURNS, "max_tokens_per_turn": 128,
                                          "max_observation_tokens": 512, "max_concurrent_trajectories": 0}}},
    })
    return IGPOAgentLoop(
        trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([]),
        tool_caller=InstantTools(),
    )


async def one(tokenizer, server, k: int):
    loop = make_loop(tokenizer, server)
    out = await loop.run({"logprobs": True}, raw_prompt=[{"role": "user", "content": f"Question {k}?"}], global_steps=k)
    assert out.extra_fields["igpo_num_turns"] == TURNS, out.extra_fields["igpo_stop_reason"]
    return out


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

    server = InstantServer(turns, answer)
    await one(tokenizer, server, -1)  # warm-up: template frame, caches
    early, late, lengths = [], [], []
    server = InstantServer(turns, answer)
    for k in range(args.trajectories):
        out = await one(tokenizer, server, k)
        lengths.append(len(out.prompt_ids) + len(out.response_ids))
    for stamps in server.stamps.values():
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # gaps[j]: the loop's work for turn j (after sampling)
        early.extend(gaps[5:15])
        late.extend(gaps[185:195])
    t10, t200 = statistics.median(early), statistics.median(late)

    server = InstantServer(turns, answer)
    start = time.perf_counter()
    await asyncio.gather(*(one(tokenizer, server, 1000 + k) for k in range(args.concurrent)))
    per_s = args.concurrent / (time.perf_counter() - start)

    print(f"context at the end of a trajectory: {statistics.mean(lengths):.0f} tokens over {TURNS} turns")
    print(f"per-turn loop cost: turn~10 {t10 * 1e6:.0f} us, turn~200 {t200 * 1e6:.0f} us")
    print(f"{args.concurrent} concurrent 200-turn trajectories: {per_s:.2f} trajectories/s")
    print(f"agent loop: per_turn_cost_ratio_turn200_vs_turn10={t200 / t10:.3f} trajectories_per_s={per_s:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=4, help="sequential trajectories for the per-turn cost")
    parser.add_argument("--concurrent", type=int, default=16, help="concurrent trajectories for the throughput")
    asyncio.run(main(parser.parse_args()))
