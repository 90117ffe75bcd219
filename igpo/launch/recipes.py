"""Recipes: the published settings we reproduce, one Hydra config each (``configs/recipe/<name>.yaml``).

A recipe file is a ``# @package _global_`` override of ``configs/igpo_trainer.yaml`` (``recipe=<name>``) plus one
section our trainer ignores, ``igpo_recipe``: what the paper ran it with (model, hardware, tools, corpus and its
coverage caveat, evaluation set and metric) and the paper's table. This module reads that section for the launcher
(``python -m igpo.launch.recipes tools <name>`` -> the tool server's backend and top-k; ``data <name>`` -> the training
data it needs, which the launcher names when ``TRAIN_FILE`` is not set) and for the evaluation harness,
which prints our numbers in the paper's table shape beside the published rows (``comparison_table``).

Every training value of a recipe carries a source tag in a trailing comment (``# [paper] ...``, ``# [code] ...``,
``# [drv] ...``, ``# [ours] why``). ``show <name>`` prints each value as composed over igpo_trainer.yaml with its
tag; ``diff <name> <launch-script.sh>`` reads a published launch script (its ``key=value`` overrides of verl's
``main_ppo``, read by ``igpo/launch/launch_script.py``), maps the reference's keys to ours (``REFERENCE_KEYS``) and
says, per key, whether the values are the same, differ (with the recipe line's reason, or UNEXPLAINED) or have no
counterpart here.

Published values are percentages as the papers print them; our per-source means (0..1) are scaled by 100.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from igpo.launch.launch_script import LaunchScriptError, read_launch_script

RECIPE_DIR = Path(__file__).resolve().parents[2] / "configs" / "recipe"
METRICS = ("em", "f1", "judge")
TOOL_BACKENDS = ("local", "web", "retriever")


class RecipeError(ValueError):
    """A recipe name or file that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class PublishedTable:
    """The paper's table: ``columns`` maps our data_source to the paper's column name, in the paper's order."""

    source: str
    metric: str
    columns: dict[str, str]
    rows: dict[str, dict[str, float]]


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    setting: str
    paper: str
    model: str
    hardware: str
    train_data: str
    tool_backend: str
    tool_topk: int
    retriever: str
    corpus: str
    corpus_caveat: str
    eval_data: str | None
    eval_metric: str
    eval_caveat: str
    eval_max_turns: int
    published: PublishedTable

    def settings_record(self) -> dict[str, Any]:
        """What evaluation writes into settings.json: the setting the numbers belong to, caveats included."""
        return {"name": self.name, "file": str(self.path), "setting": self.setting, "paper": self.paper,
                "model": self.model, "hardware": self.hardware, "tools": self.tool_backend, "top_k": self.tool_topk,
                "retriever": self.retriever, "corpus": self.corpus, "corpus_caveat": self.corpus_caveat,
                "eval_metric": self.eval_metric, "eval_caveat": self.eval_caveat,
                "published_source": self.published.source}


