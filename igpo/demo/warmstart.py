"""Warm-start the tiny CPU demo model so that it really searches (supervised, about a minute on two CPU threads).

A random model never writes a well-formed tool call, so the CPU demo's trajectories would be malformed turns with
nothing for information gain to measure. This module teaches the tiny model the agent protocol on synthetic
search-then-answer trajectories built from the local corpus (``igpo.demo.titles`` questions):

    prompt (system + user, generation prompt)
    -> <tool_call>{"name": "search", "arguments": {"query": ["<snippet>"]}}</tool_call><|im_end|>     (trained)
    -> observation: the local backend's rendered search result, as the loop frames and truncates it  (not trained)
    -> <answer>T</answer><|im_end|>                                                                 (trained)

Sequences are assembled from the agent loop's own pieces (its ``ChatFrame`` frames and truncates the observation;
the tools are a local tool server on the BM25 backend, called through the loop's own client), and the first few
are replayed through the real ``IGPOAgentLoop`` with a scripted server and must match token for token, loss mask
included: the training sequences are what the loop builds during RL. Training minimises the masked next-token loss

    L = - sum_t m_t log pi(x_t | x_<t) / sum_t m_t,     m_t = 1 on assistant tokens (the loop's response_mask)

with AdamW for a fixed step budget capped by wall time. All sequences share the system prompt (~650 of ~840
tokens), so its key/value states are computed once per step (batch 1, with gradient) and broadcast to the batch:
the same loss and gradients at a fraction of the compute. The result is cached: a stamp records every input (the
training code, the base weights, the exact training token sequences, the config).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import inspect
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from tool_server.backends.local import LocalBackend
from tool_server.client import ToolClient, ToolResult
from tool_server.process import start_tool_server

from igpo.agent import HOP_TARGETS_KEY
from igpo.demo.titles import DemoQuestion, build_questions, load_passages, split_passages
from igpo.demo.warmstart_config import WarmStartConfig
from igpo.demo.world import WorldConfig, build_world, practice_world, warm_start_config, warm_start_plan

STAMP = "igpo_warmstart.json"
# The probe that the evaluation (and the demo, via algorithm.igpo.answer_template_*) scores: the answer turn the
# warm-start teaches, so P(gt) is read in the format the model actually answers in.
ANSWER_PREFIX, ANSWER_SUFFIX = "<answer>", "</answer>"
T = TypeVar("T")


@dataclass(frozen=True)
class Example:
    """One training sequence: prompt + response ids, and the loss mask m (1 on assistant tokens)."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]


# ---------------------------------------------------------------------------------------------------- tools + loop


class LocalTools:
    """The demo's tools: a local tool server on the corpus (``tool_server.process.start_tool_server``) reached
    through the agent loop's own client (``tool_server.client.ToolClient``), so every observation is the one a
    training rollout receives; and the corpus's BM25 index in-process (``backend``), which picks the questions.

    ``run(main)`` runs ``main()`` in a fresh event loop with a client open for the ``call``s it makes (a client's
    connections belong to the event loop that opened them). ``close`` stops the server.
    """

    def __init__(self, corpus: str | Path, topk: int = 5):
        self.corpus = Path(corpus)
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(start_tool_server(
            ["--backend", "local", "--corpus", str(self.corpus.resolve()), "--default-topk", str(topk),
             "--log-level", "WARNING"]))
        self._client: ToolClient | None = None
        self._backend: LocalBackend | None = None

    @property
    def backend(self) -> LocalBackend:
        if self._backend is None:
            self._backend = LocalBackend(self.corpus)  # the server's index, loaded from its cache beside the corpus
        return self._backend

    def run(self, main: Callable[[], Awaitable[T]]) -> T:
        async def session() -> T:
            async with ToolClient(self.url) as self._client:
                try:
                    return await main()
                finally:
                    self._client = None
        return asyncio.run(session())

    async def call(self, name: str, arguments: dict) -> ToolResult:
        if self._client is None:
            raise RuntimeError("LocalTools.call runs inside LocalTools.run(main), which opens the client")
        return await self._client.call(name, arguments)

    def close(self) -> None:
        self._stack.close()


def _model_type(model_dir: Path) -> str | None:
    """``model_type`` of a checkpoint's config.json (verl picks its token builder by it)."""
    return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")


