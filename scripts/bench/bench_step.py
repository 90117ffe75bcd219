"""Benchmark one training step, phase by phase: GRPO, IGPO, InfoPO and GiGPO on the same seeded batch.

What teacher-forcing the gold answer after every turn costs a step on top of GRPO, on the CPU demo's two models:
``tiny`` (the demo's 1.6M-parameter Qwen2, ``.cache/tiny_demo_warm``; configs/cpu_demo.yaml: 16 questions x 4
samples) and ``smollm2`` (SmolLM2-135M-Instruct warm-started, ``.cache/smollm2_warm``; configs/cpu_demo.yaml +
configs/demo_model/smollm2.yaml: 4 questions x 4 samples, turns of 48 tokens, observations of 56, responses of 416).
Every size, batch size, learning rate, loss coefficient and agent setting is read from that composed Hydra config,
as the trainer reads it.

Phases of a step, each timed on its own (seconds):
    rollout         the agent loop (``igpo.agent.agent_loop.IGPOAgentLoop``) on every question x rollout.n sample, all
                    concurrent, against our HF rollout server (``igpo.cpu.hf_rollout.HFRolloutServer``: float64 for
                    tiny, float32 for smollm2, as the launcher runs them) and the demo world's local tool server
                    (``igpo.demo.warmstart.LocalTools``). Two rollouts per model, the same seeds (every request has
                    its own generator): actor side (``score_on=actor``, the default) and rollout side
                    (``score_on=rollout``: the loop also asks the server for the answer's ``prompt_logprobs`` after
                    each scored turn, overlapped with the tool call, so that cost is inside this phase).
    reward          the project's outcome reward (``igpo.reward.compute_score``, F1) on every final answer.
    scoring         IGPO actor side: the answer probes after every scored boundary, by the packed scorer the actor
                    workers call (``igpo.core.scoring.score_batch``); InfoPO: the counterfactual copies
                    (``igpo.integration.actor_worker.score_counterfactual_share``). Both run inside the method's
                    advantage, through a local scorer with ``ActorScorer``'s interface; their time is split out.
    advantage       the rest of the method through the trainer's pipeline (``igpo.integration.pipeline.
                    advantage_step`` with the real method objects; GRPO is verl's own estimator wrapped as a method).
    old log-probs   a no-grad forward of the actor over the batch, in micro-batches of
                    rollout.log_prob_micro_batch_size_per_gpu; the log-prob of every response token.
    ref log-probs   the same with a second copy of the initial weights, micro-batches of
                    ref.log_prob_micro_batch_size_per_gpu (for the KL loss).
    update          forward + backward + AdamW step over the batch: mini-batches of ppo_mini_batch_size x
                    rollout.n, micro-batches of ppo_micro_batch_size_per_gpu, verl's vanilla PPO-clip loss (clip
                    ratio, dual clip c) token-mean plus kl_loss_coef x low_var_kl against the reference, gradient
                    clipping, gradient checkpointing as the config says. The weights are restored afterwards so
                    every round scores with the same θ_old.

Shared phases: rollout, reward, old/ref log-probs and update are the same tokens for every method, so each is timed
once per model (rollouts and rewards: once per scoring side; old/ref/update: in ``--shared-rounds`` rounds, 1 by
default: each takes tens of seconds to minutes on SmolLM2, and its noise moves every method's step alike) and
counted in every method's step. The method phases (scoring, advantage) run in ``--rounds`` interleaved rounds (2 by
default), the methods' order rotating by round; each figure is printed as median (min-max). A step is the sum of its
phases; a ratio is the median of the per-round ratios to GRPO's step. The rollout-side IGPO step counts its own
rollout and reward and the actor-side batch's old/ref/update phases (the line above the table says how many of its
trajectories are token-identical to the actor side's; different tokens would change those phases a little).
Untimed warm-ups first: a two-sample rollout per side (the tool server's first search loads its index), a forward of
each model, both scoring passes on the first group.

Checked in the same run (exit 1 otherwise): every method's advantages are finite; IGPO's per-turn gains are finite and
not all zero, and at least one trajectory with a gain has a non-zero advantage; on trajectories both sides produced
token for token, the rollout server's answer log-probs and the actor-side packed scorer's agree within 1e-4 (when no
trajectory is shared, the rollout-side batch is also scored on the actor, as ``algorithm.igpo.verify_scoring`` does).

Differences from the trainer's workers (verl's Ray trainer is not started: each start costs ~60 s):
    - one process: the rollout server, the actor, the reference and the tool client share the process and its
      threads (``--threads``, 2); in the trainer they are Ray actors and processes sharing the same cores;
    - plain Hugging Face forwards over right-padded micro-batches (each padded to its longest sequence) instead of
      verl's FSDP2 engine (no parameter gathering, no torch.compile of the log-prob function, no Ray calls or
      TransferQueue reads and writes between phases, no weight sync to the rollout server after the update);
    - the scorer is called in-process (no Ray round trip, one rank);
    - the update's PPO loss is written here after verl's ``compute_policy_loss_vanilla`` (the KL term is verl's
      ``kl_penalty``), and the optimiser is created fresh each round (its first step allocates Adam's state).

Usage: .venv/bin/python scripts/bench/bench_step.py [--models tiny,smollm2] [--rounds 2] [--shared-rounds 1]
The last line is the SmolLM2 figures (the tiny model's with --models tiny):
    step: ig_step_overhead=<x> scoring_share=<s> infopo_step_overhead=<y> gigpo_step_overhead=<z>
          ig_step_overhead_rollout_side=<w> model=smollm2
ig_step_overhead = IGPO step / GRPO step with actor-side scoring (the goal of issue 48: at most 1.15); scoring_share =
answer-scoring time / IGPO step; the others likewise for InfoPO, GiGPO and IGPO scored on the rollout side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark_report import machine_line  # noqa: E402
from hydra import compose as hydra_compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.trainer.ppo.core_algos import kl_penalty  # noqa: E402

from igpo.agent.agent_loop import IGPOAgentLoop  # noqa: E402
from igpo.agent.chat_frame import encode_content, frame_for  # noqa: E402
from igpo.agent.records import TurnRecord  # noqa: E402
from igpo.config import IGPOConfig  # noqa: E402
from igpo.core.ground_truth import Probe  # noqa: E402
from igpo.core.scoring import ScoreRequest, ScoringConfig, score_batch, scoring_cost  # noqa: E402
from igpo.cpu.hf_rollout import HFRolloutServer  # noqa: E402
from igpo.demo import world as demo_world  # noqa: E402
from igpo.demo.warmstart import LocalTools  # noqa: E402
from igpo.integration.actor_worker import score_counterfactual_share  # noqa: E402
from igpo.integration.methods import method_for  # noqa: E402
from igpo.integration.pipeline import advantage_step, resolve_infra_policy  # noqa: E402
from igpo.integration.trainer import prompt_uid  # noqa: E402
from igpo.reward import compute_score  # noqa: E402

TOLERANCE = 1e-4  # actor-side vs rollout-side answer log-probs (the golden tests' tolerance)
METHODS = ("grpo", "igpo", "infopo", "gigpo")
TITLES = {"grpo": "GRPO", "igpo": "IGPO", "infopo": "InfoPO", "gigpo": "GiGPO", "igpo_rollout": "IGPO rollout-side"}


@dataclass(frozen=True)
class ModelSpec:
    checkpoint: str          # under .cache/
    overrides: tuple         # Hydra overrides over configs/cpu_demo.yaml
    rollout_dtype: str       # the HF rollout server's, as train_igpo.sh runs it
    build: str               # the command that builds the checkpoint


MODELS = {
    "tiny": ModelSpec("tiny_demo_warm", (), "float64", "bash train_igpo.sh --dry-run"),
    "smollm2": ModelSpec("smollm2_warm", ("+demo_model=smollm2",), "float32",
                         "bash train_igpo.sh demo.model=smollm2 --dry-run"),
}


class Timings:
    """Seconds per (column, phase), one value per round; each is reported on stderr as it comes."""

    def __init__(self, label: str):
        self.label = label
        self.values: dict[tuple[str, str], list[float]] = {}

    def add(self, column: str, phase: str, seconds: float) -> None:
        self.values.setdefault((column, phase), []).append(seconds)
        progress(f"{self.label} {column} {phase}: {seconds:.2f} s")

    def median(self, column: str, phase: str) -> float:
        return statistics.median(self.values[(column, phase)])

    def cell(self, column: str, phase: str) -> str:
        values = self.values.get((column, phase))
        return describe(values, ".3f") if values else "-"


# ---------------------------------------------------------------------------------------------------- set-up


def compose(spec: ModelSpec, model_dir: Path, seed: int, questions: int | None):
    overrides = [*spec.overrides, f"actor_rollout_ref.model.path={model_dir}", f"seed={seed}"]
    if questions is not None:
        overrides.append(f"data.train_batch_size={questions}")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return hydra_compose(config_name="cpu_demo", overrides=overrides)


def with_algorithm(config, estimator: str, score_on: str = "actor", verify: bool = False):
    """The run config of one method: ``algorithm.adv_estimator`` and the IGPO scoring side set."""
    copy = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    copy.algorithm.adv_estimator = estimator
    copy.algorithm.igpo.score_on = score_on
    copy.algorithm.igpo.verify_scoring = verify
    return copy


class LocalScorer:
    """``igpo.integration.actor_scoring.ActorScorer``'s interface, served by a model in this process with the worker
    methods' core calls (``score_batch`` for IGPO's probes, ``score_counterfactual_share`` for InfoPO), at the
    rollout temperature, no grad, eval mode. ``seconds`` adds up the time spent scoring; ``answers`` keeps every
    answer score by (trajectory ids, boundary) for the rollout-vs-actor comparison, ``last_requests`` the size of
    the last call's requests."""

    def __init__(self, model, tokenizer, config):
        self.model, self.tokenizer = model, tokenizer
        self.frame = frame_for(tokenizer, dict(config.data.get("apply_chat_template_kwargs", {}) or {}))
        self.scoring = {"strategy": "packed", "temperature": float(config.actor_rollout_ref.rollout.temperature)}
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.seconds = 0.0
        self.answers: dict[tuple, dict[int, list[float]]] = {}
        self.last_requests: list[tuple[int, int]] = []  # the last call's (boundaries, tokens through the layers)

    def encode(self, text: str) -> list[int]:
        return encode_content(self.tokenizer, text)

    def score_answers(self, requests: list[dict]) -> dict[int, list]:
        started = time.perf_counter()
        batch = [ScoreRequest(torch.as_tensor(r["trajectory_ids"], dtype=torch.long), list(r["boundaries"]),
                              [Probe(list(p["token_ids"]), tuple(p["span"])) for p in r["probes"]]) for r in requests]
        self.model.eval()
        with torch.no_grad():
            scores = score_batch(self.model, batch, ScoringConfig(**self.scoring))
        self.seconds += time.perf_counter() - started
        self.last_requests = [(len(r.boundaries), scoring_cost(r.boundaries, r.probes).tokens_packed) for r in batch]
        for request, values in zip(requests, scores):
            kept = self.answers.setdefault(tuple(request["trajectory_ids"]), {})
            kept.update({int(b): row for b, row in zip(request["boundaries"], values.tolist())})
        return {i: values.tolist() for i, values in enumerate(scores)}

    def score_counterfactuals(self, requests: list[dict]) -> dict[int, list]:
        started = time.perf_counter()
        self.model.eval()
        with torch.no_grad():
            out = score_counterfactual_share(self.model, requests, self.scoring, 0, 1)
        self.seconds += time.perf_counter() - started
        return out


