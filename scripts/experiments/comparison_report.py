"""The method comparison's outputs from its finished runs: steps.csv, paired.csv, the plots and summary.md (the
primary measure paired by seed against the baseline, per-hop reach, information gain by hop, sample efficiency)."""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import re
import statistics
import subprocess
import time
from pathlib import Path

from comparison_runs import Run, comparison_wall_s, tool_calls_per_trajectory
from igpo.eval.paired import mean_interval, paired_difference

ROOT = Path(__file__).resolve().parents[2]
PRIMARY = "outcome/success_share"


def mean_curve(runs: list[Run], key: str) -> dict[int, list[float]]:
    """step -> values over seeds, for the steps where every seed logged ``key``."""
    per_step: dict[int, list[float]] = {}
    for run in runs:
        for step, metrics in run.steps.items():
            if key in metrics and math.isfinite(metrics[key]):
                per_step.setdefault(step, []).append(metrics[key])
    return {s: v for s, v in sorted(per_step.items()) if len(v) == len(runs)}


def steps_to_reach(curve: dict[int, list[float]], target: float) -> int | None:
    for step, values in curve.items():
        if step > 0 and statistics.fmean(values) >= target:
            return step
    return None


def first_step_at(run: Run, target: float) -> int | None:
    """The first validated step (> 0) at which this run's validation F1 reached ``target``."""
    return steps_to_reach(mean_curve([run], "val-core/all/f1"), target)


