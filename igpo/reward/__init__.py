"""verl custom reward function for the search agent's outcome reward (docs/design/reference_igpo.md §6).

Wire it in with ``reward.custom_reward_function.path=pkg://igpo.reward`` and ``.name=compute_score``; settings go in
``+reward.custom_reward_function.reward_kwargs.<key>=...`` (see ``OutcomeRewardConfig``).

Per trajectory, with p the answer extracted from the FINAL assistant turn only (never tool or web text) and A the
gold aliases:

    R_outcome = F1(p, A)        train_reward_type = "f1"
              = EM(p, A)        train_reward_type = "em"
              = R_judge(p, A)   train_reward_type = "llm"  (1 if the LLM judge says correct, else 0)

A trajectory without an ``<answer>`` scores ``missing_answer_score`` under F1/EM (0 by default; an empty answer
scores 0) and is judged incorrect without a request. When the judge gives no verdict, R_outcome = F1(p, A) (or
``judge_failure_score`` when set), the sample reports ``judge_failed=1`` and the judge logs a warning -- never a
silent 0 (``judge_metrics()`` has the counters). Optionally a malformed final turn (``turn_format``) replaces
R_outcome by ``-answer_format_penalty`` (docs/design/reference_igpo.md §1.5; off by default so the IGPO estimator can
decide).

The reference system's outcome (DR-Venus, docs/design/reference_igpo.md §6) is ``f1_normalization="reference"``,
``missing_answer_score=-2.0``, ``tag_balance_gate=True``, ``answer_pick="first"``, ``judge_failure_score=0.0``,
``require_think=True`` (configs/fidelity/reference_drvenus.yaml sets them). It scans only the final turn, not the
whole response with the tool outputs as the reference did (docs/design/reference_igpo.md §10 item 9, a bug not
reproduced).

Every sample returns the same keys: score, f1, em, judge (nan unless the judge gave a verdict), judge_failed,
format_ok.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from igpo.agent.records import RewardInputs
from igpo.core.ground_truth import parse_ground_truth
from igpo.core.outcome import F1_NORMALIZATIONS, AnswerScores, score_answer
from igpo.core.turn_format import check_answer_turn, extract_answer, extract_first_answer, final_turn_text, \
    tags_balanced
from igpo.reward.judge import JudgeConfig, LLMJudge

REWARD_TYPES = ("f1", "em", "llm")
ANSWER_PICKS = ("last", "first")
_VERL_KWARGS = frozenset({"reward_router_address", "reward_model_tokenizer"})
"""Passed by verl's reward manager when a verl-hosted reward model is enabled; not used here."""


