"""Row validation for the QA parquet in verl's RL schema (docs/design/reference_igpo.md §7), shared by data preparation
and evaluation.

One row::

    data_source   str                         drives reward routing (igpo.reward)
    prompt        [{"role": str, "content": str}, ...] with a non-empty user message
    ability       str                         (training only)
    reward_model  {"ground_truth": aliases joined by "<|answer_split|>" (evaluation: or a list of them),
                   "style": str (training only)}
    extra_info    {"index": str, "split": str (training only)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from igpo.core.ground_truth import ANSWER_SPLIT, parse_ground_truth


def _what(value: Any) -> str:
    return "missing" if value is None else f"{type(value).__name__} {value!r:.80}"


def row_problems(row: Any, *, for_training: bool, allowed_sources: set[str] | None = None) -> list[str]:
    """Every problem of one row, each naming the field and what it should be (empty list: the row is fine).

    ``for_training=True`` checks the row as ``python -m igpo.prepare_data`` writes it: ``ability``,
    ``reward_model.style`` and ``extra_info.split`` are required and ``ground_truth`` must be one string.
    ``for_training=False`` checks what evaluation needs: those fields may be absent and ``ground_truth`` may also be a
    list of strings. ``prompt`` may be a numpy array (as pandas returns parquet lists) in both modes. A
    ``data_source`` outside ``allowed_sources`` (when given) is a problem.
    """
    if not isinstance(row, Mapping):
        return [f"row is {_what(row)}, expected a mapping"]
    problems = []
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        problems.append(f"data_source is {_what(source)}, expected a non-empty string")
    elif allowed_sources is not None and source not in allowed_sources:
        problems.append(f"unknown data_source {source!r}; allowed: {', '.join(sorted(allowed_sources))}")

    prompt = row.get("prompt")
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        problems.append(f"prompt is {_what(prompt)}, expected a non-empty list of {{role, content}} messages")
    else:
        for k, message in enumerate(prompt):
            if not isinstance(message, Mapping):
                problems.append(f"prompt[{k}] is {_what(message)}, expected a {{role, content}} mapping")
                continue
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    problems.append(f"prompt[{k}].{key} is {_what(message.get(key))}, expected a string")
        user = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if not any(isinstance(m.get("content"), str) and m["content"].strip() for m in user):
            problems.append("prompt has no user message with a non-empty question")

    if for_training and not isinstance(row.get("ability"), str):
        problems.append(f"ability is {_what(row.get('ability'))}, expected a string")

    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping):
        problems.append(f"reward_model is {_what(reward_model)}, expected {{ground_truth, style}}")
    else:
        problems.extend(_ground_truth_problems(reward_model.get("ground_truth"), for_training))
        if for_training and not isinstance(reward_model.get("style"), str):
            problems.append(f"reward_model.style is {_what(reward_model.get('style'))}, expected a string")

    keys = ("index", "split") if for_training else ("index",)
    extra = row.get("extra_info")
    if not isinstance(extra, Mapping):
        problems.append(f"extra_info.index is missing: extra_info is {_what(extra)}, expected {{{', '.join(keys)}}}")
    else:
        for key in keys:
            if not isinstance(extra.get(key), str) or not extra.get(key):
                problems.append(f"extra_info.{key} is {_what(extra.get(key))}, expected a non-empty string")
    return problems


def _ground_truth_problems(truth: Any, for_training: bool) -> list[str]:
    """Problems of ``reward_model.ground_truth`` under ``row_problems``' rules."""
    expected = f"a string of aliases joined by {ANSWER_SPLIT!r}" + ("" if for_training else " or a list of strings")
    if truth is None:
        return [f"missing ground truth: reward_model.ground_truth is missing, expected {expected}"]
    listed = not for_training and isinstance(truth, (list, tuple, np.ndarray))
    if not isinstance(truth, str) and not listed:
        return [f"reward_model.ground_truth is {_what(truth)}, expected {expected}"]
    if listed:
        wrong = [k for k, alias in enumerate(truth) if not isinstance(alias, str)]
        if wrong:
            return [f"reward_model.ground_truth[{k}] is {_what(truth[k])}, expected a string" for k in wrong]
    try:
        parse_ground_truth(truth)
    except ValueError:
        return [f"reward_model.ground_truth is unusable: missing ground truth (no non-empty alias in {truth!r:.80})"]
    return []