def _make_loop(tokenizer: Any, server: Any, tools: Any, config: WarmStartConfig, *, max_turns: int,
               scoring: bool, model_type: str | None, seed: int | None = None) -> Any:
    """An ``IGPOAgentLoop`` on ``server``. With ``seed`` the loop seeds every request as the trainer's does (the
    run's ``seed``, the step, the prompt's uid, the session id, the turn): pass ``session_id`` in its kwargs."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    from igpo.agent.agent_loop import IGPOAgentLoop

    igpo: dict[str, Any] = {"agent": {**config.agent_section(), "max_turns": max_turns}}
    if scoring:
        igpo.update(score_on="rollout", ig_tool_filter="", answer_template_prefix=ANSWER_PREFIX,
                    answer_template_suffix=ANSWER_SUFFIX)
    trainer_config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": config.prompt_length,
                                          "response_length": config.response_length}},
        "algorithm": {"igpo": igpo},
        "seed": seed,
    })
    return IGPOAgentLoop(
        trainer_config=DictConfigWrap(trainer_config), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})), hf_model_type=model_type,
        tools=ToolListWrap([]), tool_caller=tools,
    )


def _loop_kwargs(question: DemoQuestion, index: int) -> dict[str, Any]:
    return {"raw_prompt": [{"role": "user", "content": question.question}],
            "reward_model": {"ground_truth": question.answer}, "data_source": "corpus_title", "extra_info": {},
            "index": index, "uid": f"warmstart-{index}", "global_steps": 0}


def search_turn(query: str) -> str:
    """The assistant's tool-calling turn (without the end-of-turn token)."""
    call = {"name": "search", "arguments": {"query": [query]}}
    return f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"


def answer_turn(answer: str) -> str:
    return f"<answer>{answer}</answer>"


class _ScriptedServer:
    """Plays the assistant's turns of one trajectory: a search for the snippet, then the answer."""

    def __init__(self, tokenizer: Any, turns: list[str], eot_id: int):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) + [eot_id] for t in turns]
        self.calls = 0

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        ids = self.turns[self.calls]
        self.calls += 1
        if len(ids) > sampling_params["max_tokens"]:
            raise ValueError(f"warm-start: a scripted turn of {len(ids)} tokens exceeds max_tokens_per_turn="
                             f"{sampling_params['max_tokens']}")
        return TokenOutput(token_ids=list(ids), log_probs=[0.0] * len(ids))