@dataclass(frozen=True)
class OutcomeRewardConfig:
    """The ``reward_kwargs`` of the custom reward function, validated once per distinct value."""

    train_reward_type: str = "f1"
    """``f1`` | ``em`` | ``llm``: the outcome reward for every data_source not routed below."""
    reward_type_by_source: Mapping[str, str] | None = None
    """Per data_source reward type. When given, it is the complete routing table: a data_source missing from it is an
    error (a typo in a source name must not silently train on the wrong reward)."""
    judge: Mapping[str, Any] = field(default_factory=dict)
    """``JudgeConfig`` fields other than the endpoint/key/model/thinking flag, which come from the environment
    (an explicit value here overrides it, except that keys belong in the environment only)."""
    answer_format_penalty: float | None = None
    """When set, a final turn that breaks the answer-turn format scores ``-answer_format_penalty``."""
    think_prefilled: bool = False
    """The generation prompt ends with ``<think>`` (Qwen3 thinking templates), so the turn text lacks it."""
    require_think: bool = False
    """The answer-turn format check (``answer_format_penalty``) refuses a turn without ``<think>`` (reference: True).
    Off by default: small models prompted without a thinking template answer well without thinking."""
    f1_normalization: str = "squad"
    """``squad`` (drop punctuation and articles; comparable with published EM/F1) | ``reference`` (punctuation ->
    space, articles kept, DR-Venus' training F1). Changes F1 and EM (igpo.core.outcome docstring has examples)."""
    missing_answer_score: float = 0.0
    """F1/EM score of a final turn without ``<answer>...</answer>``. 0: no answer earns what a wrong one earns (ours;
    the answer-format penalty, when on, already punishes the form). Reference: -2.0 (worse than a wrong answer)."""
    tag_balance_gate: bool = False
    """F1/EM: a final turn whose code/tool_call/think/answer tags are unbalanced scores ``missing_answer_score``
    (reference: True; it applied the gate to the whole response including tool text, docs/design/reference_igpo.md §10
    item 9)."""
    answer_pick: str = "last"
    """Which ``<answer>`` of the final turn is scored: ``last`` (ours: a model that corrects itself is scored on its
    correction) | ``first`` (reference)."""
    judge_failure_score: float | None = None
    """Score when the judge gives no verdict. None: fall back to F1 (ours: a judge outage does not zero the batch's
    reward); reference: 0.0."""

    def __post_init__(self) -> None:
        if self.train_reward_type not in REWARD_TYPES:
            raise ValueError(f"train_reward_type={self.train_reward_type!r} is unknown; use one of {REWARD_TYPES}.")
        for source, kind in (self.reward_type_by_source or {}).items():
            if kind not in REWARD_TYPES:
                raise ValueError(
                    f"reward_type_by_source[{source!r}]={kind!r} is unknown; use one of {REWARD_TYPES}."
                )
        if "api_key" in self.judge:
            raise ValueError(
                "reward_kwargs.judge.api_key is set in the config; put the key in JUDGE_API_KEY (or API_KEY) in .env "
                "so it never lands in configs or logs."
            )
        if self.f1_normalization not in F1_NORMALIZATIONS:
            raise ValueError(f"f1_normalization={self.f1_normalization!r} is unknown; use one of {F1_NORMALIZATIONS}.")
        if self.answer_pick not in ANSWER_PICKS:
            raise ValueError(f"answer_pick={self.answer_pick!r} is unknown; use one of {ANSWER_PICKS}.")
        for name in ("missing_answer_score", "judge_failure_score"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} must be a finite number (reference: -2.0 and 0.0).")
        if self.answer_format_penalty is not None and not self.answer_format_penalty >= 0:
            raise ValueError(
                f"answer_format_penalty={self.answer_format_penalty!r} must be >= 0 (the score becomes its negative)."
            )

    @classmethod
    def from_kwargs(cls, reward_kwargs: Mapping[str, Any]) -> OutcomeRewardConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in reward_kwargs.items() if k not in _VERL_KWARGS}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown reward_kwargs {sorted(unknown)}; valid keys: {sorted(known)}.")
        return cls(**values)

    def reward_type(self, data_source: str) -> str:
        if self.reward_type_by_source is None:
            return self.train_reward_type
        if data_source not in self.reward_type_by_source:
            raise ValueError(
                f"data_source {data_source!r} is not in reward_type_by_source (known: "
                f"{sorted(self.reward_type_by_source)}); add it to the routing table or fix the dataset's data_source."
            )
        return self.reward_type_by_source[data_source]


def _plain(value: Any) -> Any:
    """Hydra containers (DictConfig/ListConfig) to dicts/lists, so configs compare and serialise like plain data."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


# Process-wide caches: verl calls compute_score once per sample with the same kwargs, and the judge's cache,
# rate limit and counters must be shared by all those calls.
_CONFIGS: dict[str, OutcomeRewardConfig] = {}
_JUDGES: dict[str, LLMJudge] = {}


def _config(reward_kwargs: Mapping[str, Any]) -> OutcomeRewardConfig:
    plain = {k: _plain(v) for k, v in reward_kwargs.items() if k not in _VERL_KWARGS}
    key = json.dumps(plain, sort_keys=True, default=repr)
    if key not in _CONFIGS:
        _CONFIGS[key] = OutcomeRewardConfig.from_kwargs(plain)
    return _CONFIGS[key]


def get_judge(config: OutcomeRewardConfig) -> LLMJudge:
    """The process's judge for these settings (built on first use from the environment + ``config.judge``)."""
    key = json.dumps(dict(config.judge), sort_keys=True, default=repr)
    if key not in _JUDGES:
        _JUDGES[key] = LLMJudge(JudgeConfig.from_env(**config.judge))
    return _JUDGES[key]