def available() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Read ``configs/recipe/<name>.yaml`` (or a path) and check its ``igpo_recipe`` section."""
    from omegaconf import OmegaConf

    path = _recipe_path(name_or_path)
    section = OmegaConf.to_container(OmegaConf.load(path)).get("igpo_recipe")
    if not isinstance(section, dict):
        raise RecipeError(f"{path}: no igpo_recipe section; a recipe states its setting there (see "
                          "configs/recipe/search_r1_local.yaml).")

    def need(mapping: Mapping, key: str, where: str = "igpo_recipe"):
        if mapping.get(key) in (None, ""):
            raise RecipeError(f"{path}: {where}.{key} is missing; every recipe states it.")
        return mapping[key]

    tools, evaluation, published = (need(section, k) for k in ("tool_server", "eval", "published"))
    backend, metric = need(tools, "backend", "igpo_recipe.tool_server"), need(evaluation, "metric", "igpo_recipe.eval")
    if backend not in TOOL_BACKENDS:
        raise RecipeError(f"{path}: igpo_recipe.tool_server.backend={backend!r} must be one of {TOOL_BACKENDS}.")
    for where, value in (("eval.metric", metric), ("published.metric", need(published, "metric", "published"))):
        if value not in METRICS:
            raise RecipeError(f"{path}: igpo_recipe.{where}={value!r} must be one of {METRICS}.")
    columns = {str(k): str(v) for k, v in need(published, "columns", "igpo_recipe.published").items()}
    rows: dict[str, dict[str, float]] = {}
    for label, values in need(published, "rows", "igpo_recipe.published").items():
        unknown = sorted(set(values) - set(columns) - {"avg"})
        if unknown:
            raise RecipeError(f"{path}: published row {label!r} has values for {unknown}, which are not columns "
                              f"({sorted(columns)} or avg).")
        rows[str(label)] = {str(k): float(v) for k, v in values.items()}
    return Recipe(
        name=path.stem, path=path, setting=str(need(section, "setting")), paper=str(need(section, "paper")),
        model=str(need(section, "model")), hardware=str(need(section, "hardware")),
        train_data=" ".join(str(need(section, "train_data")).split()), tool_backend=backend,
        tool_topk=int(need(tools, "topk", "igpo_recipe.tool_server")), retriever=str(need(section, "retriever")),
        corpus=str(need(section, "corpus")), corpus_caveat=" ".join(str(need(section, "corpus_caveat")).split()),
        eval_data=evaluation.get("data"), eval_metric=metric,
        eval_caveat=" ".join(str(need(evaluation, "caveat", "igpo_recipe.eval")).split()),
        eval_max_turns=int(need(evaluation, "max_turns", "igpo_recipe.eval")),
        published=PublishedTable(source=str(need(published, "source", "igpo_recipe.published")),
                                 metric=published["metric"], columns=columns, rows=rows),
    )


def comparison_table(recipe: Recipe, ours: Sequence[Mapping[str, Any]] | None, label: str = "ours") -> str:
    """Markdown: the paper's columns (its order) + AVG, the published rows, then ours (``None`` = not run yet).

    ``ours`` is ``igpo.eval.tables.summarize``'s table (one row per data_source with em/f1/judge means in 0..1). Our
    AVG is the macro mean over the paper's columns we have, and says so when some are missing, so a partial run is
    never mistaken for a full one.
    """
    table = recipe.published
    metric = recipe.eval_metric
    header = [f"{metric.upper()} (%)", *table.columns.values(), "AVG"]
    lines = [f"**{recipe.name}** -- {recipe.setting}. Published: {table.source}.",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row_label, values in table.rows.items():
        cells = [_cell(values.get(source)) for source in table.columns]
        lines.append(f"| {row_label} | " + " | ".join(cells) + f" | {_cell(values.get('avg'))} |")
    if ours is not None:
        by_source = {str(r["data_source"]): r for r in ours}
        scores = {s: 100.0 * float(by_source[s][metric]) for s in table.columns
                  if s in by_source and by_source[s].get(metric) is not None
                  and not math.isnan(float(by_source[s][metric]))}
        cells = [_cell(scores.get(source)) for source in table.columns]
        avg = _cell(sum(scores.values()) / len(scores)) if scores else "n/a"
        if scores and len(scores) < len(table.columns):
            avg += f" ({len(scores)}/{len(table.columns)} sets)"
        counts = ", ".join(f"{s}={by_source[s]['n']}" for s in table.columns if s in by_source)
        lines.append(f"| **{label}** | " + " | ".join(cells) + f" | {avg} |")
        lines += ["", f"Our questions per set: {counts or 'none'}."]
    lines += ["", f"Corpus: {recipe.corpus}. Caveat: {recipe.corpus_caveat}", f"Evaluation set: {recipe.eval_caveat}"]
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# ------------------------------------------------------------------------------- show: each value with its source

TAG_RE = re.compile(r"^\[(\w+)\]\s*(.*)$")
_KEY_LINE = re.compile(r"^(\s*)([\w.\-]+):\s*(.*)$")
_DESCRIPTION = "igpo_recipe"  # the setting's description (tools/data/table read it); not a training value


@dataclass(frozen=True)
class RecipeLine:
    """One ``key: value  # comment`` line of a recipe file: where a training value is set and what it says about it."""

    key: str
    text: str
    comment: str
    line: int

    @property
    def tag(self) -> str | None:
        match = TAG_RE.match(self.comment)
        return match.group(1) if match else None

    @property
    def reason(self) -> str | None:
        """The tag with words after it (``[ours] why``), the only kind of comment that explains a difference."""
        match = TAG_RE.match(self.comment)
        return self.comment if match and re.search(r"[A-Za-z]", match.group(2)) else None