def second_half_mean(run: Run, key: str, steps: int) -> float:
    """The mean of ``key`` over the run's training steps in the second half (steps > steps // 2); NaN when a step
    there lacks it (a run that did not log the metric is not averaged over fewer steps)."""
    values = [run.steps.get(step, {}).get(key, math.nan) for step in range(steps // 2 + 1, steps + 1)]
    return statistics.fmean(values) if values and all(math.isfinite(v) for v in values) else math.nan


def step_band(group: list[Run], key: str) -> dict[int, tuple[float, float, float]]:
    """step -> (mean, low, high) over the seeds of ``group``: the 95% t interval of ``key``, at the training steps
    every seed logged it."""
    return {step: mean_interval(values) for step, values in mean_curve(group, key).items() if step > 0}


def hop_reach(group: list[Run]) -> list[tuple[int, float, float, float]]:
    """Chain progress over every training step and seed of ``group`` (``hop/*`` of the rollout metrics): per hop k,
    (k, share of trajectories that made k correct hops, share whose k-th call was a correct hop, ... a wrong one)."""
    rows = []
    for k in range(1, 9):
        cells = []
        for name in (f"hop/reach{k}", f"hop/call{k}_right", f"hop/call{k}_wrong"):
            values = [m[name] for run in group for step, m in run.steps.items()
                      if step > 0 and name in m and math.isfinite(m[name])]
            cells.append(statistics.fmean(values) if values else math.nan)
        if all(math.isnan(c) for c in cells):
            break
        rows.append((k, *cells))
    return rows


def pooled_by_count(group: list[Run], count_key: str, values: tuple[str, ...]) -> dict[tuple, list[float]]:
    """Per-step means pooled over every step and seed of ``group``, each weighted by its step's count: for every
    metric whose name fully matches ``count_key`` (a ``..._count`` name; its groups key the result) with a count > 0,
    the siblings named by replacing ``_count`` with ``_<value>`` for each of ``values``; a step where one of them is
    not finite is skipped. Returns key (the match's groups, as text) -> [total count, count-weighted mean of
    each value ...]."""
    sums: dict[tuple, list[float]] = {}
    for run in group:
        for metrics in run.steps.values():
            for key, count in metrics.items():
                match = re.fullmatch(count_key, key)
                if not match or not count > 0:
                    continue
                found = [metrics.get(key.replace("_count", f"_{value}"), math.nan) for value in values]
                if all(math.isfinite(v) for v in found):
                    total = sums.setdefault(match.groups(), [0.0] * (1 + len(values)))
                    total[0] += count
                    for index, v in enumerate(found, 1):
                        total[index] += v * count
    return {key: [total[0]] + [v / total[0] for v in total[1:]] for key, total in sums.items()}


def hop_ig_split(group: list[Run]) -> list[tuple[int, str, float, float]]:
    """Information gain of the k-th tool call split by correct and wrong hop (``igpo/ig_hop<k>_right_*`` and
    ``_wrong_*``), pooled over steps and seeds weighting each step's mean by its turn count: (k, part, turns, mean)."""
    pooled = pooled_by_count(group, r"igpo/ig_hop(\d+)_(right|wrong)_count", ("mean",))
    return sorted((int(k), part, n, mean) for (k, part), (n, mean) in pooled.items())


def hop_table(group: list[Run]) -> list[tuple[int, float, float, float]]:
    """Information gain of the k-th tool call of a trajectory (``igpo/ig_hop<k>_*``), pooled over every step and seed
    of ``group``, weighting each step's mean and negative share by its turn count: (k, turns, mean, share < 0)."""
    pooled = pooled_by_count(group, r"igpo/ig_hop(\d+)_count", ("mean", "negative_share"))
    return sorted((int(k), n, mean, negative) for (k,), (n, mean, negative) in pooled.items())


def table_section(title: str, intro: str, columns: list[str], tables: dict[str, list[tuple]], row) -> list[str]:
    """A summary section: a markdown table of every method's rows (``row`` formats one row's cells after the
    method), or nothing when no method has any."""
    if not tables:
        return []
    lines = [f"## {title}", "", intro, "", "| method | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for method, table in tables.items():
        lines += [f"| {method} | {row(*cells)} |" for cells in table]
    return lines + [""]


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {spread:.3f}"


def demo_task(extra: list[str]) -> str:
    """The CPU demo's task the runs use (``demo.task=`` among the overrides; hops by default)."""
    return next((value.split("=", 1)[1] for value in extra if value.startswith("demo.task=")), "hops")


def data_hash(task: str = "hops") -> str:
    """The demo world's files as train_igpo.sh wrote them (questions, corpora, vocabulary) for ``task``."""
    digest = hashlib.sha256()
    folder = ROOT / ".cache" / ("demo_world" if task == "hops" else f"demo_world_{task}")
    for name in ("train.parquet", "val.parquet", "corpus.jsonl", "practice_corpus.jsonl", "vocabulary.txt"):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:16]


def write_outputs(out: Path, runs: dict[str, list[Run]], args: argparse.Namespace, trajectories: int) -> str:
    with (out / "steps.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "seed", "step", "train_score", "val_f1", "tool_calls_per_trajectory", "step_s",
                         "success_share", "same_outcome_group_share", "val_em"])
        for method, group in runs.items():
            for run in group:
                for step, m in sorted(run.steps.items()):
                    cells = [m.get("critic/score/mean"), m.get("val-core/all/f1"),
                             tool_calls_per_trajectory(m) if "critic/score/mean" in m else None,
                             m.get("timing_s/step"), m.get(PRIMARY), m.get("outcome/same_outcome_group_share"),
                             m.get("val-core/all/em")]
                    writer.writerow([method, run.seed, step] + ["" if c is None or not math.isfinite(c) else
                                                                f"{c:.4f}" for c in cells])

    curves = {method: mean_curve(group, "val-core/all/f1") for method, group in runs.items()}
    _plot(out / "val_f1.png", curves, args, f"CPU demo ({demo_task(args.extra)}), {len(args.seeds)} seeds per method")
    primary, baseline = getattr(args, "primary", PRIMARY), getattr(args, "baseline", "grpo")
    bands = {method: step_band(group, primary) for method, group in runs.items()}
    if any(bands.values()):
        plot_bands(out / "train_success.png", bands, primary,
                    f"CPU demo ({demo_task(args.extra)}), {len(args.seeds)} seeds per method")
    half = {method: [second_half_mean(run, primary, args.steps) for run in group] for method, group in runs.items()}
    with (out / "paired.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "seed", "primary", f"{baseline}_primary", "difference"])
        for method, group in runs.items():
            for index, run in enumerate(group):
                base = half[baseline][index] if baseline in half else math.nan
                writer.writerow([method, run.seed] + [f"{v:.4f}" if math.isfinite(v) else "" for v in
                                                      (half[method][index], base, half[method][index] - base)])

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    lines = [
        "# CPU method comparison (`scripts/experiments/compare_methods.py`)", "",
        f"Settings: {args.steps} steps, {trajectories} trajectories per step, validation every {args.val_every} "
        f"steps on the demo's held-out split, seeds {','.join(map(str, args.seeds))}; extra overrides: "
        f"{' '.join(args.extra) or 'none'}. Commit {commit}, data hash {data_hash(demo_task(args.extra))}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}.", "",
        "| method | val F1 before | val F1 after | train score (last step) | tool calls / trajectory | wall s / run |",
        "|---|---|---|---|---|---|",
    ]
    for method, group in runs.items():
        before = [r.steps[0]["val-core/all/f1"] for r in group if "val-core/all/f1" in r.steps.get(0, {})]
        after = [r.steps[args.steps]["val-core/all/f1"] for r in group
                 if "val-core/all/f1" in r.steps.get(args.steps, {})]
        score = [r.steps[args.steps]["critic/score/mean"] for r in group
                 if "critic/score/mean" in r.steps.get(args.steps, {})]
        calls = [statistics.fmean(v) for r in group
                 if (v := [c for s, m in r.steps.items() if s > 0 and "critic/score/mean" in m
                           and math.isfinite(c := tool_calls_per_trajectory(m))])]
        lines.append(f"| {method} | {fmt(before)} | {fmt(after)} | {fmt(score)} | {fmt(calls)} | "
                     f"{statistics.fmean(r.wall_s for r in group):.0f} |")
    lines.append("")
    every = [r for group in runs.values() for r in group]
    total_s = comparison_wall_s(every)
    lines.append(f"Wall time of all {len(every)} runs: {total_s:.0f} s ({total_s / 3600:.2f} h) on this machine, "
                 f"{args.jobs} run{'s' if args.jobs > 1 else ''} at a time"
                 f"{' (wall s / run: each run start to end, beside another)' if args.jobs > 1 else ''}.")
    lines.append("")
    lines += primary_section(half, primary, baseline, args.steps, [r.seed for r in next(iter(runs.values()))])

    target = args.target
    lines += [f"## Steps to a mean validation F1 of {target}", "",
              f"The first validated step at which the mean over seeds reaches {target}; beside it each seed's own "
              "first step (`-`: not within the run) and the final validation F1 (mean, min-max over seeds).", "",
              f"| method | mean curve reaches {target} at | per seed | val F1 at step {args.steps} |",
              "|---|---|---|---|"]
    for method, group in runs.items():
        reached = steps_to_reach(curves[method], target)
        firsts = [first_step_at(r, target) for r in group]
        final = [r.steps[args.steps]["val-core/all/f1"] for r in group
                 if "val-core/all/f1" in r.steps.get(args.steps, {})]
        spread = f"{statistics.fmean(final):.3f} ({min(final):.3f}-{max(final):.3f})" if final else "n/a"
        lines.append(f"| {method} | {f'step {reached}' if reached is not None else f'not in {args.steps} steps'} | "
                     f"{', '.join('-' if f is None else str(f) for f in firsts)} | {spread} |")
    lines.append("")

    same = {method: mean_curve(group, "outcome/same_outcome_group_share") for method, group in runs.items()}
    shown = sorted({step for curve in same.values() for step in curve})
    if shown:
        lines += ["## Groups whose trajectories all scored the same (no outcome signal), per step", "",
                  "`outcome/same_outcome_group_share`, mean over seeds.", "",
                  "| method | " + " | ".join(f"step {s}" for s in shown) + " | all steps |",
                  "|---|" + "---|" * (len(shown) + 1)]
        for method, curve in same.items():
            cells = [f"{statistics.fmean(curve[s]):.2f}" if s in curve else "" for s in shown]
            every = [v for values in curve.values() for v in values]
            overall = f"{statistics.fmean(every):.2f}" if every else "n/a"
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {overall} |")
        lines.append("")

    def tables(make) -> dict[str, list[tuple]]:
        return {method: table for method, group in runs.items() if (table := make(group))}

    lines += table_section(
        "Information gain by hop",
        "IG of the k-th tool call of a trajectory (`igpo/ig_hop<k>_*`), pooled over every step and seed, each step "
        "weighted by its turn count.",
        ["hop", "turns", "mean IG", "share negative"], tables(hop_table),
        lambda k, n, mean, negative: f"{k} | {n:.0f} | {mean:+.3f} | {negative:.2f}")
    lines += table_section(
        "Chain progress by hop",
        "Over every training step and seed: the share of trajectories that made k correct hops, and the share whose "
        "k-th tool call was the chain's next correct hop or was not (`hop/*`).",
        ["hop k", "reached k hops", "k-th call right", "k-th call wrong"], tables(hop_reach),
        lambda k, reached, right, wrong: f"{k} | {reached:.3f} | {right:.3f} | {wrong:.3f}")
    lines += table_section(
        "Information gain by hop, correct and wrong hops apart",
        "IG of the k-th tool call (`igpo/ig_hop<k>_right_*`, `_wrong_*`), pooled over steps and seeds, each step "
        "weighted by its turn count.",
        ["hop", "correct or wrong", "turns", "mean IG"], tables(hop_ig_split),
        lambda k, part, n, mean: f"{k} | {part} | {n:.0f} | {mean:+.3f}")

    if "grpo" in curves and "igpo" in curves and curves["grpo"]:
        target = statistics.fmean(curves["grpo"][max(curves["grpo"])])
        start = statistics.fmean(curves["grpo"][min(curves["grpo"])])
        if target <= start:  # GRPO did not improve: "reaching" its final figure says nothing about IGPO
            lines.append(f"Sample efficiency: not defined here: GRPO's final mean validation F1 ({target:.3f}) is not "
                         f"above its first ({start:.3f}).")
        else:
            reached = steps_to_reach(curves["igpo"], target)
            lines.append(f"Sample efficiency: GRPO's final mean validation F1 is {target:.3f}; IGPO's mean curve "
                         + (f"reaches it at step {reached} of {args.steps}." if reached is not None
                            else "does not reach it within the budget."))
    summary = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(summary)
    return summary


def primary_section(half: dict[str, list[float]], primary: str, baseline: str, steps: int,
                    seeds: list[int]) -> list[str]:
    """The summary's headline: each method's ``primary`` over the second half of its run, per seed, and its paired
    difference against ``baseline`` (the 95% paired t interval; the bootstrap's beside it)."""
    first = steps // 2 + 1
    lines = [f"## Primary measure: `{primary}` over steps {first}-{steps}, paired by seed against {baseline}", "",
             f"Each run's mean of `{primary}` over its training steps {first}-{steps}; the difference is the method's "
             f"minus {baseline}'s at the same seed (seeds {', '.join(map(str, seeds))}), with its 95% paired t "
             "interval and a percentile bootstrap interval beside it (igpo/eval/paired.py).", "",
             "| method | per seed | mean [95% CI] | difference vs " + baseline + " [95% paired t] (bootstrap) |",
             "|---|---|---|---|"]
    for method, values in half.items():
        finite = [v for v in values if math.isfinite(v)]
        per_seed = ", ".join(f"{v:.3f}" if math.isfinite(v) else "-" for v in values)
        if not finite:
            lines.append(f"| {method} | {per_seed} | n/a (the runs did not log `{primary}`) | n/a |")
            continue
        mean, low, high = mean_interval(finite)
        if method == baseline or baseline not in half:
            versus = "(the baseline)" if method == baseline else f"n/a (no {baseline} runs)"
        else:
            pairs = [(m, b) for m, b in zip(values, half[baseline]) if math.isfinite(m) and math.isfinite(b)]
            versus = (paired_difference([m for m, _ in pairs], [b for _, b in pairs]).describe()
                      if len(pairs) >= 2 else f"n/a ({len(pairs)} paired seed(s))")
        lines.append(f"| {method} | {per_seed} | {mean:.3f} [{low:.3f}, {high:.3f}] | {versus} |")
    lines.append("")
    return lines


def plot_bands(path: Path, bands: dict[str, dict[int, tuple[float, float, float]]], key: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, band in bands.items():
        if not band:
            continue
        steps = list(band)
        ax.plot(steps, [m for m, _, _ in band.values()], label=method)
        ax.fill_between(steps, [lo for _, lo, _ in band.values()], [hi for _, _, hi in band.values()], alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{key}\n(mean over seeds; band: 95% t interval)")
    ax.set_title(title, wrap=True)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot(path: Path, curves: dict[str, dict[int, list[float]]], args: argparse.Namespace, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, curve in curves.items():
        if not curve:
            continue
        steps = list(curve)
        ax.plot(steps, [statistics.fmean(v) for v in curve.values()], marker="o", label=method)
        ax.fill_between(steps, [min(v) for v in curve.values()], [max(v) for v in curve.values()], alpha=0.2)
    ax.axhline(args.target, color="grey", linestyle=":", linewidth=1, label=f"target {args.target}")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation F1 (mean over seeds; band: min..max)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
