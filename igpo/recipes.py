"""Recipes: the published settings we reproduce, one Hydra config each (``configs/recipe/<name>.yaml``).

A recipe file is a ``# @package _global_`` override of ``configs/igpo_trainer.yaml`` (``recipe=<name>``) plus one
section our trainer ignores, ``igpo_recipe``: what the paper ran it with (model, hardware, tools, corpus and its
coverage caveat, evaluation set and metric) and the paper's table. This module reads that section for the launcher
(``python -m igpo.recipes tools <name>`` -> the tool server's backend and top-k; ``data <name>`` -> the training
data it needs, which the launcher names when ``TRAIN_FILE`` is not set) and for the evaluation harness,
which prints our numbers in the paper's table shape beside the published rows (``comparison_table``).

Published values are percentages as the papers print them; our per-source means (0..1) are scaled by 100.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECIPE_DIR = Path(__file__).resolve().parent.parent / "configs" / "recipe"
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

    path = Path(name_or_path)
    if path.suffix != ".yaml":
        path = RECIPE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise RecipeError(f"recipe {str(name_or_path)!r}: no file {path}; use one of {available()}.")
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

    ``ours`` is ``igpo.evaluation.summarize``'s table (one row per data_source with em/f1/judge means in 0..1). Our
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m igpo.recipes", description=__doc__,
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
    table.add_argument("--results", type=Path, help="results.csv written by scripts/evaluate.py")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print("\n".join(available()))
        elif args.command == "tools":
            recipe = load_recipe(args.name)
            print(recipe.tool_backend, recipe.tool_topk)
        elif args.command == "data":
            print(load_recipe(args.name).train_data)
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
        raise RecipeError(f"--results {path}: no such file; pass the results.csv of a scripts/evaluate.py run.")
    with path.open(newline="", encoding="utf-8") as f:
        return [{k: (None if v == "" else v) for k, v in row.items()} for row in csv.DictReader(f)]


if __name__ == "__main__":
    sys.exit(main())