def recipe_lines(name_or_path: str | Path) -> dict[str, RecipeLine]:
    """The training values a recipe file sets (all but its ``igpo_recipe`` description), keyed by dotted path.

    Read from the YAML text, since the tags live in comments, and checked against what OmegaConf loads, so a value
    written in a shape this reader does not follow is named instead of silently skipped.
    """
    from omegaconf import OmegaConf

    path = _recipe_path(name_or_path)
    found: dict[str, RecipeLine] = {}
    stack: list[tuple[int, str]] = []
    in_description = False
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _KEY_LINE.match(raw)
        if not raw.strip() or raw.lstrip().startswith("#") or not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        if indent == 0:
            in_description = key == _DESCRIPTION
        if in_description:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, comment = _split_comment(rest)
        if value:
            dotted = ".".join([k for _, k in stack] + [key])
            found[dotted] = RecipeLine(key=dotted, text=value, comment=comment, line=number)
        else:
            stack.append((indent, key))
    loaded = OmegaConf.to_container(OmegaConf.load(path))
    expected = {k for k in _leaves(loaded) if not k.startswith(_DESCRIPTION + ".")}
    missed = sorted(expected - set(found))
    if missed:
        raise RecipeError(f"{path}: cannot find the line of {missed}; write each training value on its own "
                          "`key: value  # [tag] why` line (block mappings, no flow-style maps).")
    return found


def compose_recipe(name: str):
    """configs/igpo_trainer.yaml with ``recipe=<name>``, as Hydra composes it for training."""
    from hydra import compose, initialize_config_dir

    _recipe_path(name)
    with initialize_config_dir(config_dir=str(RECIPE_DIR.parent), version_base=None):
        return compose(config_name="igpo_trainer", overrides=[f"recipe={name}"])


def show_recipe(name: str) -> str:
    """Every training value the recipe sets, its value after composition, and its source tag (or UNTRACED)."""
    lines = recipe_lines(name)
    config = compose_recipe(name)
    rows = [(key, _fmt(_select(config, key)), line.comment if line.tag else f"UNTRACED {line.comment}".rstrip())
            for key, line in lines.items()]
    width = max(len(f"{k} = {v}") for k, v, _ in rows)
    untraced = sum(c.startswith("UNTRACED") for _, _, c in rows)
    out = [f"recipe {name} ({_recipe_path(name).relative_to(RECIPE_DIR.parent.parent)}), "
           f"composed over configs/igpo_trainer.yaml:"]
    out += [f"  {f'{k} = {v}':<{width}}  # {c}" for k, v, c in rows]
    out.append(f"{len(rows)} values, {len(rows) - untraced} traced, {untraced} UNTRACED")
    return "\n".join(out)


# ------------------------------------------------------------------- diff: a recipe against a published script


@dataclass(frozen=True)
class Counterpart:
    """Where a reference script's key lives in our config. ``ours`` empty: deliberately not ours (``reason`` why).
    Several keys combine as ``combine`` says (``sum``: a context length; ``product``: a count in trajectories)."""

    ours: tuple[str, ...]
    reason: str
    combine: str = "one"
    why: str | None = None  # the key whose recipe line explains a difference; None: the first of ``ours``


def _to(key: str, reason: str) -> Counterpart:
    return Counterpart((key,), reason)


def _dropped(reason: str) -> Counterpart:
    return Counterpart((), reason)


_CONTEXT = ("data.max_prompt_length", "data.max_response_length")
_PATHS = "a path or endpoint: train_igpo.sh takes TRAIN_FILE/VAL_FILE, MODEL_PATH, OUTPUT_DIR, RETRIEVER_URL"
_LOGGING = "logging and experiment tracking, not the method"
_VALIDATION = ("validation during training: ours evaluates after training with python -m igpo.evaluate "
               "(igpo_trainer.yaml sets test_freq=-1, val_before_train=false)")
_MICRO = ("micro-batching for the reference's GPUs: ours packs micro-batches by tokens (use_dynamic_bsz, "
          "igpo_launch.tokens_per_gpu); the update does not change")
_CRITIC = "no critic: the group baseline (GRPO, IGPO) needs none"
_IGPO_KEY = "DR-Venus's top-level algorithm key; ours lives under algorithm.igpo"

