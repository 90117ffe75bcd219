"""Ground-truth handling and the teacher-forced pseudo answer of IGPO (docs/design/reference_igpo.md §1.1).

IGPO scores a boundary s by teacher-forcing the pseudo answer

    P(gt) = prefix + gt + suffix

after the boundary context c_s and averaging the policy's log-probs over the ground-truth tokens only,
the span G = [gs, ge) of P(gt)'s tokens:  l_s = (1/|G|) * sum_{j in G} log pi(y_j | c_s, y_<j).

This module turns a dataset ground truth into a list of aliases, picks the aliases that are scored,
and tokenizes P(gt) once, locating G from character offsets (robust to BPE merges across the
prefix/answer/suffix seams, unlike counting tokens of separately tokenized pieces).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

ANSWER_SPLIT = "<|answer_split|>"
"""Literal separator joining the aliases of a multi-answer ground truth in the QA parquet files."""

ALIAS_MODES = ("first", "max", "mean", "logsumexp")


def _fact_check_label(alias: str) -> str:
    """Collapse a fact-checking ground truth (a JSON list of ``{"label": ...}`` objects) to "true"/"false".

    Rule of the reference (§1.1 step 3): "false" if any entry's label is "false" (case-insensitive), else "true".
    Anything that is not such a list is returned unchanged.
    """
    if not alias.startswith("["):
        return alias
    try:
        parsed = json.loads(alias)
    except ValueError:
        return alias
    if not (isinstance(parsed, list) and parsed and all(isinstance(e, dict) and "label" in e for e in parsed)):
        return alias
    return "false" if any(str(e["label"]).strip().lower() == "false" for e in parsed) else "true"


def parse_ground_truth(gt: Any, fact_check_labels: bool = True) -> list[str]:
    """Normalise a ground truth to a non-empty list of aliases.

    Accepts a string whose aliases are joined by ``ANSWER_SPLIT``, or a list / tuple / 1-D ``np.ndarray`` of strings
    (as parquet readers return). Each alias is stripped; empty aliases are dropped; a fact-checking JSON label list
    becomes "true"/"false" (``fact_check_labels=False`` keeps the JSON text, as the reference's F1/EM reward read it).
    Raises ``ValueError`` naming the value when nothing usable remains or an element is not
    a string.
    """
    if isinstance(gt, (str, np.str_)):
        pieces = str(gt).split(ANSWER_SPLIT)
    elif isinstance(gt, (list, tuple, np.ndarray)):
        pieces = []
        for element in (gt.tolist() if isinstance(gt, np.ndarray) else gt):
            if not isinstance(element, (str, np.str_)):
                raise ValueError(
                    f"ground truth {gt!r} contains {element!r} of type {type(element).__name__}; every alias must be "
                    "a string. Fix the dataset's reward_model.ground_truth column."
                )
            # A list element may itself carry joined aliases.
            pieces.extend(str(element).split(ANSWER_SPLIT))
    else:
        raise ValueError(
            f"ground truth {gt!r} has type {type(gt).__name__}; expected a string (aliases joined by "
            f"{ANSWER_SPLIT!r}) or a list of strings."
        )
    aliases = [_fact_check_label(p.strip()) if fact_check_labels else p.strip() for p in pieces]
    aliases = [a for a in aliases if a]
    if not aliases:
        raise ValueError(f"ground truth {gt!r} has no non-empty alias; every sample needs an answer to score against.")
    return aliases


def scoring_aliases(aliases: list[str], mode: str) -> list[str]:
    """Aliases whose probe is scored for information gain.

    ``first``: only ``aliases[0]`` (the paper and DR-Venus); ``max`` / ``mean`` / ``logsumexp``: all aliases, the
    caller reduces the per-alias boundary scores l_s^(a) by max, mean or log Σ_a exp over a.
    """
    if mode not in ALIAS_MODES:
        raise ValueError(f"answer alias mode {mode!r} is unknown; use one of {ALIAS_MODES}.")
    if not aliases:
        raise ValueError("scoring_aliases got an empty alias list; call parse_ground_truth first.")
    return [aliases[0]] if mode == "first" else list(aliases)


@dataclass(frozen=True)
class AnswerTemplate:
    """The pseudo answer P(gt) = prefix + gt + suffix teacher-forced after every scored boundary.

    The default prefix closes a thinking block and opens ``<answer>``, which reads naturally after a Qwen3-thinking
    generation prompt (``<|im_start|>assistant\\n<think>\\n``). The end-of-turn token text (e.g. ``<|im_end|>``) is
    appended to ``suffix`` by the caller from the tokenizer, so the template is not tied to one chat format.
    """

    prefix: str = "Now there's enough information to answer\n</think>\n<answer>\n"
    suffix: str = "\n</answer>"


@dataclass(frozen=True)
class Probe:
    """A tokenized pseudo answer and the ground-truth token span inside it."""

    token_ids: list[int]
    """Token ids of P(gt), tokenized with ``add_special_tokens=False`` (no BOS injected mid-sequence)."""
    span: tuple[int, int]
    """[gs, ge): the tokens of P(gt) that overlap the ground-truth characters; ``ge > gs``."""


def build_probe(tokenizer: Any, answer: str, template: AnswerTemplate) -> Probe:
    """Tokenize P(answer) and find G = [gs, ge) from character offsets.

    A token belongs to G when its character range [start, end) is non-empty and overlaps the answer's characters
    [len(prefix), len(prefix) + len(answer)). Needs a fast (Rust) tokenizer for ``return_offsets_mapping``.
    Raises ``ValueError`` when the answer is empty or no token covers it.
    """
    if not answer:
        raise ValueError("build_probe got an empty answer; parse_ground_truth drops empty aliases, use its output.")
    text = template.prefix + answer + template.suffix
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} cannot return offsets; load a fast tokenizer (use_fast=True)."
        ) from err
    token_ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    a0, a1 = len(template.prefix), len(template.prefix) + len(answer)
    covering = [k for k, (start, end) in enumerate(offsets) if end > start and start < a1 and end > a0]
    if not covering:
        raise ValueError(
            f"no token of the pseudo answer covers the ground truth {answer!r} (characters [{a0}, {a1}) of {text!r}); "
            "check that the tokenizer returns character offsets."
        )
    return Probe(token_ids=token_ids, span=(covering[0], covering[-1] + 1))


def answer_probes(tokenizer, ground_truth, template: AnswerTemplate, alias_mode: str) -> list[Probe]:
    """The probes to score for one sample: one per alias that ``alias_mode`` keeps (``first`` keeps one)."""
    return [build_probe(tokenizer, alias, template) for alias in scoring_aliases(parse_ground_truth(ground_truth),
                                                                                 alias_mode)]
