"""Rule-based outcome rewards: SQuAD answer normalisation, exact match and token F1 over all gold aliases.

One normaliser and one F1 for the whole package (the reference had a set-based and a multiset-based F1 that
disagreed, igpo.md §10 item 10). Definitions follow the official SQuAD evaluation script:

    norm(s)  = collapse_whitespace(remove_articles(remove_ascii_punctuation(lower(s))))
    EM(p, A) = max_{a in A} [ norm(p) == norm(a) ]
    F1(p, A) = max_{a in A} F1_tok(p, a);  T_p, T_a = multisets of whitespace tokens of norm(p), norm(a):
        F1_tok = 2 * P * R / (P + R),  P = |T_p ∩ T_a| / |T_p|,  R = |T_p ∩ T_a| / |T_a|   (∩ = multiset min-count)
        F1_tok = 1 if T_p and T_a are both empty, 0 if exactly one is empty (SQuAD v2 rule)

A = the aliases of one ground truth (``igpo.core.ground_truth.parse_ground_truth``). Only ASCII punctuation
(``string.punctuation``) is removed, as in SQuAD; unicode letters are lower-cased by ``str.lower`` and otherwise kept,
so scores stay comparable with published EM/F1 numbers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

_ARTICLES = re.compile(r"\b(a|an|the)\b", flags=re.UNICODE)
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def contains_answer(text: str, aliases: list[str]) -> bool:
    """Does ``text`` contain one of the gold aliases as whole normalised words? (the IG diagnostics' "answer seen")

    norm(a) must occur in norm(text) between word boundaries: "paris" is seen in "... in Paris, France" but not in
    "Parisian". Aliases that normalise to nothing (e.g. "the") are never seen.
    """
    _check_aliases(aliases)
    haystack = f" {normalize_answer(text)} "
    return any(needle and f" {needle} " in haystack for needle in map(normalize_answer, aliases))


def _check_aliases(aliases: list[str]) -> None:
    if isinstance(aliases, str):
        raise TypeError(
            f"aliases must be a list of strings, got the string {aliases[:80]!r}; "
            "split it with igpo.core.ground_truth.parse_ground_truth first."
        )
    if len(aliases) == 0:
        raise ValueError("aliases is empty; every sample needs at least one gold answer to score against.")


def _token_f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(gold_tokens)
    return 2.0 * precision * recall / (precision + recall)


def exact_match(prediction: str, aliases: list[str]) -> float:
    """EM(p, A) = max over aliases a of [norm(p) == norm(a)], as 0.0 or 1.0."""
    _check_aliases(aliases)
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(a) for a in aliases))


def f1_score(prediction: str, aliases: list[str]) -> float:
    """F1(p, A) = max over aliases a of the multiset token F1 between norm(p) and norm(a)."""
    _check_aliases(aliases)
    prediction_tokens = normalize_answer(prediction).split()
    return max(_token_f1(prediction_tokens, normalize_answer(a).split()) for a in aliases)


@dataclass(frozen=True)
class AnswerScores:
    """EM and F1 of one predicted answer against one ground truth's aliases."""

    em: float
    f1: float


def score_answer(prediction: str, aliases: list[str]) -> AnswerScores:
    """EM and F1 in one pass (each alias normalised once)."""
    _check_aliases(aliases)
    normalized = normalize_answer(prediction)
    prediction_tokens = normalized.split()
    em, f1 = 0.0, 0.0
    for alias in aliases:
        gold = normalize_answer(alias)
        em = max(em, float(normalized == gold))
        f1 = max(f1, _token_f1(prediction_tokens, gold.split()))
    return AnswerScores(em=em, f1=f1)