def judge_metrics() -> dict[str, float]:
    """Judge counters of this process (summed over judge settings), for the trainer's metrics."""
    totals: dict[str, float] = {}
    for judge in _JUDGES.values():
        for name, value in judge.stats.as_metrics().items():
            totals[name] = totals.get(name, 0.0) + value
    calls = totals.get("judge/calls", 0.0)
    if calls:
        totals["judge/failure_rate"] = totals["judge/failures"] / calls
    return totals


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **reward_kwargs: Any,
) -> dict[str, float]:
    """Outcome reward of one trajectory (module docstring); verl's custom reward function contract.

    ``extra_info`` is read through ``RewardInputs`` (``igpo.agent.records``): the final assistant turn's text the agent
    loop recorded; without it the text after the last ``</tool_response>`` of ``solution_str`` is used. Raises
    ``ValueError`` for a ground truth without aliases or a data_source missing from the routing table.
    """
    config = _config(reward_kwargs)
    reward_type = config.reward_type(data_source)
    try:
        aliases = parse_ground_truth(ground_truth)
    except ValueError as err:
        raise ValueError(f"data_source {data_source!r}: {err}") from err
    sample = RewardInputs.from_extra_info(extra_info)
    turn = sample.final_turn_text if sample.final_turn_text is not None else final_turn_text(solution_str)

    pick = extract_first_answer if config.answer_pick == "first" else extract_answer
    answer = pick(turn)
    think_prefilled = config.think_prefilled if sample.think_prefilled is None else sample.think_prefilled
    format_ok = check_answer_turn(turn, think_prefilled=bool(think_prefilled), require_think=config.require_think)
    # F1/EM. The reference's text handling (f1_normalization="reference") lower-cases the whole turn before it looks
    # for the answer tags (so <Answer> counts) and reads a fact-check JSON gold as plain text; the judge sees the
    # answer as written.
    scored, gold = answer, aliases
    if config.f1_normalization == "reference":
        scored, gold = pick(turn.lower()), parse_ground_truth(ground_truth, fact_check_labels=False)
    # An empty answer earns nothing even when an alias normalises to "" (e.g. "The"), where SQuAD would say 1.
    scores = score_answer(scored, gold, config.f1_normalization) if scored else AnswerScores(em=0.0, f1=0.0)
    missing = scored is None or (config.tag_balance_gate and not tags_balanced(turn.lower()))

    judge, judge_failed = math.nan, 0.0
    if reward_type == "llm":
        raw_gold = ground_truth if isinstance(ground_truth, str) else None
        verdict = await get_judge(config).judge(sample.question, answer or "", aliases, raw_gold=raw_gold)
        if verdict.correct is None:
            judge_failed = 1.0
            score = scores.f1 if config.judge_failure_score is None else float(config.judge_failure_score)
        else:
            judge = float(verdict.correct)
            score = judge
    elif missing:
        score = float(config.missing_answer_score)
    else:
        score = scores.f1 if reward_type == "f1" else scores.em

    if config.answer_format_penalty is not None and not format_ok:
        score = -config.answer_format_penalty
    return {
        "score": float(score),
        "f1": scores.f1,
        "em": scores.em,
        "judge": judge,
        "judge_failed": judge_failed,
        "format_ok": float(format_ok),
    }