# ---------------------------------------------------------------------------------------------------- the batch


@dataclass
class Batch:
    """One rollout as the trainer stores it: per row the prompt and response ids, the loss mask, the agent loop's
    turn record, the outcome reward at the last response token, the rollout's log-probs; uids and keys."""
    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    records: list
    uids: list[str]
    keys: list[str]
    ground_truths: list[str]
    response_mask: torch.Tensor      # [B, R] bool
    rollout_log_probs: torch.Tensor  # [B, R]
    rm_scores: torch.Tensor = None   # [B, R], set by the reward phase
    log_probs: dict = field(default_factory=dict)  # old_log_probs, ref_log_prob: [B, R]

    @property
    def size(self) -> int:
        return len(self.prompts)

    def tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompts, self.responses))

    def head(self, rows: int) -> "Batch":
        """The first ``rows`` rows (whole groups when ``rows`` is a multiple of rollout.n)."""
        return Batch(self.prompts[:rows], self.responses[:rows], self.records[:rows], self.uids[:rows],
                     self.keys[:rows], self.ground_truths[:rows], self.response_mask[:rows],
                     self.rollout_log_probs[:rows], self.rm_scores[:rows],
                     {k: v[:rows] for k, v in self.log_probs.items()})

    def fields(self, method) -> dict:
        """What the trainer hands ``method``: its row fields and the response fields it names that exist."""
        rows = {"prompts": self.prompts, "responses": self.responses,
                "reward_model": [{"ground_truth": gt} for gt in self.ground_truths]}
        response = {"rollout_log_probs": self.rollout_log_probs, **self.log_probs}
        out = {name: rows[name] for name in method.fields}
        out.update({name: response[name].float() for name in method.response_fields if name in response})
        return out


