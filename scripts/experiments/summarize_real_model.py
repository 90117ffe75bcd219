"""Summarise the real-model comparison (results/real_model/plan.md): held-out avg@4 / pass@4 before, in the middle
and after training per run, bootstrapped over questions, and the training curves.

Reads the runs that ``scripts/experiments/compare_methods.py --validation-dumps`` left under
``<folder>/runs/<method>-s<seed>/``:
``train.log`` (every step's metrics), ``validation/<step>.jsonl`` (verl's validation generations: one line per
sample with its prompt ``input``, its ``score`` and the reward's extra fields, ``em`` among them) and
``peak_rss_mb.txt``. Before training every method at a seed has the same model and the same seeded samples, so a run
without a step-0 dump (``--val-before baseline``) takes the baseline's at its seed; the summary checks the two runs'
step-1 metrics agree.

Per question q of the held-out set: avg@k_q = the mean exact match of its k samples, pass@k_q = 1 if any is exact.
A run's avg@k is the mean over questions; the difference after − before is paired by question, and its interval is
the percentile bootstrap over questions (10,000 resamples, seed 0).

Writes into ``<folder>``: ``summary.md``, ``validation.csv`` (method, seed, step, avg@k, pass@k, each with its
bootstrap interval), ``steps.csv`` (the training curves), ``val_avg.png`` (held-out avg@k against step per method:
each seed's line with its 95% bootstrap band over questions, and the mean over seeds) and ``training.png``
(success, well-formed call share, tool calls, KL, entropy, information gain seen vs unseen).

With ``--pilot`` it reads the pilot instead (``<folder>/lr<rate>/runs/grpo-s0/``, the plan's P1 and P2) and applies
the plan's rule for the learning rate and the step count; it writes ``<folder>/summary.md``.

Usage: python scripts/experiments/summarize_real_model.py [--folder results/real_model/comparison] [--baseline grpo]
       python scripts/experiments/summarize_real_model.py --pilot [--folder results/real_model/pilot]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from comparison_runs import Run, model_digest, parse_log  # noqa: E402  (the comparison's own log parsing)

from igpo.eval.paired import bootstrap_interval  # noqa: E402

EXPECTED_MODEL = "a8eb51a63f99a6d8"
CURVES = ("outcome/success_share", "health/wellformed_call_share", "igpo/turns_mean", "igpo/ig_mean_answer_seen",
          "igpo/ig_mean_answer_unseen", "actor/kl_loss", "actor/entropy", "outcome/same_outcome_group_share",
          "igpo/truncated_ratio", "timing_s/step")


def read_dump(path: Path) -> dict[str, list[float]]:
    """question (its prompt text) -> the exact match of each of its samples, from one validation dump."""
    per_question: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        value = row.get("em", row.get("score"))
        if value is None:
            raise ValueError(f"{path}: a line has neither `em` nor `score`; is it a verl validation dump?")
        per_question.setdefault(row["input"], []).append(float(value))
    return per_question


def question_scores(dump: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """question -> (avg@k, pass@k)."""
    return {q: (statistics.fmean(v), float(max(v) >= 1.0)) for q, v in dump.items()}


def bootstrap(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the percentile 95% bootstrap interval of the mean of ``values`` (per-question figures)."""
    if not values:
        return math.nan, math.nan, math.nan
    return (statistics.fmean(values), *bootstrap_interval(values, 0.95, resamples, seed))


def paired_change(before: dict[str, tuple], after: dict[str, tuple], which: int) -> tuple[float, float, float]:
    """after − before of avg@k (``which`` 0) or pass@k (1), paired by question, bootstrapped over questions. The two
    dumps must hold the same questions."""
    if set(before) != set(after):
        raise ValueError(f"the two validations hold different questions ({len(before)} and {len(after)}; "
                         f"{len(set(before) ^ set(after))} differ): they are not of the same held-out set")
    return bootstrap([after[q][which] - before[q][which] for q in sorted(before)])


def fmt(triple: tuple[float, float, float], sign: bool = False) -> str:
    mean, low, high = triple
    if not math.isfinite(mean):
        return "-"
    s = "+" if sign else ""
    return f"{mean:{s}.3f} [{low:{s}.3f}, {high:{s}.3f}]"


