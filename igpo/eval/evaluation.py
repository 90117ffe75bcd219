"""Benchmark evaluation of a search agent: the ``igpo_agent`` loop over a QA parquet, scored like training.

For every row r of the test set (verl RL schema, docs/design/reference_igpo.md §7) the agent loop runs one trajectory
with greedy decoding
by default, and the final assistant turn is scored by ``igpo.reward.compute_score`` -- the same code as the training
reward, so the numbers mean the same thing (SQuAD normalisation, max over the gold aliases A_r):

    EM_r = max_{a in A_r} [norm(p_r) == norm(a)]        F1_r = max_{a in A_r} F1_tok(p_r, a)
    J_r  = 1 if the LLM judge says p_r is correct, 0 if it says not, missing if it gave no verdict

with p_r the answer inside the last ``<answer>`` of the final turn (no answer: EM_r = F1_r = 0). A source's score is
the mean over its rows; ``ALL`` is the mean over all rows (micro) and ``AVG`` the mean over sources (macro, the
figure the IGPO / DeepResearcher tables report). The judge mean is over the rows the judge gave a verdict for; the
rows it did not are counted in ``judge_failed``, never scored 0.

With ``runs = k > 1`` every question q is answered k times by sampling (temperature > 0), run r with its own seeds,
and each score s in {EM, F1, judge} also gets, over the questions Q of a source (runs without a score left out):

    avg@k = mean_{q in Q} mean_r s_{q,r}        pass@k = mean_{q in Q} max_r s_{q,r}

For 0/1 scores (EM, judge) pass@k is the usual one: the share of questions answered correctly in at least one of the
k runs ("correct" = EM 1, or the judge's yes); for F1 it is the mean best F1. max >= mean per question, so
pass@k >= avg@k in every row; with every run scored, avg@k is the mean over the k runs of the per-run mean score.
Sampling is seeded per request, ``request_seed(seed, 0, question, run, turn, attempt)`` (``igpo.agent.agent_loop``): the
HF server samples each request from its own torch generator, a vLLM endpoint gets the request's ``seed``.

What runs where (this module is the run itself; each other job has its module in ``igpo/eval/``):
- the settings (``settings.py``): ``EvalConfig``, what ``settings.json`` records, the resume check;
- the test set (``data.py``): ``load_rows`` reads and validates the parquet into ``EvalRow`` records;
- the policy (``policy.py``): ``HFRolloutServer`` (a local Hugging Face checkpoint, CPU or GPU) or
  ``OpenAICompletionsServer`` (an OpenAI-compatible ``/v1/completions`` endpoint that takes token ids and returns
  token ids, e.g. vLLM); both have the ``generate(request_id, prompt_ids, sampling_params) -> TokenOutput`` contract
  of verl's server manager;
- the tools (``tools.py``): a ``tool_server`` reached through ``ToolClient`` (``local_tool_server`` starts one on a
  local corpus);
- the bookkeeping (``traces.py``): ``TraceStore`` appends one JSON line per finished row to ``traces.jsonl`` as soon
  as it is done, so an interrupted run resumes where it stopped (rows keyed by ``(data_source, extra_info.index,
  run)``);
- the results: ``tables.py`` (the per-source table with ``ALL`` / ``AVG`` and avg@k / pass@k) and ``plots.py``.

A row whose rollout raised (endpoint down, tool client crash) is NOT written: it is reported as failed and a rerun
redoes it. ``settings.json`` records everything that changes the numbers; resuming with different settings is
refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from igpo.agent.records import RewardInputs, TurnRecord
from igpo.core.turn_format import extract_answer
from igpo.eval.data import EvalRow
from igpo.eval.settings import EvalConfig
from igpo.eval.traces import TraceStore

logger = logging.getLogger(__name__)


class Progress:
    """Prints ``done/total``, the rate of this run and an ETA every ``every`` finished rows, and at the end.

    ``unit`` names what is counted: rows, or (question, run) pairs with ``--runs`` > 1."""

    def __init__(self, total: int, resumed: int, every: int, emit: Callable[[str], None], unit: str = "rows") -> None:
        self.total, self.resumed, self.every, self.emit, self.unit = total, resumed, every, emit, unit
        self.done = self.failed = 0
        self.start = time.perf_counter()

    def tick(self, failed: bool = False) -> None:
        self.done += 1
        self.failed += int(failed)
        remaining = self.total - self.resumed - self.done
        if self.done % self.every == 0 or remaining == 0:
            self.emit(self.line())

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        remaining = self.total - self.resumed - self.done
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "?"
        return (f"[evaluate] {self.resumed + self.done}/{self.total} {self.unit} ({self.resumed} resumed, "
                f"{self.failed} failed) | {rate:.2f} {self.unit}/s | elapsed {elapsed:.0f}s | ETA {eta}")


@dataclass
class RunReport:
    """What one ``evaluate`` call did."""

    total: int
    """(question, run) pairs selected: rows x runs."""
    resumed: int
    finished: int
    failed: dict[tuple[str, str, int], str] = field(default_factory=dict)
    """(data_source, index, run) -> error of every rollout that raised (not written; a rerun redoes it)."""
    rejudged: int = 0
    seconds: float = 0.0


def _reward_kwargs(config: EvalConfig, judge_settings: Mapping[str, Any] | None) -> dict[str, Any]:
    if not config.judge:
        return {"train_reward_type": "f1"}
    return {"train_reward_type": "llm", "judge": dict(judge_settings or {})}


async def score_record(row: EvalRow, final_turn_text: str, reward_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """EM / F1 / judge of a final turn, by the training reward function (module docstring)."""
    from igpo.reward import compute_score

    scores = await compute_score(
        row.data_source, "", row.ground_truth,
        extra_info=RewardInputs(final_turn_text, question=row.question).to_extra_info(), **reward_kwargs,
    )
    judge = None if math.isnan(scores["judge"]) else scores["judge"]
    return {"em": scores["em"], "f1": scores["f1"], "judge": judge, "judge_failed": bool(scores["judge_failed"]),
            "format_ok": bool(scores["format_ok"])}


def trace_record(row: EvalRow, output: Any, record: TurnRecord, scores: Mapping[str, Any], tokenizer: Any,
                 seconds: float, run: int = 0) -> dict:
    """One trace line: the row, the scores, and what the agent loop recorded (``record``, read from ``output``)."""
    final_turn = record.final_turn_text
    names = list(record.tool_names)
    return {
        "data_source": row.data_source, "index": row.index, "run": run, "row": row.number, "question": row.question,
        "gold": list(row.aliases), "final_answer": extract_answer(final_turn), **scores,
        "turns": record.num_turns, "tool_calls": sum(n is not None for n in names),
        "tool_names": names, "tool_status": list(record.tool_status),
        "stop_reason": record.stop_reason, "forced_final": bool(record.forced_final),
        "truncated": bool(record.truncated), "infra_errors": int(record.infra_errors),
        "retries": int(record.retries), "sample_error": record.error,
        "prompt_tokens": len(output.prompt_ids), "response_tokens": len(output.response_ids),
        "seconds": round(seconds, 3), "final_turn_text": final_turn,
        "response_text": tokenizer.decode(output.response_ids, skip_special_tokens=False),
    }


class _OnceFilter(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def make_agent_loop_factory(tokenizer: Any, server: Any, tools: Any, config: EvalConfig) -> Callable[[], Any]:
    """A constructor of ``IGPOAgentLoop`` objects as verl would build them, without Ray (score_on=actor)."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    from igpo.agent.agent_loop import IGPOAgentLoop

    trainer_config = DictConfigWrap(OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": config.prompt_length,
                                          "response_length": config.response_length}},
        "algorithm": {"igpo": {"score_on": "actor", "agent": config.agent_section()}},
        "seed": config.seed,  # with the uid and session_id of each run: per-request seeds (request_seed)
    }))
    data_config = DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": dict(config.chat_template_kwargs)}))
    # verl warns on every loop construction when the model family has no token builder; once per run is enough.
    wiring = logging.getLogger("verl.utils.tokenizer.continuous_token_wiring")
    if not any(isinstance(f, _OnceFilter) for f in wiring.filters):
        wiring.addFilter(_OnceFilter())

    def build() -> IGPOAgentLoop:
        return IGPOAgentLoop(trainer_config=trainer_config, server_manager=server, tokenizer=tokenizer,
                             processor=None, dataset_cls=None, data_config=data_config, hf_model_type=None,
                             tools=ToolListWrap([]), tool_caller=tools)

    return build