def sampling_params(rollout_config) -> dict:
    """What verl's agent-loop worker sends the loop (``AgentLoopWorker``: temperature, top_p, top_k, logprobs)."""
    return {"temperature": float(rollout_config.temperature), "top_p": float(rollout_config.top_p),
            "top_k": int(rollout_config.top_k), "repetition_penalty": 1.0,
            "logprobs": bool(rollout_config.calculate_log_probs)}


async def rollout(config, server, tokenizer, tools, questions, model_type: str, samples: int | None = None,
                  step: int = 1) -> list:
    """Every question x ``samples`` (rollout.n) samples through ``IGPOAgentLoop``, all at once (one agent-loop
    worker). The uids and session ids are fixed, so every request's sampling seed is (seed, step, uid, session, turn,
    attempt)."""
    n = samples or int(config.actor_rollout_ref.rollout.n)
    params = sampling_params(config.actor_rollout_ref.rollout)
    jobs = []
    for i, question in enumerate(questions):
        for session in range(n):
            loop = IGPOAgentLoop(trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer,
                                 processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                                 hf_model_type=model_type, tools=ToolListWrap([]), tool_caller=tools)
            jobs.append(loop.run(dict(params), raw_prompt=[{"role": "user", "content": question.question}],
                                 reward_model={"ground_truth": question.answer},
                                 data_source=f"{demo_world.DATA_SOURCE}_{question.kind}", extra_info={}, index=i,
                                 uid=prompt_uid(step, i), session_id=session, global_steps=step))
    return await asyncio.gather(*jobs)