def peak_mb(directory: Path) -> float:
    """The run's peak process-tree memory that compare_methods wrote (``peak_rss_mb.txt``); NaN for a run without."""
    peak = directory / "peak_rss_mb.txt"
    return float(peak.read_text()) if peak.is_file() else math.nan


def health_warnings(log: str) -> list[str]:
    """The health monitor's findings, which it writes into the training log as ``igpo: warning: ...`` lines."""
    return re.findall(r"igpo: warning: ([^\n]*)", log)


def load(folder: Path) -> dict[str, list]:
    runs: dict[str, list] = {}
    for directory in sorted((folder / "runs").glob("*-s*")):
        method, _, seed = directory.name.rpartition("-s")
        run = Run(method, int(seed), directory)
        log = (directory / "train.log").read_text() if (directory / "train.log").is_file() else ""
        run.steps = parse_log(log)
        run.warnings = health_warnings(log)
        run.dumps = {int(p.stem): question_scores(read_dump(p)) for p in (directory / "validation").glob("*.jsonl")}
        run.peak_mb = peak_mb(directory)
        run.digest = model_digest(run)
        runs.setdefault(method, []).append(run)
    return runs


# The plan's pilot: P1 is the current rate, P2 the higher one; the rule's margin, window and hour.
PILOT_LOW, PILOT_HIGH = "1e-5", "5e-5"
PILOT_MARGIN = 0.03
PILOT_WINDOW = range(6, 11)
HOUR_S, START_S, VALIDATION_STEPS, MIN_STEPS = 3600.0, 120.0, 16, 16


def _mean(run_steps: dict, key: str, steps) -> float:
    values = [run_steps[s][key] for s in steps if key in run_steps.get(s, {})]
    return statistics.fmean(values) if values else math.nan


def pilot_figures(run_dir: Path) -> dict:
    """One pilot run's figures: success and well-formed call share (steps 6-10, and step 1), the medians of the step,
    rollout and update times over steps 2-10, the single-outcome group share, KL and entropy at the end, health
    warnings and peak memory."""
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    if not log:
        raise ValueError(f"{run_dir}: no train.log; run the pilot first (results/real_model/plan.md)")
    steps = parse_log(log)
    trained = sorted(s for s, m in steps.items() if s > 0 and "critic/score/mean" in m)
    timed = [s for s in trained if s >= 2]

    def median(key):
        values = [steps[s][key] for s in timed if key in steps[s]]
        return statistics.median(values) if values else math.nan

    return {"steps": len(trained),
            "success_window": _mean(steps, "outcome/success_share", PILOT_WINDOW),
            "success_1": _mean(steps, "outcome/success_share", [1]),
            "wellformed_window": _mean(steps, "health/wellformed_call_share", PILOT_WINDOW),
            "wellformed_1": _mean(steps, "health/wellformed_call_share", [1]),
            "same_outcome": _mean(steps, "outcome/same_outcome_group_share", trained),
            "kl_end": _mean(steps, "actor/kl_loss", trained[-1:]),
            "entropy_1": _mean(steps, "actor/entropy", [1]), "entropy_end": _mean(steps, "actor/entropy", trained[-1:]),
            "step_s": median("timing_s/step"), "gen_s": median("timing_s/gen"),
            "update_s": median("timing_s/update_actor"),
            "warnings": len(health_warnings(log)),
            "peak_mb": peak_mb(run_dir)}