async def evaluate(
    rows: list[EvalRow],
    *,
    tokenizer: Any,
    server: Any,
    tools: Any,
    config: EvalConfig,
    store: TraceStore,
    judge_settings: Mapping[str, Any] | None = None,
    emit: Callable[[str], None] = print,
) -> RunReport:
    """Run the agent loop ``config.runs`` times over every row (each (row, run) not yet in ``store``; at most
    ``config.concurrency`` at once) and score each answer.

    Run r of row q is sampled with the agent loop's per-request seeds from (``config.seed``, q's uid, r), so it draws
    the same tokens however the runs are batched or resumed (where the backend honours a seed). With the judge
    enabled, finished answers whose judge call failed earlier are judged again first (no rollout).
    """
    start = time.perf_counter()
    reward_kwargs = _reward_kwargs(config, judge_settings)
    build = make_agent_loop_factory(tokenizer, server, tools, config)
    build()  # the chat template is checked once here, so a template problem stops the run before any row
    pairs = [(row, run) for row in rows for run in range(config.runs)]
    report = RunReport(total=len(pairs), resumed=sum(row.run_key(run) in store for row, run in pairs), finished=0)

    if config.judge:
        stale = [(row, run) for row, run in pairs
                 if row.run_key(run) in store and store.records[row.run_key(run)].get("judge_failed")]
        for row, run in stale:
            record = store.records[row.run_key(run)]
            record.update(await score_record(row, record["final_turn_text"], reward_kwargs))
            if not record["judge_failed"]:
                report.rejudged += 1
        if stale:
            store.rewrite()
            emit(f"[evaluate] re-judged {len(stale)} finished rows whose judge call had failed "
                 f"({report.rejudged} now have a verdict)")

    todo = [(row, run) for row, run in pairs if row.run_key(run) not in store]
    unit = "rows" if config.runs == 1 else "(question, run) pairs"
    progress = Progress(len(pairs), report.resumed, config.progress_every, emit, unit=unit)
    semaphore = asyncio.Semaphore(config.concurrency)
    sampling = config.sampling_params()

    async def one(row: EvalRow, run: int) -> None:
        async with semaphore:
            began = time.perf_counter()
            try:
                output = await build().run(
                    dict(sampling), raw_prompt=[dict(m) for m in row.messages],
                    reward_model={"ground_truth": row.ground_truth}, data_source=row.data_source,
                    extra_info={"index": row.index}, index=row.index, global_steps=0,
                    uid=row.uid, session_id=run,  # the seed key: (seed, step 0, question, run)
                )
                turn_record = TurnRecord.from_extra_fields(output.extra_fields)
                scores = await score_record(row, turn_record.final_turn_text, reward_kwargs)
            except Exception as err:  # noqa: BLE001 - recorded per (row, run), reported, redone by the next run
                message = f"{type(err).__name__}: {err}"
                report.failed[row.run_key(run)] = message
                logger.warning("row %d %s run %d failed: %s", row.number, row.key, run, message)
                progress.tick(failed=True)
                return
            store.append(trace_record(row, output, turn_record, scores, tokenizer, time.perf_counter() - began,
                                      run=run))
            report.finished += 1
            progress.tick()

    await asyncio.gather(*(one(row, run) for row, run in todo))
    if not todo:
        emit(progress.line())
    report.seconds = time.perf_counter() - start
    return report