def _encode_prompts(tokenizer: Any, user_messages: list[str]) -> list[list[int]]:
    """Token ids of the loop's prompt (default system prompt + user message + generation prompt) for each message.

    The text before the user turn's ``<|im_start|>`` is the same for every message and the tokenizer splits at that
    control token, so it is encoded once (the system prompt is ~90% of every prompt). The replay check in
    ``build_examples`` confirms the ids equal the loop's.
    """
    from igpo.agent import protocol

    texts = [tokenizer.apply_chat_template(
        [{"role": "system", "content": protocol.DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": message}],
        tokenize=False, add_generation_prompt=True) for message in user_messages]
    marker = "<|im_start|>"
    heads = {text[: text.rfind(marker, 0, text.rfind(message)) + len(marker)] for text, message in
             zip(texts, user_messages)}
    if len(heads) != 1 or marker not in next(iter(heads)):  # not ChatML: encode every prompt whole
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    head = next(iter(heads))
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tails = tokenizer([text[len(head):] for text in texts], add_special_tokens=False)["input_ids"]
    return [head_ids + tail for tail in tails]


def build_examples(tokenizer: Any, tools: LocalTools, questions: list[DemoQuestion], config: WarmStartConfig,
                   model_type: str | None = None) -> tuple[list[Example], dict[str, int]]:
    """Search-then-answer sequences in the agent loop's exact layout; returns (examples, counts of skips).

    Sequences are assembled from the loop's own pieces (its ``ChatFrame`` frames and truncates the observation),
    tokenised in batches; the first ``config.verify_examples`` are then replayed through the real ``IGPOAgentLoop``
    and must match token for token, mask included (a mismatch raises: the layout drifted from the loop).
    A question is skipped when its tool call does not fit ``max_tokens_per_turn`` or when the answer is not visible
    in the (possibly truncated) observation: training it would teach the model to answer from nowhere.
    """
    from igpo.agent.chat_frame import ChatFrame

    frame = ChatFrame.build(tokenizer, {})
    eot = [frame.eot_id]

    def encode(texts: list[str], **kwargs: Any) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False, **kwargs)["input_ids"] if texts else []

    prompts = _encode_prompts(tokenizer, [q.question for q in questions])
    calls = encode([search_turn(q.snippet) for q in questions])
    answers = encode([answer_turn(q.answer) for q in questions])

    async def search_all() -> list[Any]:
        return [await tools.call("search", {"query": [q.snippet]}) for q in questions]

    results = tools.run(search_all)
    # Tool output is untrusted text: control-token text in it stays plain text, as in the loop.
    contents = encode([r.text for r in results], split_special_tokens=True)
    pairs: list[tuple[DemoQuestion, Example]] = []
    skipped = {"call_too_long": 0, "answer_not_shown": 0}
    for q, prompt, call, answer, content, result in zip(questions, prompts, calls, answers, contents, results):
        # The loop's budget rule: a tool turn, a worst-case observation and a final turn must fit its context
        # limit, or it would force the answer at once (a different prompt).
        limit = min(config.prompt_length + config.response_length, len(prompt) + config.response_length)
        need = len(prompt) + 2 * (config.max_tokens_per_turn + 1) + config.max_observation_tokens + frame.max_frame_len
        if not result.ok or len(prompt) > config.prompt_length or need > limit:
            raise ValueError(f"warm-start: question {q.question!r} does not fit the loop sizes (prompt {len(prompt)} "
                             f"tokens, search ok={result.ok}); raise prompt_length/response_length")
        if len(call) + 1 > config.max_tokens_per_turn:
            skipped["call_too_long"] += 1
            continue
        observation = frame.observation(content, None, config.max_observation_tokens, tokenizer)
        if f"[{q.answer}]" not in tokenizer.decode(observation):
            skipped["answer_not_shown"] += 1
            continue
        turns = (call + eot, observation, answer + eot)
        pairs.append((q, Example(tuple(prompt) + tuple(t for turn in turns for t in turn),
                                 (0,) * len(prompt) + tuple(m for turn, m in zip(turns, (1, 0, 1)) for _ in turn))))
    _verify_against_loop(tokenizer, tools, pairs[: config.verify_examples], config, model_type)
    return [example for _, example in pairs], skipped


def _verify_against_loop(tokenizer: Any, tools: LocalTools, pairs: list[tuple[DemoQuestion, Example]],
                         config: WarmStartConfig, model_type: str | None) -> None:
    """Replay (question, example) pairs through ``IGPOAgentLoop`` (scripted turns); require identical ids and masks."""
    eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def replay(index: int, question: DemoQuestion) -> Example:
        server = _ScriptedServer(tokenizer, [search_turn(question.snippet), answer_turn(question.answer)], eot_id)
        loop = _make_loop(tokenizer, server, tools, config, max_turns=config.max_turns, scoring=False,
                          model_type=model_type)
        out = await loop.run({"temperature": 1.0}, **_loop_kwargs(question, index))
        return Example(tuple(out.prompt_ids) + tuple(out.response_ids),
                       (0,) * len(out.prompt_ids) + tuple(out.response_mask))

    async def replay_all() -> list[Example]:
        return [await replay(i, q) for i, (q, _) in enumerate(pairs)]

    for (question, built), rolled in zip(pairs, tools.run(replay_all)):
        if built != rolled:
            raise AssertionError(
                f"warm-start: the synthetic sequence for {question.question!r} differs from the agent loop's rollout "
                "of the same turns (the loop's prompt or observation layout changed); fix build_examples")


# ---------------------------------------------------------------------------------------------------- world task


def world_examples(tokenizer: Any, tools: LocalTools, world: Any, config: WarmStartConfig, *, plans_per_question: int,
                   model_type: str | None = None,
                   chain_plan: tuple[float, float] | None = None) -> tuple[list[Example], dict[str, int]]:
    """Warm-start sequences for the generated world (``igpo.demo.world``): every training question played
    ``plans_per_question`` times by the imperfect policy of ``demo_world.warm_start_plan``, each one run through the
    real ``IGPOAgentLoop`` with a scripted server, so every sequence is the loop's own layout (prompt, tool turns,
    observations as the loop frames and truncates them, answer) with its loss mask. A plan the loop cannot play to
    its end (it would force the answer earlier, e.g. for lack of context) is skipped and counted. ``chain_plan``:
    the chain questions' (p_no_search, p_next_hop), default the world's calibrated ``CHAIN_P_*``."""
    from igpo.agent import records  # torch: imported where a loop runs, not by the launcher's cache check (main)

    eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(config.seed)
    chain = {"chain": chain_plan} if chain_plan else {}
    jobs = [(q, warm_start_plan(world, q, rng, **chain)) for q in world.questions("train")
            for _ in range(plans_per_question)]

    async def play(index: int, question: Any, plan: Any) -> tuple[Example | None, str]:
        turns = [search_turn(query) for query in plan.queries] + [answer_turn(plan.answer)]
        server = _ScriptedServer(tokenizer, turns, eot_id)
        loop = _make_loop(tokenizer, server, tools, config, max_turns=config.max_turns, scoring=False,
                          model_type=model_type)
        kwargs = {"raw_prompt": [{"role": "user", "content": question.question}],
                  "reward_model": {"ground_truth": question.answer}, "data_source": "demo_world", "extra_info": {},
                  "index": index, "uid": f"warmstart-{index}", "global_steps": 0}
        out = await loop.run({"temperature": 1.0}, **kwargs)
        record = records.TurnRecord.from_extra_fields(out.extra_fields)
        if server.calls != len(turns) or record.stop_reason != "answer" or record.forced_final:
            return None, "not_played_to_the_end"
        if not all(record.format_ok):
            return None, "malformed"
        return Example(tuple(out.prompt_ids) + tuple(out.response_ids),
                       (0,) * len(out.prompt_ids) + tuple(out.response_mask)), "ok"

    async def play_all() -> list[tuple[Example | None, str]]:
        return [await play(i, q, plan) for i, (q, plan) in enumerate(jobs)]

    examples, skipped = [], {"not_played_to_the_end": 0, "malformed": 0}
    for example, status in tools.run(play_all):
        if example is None:
            skipped[status] += 1
        else:
            examples.append(example)
    return examples, skipped


# ---------------------------------------------------------------------------------------------------- training


def _shared_prefix_len(examples: list[Example]) -> int:
    """Length of the token prefix common to every example, stopping before the first trained token."""
    first = examples[0]
    n = min(len(e.ids) for e in examples) - 1
    for e in examples[1:]:
        k = 0
        while k < n and e.ids[k] == first.ids[k]:
            k += 1
        n = k
    trained = min(e.mask.index(1) for e in examples)
    return min(n, trained)


def masked_lm_loss(model: Any, batch: list[Example], prefix_len: int):
    """L = -sum_t m_t log pi(x_t | x_<t) / sum_t m_t over the batch, with the shared prefix encoded once.

    The prefix ``ids[:prefix_len]`` (identical in every example, no trained token) runs at batch size 1; its
    key/value states, expanded to the batch, are the cache for the right-padded suffixes. Gradients flow through
    the expansion, so this equals the full-sequence loss.
    """
    import torch
    from transformers import DynamicCache

    size = len(batch)
    width = max(len(e.ids) for e in batch) - prefix_len
    suffix = torch.zeros((size, width), dtype=torch.long)  # pad id 0: padded positions have m = 0
    mask = torch.zeros((size, width), dtype=torch.float32)
    for row, example in enumerate(batch):
        tail = example.ids[prefix_len:]
        suffix[row, : len(tail)] = torch.tensor(tail)
        mask[row, : len(tail)] = torch.tensor(example.mask[prefix_len:], dtype=torch.float32)
    prefix = torch.tensor(batch[0].ids[:prefix_len])[None, :]
    cache = model(input_ids=prefix, use_cache=True).past_key_values
    expanded = DynamicCache(ddp_cache_data=[
        (layer.keys.expand(size, -1, -1, -1), layer.values.expand(size, -1, -1, -1)) for layer in cache.layers
    ])
    positions = (prefix_len + torch.arange(width))[None, :].expand(size, -1)
    # Right padding: real tokens never attend to the later pad tokens under the causal mask; pads carry m = 0.
    logits = model(input_ids=suffix, past_key_values=expanded, position_ids=positions, use_cache=True).logits
    log_probs = logits[:, :-1].float().log_softmax(-1).gather(-1, suffix[:, 1:, None]).squeeze(-1)
    # Token prefix_len is predicted from the prefix's last position; it is prompt text (m = 0), checked below.
    if float(mask[:, 0].sum()) != 0:
        raise AssertionError("warm-start: the shared prefix ends inside an assistant turn")
    target_mask = mask[:, 1:]
    return -(log_probs * target_mask).sum() / target_mask.sum()


def train(model: Any, examples: list[Example], config: WarmStartConfig) -> list[float]:
    """AdamW on the masked loss until ``seconds`` or ``max_steps``; returns the loss of every step."""
    import torch

    prefix_len = _shared_prefix_len(examples)
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    order: list[int] = []
    losses: list[float] = []
    start = time.monotonic()
    while len(losses) < config.max_steps and time.monotonic() - start < config.seconds:
        # The schedule follows the steps alone: the wall-time cap can end a run early (the caller says so), but it
        # never shapes the learning rate, so a run that reaches max_steps is the same on a busy machine as on an
        # idle one (a schedule on wall time made the model depend on the machine's load).
        progress = len(losses) / config.max_steps
        # Linear warm-up, then linear decay to 10% at max_steps: the last steps settle the format.
        scale = min(1.0, (len(losses) + 1) / (config.warmup_steps + 1)) * max(0.1, 1.0 - progress)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * scale
        if len(order) < config.batch_size:  # a fresh shuffled epoch
            order = list(range(len(examples)))
            rng.shuffle(order)
        batch = [examples[order.pop()] for _ in range(min(config.batch_size, len(examples)))]
        loss = masked_lm_loss(model, batch, prefix_len)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"warm-start: the loss became {float(loss)} at step {len(losses)}; lower lr "
                                     f"(now {config.lr})")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------------- entry point