def to_batch(outputs, questions, n: int) -> Batch:
    B = len(outputs)
    R = max(len(out.response_ids) for out in outputs)
    mask = torch.zeros(B, R, dtype=torch.bool)
    rollout_lp = torch.zeros(B, R)
    for row, out in enumerate(outputs):
        mask[row, :len(out.response_mask)] = torch.tensor(out.response_mask, dtype=torch.bool)
        if out.response_logprobs is not None:
            rollout_lp[row, :len(out.response_logprobs)] = torch.tensor(out.response_logprobs)
    uids = [prompt_uid(1, row // n) for row in range(B)]
    return Batch(prompts=[torch.tensor(out.prompt_ids) for out in outputs],
                 responses=[torch.tensor(out.response_ids) for out in outputs],
                 records=[TurnRecord.from_extra_fields(out.extra_fields) for out in outputs], uids=uids,
                 keys=[f"{uid}_{row % n}_0" for row, uid in enumerate(uids)],
                 ground_truths=[questions[row // n].answer for row in range(B)], response_mask=mask,
                 rollout_log_probs=rollout_lp)


async def rewards(config, outputs, questions, n: int, tokenizer) -> torch.Tensor:
    """Outcome scores [B] by the reward function verl's reward loop calls, on the decoded responses, the agent loop's
    extra fields as ``extra_info`` (the final turn's text), the config's reward kwargs."""
    kwargs = OmegaConf.to_container(config.reward.custom_reward_function.reward_kwargs, resolve=True)
    scores = await asyncio.gather(*(
        compute_score(f"{demo_world.DATA_SOURCE}_{questions[row // n].kind}",
                      tokenizer.decode(out.response_ids, skip_special_tokens=True), questions[row // n].answer,
                      extra_info=out.extra_fields, **kwargs)
        for row, out in enumerate(outputs)))
    return torch.tensor([s["score"] for s in scores])


def place_scores(batch: Batch, scores: torch.Tensor) -> None:
    """The outcome on the last response token, where verl's reward loop puts it (``rm_scores``)."""
    batch.rm_scores = torch.zeros(batch.response_mask.shape)
    for row, response in enumerate(batch.responses):
        batch.rm_scores[row, len(response) - 1] = scores[row]


# ---------------------------------------------------------------------------------------------------- model phases


def micro_batch(batch: Batch, rows: list[int]):
    """(input ids [b, S], attention mask [b, S]) of prompt + response, right-padded to the longest of ``rows``."""
    sequences = [torch.cat([batch.prompts[r], batch.responses[r]]) for r in rows]
    S = max(len(s) for s in sequences)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    attention = torch.zeros(len(rows), S, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], attention[i, :len(s)] = s, 1
    return ids, attention


def response_log_probs(model, batch: Batch, rows: list[int], temperature: float) -> torch.Tensor:
    """log π(response token | everything before it) [b, R] (0 past each response), logits / temperature."""
    ids, attention = micro_batch(batch, rows)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = torch.zeros(len(rows), batch.response_mask.shape[1])
    for i, r in enumerate(rows):
        P, n = len(batch.prompts[r]), len(batch.responses[r])
        # Position P-1+j predicts response token j.
        out[i, :n] = log_probs[i, P - 1:P - 1 + n].gather(-1, batch.responses[r][:, None]).squeeze(-1)
    return out


@torch.no_grad()
def forward_log_probs(model, batch: Batch, micro: int, temperature: float) -> torch.Tensor:
    model.eval()
    return torch.cat([response_log_probs(model, batch, list(range(s, min(s + micro, batch.size))), temperature)
                      for s in range(0, batch.size, micro)])


def ppo_loss(log_prob, old_log_prob, advantages, mask, tokens: float, actor) -> torch.Tensor:
    """verl's vanilla PPO-clip loss (``compute_policy_loss_vanilla``: ratio clipped to [1-ε_low, 1+ε_high], dual clip
    at c for negative advantages), summed over this micro-batch's loss tokens / the mini-batch's loss tokens, so the
    micro-batches add up to verl's token mean."""
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
    dual = torch.minimum(-advantages * float(actor.get("clip_ratio_c", 3.0)), clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    return (losses * mask).sum() / tokens


def update(model, batch: Batch, advantages: torch.Tensor, config) -> None:
    """One PPO update over the batch (ppo_epochs=1, no shuffle): per mini-batch, the micro-batches' gradients, clipped,
    then one AdamW step."""
    actor = config.actor_rollout_ref.actor
    temperature = float(config.actor_rollout_ref.rollout.temperature)
    optim = actor.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(optim.lr), betas=tuple(optim.betas),
                                  weight_decay=float(optim.weight_decay))
    if config.actor_rollout_ref.model.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as verl's engine
    model.train()
    mini = int(actor.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n)
    micro = int(actor.ppo_micro_batch_size_per_gpu)
    old, ref = batch.log_probs["old_log_probs"], batch.log_probs["ref_log_prob"]
    for m in range(0, batch.size, mini):
        rows = list(range(m, min(m + mini, batch.size)))
        tokens = float(batch.response_mask[rows].sum().clamp_min(1))
        for s in range(0, len(rows), micro):
            part = rows[s:s + micro]
            log_prob = response_log_probs(model, batch, part, temperature)
            mask = batch.response_mask[part].float()
            loss = ppo_loss(log_prob, old[part], advantages[part].float(), mask, tokens, actor)
            if actor.use_kl_loss:
                kl = kl_penalty(log_prob, ref[part], actor.kl_loss_type)
                loss = loss + float(actor.kl_loss_coef) * (kl * mask).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(optim.clip_grad))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.gradient_checkpointing_disable()
    model.eval()


# ---------------------------------------------------------------------------------------------------- one model


@dataclass
class ModelResult:
    name: str
    timings: Timings
    steps: dict        # column -> per-round step seconds
    scoring: list      # IGPO's per-round answer-scoring seconds
    lines: list        # what was printed about the model
    failures: list


def progress(message: str) -> None:
    """A long run shows where it is (stderr: the report reads stdout)."""
    print(f"bench_step: {message}", file=sys.stderr, flush=True)


def in_memory(model):
    """The model with its weights copied into the process's own memory. transformers maps a float32 checkpoint's
    file and keeps the weights as views of it: clean file pages that a machine short of memory drops and reads back
    from disk on the next pass (measured here: the same answer scoring took 5 s in one round and 108 s in another).
    verl's FSDP workers hold their own copies (the shards), and so does this."""
    with torch.no_grad():
        for parameter in model.parameters():  # tied weights are one parameter: they stay tied
            parameter.data = parameter.data.clone()
        for buffer in model.buffers():
            buffer.data = buffer.data.clone()
    return model


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def run_model(name: str, args) -> ModelResult:

    spec = MODELS[name]
    model_dir = REPO / ".cache" / spec.checkpoint
    if not (model_dir / "model.safetensors").is_file():
        raise SystemExit(f"bench_step: the {name} model is not built ({model_dir} has no model.safetensors); build it "
                         f"with `{spec.build}` (cached afterwards) or leave it out with --models")
    config = compose(spec, model_dir, args.seed, args.questions)
    n = int(config.actor_rollout_ref.rollout.n)
    world_files = demo_world.write_world(REPO / ".cache" / "demo_world", REPO / "data" / "wiki_passages_1000.jsonl")
    questions = demo_world.build_world().questions("train")[:int(config.data.train_batch_size)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    rollout_cfg = config.actor_rollout_ref.rollout
    server = HFRolloutServer(str(model_dir), max_model_len=int(rollout_cfg.max_model_len),
                             response_length=int(rollout_cfg.response_length), dtype=spec.rollout_dtype,
                             seed=int(args.seed))
    # The trainer's server holds private copies from its first weight sync on; file-backed, SmolLM2's (float32) first
    # rollout took 122 s against 23 s for the second on the same tokens.
    in_memory(server.model)
    actor = in_memory(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    reference = in_memory(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    torch.set_num_threads(args.threads)  # the server set its own thread count when it loaded
    scorer = LocalScorer(actor, tokenizer, config)
    timings, lines, failures = Timings(name), [], []
    sides = {"actor": with_algorithm(config, "igpo", "actor"), "rollout": with_algorithm(config, "igpo", "rollout")}

    tools = LocalTools(world_files["corpus"], demo_world.TOPK)
    try:
        async def both_rollouts():
            out = {}
            for side, side_config in sides.items():
                # Untimed warm-up (step 0: other seeds): the tool server's first search loads its index, the
                # server's first batches allocate.
                await rollout(side_config, server, tokenizer, tools, questions[:1], model_type, samples=2, step=0)
                started = time.perf_counter()
                out[side] = await rollout(side_config, server, tokenizer, tools, questions, model_type)
                timings.add("rollout_" + side, "rollout", time.perf_counter() - started)
                started = time.perf_counter()
                out[side + "_scores"] = await rewards(config, out[side], questions, n, tokenizer)
                timings.add("rollout_" + side, "reward", time.perf_counter() - started)
            return out

        rolled = tools.run(both_rollouts)
    finally:
        tools.close()
    batches = {}
    for side in sides:
        batches[side] = to_batch(rolled[side], questions, n)
        place_scores(batches[side], rolled[side + "_scores"])
    batch, side_batch = batches["actor"], batches["rollout"]
    same = sum(torch.equal(a, b) and torch.equal(p, q) for a, b, p, q in
               zip(batch.responses, side_batch.responses, batch.prompts, side_batch.prompts))
    turns = [record.num_turns for record in batch.records]
    plural = "s" * (len(questions) != 1)
    lines.append(f"{name}: {batch.size} trajectories ({len(questions)} question{plural} x {n}), {batch.tokens()} "
                 f"tokens (responses {min(len(r) for r in batch.responses)}-{max(len(r) for r in batch.responses)}), "
                 f"{sum(turns)} turns, mean outcome {float(batch.rm_scores.sum(-1).mean()):.3f}; rollout side: "
                 f"{side_batch.tokens()} tokens, {same}/{batch.size} trajectories token-identical to the actor side's")

    ref_cfg = config.actor_rollout_ref.ref
    temperature = float(rollout_cfg.temperature)
    infra_failure = IGPOConfig.from_algorithm(config.algorithm).infra_failure
    saved = {k: v.detach().clone() for k, v in actor.state_dict().items()}
    columns = [*METHODS, "igpo_rollout"]
    results: dict[str, Any] = {}

    def run_method(column: str, on: Batch | None = None, record: bool = True) -> None:
        estimator = "igpo" if column == "igpo_rollout" else column
        method_config = with_algorithm(config, estimator, "rollout" if column == "igpo_rollout" else "actor")
        method = method_for(method_config)  # a fresh one each round: IGPO's warm-up gate keeps state
        if on is None:
            on = side_batch if column == "igpo_rollout" else batch
        policy = resolve_infra_policy(method, infra_failure, estimator)
        scorer.seconds = 0.0
        out, seconds = timed(lambda: advantage_step(
            method, on.records, on.uids, on.response_mask, on.rm_scores, infra_failure=policy, scorer=scorer,
            fields=on.fields(method), keys=on.keys, step=1, total_steps=int(config.trainer.total_training_steps)))
        if not record:
            return
        if column in ("igpo", "infopo"):
            timings.add(column, "scoring", scorer.seconds)
        timings.add(column, "advantage", seconds - scorer.seconds)
        results[column] = out

    # Untimed warm-up of both models' forward (the first call with these shapes sets up kernels: seconds).
    for module, micro in ((actor, rollout_cfg.log_prob_micro_batch_size_per_gpu),
                          (reference, ref_cfg.log_prob_micro_batch_size_per_gpu)):
        forward_log_probs(module, batch.head(int(micro)), int(micro), temperature)
    for r in range(max(args.rounds, args.shared_rounds)):
        if r < args.shared_rounds:
            batch.log_probs["old_log_probs"], seconds = timed(lambda: forward_log_probs(
                actor, batch, int(rollout_cfg.log_prob_micro_batch_size_per_gpu), temperature))
            timings.add("shared", "old log-probs", seconds)
            batch.log_probs["ref_log_prob"], seconds = timed(lambda: forward_log_probs(
                reference, batch, int(ref_cfg.log_prob_micro_batch_size_per_gpu), temperature))
            timings.add("shared", "ref log-probs", seconds)
        if r == 0:
            # Untimed warm-up of the scoring passes on the first group (first calls of the packed kernels).
            for column in ("igpo", "infopo"):
                run_method(column, batch.head(n), record=False)
        if r < args.rounds:
            order = columns[r % len(columns):] + columns[:r % len(columns)]
            for column in order:
                run_method(column)
        if r < args.shared_rounds:
            _, seconds = timed(lambda: update(actor, batch, results["grpo"].advantages, config))
            timings.add("shared", "update", seconds)
            actor.load_state_dict(saved)  # every round scores with θ_old

    # The last timed IGPO round's requests (InfoPO calls the other pass): what the answer scoring computed.
    lines.append(scoring_work(results["igpo"].metrics, batch, scorer.last_requests))
    failures += check_advantages(results, batch, lines)
    failures += check_scoring(scorer, side_batch, lines, lambda: run_verify(config, side_batch, scorer, infra_failure))

    steps = step_seconds(timings, args.rounds)
    return ModelResult(name, timings, steps, timings.values[("igpo", "scoring")], lines, failures)


def run_verify(config, side_batch: Batch, scorer: LocalScorer, infra_failure: str | None) -> None:
    """The rollout-side batch scored on the actor too (``verify_scoring``), for trajectories the sides do not share."""
    method = method_for(with_algorithm(config, "igpo", "rollout", verify=True))
    advantage_step(method, side_batch.records, side_batch.uids, side_batch.response_mask, side_batch.rm_scores,
                   infra_failure=resolve_infra_policy(method, infra_failure, "igpo"), scorer=scorer,
                   fields=side_batch.fields(method), keys=side_batch.keys, step=1)


def scoring_work(metrics: dict, batch: Batch, requests: list[tuple[int, int]]) -> str:
    """Where IGPO's answer scoring spends its tokens: every request re-encodes its trajectory up to its last scored
    boundary; a trajectory without a scored tool turn is not sent (its baseline would feed no information gain)."""
    return (f"  IGPO answer scoring: {len(requests)} requests for {batch.size} trajectories (the others have no scored "
            f"tool turn), {int(metrics.get('igpo/scoring_tokens', 0))} tokens (packed: "
            f"{sum(t for _, t in requests)} through the layers, {sum(b for b, _ in requests)} boundaries), against "
            f"{batch.tokens()} tokens in the batch")


def step_seconds(timings: Timings, rounds: int) -> dict[str, list[float]]:
    """Per method, per round: the sum of its phases (shared phases at their median over their rounds)."""
    shared = sum(timings.median("shared", phase) for phase in ("old log-probs", "ref log-probs", "update"))
    steps = {}
    for column in [*METHODS, "igpo_rollout"]:
        side = "rollout_rollout" if column == "igpo_rollout" else "rollout_actor"
        base = timings.median(side, "rollout") + timings.median(side, "reward") + shared
        per_round = []
        for r in range(rounds):
            own = timings.values[(column, "advantage")][r]
            if (column, "scoring") in timings.values:
                own += timings.values[(column, "scoring")][r]
            per_round.append(base + own)
        steps[column] = per_round
    return steps


# ---------------------------------------------------------------------------------------------------- checks


def check_advantages(results: dict, batch: Batch, lines: list) -> list[str]:
    failures = []
    for column, out in results.items():
        if not bool(torch.isfinite(out.advantages).all()):
            failures.append(f"{column}: advantages are not all finite")
    igpo = results["igpo"]
    gains = igpo.turn_values if igpo.turn_values is not None else torch.zeros(0)
    if not bool(torch.isfinite(gains).all()):
        failures.append("igpo: a per-turn information gain is not finite")
    elif gains.numel() and not bool((gains != 0).any()):
        failures.append(f"igpo: all {gains.numel()} per-turn information gains are 0")
    # Rows with an IG position: a tool turn that reached its tool (ig_turns=reached) before the final turn.
    with_ig = [i for i, record in enumerate(batch.records)
               if any(status == "ok" for status in record.tool_status[:max(record.num_turns - 1, 0)])]
    moved = [i for i in with_ig if bool((igpo.advantages[i][igpo.infra.loss_mask[i]] != 0).any())]
    if with_ig and not moved:
        failures.append(f"igpo: none of the {len(with_ig)} trajectories with an information gain has a non-zero "
                        "advantage")
    lines.append(f"  checks: advantages finite ({', '.join(results)}); IGPO: {gains.numel()} per-turn gains "
                 f"(mean {float(gains.mean()) if gains.numel() else float('nan'):.3f}), {len(moved)}/{len(with_ig)} "
                 "trajectories with a gain have a non-zero advantage")
    return failures


def check_scoring(scorer: LocalScorer, side_batch: Batch, lines: list, verify) -> list[str]:
    """Rollout-side answer log-probs (the records) against the actor-side scorer's on the same token ids."""

    def compare():
        diffs = []
        for prompt, response, record in zip(side_batch.prompts, side_batch.responses, side_batch.records):
            actor = scorer.answers.get(tuple(torch.cat([prompt, response]).tolist()), {})
            for boundary, values in zip(record.boundaries, record.answer_logprobs):
                if values is not None and int(boundary) in actor:
                    diffs += [abs(a - b) for a, b in zip(actor[int(boundary)], values)]
        return diffs

    diffs, how = compare(), "on the trajectories both sides produced"
    if not diffs:
        verify()
        diffs, how = compare(), "on the rollout-side batch scored on the actor too (verify_scoring)"
    rollout_scored = sum(v is not None for record in side_batch.records for v in record.answer_logprobs)
    worst = max(diffs, default=float("nan"))
    lines.append(f"  checks: rollout-side vs actor-side answer log-probs {how}: {len(diffs)} values of "
                 f"{rollout_scored} scored boundaries, max |diff| {worst:.2e} (tolerance {TOLERANCE:g})")
    if not diffs:
        return ["no boundary was scored on both sides: the rollout-side scoring check compared nothing"]
    if not worst <= TOLERANCE:  # NaN fails too
        return [f"rollout-side and actor-side answer log-probs differ by {worst:.2e} > {TOLERANCE:g}"]
    return []


# ---------------------------------------------------------------------------------------------------- report


PHASES = ("rollout", "reward", "scoring", "advantage", "old log-probs", "ref log-probs", "update")


def table(result: ModelResult) -> list[str]:
    t = result.timings
    columns = [*METHODS, "igpo_rollout"]
    head = ["phase"] + [TITLES[c] for c in columns]
    rows = []
    for phase in PHASES:
        cells = []
        for column in columns:
            if phase in ("rollout", "reward"):
                cells.append(t.cell("rollout_rollout" if column == "igpo_rollout" else "rollout_actor", phase))
            elif phase in ("old log-probs", "ref log-probs", "update"):
                cells.append(t.cell("shared", phase))
            else:
                cells.append(t.cell(column, phase))
        shared = "*" if phase not in ("scoring", "advantage") else ""
        rows.append([phase + shared] + cells)
    grpo = result.steps["grpo"]
    rows.append(["step"] + [describe(result.steps[c]) for c in columns])
    rows.append(["step / GRPO's"] + [describe([s / g for s, g in zip(result.steps[c], grpo)], ".3f")
                                     for c in columns])
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    out = [f"{result.name}: seconds per phase, median (min-max) over rounds; * shared by every method (the same "
           "tokens), timed once per model or per --shared-rounds and counted in each step"]
    for row in [head] + rows:
        out.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return out


def describe(values: list[float], fmt: str = ".2f") -> str:
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def ratio(result: ModelResult, column: str) -> float:
    return statistics.median([s / g for s, g in zip(result.steps[column], result.steps["grpo"])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the method phases (>= 1)")
    parser.add_argument("--shared-rounds", type=int, default=1, help="rounds of old/ref log-probs and update (>= 1)")
    parser.add_argument("--questions", type=int, default=None,
                        help="questions per step (default: the config's data.train_batch_size)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SystemExit(f"--models={args.models}: use a comma list of {', '.join(MODELS)}")
    if args.rounds < 1 or args.shared_rounds < 1:
        raise SystemExit("--rounds and --shared-rounds must be >= 1")
    # The methods' start-up warnings (GRPO trains on infra failures, InfoPO reuses old log-probs) say nothing here.
    logging.getLogger("igpo.integration").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(machine_line(args.threads), flush=True)
    started = time.perf_counter()
    results = []
    for name in models:
        result = run_model(name, args)
        results.append(result)
        for line in result.lines + table(result):
            print(line, flush=True)
    failures = [f"{r.name}: {f}" for r in results for f in r.failures]
    headline = next((r for r in results if r.name == "smollm2"), results[-1])
    igpo_steps = headline.steps["igpo"]
    share = statistics.median([s / step for s, step in zip(headline.scoring, igpo_steps)])
    print(f"wall time {time.perf_counter() - started:.0f} s; absolute seconds move with the machine's speed and load, "
          "the ratios less")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    print(f"step: ig_step_overhead={ratio(headline, 'igpo'):.3f} scoring_share={share:.3f} "
          f"infopo_step_overhead={ratio(headline, 'infopo'):.3f} gigpo_step_overhead={ratio(headline, 'gigpo'):.3f} "
          f"ig_step_overhead_rollout_side={ratio(headline, 'igpo_rollout'):.3f} model={headline.name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