def pilot_rule(low: dict, high: dict) -> tuple[str, int, str]:
    """The plan's rule, fixed before the pilot: the higher rate if its success over steps 6-10 is at least the lower
    one's + 0.03, its well-formed call share over steps 6-10 at least half its step 1's, and no health warning; the
    step count N, the largest even number with N x median step + 3 validations (each 16 steps' rollout time) + 120 s
    of start-up within an hour, at least 16. Returns (rate, N, the reason in words)."""
    gains = high["success_window"] - low["success_window"]
    kept_form = high["wellformed_window"] >= 0.5 * high["wellformed_1"]
    if gains >= PILOT_MARGIN and kept_form and high["warnings"] == 0:
        rate, chosen = PILOT_HIGH, high
        why = (f"{PILOT_HIGH}: success over steps 6-10 {gains:+.3f} over {PILOT_LOW} (>= {PILOT_MARGIN}), well-formed "
               f"share {high['wellformed_window']:.3f} >= half of step 1's {high['wellformed_1']:.3f}, no warning")
    else:
        rate, chosen = PILOT_LOW, low
        failed = [f"success gain {gains:+.3f} < {PILOT_MARGIN}"] if not gains >= PILOT_MARGIN else []
        failed += [] if kept_form else [f"well-formed share {high['wellformed_window']:.3f} < half of step 1's "
                                        f"{high['wellformed_1']:.3f}"]
        failed += [f"{high['warnings']} health warning(s)"] if high["warnings"] else []
        why = f"{PILOT_LOW}: {PILOT_HIGH} fails the rule ({'; '.join(failed)})"
    validation_s = VALIDATION_STEPS * chosen["gen_s"]
    fit = int((HOUR_S - START_S - 3 * validation_s) // chosen["step_s"])
    steps = max(MIN_STEPS, fit - fit % 2)
    why += (f"; N = {steps} (median step {chosen['step_s']:.1f} s, a validation ~{validation_s:.0f} s: "
            f"{steps} x {chosen['step_s']:.1f} + 3 x {validation_s:.0f} + {START_S:.0f} = "
            f"{steps * chosen['step_s'] + 3 * validation_s + START_S:.0f} s)")
    return rate, steps, why


def pilot(folder: Path) -> list[str]:
    """The pilot's summary lines (and ``<folder>/summary.md``)."""
    runs = {rate: pilot_figures(folder / f"lr{rate}" / "runs" / "grpo-s0") for rate in (PILOT_LOW, PILOT_HIGH)}
    rate, steps, why = pilot_rule(runs[PILOT_LOW], runs[PILOT_HIGH])
    lines = ["# SmolLM2 pilot: GRPO seed 0, 10 steps at 4 x 4, validation off (results/real_model/plan.md)", "",
             f"Written by `scripts/experiments/summarize_real_model.py --pilot` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "| learning rate | steps | success step 1 | success 6-10 | well-formed step 1 | well-formed 6-10 | "
             "single-outcome groups | KL end | entropy 1 -> end | median step s | rollout s | update s | warnings | "
             "peak MB |", "|" + "---|" * 14]
    for name, f in runs.items():
        lines.append(f"| {name} | {f['steps']} | {f['success_1']:.3f} | {f['success_window']:.3f} | "
                     f"{f['wellformed_1']:.3f} | {f['wellformed_window']:.3f} | {f['same_outcome']:.3f} | "
                     f"{f['kl_end']:.4f} | {f['entropy_1']:.3f} -> {f['entropy_end']:.3f} | {f['step_s']:.1f} | "
                     f"{f['gen_s']:.1f} | {f['update_s']:.1f} | {f['warnings']} | {f['peak_mb']:.0f} |")
    lines += ["", f"**The plan's rule**: learning rate {why}.", ""]
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--baseline", default="grpo")
    parser.add_argument("--pilot", action="store_true", help="read the pilot (P1, P2) and apply the plan's rule")
    args = parser.parse_args()
    if args.pilot:
        print("\n".join(pilot(args.folder or ROOT / "results" / "real_model" / "pilot")))
        return
    args.folder = args.folder or ROOT / "results" / "real_model" / "comparison"
    if not (args.folder / "runs").is_dir():
        parser.error(f"--folder {args.folder}: no runs/ folder (run scripts/experiments/compare_methods.py "
                     "--validation-dumps --out <folder> first)")
    runs = load(args.folder)
    base = {r.seed: r for r in runs.get(args.baseline, [])}
    lines = ["# SmolLM2-135M-Instruct on the CPU demo: held-out accuracy before and after training (issue 62)", "",
             "Written by `scripts/experiments/summarize_real_model.py` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
             f"from {args.folder.name}/runs (plan: ../plan.md). Intervals: percentile bootstrap over the held-out "
             "questions (10,000 resamples), differences paired by question.", ""]
    digests = {r.digest for group in runs.values() for r in group}
    lines.append(f"- Model digest: {', '.join(sorted(str(d) for d in digests))} (expected {EXPECTED_MODEL}): "
                 + ("as expected." if digests == {EXPECTED_MODEL} else "**NOT as expected**."))
    unpaired = [f"{m} seed {r.seed}" for m, g in runs.items() if m != args.baseline for r in g
                if r.seed not in base or any(r.steps.get(1, {}).get(k) != base[r.seed].steps.get(1, {}).get(k)
                                             for k in ("critic/score/mean", "igpo/turns_mean"))]
    lines += [f"- Step-1 pairing with {args.baseline} (training score and turns at step 1): "
              + ("held at every seed." if not unpaired else "**broken**: " + ", ".join(unpaired)), ""]

    header = "| method | seed | step | avg@k | pass@k | avg@k − before | pass@k − before |"
    lines += ["## Held-out avg@k and pass@k (k = samples per question)", "", header, "|---|---|---|---|---|---|---|"]
    rows = []
    for method, group in runs.items():
        for run in group:
            before = run.dumps.get(0) or (base[run.seed].dumps.get(0) if run.seed in base else None)
            for step in sorted(set(run.dumps) | ({0} if before else set())):
                scores = run.dumps.get(step) or before
                avg = bootstrap([v[0] for v in scores.values()])
                passed = bootstrap([v[1] for v in scores.values()])
                if step > 0 and before:
                    d_avg, d_pass = paired_change(before, scores, 0), paired_change(before, scores, 1)
                else:
                    d_avg = d_pass = (math.nan, math.nan, math.nan)
                rows.append([method, run.seed, step, *avg, *passed, *d_avg])
                lines.append(f"| {method} | {run.seed} | {step} | {fmt(avg)} | {fmt(passed)} | {fmt(d_avg, True)} | "
                             f"{fmt(d_pass, True)} |")
    with (args.folder / "validation.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "seed", "step", "avg", "avg_low", "avg_high", "pass", "pass_low", "pass_high",
                         "avg_change", "avg_change_low", "avg_change_high"])
        writer.writerows([[*r[:3], *(f"{v:.4f}" if math.isfinite(v) else "" for v in r[3:])] for r in rows])

    lines += ["", "## Learning shown? (the plan's rule)", ""]
    for method, group in runs.items():
        finals = []
        for run in group:
            last = max(run.dumps) if run.dumps else None
            before = run.dumps.get(0) or (base[run.seed].dumps.get(0) if run.seed in base else None)
            if last and before:
                finals.append((run.seed, paired_change(before, run.dumps[last], 0)))
        clear = [s for s, (_, low, _) in finals if low > 0]
        shown = bool(clear) and all(mean >= 0 for _, (mean, _, _) in finals) and len(finals) >= 2
        lines.append(f"- {method}: " + "; ".join(f"seed {s} {fmt(t, True)}" for s, t in finals)
                     + f" -> **{'shown' if shown else 'not shown'}** (at least one seed's interval above 0, the "
                     "other's difference not negative).")
    if args.baseline in runs and len(runs) > 1:
        lines += ["", f"Each method − {args.baseline} after training, avg@k paired by question at each seed:", ""]
        for method, group in runs.items():
            if method == args.baseline:
                continue
            for run in group:
                other = base.get(run.seed)
                if other and run.dumps and other.dumps and max(run.dumps) == max(other.dumps):
                    last = max(run.dumps)
                    lines.append(f"- {method} seed {run.seed}, step {last}: "
                                 f"{fmt(paired_change(other.dumps[last], run.dumps[last], 0), True)}")

    lines += ["", "## Runs", "", "| method | seed | steps | median step s | peak memory MB (tree RSS) | entropy step 1 "
              "-> last | health warnings |", "|---|---|---|---|---|---|---|"]
    with (args.folder / "steps.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "seed", "step", *CURVES])
        for method, group in runs.items():
            for run in group:
                trained = sorted(s for s, m in run.steps.items() if s > 0 and "critic/score/mean" in m)
                for step in trained:
                    writer.writerow([method, run.seed, step] + [
                        f"{run.steps[step][k]:.4f}" if k in run.steps[step] else "" for k in CURVES])
                times = [run.steps[s]["timing_s/step"] for s in trained[1:] if "timing_s/step" in run.steps[s]]
                entropy = [run.steps[s]["actor/entropy"] for s in trained if "actor/entropy" in run.steps[s]]
                lines.append(f"| {method} | {run.seed} | {len(trained)} | "
                             + (f"{statistics.median(times):.1f}" if times else "-") + f" | {run.peak_mb:.0f} | "
                             + (f"{entropy[0]:.3f} -> {entropy[-1]:.3f}" if entropy else "-") + " | "
                             + ("; ".join(w.replace("|", "/") for w in run.warnings) or "none") + " |")
    _plots(args.folder, runs, base)
    (args.folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def avg_curves(runs: dict[str, list], base: dict) -> dict[str, tuple[dict, dict]]:
    """method -> ({seed: {step: (avg@k, low, high)}}, {step: mean avg@k over seeds}): each run's held-out avg@k with
    its bootstrap interval over questions at every validated step (step 0 borrowed from the baseline at its seed),
    and the mean over the method's seeds at the steps all of them validated (empty for a single seed)."""
    out = {}
    for method, group in runs.items():
        curves = {}
        for run in group:
            dumps = dict(run.dumps)
            if 0 not in dumps and run.seed in base and 0 in base[run.seed].dumps:
                dumps[0] = base[run.seed].dumps[0]
            curves[run.seed] = {s: bootstrap([v[0] for v in dumps[s].values()]) for s in sorted(dumps)}
        shared = sorted(set.intersection(*(set(c) for c in curves.values()))) if len(curves) > 1 else []
        out[method] = (curves, {s: statistics.fmean(c[s][0] for c in curves.values()) for s in shared})
    return out


def _plots(folder: Path, runs: dict[str, list], base: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for index, (method, (curves, mean)) in enumerate(avg_curves(runs, base).items()):
        color = f"C{index}"
        for seed, curve in curves.items():
            steps = sorted(curve)
            ax.plot(steps, [curve[s][0] for s in steps], color=color, alpha=0.5, linewidth=1, marker="o",
                    markersize=3, label=f"{method} seed {seed}")
            ax.fill_between(steps, [curve[s][1] for s in steps], [curve[s][2] for s in steps], color=color,
                            alpha=0.12, linewidth=0)
        if mean:
            ax.plot(sorted(mean), [mean[s] for s in sorted(mean)], color=color, linewidth=2.5,
                    label=f"{method} mean of {len(curves)} seeds")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out avg@k exact match")
    ax.set_title("bands: 95% bootstrap over questions, per seed", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "val_avg.png", dpi=100)
    plt.close(fig)

    # One panel a curve; the last one holds information gain on turns whose observation showed the answer (solid)
    # and on those that did not (dashed), for the runs that compute it.
    keys = ("outcome/success_share", "health/wellformed_call_share", "igpo/turns_mean", "actor/kl_loss",
            "actor/entropy", ("igpo/ig_mean_answer_seen", "igpo/ig_mean_answer_unseen"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, panel in zip(axes, keys):
        for key, style in zip((panel,) if isinstance(panel, str) else panel, ("-", "--")):
            for index, (method, group) in enumerate(runs.items()):
                for run in group:
                    steps = sorted(s for s, m in run.steps.items() if s > 0 and key in m)
                    if steps:
                        ax.plot(steps, [run.steps[s][key] for s in steps], style, color=f"C{index}", alpha=0.6,
                                label=f"{method} s{run.seed}")
        ax.set_title(panel if isinstance(panel, str) else "information gain: answer seen (-), unseen (--)",
                     fontsize=9)
        ax.set_xlabel("step")
    drawn = [ax for ax in axes if ax.get_legend_handles_labels()[0]]
    if drawn:
        drawn[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(folder / "training.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