def trained_model(model_dir: Path, examples: list[Example], config: WarmStartConfig) -> tuple[Any, list[float], float]:
    """The base checkpoint in float32, trained on ``examples``: (model, the loss of every step, training seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        start = time.monotonic()
        losses = train(model, examples, config)
        return model, losses, time.monotonic() - start
    finally:
        torch.set_num_threads(threads)


# The code that turns (base weights, training sequences, config) into the warm-started weights; the cache key hashes
# its source, not the whole module, so that an edit elsewhere here (the CLI, the measures, the cache check itself)
# keeps a cached model (SmolLM2's warm-start costs 17-30 min on two cores). tests/demo/test_warmstart.py checks that
# every function of this module these call is listed.
TRAINING_CODE = (trained_model, train, masked_lm_loss, _shared_prefix_len)


def _fingerprint(model_dir: Path, examples: list[Example], config: WarmStartConfig) -> str:
    """Every input of the result: the training code (``TRAINING_CODE``'s source, torch's and transformers' versions),
    the base checkpoint's files, the exact training sequences (which capture the corpus, the protocol, the tool
    rendering and the tokenizer) and the config."""
    import importlib.metadata

    digest = hashlib.sha256()
    for function in TRAINING_CODE:
        digest.update(inspect.getsource(function).encode())
    for dist in ("torch", "transformers"):
        digest.update(importlib.metadata.version(dist).encode())
    digest.update(json.dumps(asdict(config), sort_keys=True).encode())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != STAMP):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for example in examples:
        digest.update(json.dumps([example.ids, example.mask]).encode())
    return digest.hexdigest()[:16]


def inputs_key(base: Path, corpus: Path, options: dict[str, Any]) -> str:
    """A cheap key for the launcher's cache check (recorded in the stamp as ``inputs_key``): the CLI's options, the
    base checkpoint's and the corpus's bytes, every source file of the two packages that build the training
    sequences (``igpo``, ``tool_server``) and the tokenizer libraries' versions. It covers what ``_fingerprint``
    covers, and more (any code change counts), without building the sequences (~7 s with verl's imports): a match
    reuses the checkpoint, a miss falls back to the full fingerprint."""
    import importlib.metadata

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for package in ("igpo", "tool_server"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    for path in sorted(p for p in base.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(corpus.read_bytes())
    for dist in ("transformers", "tokenizers"):
        digest.update(importlib.metadata.version(dist).encode())
    return digest.hexdigest()[:16]


def training_questions(corpus: Path, tools: LocalTools, config: WarmStartConfig) -> list[DemoQuestion]:
    """``examples_per_passage`` questions per training passage (held-out passages excluded), distinct snippets."""
    train_passages, _ = split_passages(load_passages(corpus), config.data)
    questions = []
    for k in range(config.examples_per_passage):
        questions += build_questions(train_passages, tools.backend, config.data, salt=1000 + k)
    return questions


def heldout_questions(corpus: Path, tools: LocalTools, config: WarmStartConfig) -> list[DemoQuestion]:
    """The validation questions of ``igpo.demo.titles`` (the passages the warm-start never trains on)."""
    _, val_passages = split_passages(load_passages(corpus), config.data)
    return build_questions(val_passages, tools.backend, config.data)


def warm_start(model_dir: str | Path, corpus: str | Path, out_dir: str | Path, *, seconds: float | None = None,
               seed: int | None = None, config: WarmStartConfig | None = None, world: Any = None,
               chain_plan: tuple[float, float] | None = None) -> Path:
    """Warm-start the checkpoint in ``model_dir`` on synthetic search-then-answer trajectories; save to ``out_dir``.

    Args:
        model_dir: a Hugging Face causal-LM checkpoint with its tokenizer (e.g. ``igpo.demo.tiny_model`` output).
        corpus: the local JSONL corpus the demo's tool server searches.
        out_dir: where the trained checkpoint + tokenizer go; returned unchanged when its stamp matches the inputs.
        seconds, seed: when given, override ``config.seconds`` / ``config.seed`` (the CLI's knobs).
        config: everything else; defaults to ``WarmStartConfig()`` (the CPU demo's sizes).
        world: a ``igpo.demo.world.World`` whose corpus ``corpus`` is: train on its questions with the imperfect
            policy of ``demo_world.warm_start_plan`` instead of the corpus-title questions.
        chain_plan: with ``world``, the chain questions' (p_no_search, p_next_hop) instead of the calibrated defaults
            (a model calibrated on another CPU type: results/turn_credit/plan.md).
    Returns:
        ``out_dir``, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``. Its stamp holds the loss curve.
    """
    from transformers import AutoTokenizer

    config = config or WarmStartConfig()
    overrides = {k: v for k, v in (("seconds", seconds), ("seed", seed)) if v is not None}
    config = dataclasses.replace(config, **overrides)
    model_dir, corpus, out_dir = Path(model_dir), Path(corpus), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"warm-start: {model_dir} is not a Hugging Face checkpoint (no config.json); build "
                                "one with python -m igpo.demo.tiny_model --out DIR --corpus FILE")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = LocalTools(corpus, config.topk)
    try:
        if world is not None:
            examples, skipped = world_examples(tokenizer, tools, world, config,
                                               plans_per_question=config.examples_per_passage,
                                               model_type=_model_type(model_dir), chain_plan=chain_plan)
        else:
            examples, skipped = build_examples(tokenizer, tools, training_questions(corpus, tools, config), config,
                                               _model_type(model_dir))
    finally:
        tools.close()
    if not examples:
        raise ValueError(f"warm-start: no usable training trajectory from {corpus} (skipped: {skipped}); raise "
                         "max_tokens_per_turn / max_observation_tokens")
    fingerprint = _fingerprint(model_dir, examples, config)
    stamp = out_dir / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return out_dir

    model, losses, elapsed = trained_model(model_dir, examples, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # a half-written directory must not look finished
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    head, tail = losses[: min(5, len(losses))], losses[-min(5, len(losses)):]
    report = {
        "fingerprint": fingerprint, "base": str(model_dir), "config": asdict(config), "examples": len(examples),
        "skipped": skipped, "steps": len(losses), "train_seconds": round(elapsed, 1),
        "loss_start": sum(head) / len(head), "loss_end": sum(tail) / len(tail), "losses": losses,
    }
    stamp.write_text(json.dumps(report, indent=1))
    if len(losses) < config.max_steps:
        import sys

        print(f"warm-start: the {config.seconds:g} s time cap stopped training after {len(losses)} of "
              f"{config.max_steps} steps (loss {report['loss_end']:.3f}); the model is weaker than a full run's. "
              f"Delete {out_dir} and rerun on a less loaded machine, or raise --seconds.", file=sys.stderr)
    return out_dir


# ---------------------------------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class ProtocolReport:
    """What sampling (temperature 1) through the agent loop shows about a checkpoint.

    search_first: share of trajectories whose first turn is a well-formed search call (format check passes).
    found: share whose first search shows the ground-truth title in its observation.
    answer_after_observation: share that end with an ``<answer>`` turn after at least one observation.
    exact: share whose final answer equals the ground truth.
    ig_first_search: mean l_1 - l_0 over trajectories whose first turn was a search, where
        l_s = mean log pi(gt tokens | context[:b_s], <answer>) (the loop's rollout-side scoring).
    ig_positive: share of those with l_1 - l_0 > 0.
    """

    n: int
    search_first: float
    found: float
    answer_after_observation: float
    exact: float
    ig_first_search: float | None
    ig_positive: float | None


def measure(model_dir: str | Path, corpus: str | Path, *, n: int = 32, seed: int = 0,
            config: WarmStartConfig | None = None, max_turns: int = 4) -> ProtocolReport:
    """Roll out ``n`` held-out demo questions with ``HFRolloutServer`` + ``IGPOAgentLoop`` (Ray-free) and report."""
    import torch
    from transformers import AutoTokenizer

    from igpo.agent import records
    from igpo.cpu.hf_rollout import HFRolloutServer

    config = config or WarmStartConfig()
    corpus = Path(corpus)
    tools = LocalTools(corpus, config.topk)
    threads = torch.get_num_threads()
    try:
        questions = heldout_questions(corpus, tools, config)
        questions = [questions[i % len(questions)] for i in range(n)]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        server = HFRolloutServer(str(model_dir), max_model_len=config.prompt_length + config.response_length,
                                 response_length=config.response_length, seed=seed)
        torch.set_num_threads(config.threads)  # the server picks its own thread count; this is a one-off measure

        async def run_all() -> list[Any]:
            params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
            return await asyncio.gather(*(
                _make_loop(tokenizer, server, tools, config, max_turns=max_turns, scoring=True,
                           model_type=_model_type(Path(model_dir)), seed=seed)
                .run(params, **_loop_kwargs(q, i), session_id=i) for i, q in enumerate(questions)))

        outputs = tools.run(run_all)
    finally:
        torch.set_num_threads(threads)
        tools.close()

    search_first = found = answered = exact = 0
    gains: list[float] = []
    for question, out in zip(questions, outputs):
        record = records.TurnRecord.from_extra_fields(out.extra_fields)
        if record.tool_names[:1] == ["search"] and record.format_ok[0]:
            search_first += 1
            observation = tokenizer.decode(out.response_ids[record.turn_ends[0] + 1:])
            found += f"[{question.answer}]" in observation.split("</tool_response>")[0]
            scores = record.answer_logprobs
            if len(scores) > 1 and scores[0] is not None and scores[1] is not None:
                gains.append(scores[1][0] - scores[0][0])
        answered += record.stop_reason == "answer" and record.num_turns >= 2
        exact += record.final_answer == question.answer
    return ProtocolReport(
        n=n, search_first=search_first / n, found=found / n, answer_after_observation=answered / n, exact=exact / n,
        ig_first_search=sum(gains) / len(gains) if gains else None,
        ig_positive=sum(g > 0 for g in gains) / len(gains) if gains else None,
    )


def measure_world(model_dir: str | Path, corpus: str | Path, world: Any, *, split: str = "val", n: int | None = None,
                  seed: int = 0, config: WarmStartConfig | None = None) -> dict[str, float]:
    """Sample (temperature 1) the world's ``split`` questions through ``IGPOAgentLoop`` + ``HFRolloutServer`` (no Ray).

    Returns the mean F1, the share with the full score (exact: the trainer's ``outcome/success_share``), and what the
    policy did: searched first, searched the asked person first (right_person), searched as often as a two-hop
    question needs (second_hop; the chain task: full_chain), made every hop of its chain correctly (chain_right, from
    the loop's ``TurnRecord.hop_right``), made at least k correct hops (reach<k>), and the mean F1 per question kind.
    With ``seed`` each request is sampled as the trainer's rollout samples it (see the server's construction below).
    """
    import torch
    from transformers import AutoTokenizer

    from igpo.agent import records
    from igpo.agent.protocol import parse_turn
    from igpo.core.outcome import f1_score
    from igpo.cpu.hf_rollout import HFRolloutServer

    config = config or WarmStartConfig()
    questions = world.questions(split)
    questions = questions[:n] if n else questions
    tools = LocalTools(corpus, config.topk)
    threads = torch.get_num_threads()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # The seed reaches every request as in the trainer's rollout: the loop derives each turn's sampling seed
        # from (seed, step, uid, session id, turn), so two seeds sample two sets of trajectories.
        server = HFRolloutServer(str(model_dir), max_model_len=config.prompt_length + config.response_length,
                                 response_length=config.response_length, seed=seed)
        torch.set_num_threads(config.threads)

        async def run_all() -> list[Any]:
            params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
            return await asyncio.gather(*(
                _make_loop(tokenizer, server, tools, config, max_turns=config.max_turns, scoring=False,
                           model_type=_model_type(Path(model_dir)), seed=seed)
                .run(params, raw_prompt=[{"role": "user", "content": q.question}],
                     reward_model={"ground_truth": q.answer}, data_source="demo_world",
                     extra_info={HOP_TARGETS_KEY: world.hop_targets(q)}, index=i, uid=f"measure-{i}",
                     global_steps=0, session_id=i) for i, q in enumerate(questions)))

        outputs = tools.run(run_all)
    finally:
        torch.set_num_threads(threads)
        tools.close()

    scores: dict[str, list[float]] = {}
    searched = right = hops = two_hop = exact = chain_right = 0
    reach: dict[int, int] = {}
    for question, out in zip(questions, outputs):
        record = records.TurnRecord.from_extra_fields(out.extra_fields)
        reached = sum(record.hop_right)
        chain_right += reached >= question.hops
        for k in range(1, reached + 1):
            reach[k] = reach.get(k, 0) + 1
        answer = record.final_answer
        score = f1_score(answer, [question.answer]) if answer else 0.0
        scores.setdefault(question.kind, []).append(score)
        exact += score >= 1.0  # the trainer's success (outcome/success_share): the full outcome score
        tools_used = [t for t in record.tool_names if t]
        if tools_used:
            searched += 1
            first = tokenizer.decode(out.response_ids[: record.turn_ends[0] + 1])
            call = parse_turn(first.split("<|im_end|>")[0])
            query = call.arguments.get("query") if call.kind == "tool_call" else None
            right += question.person in " ".join([query] if isinstance(query, str) else query or [])
        if question.hops >= 2:  # searched as often as the question needs (the chain task's full chain)
            two_hop += 1
            hops += len(tools_used) >= question.hops
    count = len(questions)
    report = {"n": float(count), "f1": sum(sum(v) for v in scores.values()) / count, "exact": exact / count,
              "searched": searched / count,
              "right_person": right / count,
              "second_hop" if world.task == "hops" else "full_chain": hops / two_hop if two_hop else float("nan"),
              "chain_right": chain_right / count}
    report.update({f"reach{k}": reach.get(k, 0) / count for k in range(1, max(q.hops for q in questions) + 1)})
    report.update({f"f1_{kind}": sum(v) / len(v) for kind, v in scores.items()})
    return report


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="checkpoint to start from (python -m igpo.demo.tiny_model output)")
    parser.add_argument("--corpus", required=True, help="JSONL corpus, e.g. data/wiki_passages_1000.jsonl")
    parser.add_argument("--out", required=True, help="output checkpoint directory (reused when up to date)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default {WarmStartConfig.max_steps}; world: demo_world.WARM_START_STEPS)")
    parser.add_argument("--seconds", type=float, default=WarmStartConfig.seconds,
                        help="training wall-time cap; training stops at --steps or here, whichever comes first")
    parser.add_argument("--seed", type=int, default=WarmStartConfig.seed)
    parser.add_argument("--eval", type=int, default=0, metavar="N",
                        help="also roll out N held-out questions with the base and the warm-started model")
    parser.add_argument("--world-seed", type=int, default=None,
                        help="train on the practice world of the generated world of this seed (igpo.demo.world; "
                             "--corpus is its practice_corpus.jsonl) instead of the corpus-title questions")
    parser.add_argument("--task", default="hops", help="the world's task with --world-seed: hops or chain")
    parser.add_argument("--chain-plan", default=None, metavar="P_NO_SEARCH,P_NEXT_HOP",
                        help="with --task chain: the warm-start policy's probabilities (default: the calibrated "
                             "igpo.demo.world.CHAIN_P_NO_SEARCH, CHAIN_P_NEXT_HOP)")
    args = parser.parse_args()
    chain_plan = None
    if args.chain_plan is not None:
        try:
            chain_plan = tuple(float(v) for v in args.chain_plan.split(","))
        except ValueError:
            chain_plan = ()
        if args.task != "chain" or args.world_seed is None:
            parser.error("--chain-plan applies to the chain task's world only: add --task chain --world-seed N")
        if len(chain_plan) != 2 or not all(0.0 <= p <= 1.0 for p in chain_plan):
            parser.error(f"--chain-plan {args.chain_plan}: give two probabilities, e.g. 0.35,0.5")
    stamp_path = Path(args.out) / STAMP
    key = (inputs_key(Path(args.base), Path(args.corpus), {k: v for k, v in vars(args).items() if k != "eval"})
           if Path(args.base).is_dir() and Path(args.corpus).is_file() else None)  # else warm_start says what is wrong
    if key and not args.eval and stamp_path.is_file() and json.loads(stamp_path.read_text()).get("inputs_key") == key:
        print(args.out)
        return
    config = WarmStartConfig(max_steps=args.steps or WarmStartConfig.max_steps)
    world = None
    if args.world_seed is not None:
        # Trained on the practice world (same names, other facts): --corpus is its practice_corpus.jsonl.
        world = practice_world(build_world(WorldConfig(seed=args.world_seed, task=args.task)), args.world_seed)
        config = warm_start_config(max_steps=args.steps, task=args.task)
    out = warm_start(args.base, args.corpus, args.out, seconds=args.seconds, seed=args.seed, config=config,
                     world=world, chain_plan=chain_plan)
    stamp = json.loads((Path(out) / STAMP).read_text())
    if key:
        stamp_path.write_text(json.dumps({**stamp, "inputs_key": key}, indent=1))
    print(f"warm-start: {stamp['examples']} sequences, {stamp['steps']} steps in {stamp['train_seconds']} s, "
          f"loss {stamp['loss_start']:.3f} -> {stamp['loss_end']:.3f}")
    if args.eval:
        for name, path in (("base", args.base), ("warm", out)):
            if world is not None:  # the world's held-out people, searched in its own corpus next to the practice one
                report = measure_world(path, Path(args.corpus).with_name("corpus.jsonl"),
                                       build_world(WorldConfig(seed=args.world_seed, task=args.task)), n=args.eval,
                                       seed=args.seed,
                                       config=config)
            else:
                report = asdict(measure(path, args.corpus, n=args.eval, seed=args.seed, config=config))
            print(f"warm-start eval ({name}): {report}")
    print(out)


if __name__ == "__main__":
    main()