# Reference key (without Hydra's leading +) -> ours. Keys not listed compare with the same key of our config when it
# exists there, and are `not ours` otherwise.
REFERENCE_KEYS: dict[str, Counterpart] = {
    # group size and batch units
    "actor_rollout_ref.rollout.n_agent": _to("actor_rollout_ref.rollout.n",
                                             "Search-R1 repeats each prompt n_agent times (its rollout.n stays 1)"),
    "agent_grpo.n": _to("actor_rollout_ref.rollout.n",
                        "IGPO and DR-Venus repeat each prompt agent_grpo.n times (their rollout.n stays 1)"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Counterpart(
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n"),
        "theirs counts trajectories (rollout.n is 1 there); verl 0.9.1 counts prompts x rollout.n: compared in "
        "trajectories", "product"),
    # lengths
    "data.max_prompt_length": Counterpart(
        _CONTEXT, "the references grow the prompt turn by turn, so theirs bounds the conversation; ours bounds the "
        "first prompt and counts every turn in data.max_response_length: compared as the context", "sum",
        "data.max_response_length"),
    "data.max_start_length": _to("data.max_prompt_length", "Search-R1's budget for the first prompt"),
    "data.max_response_length": _to("algorithm.igpo.agent.max_tokens_per_turn",
                                    "the references' generation cap of one turn (ours: max_tokens_per_turn; our "
                                    "data.max_response_length spans all turns)"),
    "data.max_model_len": Counterpart(_CONTEXT, "the context window: ours is prompt + response", "sum",
                                      "data.max_response_length"),
    "actor_rollout_ref.rollout.max_model_len": Counterpart(_CONTEXT, "the vLLM context window: ours is planned as "
                                                           "prompt + response", "sum", "data.max_response_length"),
    "actor_rollout_ref.rollout.prompt_length": _to("data.max_prompt_length",
                                                   "DR-Venus's async loop: padding of the first prompt"),
    "actor_rollout_ref.rollout.response_length": _to("algorithm.igpo.agent.max_tokens_per_turn",
                                                     "DR-Venus's async loop: the generation cap of one turn"),
    "data.max_obs_length": _to("algorithm.igpo.agent.max_observation_tokens", "Search-R1's cap on one tool result"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": _to("igpo_launch.tokens_per_gpu",
                                                             "planned from igpo_launch.tokens_per_gpu"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _to("igpo_launch.sequence_parallel",
                                                                  "planned from igpo_launch.sequence_parallel"),
    # the agent and its tools
    "max_turns": _to("algorithm.igpo.agent.max_turns", "the references' turn cap"),
    "tool_timeout": _to("algorithm.igpo.agent.tool_timeout_s", "DR-Venus's per-call tool deadline"),
    "retriever.topk": _to("igpo_recipe.tool_server.topk", "passages per search, served by our tool server"),
    "actor_rollout_ref.rollout.agent.completion_cutoff": _to("algorithm.igpo.agent.completion_cutoff",
                                                             "our agent loop's straggler cut-off"),
    "search_engine": _dropped("the tool backend is igpo_recipe.tool_server.backend (online_search = our web)"),
    "codeact_env_disabled": _dropped("IGPO's code-execution tool switch (off there); our agents have no code tool"),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": _dropped("DR-Venus's agent-loop file; ours is "
                                                                       "igpo_agent, set by igpo_base.yaml"),
    "actor_rollout_ref.actor.state_masking": _dropped("tool observations never enter our loss (response_mask 0)"),
    "actor_rollout_ref.actor.mask_tool_response": _dropped("tool observations never enter our loss (response_mask 0)"),
    "reward_model.reward_kwargs.deepthink_disabled": _dropped("DR-Venus's mid-rollout 'think deeper' prompts (off "
                                                              "there); our agent loop sends none"),
    # algorithm
    "algorithm.use_info_gain": _dropped("implied by algorithm.adv_estimator=igpo"),
    "algorithm.no_think_rl": _dropped("Search-R1's ablation that drops the reasoning (false there, as ours)"),
    "algorithm.info_gain_type": _to("algorithm.igpo.info_gain_type", _IGPO_KEY),
    "algorithm.info_gain_norm_mode": _to("algorithm.igpo.norm_mode", _IGPO_KEY),
    "algorithm.ig_compute_freq": _to("algorithm.igpo.ig_compute_freq", _IGPO_KEY),
    "algorithm.ig_tool_filter": _to("algorithm.igpo.ig_tool_filter", _IGPO_KEY),
    "algorithm.ig_weight": _to("algorithm.igpo.ig_weight", _IGPO_KEY),
    "algorithm.use_format_penalty": _to("algorithm.igpo.use_format_penalty", _IGPO_KEY),
    "algorithm.format_penalty_scale": _to("algorithm.igpo.format_penalty_scale", _IGPO_KEY),
    "reward_model.train_reward_type": _to("reward.custom_reward_function.reward_kwargs.train_reward_type",
                                          "our reward function's argument"),
    "reward_model.reward_manager": _dropped("our reward manager is set by igpo_base.yaml for igpo.reward"),
    "data.shuffle_train_dataloader": _to("data.shuffle", "the older verl name"),
    # hardware-specific
    "actor_rollout_ref.model.use_remove_padding": _dropped("planned by igpo_launch.attention: on with flash-attn, "
                                                           "off under the sdpa fallback"),
    "actor_rollout_ref.actor.fsdp_config.grad_offload": _dropped("no such key in verl 0.9.1: gradients offload with "
                                                                 "param_offload"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": _dropped(_MICRO),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": _dropped(_MICRO),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": _dropped(_MICRO),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": _dropped(_MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": _dropped(_MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": _dropped(_MICRO),
    "critic.optim.lr": _dropped(_CRITIC),
    "critic.model.path": _dropped(_CRITIC),
    "critic.ppo_micro_batch_size_per_gpu": _dropped(_CRITIC),
    # data, paths, logging, validation
    "data.train_data_num": _dropped("Search-R1's row subsampling; null there (all rows), as ours"),
    "data.val_data_num": _dropped("Search-R1's row subsampling; null there (all rows), as ours"),
    "data.train_files": _dropped(_PATHS),
    "data.val_files": _dropped(_PATHS),
    "data.data_writing_path": _dropped(_PATHS),
    "actor_rollout_ref.model.path": _dropped(_PATHS),
    "retriever.url": _dropped(_PATHS),
    "trainer.default_local_dir": _dropped(_PATHS),
    "trainer.default_hdfs_dir": _dropped(_PATHS),
    "trainer.validation_data_dir": _dropped(_PATHS),
    "trainer.logger": _dropped(_LOGGING),
    "trainer.project_name": _dropped(_LOGGING),
    "trainer.experiment_name": _dropped(_LOGGING),
    "actor_rollout_ref.rollout.disable_log_stats": _dropped(_LOGGING),
    "trace_save_interval": _dropped(_LOGGING),
    "trace_max_samples": _dropped(_LOGGING),
    "data.val_batch_size": _dropped(_VALIDATION),
    "trainer.val_only": _dropped(_VALIDATION),
    "trainer.val_before_train": _dropped(_VALIDATION),
    "trainer.test_freq": _dropped(_VALIDATION),
    "reward_model.valid_reward_type": _dropped(_VALIDATION),
}


def diff_recipe(name: str, script: Path) -> str:
    """One line per override of the script: same, differs (with the recipe line's reason or UNEXPLAINED), not ours
    (with the reason when REFERENCE_KEYS drops it on purpose) or unresolved; then the counts."""
    try:
        launch = read_launch_script(Path(script))
    except LaunchScriptError as err:
        raise RecipeError(str(err)) from None
    lines = recipe_lines(name)
    config = compose_recipe(name)
    out = [f"recipe {name} vs {launch.path}:"]
    counts = {"same": 0, "differ": 0, "unexplained": 0, "not ours": 0, "unresolved": 0}
    for key in sorted({*launch.overrides, *launch.unresolved}):
        part = REFERENCE_KEYS.get(key)
        if part is None:
            part = _to(key, "") if _select(config, key) is not _ABSENT else _dropped("")
        if not part.ours:
            counts["not ours"] += 1
            theirs = launch.overrides.get(key, launch.unresolved.get(key))
            out.append(f"not ours: {key}={theirs}" + (f" — {part.reason}" if part.reason else
                                                       " — no counterpart in our config"))
            continue
        joint = " x " if part.combine == "product" else " + "
        label = key if part.ours == (key,) else f"{key} -> {joint.join(part.ours)}"
        ours, shown = _ours(config, part)
        if key in launch.unresolved:
            counts["unresolved"] += 1
            out.append(f"{label}: unresolved: ours={shown} theirs={launch.unresolved[key]} (the script works it "
                       "out at run time or reads it from elsewhere)")
            continue
        theirs = launch.overrides[key]
        if _same(ours, theirs):
            counts["same"] += 1
            out.append(f"{label}: same ({shown})")
            continue
        counts["differ"] += 1
        line = lines.get(part.why or part.ours[0])
        reason = line.reason if line else None
        if not reason:
            counts["unexplained"] += 1
        out.append(f"{label}: differs: ours={shown} theirs={theirs} — {reason or 'UNEXPLAINED'}")
    summary = (f"{counts['same']} same, {counts['differ']} differ ({counts['unexplained']} unexplained), "
               f"{counts['not ours']} not ours")
    if counts["unresolved"]:
        summary += f", {counts['unresolved']} unresolved"
    out.append(summary)
    return "\n".join(out)


_ABSENT = object()


def _select(config, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key, default=_ABSENT, throw_on_missing=False)


def _ours(config, part: Counterpart) -> tuple[Any, str]:
    values = [_select(config, k) for k in part.ours]
    if any(v is _ABSENT for v in values):
        return _ABSENT, "<absent>"
    if part.combine == "one":
        return values[0], _fmt(values[0])
    numbers = [_value(v) for v in values]
    if not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
        return _ABSENT, " / ".join(_fmt(v) for v in values)
    total = math.prod(numbers) if part.combine == "product" else sum(numbers)
    sign = " x " if part.combine == "product" else " + "
    return total, f"{_fmt(total)} (= {sign.join(_fmt(v) for v in values)})"


def _value(value: Any) -> Any:
    """A comparable form of a config value or a script's text: bools, None, numbers, tuples, else the string."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, (list, tuple)):
        return tuple(_value(v) for v in value)
    if not isinstance(value, str):
        return value
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    if text.startswith("[") and text.endswith("]"):
        return tuple(_value(v) for v in text[1:-1].split(",") if v.strip())
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _same(ours: Any, theirs: str) -> bool:
    if ours is _ABSENT:
        return False
    a, b = _value(ours), _value(theirs)
    numeric = (int, float)
    if isinstance(a, numeric) and isinstance(b, numeric) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _fmt(value: Any) -> str:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if value is _ABSENT:
        return "<absent>"
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if value == "":
        return '""'
    return str(value)


def _split_comment(rest: str) -> tuple[str, str]:
    """``value  # comment`` -> (value, comment); a ``#`` inside quotes is part of the value."""
    quote = None
    for i, char in enumerate(rest):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), ""


def _leaves(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict) and tree:
        return [k for key, value in tree.items() for k in _leaves(value, f"{prefix}{key}.")]
    return [prefix[:-1]]


def _recipe_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix != ".yaml":
        path = RECIPE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise RecipeError(f"recipe {str(name_or_path)!r}: no file {path}; use one of {available()}.")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m igpo.launch.recipes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the recipe names")
    tools = sub.add_parser("tools", help="print '<backend> <topk>' of the recipe's tool server (for train_igpo.sh)")
    tools.add_argument("name")
    data = sub.add_parser("data", help="the recipe's training data and where it comes from (train_igpo.sh names it "
                                       "when TRAIN_FILE is not set)")
    data.add_argument("name")
    table = sub.add_parser("table", help="the published table of a recipe, with ours from an evaluation's results.csv")
    table.add_argument("name")
    table.add_argument("--results", type=Path, help="results.csv written by python -m igpo.evaluate")
    show = sub.add_parser("show", help="every training value the recipe sets, as composed over igpo_trainer.yaml, "
                                       "with its source tag")
    show.add_argument("name")
    diff = sub.add_parser("diff", help="compare a recipe with a published launch script's verl overrides, key by key")
    diff.add_argument("name")
    diff.add_argument("script", type=Path, help="the reference's bash launch script (e.g. Search-R1's train_grpo.sh)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print("\n".join(available()))
        elif args.command == "tools":
            recipe = load_recipe(args.name)
            print(recipe.tool_backend, recipe.tool_topk)
        elif args.command == "data":
            print(load_recipe(args.name).train_data)
        elif args.command == "show":
            print(show_recipe(args.name))
        elif args.command == "diff":
            print(diff_recipe(args.name, args.script))
        else:
            recipe = load_recipe(args.name)
            print(comparison_table(recipe, _read_results(args.results) if args.results else None))
    except RecipeError as error:
        print(f"igpo: recipe error: {error}", file=sys.stderr)
        return 2
    return 0


def _read_results(path: Path) -> list[dict[str, Any]]:
    import csv

    if not path.is_file():
        raise RecipeError(f"--results {path}: no such file; pass the results.csv of a python -m igpo.evaluate run.")
    with path.open(newline="", encoding="utf-8") as f:
        return [{k: (None if v == "" else v) for k, v in row.items()} for row in csv.DictReader(f)]


if __name__ == "__main__":
    sys.exit(main())
