"""Summarise the turn-credit comparison (results/turn_credit/plan.md): the oracle gate, the rows, the per-turn table.

Reads the runs that ``scripts/experiments/compare_methods.py`` left under
``<folder>/<comparison>/runs/<method>-s<seed>/``
(``train.log``, ``console.log`` and, with ``--trajectories``, the trajectory log ``trajectories/step_*.jsonl``, whose
per-turn rows it also writes to the run's own ``turns.csv.gz`` and reads from there once the log is gone: the logs are
not kept in git, so a comparison resumed in a fresh checkout still has every finished run's turns) and writes into
``<folder>`` (or ``--out``):

    summary.md          the checks the plan fixes (model digest, calibration bounds, the oracle working, step-1
                        pairing, repeat of chain_compare_v2's GRPO runs), the gate (oracle − GRPO on the primary
                        measure, 95% paired t and bootstrap intervals, p, s_d, detectable difference, pass or not),
                        the rows (each − GRPO, Holm-adjusted p-values, intervals at 95% and at the Holm family's
                        Bonferroni level; successors − IGPO likewise), validation avg@8 after training, and the
                        per-turn table by what the turn did (igpo/eval/turn_kinds.py) and question type
    paired.csv          method, seed, primary, the baseline's primary, difference, validation EM after
    steps.csv           method, seed, step, primary, training score, tool calls per trajectory, reach1-3
    turns.csv.gz        one row per turn of every logged training trajectory: method, seed, step, row, hops, turn,
                        kind, applied advantage (mean over the turn's tokens in the loss), turn reward (the oracle's,
                        IGPO's or IG-Search's information gain, TIPS's shaping reward), outcome score
    train_success.png   the primary measure per step, mean over seeds with the 95% t band, per method
    val_em.png          validation avg@8 exact match after training per seed and method (GRPO's before beside it)

Usage (from the repository root, with the CPU .venv):
    python scripts/experiments/summarize_turn_credit.py            # results/turn_credit, every comparison in it
    python scripts/experiments/summarize_turn_credit.py --comparisons gate_A
    python scripts/experiments/summarize_turn_credit.py --comparisons A2 --out results/turn_credit/A2 \
        --expected-model ab3e9e6bcc97c34a --repeats A2_2026-12-08_check     # the pinned model's comparison
A comparison still running is summarised over its finished runs; the summary says how many seeds each method has.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

# The comparison's own log parsing and plots.
from comparison_report import plot_bands, second_half_mean, step_band  # noqa: E402
from comparison_runs import (STEP_LINE, Run, comparison_wall_s, console_value, load_finished,  # noqa: E402
                             model_digest, parse_log, tool_calls_per_trajectory)

from igpo.eval.paired import (detectable_difference, holm, mean_interval, paired_difference,  # noqa: E402
                              paired_t_p, t_quantile)
from igpo.eval.turn_kinds import KINDS, chain_hops, turn_kinds  # noqa: E402

PRIMARY = "outcome/success_share"
EXPECTED_MODEL = "607a9ea80d998160"
FAMILY = ("igpo", "igpo_telescoped", "ig_search", "tips", "igpo_turnnorm")
SUCCESSORS = ("igpo_telescoped", "ig_search", "tips", "igpo_turnnorm")
# verl's validation aggregates print as np.float64(...): read those too.
METRIC = re.compile(r"([A-Za-z0-9_@/\-.]+):(?:np\.float64\()?(-?[0-9.]+(?:[eE][-+]?[0-9]+)?|nan|inf)\)?")
# What a repeated run may differ in: wall-clock timings, throughput, memory and the ETA.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "progress/")


def load_runs(folder: Path, comparisons: list[str], steps: int) -> tuple[dict[str, list], list[str]]:
    """method -> finished runs (sorted by seed; a method in two comparisons keeps the first one's run at a seed),
    and notes on what was skipped."""
    runs: dict[str, dict[int, Run]] = {}
    notes = []
    for comparison in comparisons:
        for directory in sorted((folder / comparison / "runs").glob("*-s*")):
            method, _, seed = directory.name.rpartition("-s")
            run = Run(method, int(seed), directory)
            if not load_finished(run, steps):
                notes.append(f"{comparison}/{directory.name}: not finished (no step {steps} in its log)")
                continue
            run.comparison = comparison
            kept = runs.setdefault(method, {})
            if run.seed in kept:
                notes.append(f"{comparison}/{directory.name}: seed {run.seed} of {method} already read from "
                             f"{kept[run.seed].comparison}; this one is not used")
                continue
            kept[run.seed] = run
    return {m: [by_seed[s] for s in sorted(by_seed)] for m, by_seed in sorted(runs.items())}, notes


def val_metrics(run) -> dict[str, float]:
    """The validation metrics of the run's last step, np.float64 values included."""
    text = (run.directory / "train.log").read_text()
    out: dict[str, float] = {}
    last = max(run.steps)
    for line in text.splitlines():
        match = STEP_LINE.search(line)
        if match and int(match.group(1)) == last and "val-" in line:
            out.update((k, float(v)) for k, v in METRIC.findall(match.group(2)) if k.startswith("val-"))
    return out


def turn_reward_terms() -> tuple[str, ...]:
    """The names under which the registered methods log their per-turn reward in the trajectory terms (each method's
    ``gain_term``: the oracle's hop reward, information gain, TIPS's shaping reward)."""
    from igpo.integration.methods import METHODS, load_methods

    load_methods({})
    return tuple(sorted({cls.gain_term for cls in METHODS.values() if getattr(cls, "gain_term", None)}))


TURN_COLUMNS = ["method", "seed", "step", "row", "hops", "turn", "kind", "advantage", "turn_reward", "score"]
RUN_TURNS = "turns.csv.gz"  # a run's own per-turn rows, beside its logs


def run_turns(run) -> list[list]:
    """The run's per-turn rows: from its trajectory log when it has one (and then also written to the run's
    ``turns.csv.gz``), else from that file, kept in git where the trajectory log (2 MB a run) is not; empty without
    either."""
    kept = run.directory / RUN_TURNS
    if any((run.directory / "trajectories").glob("step_*.jsonl")):
        rows = turn_rows(run)
        write_turns(kept, rows)
        return rows
    if not kept.is_file():
        return []
    with gzip.open(kept, "rt", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header != TURN_COLUMNS:
            raise SystemExit(f"{kept}: columns {header}, expected {TURN_COLUMNS}; write it again from the run's "
                             f"trajectory log")
        rows = [[r[0], int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), r[6], float(r[7]), float(r[8]),
                 float(r[9])] for r in reader]
    if any(r[0] != run.method or r[1] != run.seed for r in rows):
        raise SystemExit(f"{kept}: holds turns of another run than {run.method} seed {run.seed}")
    return rows


def write_turns(path: Path, rows: list[list]) -> None:
    with gzip.open(path, "wt", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TURN_COLUMNS)
        for row in rows:
            writer.writerow([f"{v:.5g}" if isinstance(v, float) else v for v in row])


def turn_rows(run) -> list[list]:
    """One row per turn of every trajectory in the run's trajectory log (empty without one)."""
    from igpo.integration.trajectory_log import read_step, token_advantages

    names = turn_reward_terms()
    rows = []
    for path in sorted((run.directory / "trajectories").glob("step_*.jsonl")):
        for index, line in enumerate(read_step(path)):
            record = line["record"]
            hops = chain_hops(record.question)
            if hops < 1 or len(record.hop_right) != record.num_turns:
                continue
            kinds = turn_kinds(record, hops)
            per_token = token_advantages(line) if "advantage" in line else []
            terms = line.get("terms") or {}
            reward = next((terms[name] for name in names if isinstance(terms.get(name), list)), None)
            spans = line.get("turn_spans") or []
            for turn, kind in enumerate(kinds):
                advantage = math.nan
                if turn < len(spans) and spans[turn][0] is not None:
                    values = [v for v in per_token[spans[turn][0]:spans[turn][1]] if v is not None]
                    advantage = statistics.fmean(values) if values else math.nan
                value = reward[turn] if reward is not None and turn < len(reward) else None
                rows.append([run.method, run.seed, line["step"], index, hops, turn, kind, advantage,
                             math.nan if value is None else value, line["score"]])
    return rows


def fmt(value: float, digits: int = 3, sign: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def checks(runs: dict[str, list], baseline: str, gate: str, steps: int, folder: Path,
           expected_model: str = EXPECTED_MODEL, repeats_in: list[str] | None = None,
           step1_band: tuple[float, float] = (0.05, 0.15)) -> list[str]:
    lines = ["## Checks the plan fixes", ""]
    digests = {model_digest(r) for group in runs.values() for r in group}
    lines.append(f"- Model digest: {', '.join(sorted(str(d) for d in digests))} (expected {expected_model}): "
                 + ("**as expected**." if digests == {expected_model} else "**NOT as expected**: the comparison "
                    "stops until this is explained."))
    base = runs.get(baseline, [])
    if base:
        first = [r.steps.get(1, {}).get(PRIMARY, math.nan) for r in base]
        half = [second_half_mean(r, PRIMARY, steps) for r in base]
        low, high = step1_band
        low_ok = all(v >= 0.031 for v in first) and low <= statistics.fmean(first) <= high
        lines.append(f"- Calibration, below: {baseline}'s step-1 success per seed {', '.join(fmt(v) for v in first)}"
                     f" (mean {fmt(statistics.fmean(first))}); bound >= 0.031 at every seed and mean in "
                     f"{low:g}-{high:g}: **{'met' if low_ok else 'not met'}**.")
        high_ok = all(v < 0.5 for v in half)
        lines.append(f"- Calibration, above (room): {baseline}'s steps {steps // 2 + 1}-{steps} success per seed "
                     f"{', '.join(fmt(v) for v in half)}; bound < 0.50 at every seed: "
                     f"**{'met' if high_ok else 'not met'}**.")
    oracles = [arm for arm in gate.split(",") if arm in runs and arm.startswith("oracle")]
    if oracles:
        bad = [(arm, r.seed, s) for arm in oracles for r in runs[arm] for s, m in r.steps.items()
               if s > 0 and "critic/score/mean" in m
               and not (m.get("oracle/right_hop_turns", 0) > 0 and m.get("oracle/rows_without_chain", 1) == 0)]
        lines.append(f"- The oracle works (`oracle/right_hop_turns` > 0, `oracle/rows_without_chain` = 0 at every "
                     f"step of {', '.join(oracles)}): **{'yes' if not bad else f'no, at (arm, seed, step) {bad}'}**.")
    keys = ("critic/score/mean", "igpo/turns_mean", "hop/reach1", "hop/reach2", "hop/reach3")
    unpaired = []
    for method, group in runs.items():
        if method == baseline:
            continue
        for run in group:
            other = next((b for b in base if b.seed == run.seed), None)
            if other is None or any(run.steps.get(1, {}).get(k) != other.steps.get(1, {}).get(k) for k in keys):
                unpaired.append(f"{method} seed {run.seed}")
    lines.append(f"- Step-1 pairing (every arm's step-1 {', '.join(f'`{k}`' for k in keys)} equal to {baseline}'s at "
                 f"its seed): **{'held at every seed' if not unpaired else 'broken: ' + ', '.join(unpaired)}**.")
    repeats = [line for line in (earlier_repeat(run, baseline, steps) for run in base) if line]
    if repeats:
        lines.append(f"- {baseline} against chain_compare_v2's runs at the same seed (training score and turns at "
                     f"steps 1-{steps}; only the validation's sample count differs): {'; '.join(repeats)}.")
    return lines + repeat_lines(folder, runs, steps, repeats_in) + [""]


def earlier_repeat(run, baseline: str, steps: int, earlier: Path = ROOT / "results" / "chain_compare_v2" / "runs"):
    """Whether a baseline run at seed 0 or 1 repeats chain_compare_v2's at its seed (training score and turns at every
    step), or why that does not apply (another batch layout, another model); None where there is no such run."""
    log = earlier / f"{baseline}-s{run.seed}" / "train.log"
    if run.seed > 1 or not log.is_file():
        return None
    here, there = batch_layout(run.directory), batch_layout(log.parent)
    if here != there:  # another regime: nothing to repeat
        return f"seed {run.seed}: not applicable (batch {here} here, {there} there)"
    here, there = model_digest(run), model_digest(Run(baseline, run.seed, log.parent))
    if here != there:  # another model (e.g. one built on another CPU type): nothing to repeat
        return f"seed {run.seed}: not applicable (model {here} here, {there} there)"
    old = parse_log(log.read_text())
    same = all(old.get(s, {}).get(k) == run.steps.get(s, {}).get(k)
               for s in range(1, steps + 1) for k in ("critic/score/mean", "igpo/turns_mean"))
    return f"seed {run.seed}: {'identical' if same else 'different'}"


def repeat_lines(folder: Path, runs: dict[str, list], steps: int, repeats_in: list[str] | None = None) -> list[str]:
    """Each run of a ``<name>_check`` comparison in ``folder`` (or of the comparisons ``repeats_in`` names: a run
    repeated in another clone, or on another machine, before its arm is reused there: the plan's amendments) against
    the run this summary uses at its method and seed: every metric the log has at steps 1-``steps`` but the
    ``VOLATILE`` ones must be equal."""
    lines = []
    found = (folder.glob("*_check/runs/*-s*") if repeats_in is None
             else (d for name in repeats_in for d in (folder / name / "runs").glob("*-s*")))
    for directory in sorted(found):
        method, _, seed = directory.name.rpartition("-s")
        check = Run(method, int(seed), directory)
        where = f"{method} seed {seed} repeated in `{directory.parent.parent.name}`"
        used = next((r for r in runs.get(method, []) if r.seed == int(seed)), None)
        if used is None or not load_finished(check, steps):
            why = "no run of that method and seed to compare against" if used is None else "not finished here"
            lines.append(f"- {where}: **not compared** ({why}).")
            continue
        models = model_digest(check), model_digest(used)
        if models[0] != models[1]:
            lines.append(f"- {where}: **not compared** (another model: {models[0]} there, {models[1]} in "
                         f"`{used.comparison}`).")
            continue
        differing = sorted({key for step in range(1, steps + 1)
                            for key in set(check.steps.get(step, {})) | set(used.steps.get(step, {}))
                            if not key.startswith(VOLATILE)
                            and check.steps.get(step, {}).get(key) != used.steps.get(step, {}).get(key)})
        verdict = ("**identical**" if not differing else
                   f"**different** in {len(differing)} metrics ({', '.join(differing[:6])})")
        lines.append(f"- {where} against `{used.comparison}`'s run (every metric at steps 1-{steps} but wall-clock "
                     f"timings, throughput, memory and the ETA): {verdict}.")
    return lines


def batch_layout(directory: Path) -> str | None:
    """The run's prompts x rollouts as the launcher's plan line printed it (``batch 16x4``)."""
    return console_value(directory, r"batch (\d+x\d+)")


def contrast_line(name: str, values: list[float], base: list[float], level: float | None = None) -> tuple:
    d = paired_difference(values, base)
    p = paired_t_p(values, base)
    sd = d.sd
    wide = None
    if level is not None:
        half = t_quantile(1 - level / 2, d.n - 1) * sd / math.sqrt(d.n)
        wide = (d.mean - half, d.mean + half)
    return d, p, wide


def gate_section(runs: dict[str, list], baseline: str, gate: str, steps: int) -> tuple[list[str], bool | None]:
    if gate not in runs or baseline not in runs:
        return ["## The gate", "", "No finished runs of both arms yet.", ""], None
    seeds = sorted({r.seed for r in runs[gate]} & {r.seed for r in runs[baseline]})
    g = [second_half_mean(next(r for r in runs[gate] if r.seed == s), PRIMARY, steps) for s in seeds]
    b = [second_half_mean(next(r for r in runs[baseline] if r.seed == s), PRIMARY, steps) for s in seeds]
    lines = [f"## The gate: {gate} − {baseline}, `{PRIMARY}` over steps {steps // 2 + 1}-{steps}", "",
             f"Seeds {', '.join(map(str, seeds))} ({len(seeds)} of the plan's 10).", "",
             "| seed | " + " | ".join(map(str, seeds)) + " |", "|---|" + "---|" * len(seeds),
             f"| {baseline} | " + " | ".join(fmt(v) for v in b) + " |",
             f"| {gate} | " + " | ".join(fmt(v) for v in g) + " |",
             "| difference | " + " | ".join(fmt(x - y, sign=True) for x, y in zip(g, b)) + " |", ""]
    if len(seeds) < 2:
        return lines + ["Too few paired seeds for an interval.", ""], None
    d, p, _ = contrast_line(gate, g, b)
    passed = d.t_low > 0
    lines += [f"- Difference {d.describe()}; paired t p = {p:.4f}; s_d = {d.sd:.4f}; detectable difference at this "
              f"s_d over {d.n} seeds (α 0.05, power 0.8): {detectable_difference(d.sd, d.n):.3f}.",
              f"- **The gate {'passes' if passed else 'does not pass'}** (the plan: the 95% paired t interval entirely "
              f"above 0){'' if len(seeds) == 10 else ' — provisional: the gate is read at 10 seeds'}.", ""]
    return lines, passed


def answer_hop_reach(turns: list[list], steps: int) -> dict[tuple[str, int], float]:
    """(method, seed) -> the share of its trajectories in steps ``steps // 2 + 1``..``steps`` that made the
    answer-revealing hop (a turn of kind ``answer_hop``), from the per-turn rows."""
    made: dict[tuple, set] = {}
    seen: dict[tuple, set] = {}
    for row in turns:
        if row[2] > steps // 2:
            seen.setdefault((row[0], row[1]), set()).add((row[2], row[3]))
            if row[6] == "answer_hop":
                made.setdefault((row[0], row[1]), set()).add((row[2], row[3]))
    return {key: len(made.get(key, ())) / len(trajectories) for key, trajectories in seen.items()}


def gate_family_section(runs: dict[str, list], baseline: str, arms: list[str], steps: int,
                        turns: list[list]) -> tuple[list[str], bool | None]:
    """Several gate arms (results/turn_credit2/plan.md): each − ``baseline`` on the primary measure, Holm across the
    arms; the gate passes when an arm's Holm-adjusted p is below 0.05 with a positive difference. Then the secondary
    measures the same way: the mean success over all steps (learning speed) and the share of trajectories reaching
    the answer-revealing hop over the second half."""
    arms = [a for a in arms if a in runs]
    if not arms or baseline not in runs:
        return ["## The gate", "", "No finished runs of the baseline and a gate arm yet.", ""], None
    reach = answer_hop_reach(turns, steps)
    measures = {
        f"`{PRIMARY}` over steps {steps // 2 + 1}-{steps} (primary)": lambda r: second_half_mean(r, PRIMARY, steps),
        f"`{PRIMARY}` over steps 1-{steps} (learning speed)":
            lambda r: statistics.fmean(r.steps[s][PRIMARY] for s in range(1, steps + 1) if PRIMARY in r.steps.get(s, {})),
        f"answer-revealing hop reached, steps {steps // 2 + 1}-{steps}": lambda r: reach.get((r.method, r.seed), math.nan),
    }
    lines = [f"## The gate: each of {', '.join(arms)} − {baseline}, Holm across {len(arms)}", ""]
    passed = None
    for title, value in measures.items():
        stats = {}
        for arm in arms:
            seeds = sorted({r.seed for r in runs[arm]} & {r.seed for r in runs[baseline]})
            if len(seeds) < 2:
                continue
            mine = [value(next(r for r in runs[arm] if r.seed == s)) for s in seeds]
            base = [value(next(r for r in runs[baseline] if r.seed == s)) for s in seeds]
            if not all(math.isfinite(v) for v in mine + base):
                continue
            stats[arm] = (seeds, mine, base, *contrast_line(arm, mine, base, 0.05 / len(arms)))
        lines += [f"### {title}", "", "| arm | seeds | mean (baseline's) | difference [95% t] | interval at α/m | p | "
                  "Holm p | s_d | detectable |", "|---|---|---|---|---|---|---|---|---|"]
        adjusted = holm({a: st[4] for a, st in stats.items()}) if stats else {}
        for arm, (seeds, mine, base, d, p, wide) in stats.items():
            lines.append(f"| {arm} | {len(seeds)} | {fmt(statistics.fmean(mine))} ({fmt(statistics.fmean(base))}) | "
                         f"{d.describe()} | [{fmt(wide[0], sign=True)}, {fmt(wide[1], sign=True)}] | {p:.4f} | "
                         f"{adjusted[arm]:.4f} | {d.sd:.4f} | {detectable_difference(d.sd, d.n):.3f} |")
        lines.append("")
        if passed is None and stats:
            winners = [a for a, st in stats.items() if adjusted[a] < 0.05 and st[3].mean > 0]
            complete = all(len(st[0]) == 10 for st in stats.values())
            passed = bool(winners)
            lines += [f"- **The gate {'passes' if passed else 'does not pass'}** (the plan: an arm's Holm-adjusted p "
                      f"below 0.05 with a positive difference){': ' + ', '.join(winners) if winners else ''}"
                      f"{'' if complete else ' — provisional: the gate is read at 10 seeds'}.", ""]
    return lines, passed


def rows_section(runs: dict[str, list], baseline: str, steps: int, family: tuple[str, ...] = FAMILY,
                 successors: tuple[str, ...] = SUCCESSORS, reference: str = "igpo") -> list[str]:
    family = [m for m in family if m in runs]
    if not family:
        return []

    def primary(method: str, seeds: list[int]) -> list[float]:
        return [second_half_mean(next(r for r in runs[method] if r.seed == s), PRIMARY, steps) for s in seeds]

    lines = [f"## The rows: each − {baseline}, Holm across {len(family)} contrasts", "",
             "Intervals: 95% paired t, and at the Bonferroni level of the family (α / m, the widest level Holm uses; "
             "conservative for every row but the smallest p).", "",
             "| row | seeds | mean | difference [95% t] | interval at α/m | p | Holm p |", "|---|---|---|---|---|---|---|"]
    stats = {}
    for method in family:
        seeds = sorted({r.seed for r in runs[method]} & {r.seed for r in runs[baseline]})
        if len(seeds) < 2:
            continue
        values, base = primary(method, seeds), primary(baseline, seeds)
        stats[method] = (seeds, values, *contrast_line(method, values, base, 0.05 / len(family)))
    adjusted = holm({m: s[3] for m, s in stats.items()}) if stats else {}
    for method, (seeds, values, d, p, wide) in stats.items():
        lines.append(f"| {method} | {len(seeds)} | {fmt(statistics.fmean(values))} | {d.describe()} | "
                     f"[{fmt(wide[0], sign=True)}, {fmt(wide[1], sign=True)}] | {p:.4f} | {adjusted[method]:.4f} |")
    successors = [m for m in successors if m in runs and reference in runs]
    if successors:
        lines += ["", f"Secondary: each successor − {reference}, Holm across {len(successors)}.", "",
                  f"| row | difference vs {reference} [95% t] | p | Holm p |", "|---|---|---|---|"]
        second = {}
        for method in successors:
            seeds = sorted({r.seed for r in runs[method]} & {r.seed for r in runs[reference]})
            if len(seeds) >= 2:
                second[method] = contrast_line(method, primary(method, seeds), primary(reference, seeds))
        adjusted = holm({m: s[1] for m, s in second.items()}) if second else {}
        for method, (d, p, _) in second.items():
            lines.append(f"| {method} | {d.describe()} | {p:.4f} | {adjusted[method]:.4f} |")
    return lines + [""]


def validation_section(runs: dict[str, list], baseline: str) -> tuple[list[str], dict]:
    lines = ["## Validation after training (key secondary): sampled, temperature 1, 8 samples per held-out question",
             "", "avg@8 exact match over the 64 held-out questions (`val-core/all/em`); pass@8 per question type "
             "where verl logs it (`best@8`); before training: the baseline's figure (every arm's at its seed).", "",
             "| method | seeds | avg@8 EM after (mean [95% t]) | − baseline [95% paired t] | pass@8 2-hop / 3-hop |",
             "|---|---|---|---|---|"]
    after = {m: {r.seed: val_metrics(r) for r in group} for m, group in runs.items()}
    before = [r.steps.get(0, {}).get("val-core/all/em", math.nan) for r in runs.get(baseline, [])]
    for method, by_seed in after.items():
        em = {s: v.get("val-core/all/em", math.nan) for s, v in by_seed.items()}
        finite = [v for v in em.values() if math.isfinite(v)]
        if not finite:
            continue
        mean, low, high = mean_interval(finite)
        versus = "(the baseline)"
        if method != baseline and baseline in after:
            seeds = [s for s in em if s in after[baseline]]
            base = [after[baseline][s].get("val-core/all/em", math.nan) for s in seeds]
            versus = (paired_difference([em[s] for s in seeds], base).describe() if len(seeds) >= 2 else "-")
        passes = []
        for source in ("demo_world_mentor2", "demo_world_mentor3"):
            values = [v[f"val-core/{source}/em/best@8/mean"] for v in by_seed.values()
                      if f"val-core/{source}/em/best@8/mean" in v]
            passes.append(fmt(statistics.fmean(values)) if values else "-")
        lines.append(f"| {method} | {len(finite)} | {mean:.3f} [{low:.3f}, {high:.3f}] | {versus} | "
                     f"{' / '.join(passes)} |")
    if any(math.isfinite(v) for v in before):
        lines.append(f"| before training | {len(before)} | {statistics.fmean(before):.3f} | | |")
    return lines + [""], after


def turn_section(turns: list[list]) -> list[str]:
    if not turns:
        return ["## What the turns did", "", "No trajectory logs.", ""]
    lines = ["## What the turns did (every training step and seed)", "",
             "Per method and question type: turns of each kind per trajectory, the mean applied advantage over the "
             "turn's tokens, and the mean turn reward where the method logs one (the oracle's hop reward; the "
             "information gain of IGPO and IG-Search; TIPS's shaping reward). Kinds: igpo/eval/turn_kinds.py.", "",
             "| method | hops | trajectories | " + " | ".join(KINDS) + " |", "|---|---|---|" + "---|" * len(KINDS)]
    groups: dict[tuple, list[list]] = {}
    for row in turns:
        groups.setdefault((row[0], row[4]), []).append(row)
    for (method, hops), rows in sorted(groups.items()):
        trajectories = len({(r[1], r[2], r[3]) for r in rows})
        cells = []
        for kind in KINDS:
            picked = [r for r in rows if r[6] == kind]
            if not picked:
                cells.append("0")
                continue
            adv = [r[7] for r in picked if math.isfinite(r[7])]
            reward = [r[8] for r in picked if math.isfinite(r[8])]
            cell = f"{len(picked) / trajectories:.2f}; A {fmt(statistics.fmean(adv), 2, True) if adv else '-'}"
            if reward:
                cell += f"; r {fmt(statistics.fmean(reward), 2, True)}"
            cells.append(cell)
        lines.append(f"| {method} | {hops} | {trajectories} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=ROOT / "results" / "turn_credit")
    parser.add_argument("--comparisons", default=None,
                        help="comma-separated sub-folders (default: every one with a runs/ folder, gates first)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--baseline", default="grpo")
    parser.add_argument("--gate", default="oracle",
                        help="the gate's arm, or several comma-separated (each − the baseline, Holm across them)")
    parser.add_argument("--family", default=",".join(FAMILY),
                        help="the rows: each − the baseline, Holm across them (comma-separated)")
    parser.add_argument("--successors", default=",".join(SUCCESSORS),
                        help="the rows compared with --reference as well, Holm across them (comma-separated)")
    parser.add_argument("--reference", default="igpo", help="the rows' second baseline")
    parser.add_argument("--step1-band", default="0.05,0.15", metavar="LOW,HIGH",
                        help="the plan's band for the baseline's mean step-1 success (calibration check)")
    parser.add_argument("--title", default="Turn-level credit on the chain task: the oracle gate and the rows (issue 61)")
    parser.add_argument("--repeats", default=None, metavar="NAMES",
                        help="comma-separated sub-folders holding runs repeated elsewhere, checked against the runs "
                             "used (default: every <name>_check folder)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where summary.md and the tables and plots go (default: --folder)")
    parser.add_argument("--expected-model", default=EXPECTED_MODEL, metavar="SHA256_16",
                        help=f"the model digest every run must print (default {EXPECTED_MODEL}, the plan's)")
    args = parser.parse_args()
    if args.comparisons:
        comparisons = [c.strip() for c in args.comparisons.split(",") if c.strip()]
    else:
        comparisons = sorted((p.name for p in args.folder.iterdir() if (p / "runs").is_dir()),
                             key=lambda name: (not name.startswith("gate"), name))
    missing = [c for c in comparisons if not (args.folder / c / "runs").is_dir()]
    if missing or not comparisons:
        parser.error(f"--comparisons: no runs/ folder under {args.folder} for {missing or 'any comparison'}")
    runs, notes = load_runs(args.folder, comparisons, args.steps)
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    if not runs:
        parser.error(f"no finished run under {args.folder} ({'; '.join(notes) or 'nothing found'})")

    turns = [row for group in runs.values() for r in group for row in run_turns(r)]
    write_turns(out / "turns.csv.gz", turns)
    with (out / "steps.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "seed", "step", "primary", "train_score", "tool_calls_per_trajectory",
                         "reach1", "reach2", "reach3"])
        for method, group in runs.items():
            for run in group:
                for step, m in sorted(run.steps.items()):
                    if step < 1:
                        continue
                    cells = [m.get(PRIMARY), m.get("critic/score/mean"), tool_calls_per_trajectory(m),
                             m.get("hop/reach1"), m.get("hop/reach2"), m.get("hop/reach3")]
                    writer.writerow([method, run.seed, step] + [fmt(c, 4) for c in cells])

    gates = [g.strip() for g in args.gate.split(",") if g.strip()]
    if len(gates) == 1:
        gate_lines, _ = gate_section(runs, args.baseline, gates[0], args.steps)
    else:
        gate_lines, _ = gate_family_section(runs, args.baseline, gates, args.steps, turns)
    val_lines, after = validation_section(runs, args.baseline)
    with (out / "paired.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "seed", "primary", f"{args.baseline}_primary", "difference", "val_em_after"])
        base = {r.seed: second_half_mean(r, PRIMARY, args.steps) for r in runs.get(args.baseline, [])}
        for method, group in runs.items():
            for run in group:
                value = second_half_mean(run, PRIMARY, args.steps)
                b = base.get(run.seed, math.nan)
                writer.writerow([method, run.seed, fmt(value, 4), fmt(b, 4), fmt(value - b, 4, True),
                                 fmt(after[method][run.seed].get("val-core/all/em", math.nan), 4)])
    bands = {method: step_band(group, PRIMARY) for method, group in runs.items() if len(group) >= 2}
    if bands:
        counts = {len(g) for g in runs.values()}
        seeds = (f"{counts.pop()} seeds each" if len(counts) == 1
                 else ", ".join(f"{m} {len(g)} seeds" for m, g in runs.items()))
        plot_bands(out / "train_success.png", bands, PRIMARY, f"chain task, {seeds}")
    _plot_validation(out / "val_em.png", runs, after, args.baseline)

    commits = sorted({(r.directory.parent.parent / "commit.txt").read_text().strip()
                      for g in runs.values() for r in g if (r.directory.parent.parent / "commit.txt").is_file()})
    every = [r for group in runs.values() for r in group]
    wall = comparison_wall_s(every)
    lines = [f"# {args.title}", "",
             "Written by `scripts/experiments/summarize_turn_credit.py` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
             f"from {', '.join(comparisons)} (plan: plan.md; runs' commit: {', '.join(commits) or 'see the plan'}). "
             f"Runs: " + ", ".join(f"{m} {len(g)}" for m, g in runs.items()) + f"; wall time {wall / 3600:.2f} h "
             f"(union of the runs' intervals); mean wall time a run: "
             + ", ".join(f"{m} {statistics.fmean(r.wall_s for r in g):.0f} s" for m, g in runs.items()) + ".", ""]
    if notes:
        lines += ["Skipped: " + "; ".join(notes) + ".", ""]
    repeats_in = [c.strip() for c in args.repeats.split(",") if c.strip()] if args.repeats is not None else None
    band = tuple(float(v) for v in args.step1_band.split(","))
    lines += checks(runs, args.baseline, args.gate, args.steps, args.folder, args.expected_model,
                    repeats_in, band) + gate_lines
    family = tuple(m.strip() for m in args.family.split(",") if m.strip())
    successors = tuple(m.strip() for m in args.successors.split(",") if m.strip())
    lines += rows_section(runs, args.baseline, args.steps, family, successors, args.reference) + val_lines
    lines += turn_section(turns)
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _plot_validation(path: Path, runs: dict[str, list], after: dict, baseline: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = []
    if baseline in runs:
        before = [r.steps.get(0, {}).get("val-core/all/em", math.nan) for r in runs[baseline]]
        labels.append(("before", before))
    labels += [(m, [after[m][r.seed].get("val-core/all/em", math.nan) for r in g]) for m, g in runs.items()]
    for x, (label, values) in enumerate(labels):
        finite = [v for v in values if math.isfinite(v)]
        ax.scatter([x] * len(finite), finite, alpha=0.6)
        if len(finite) >= 2:
            mean, low, high = mean_interval(finite)
            ax.errorbar([x + 0.15], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color="black", capsize=4)
    ax.set_xticks(range(len(labels)), [label for label, _ in labels], rotation=20, ha="right")
    ax.set_ylabel("validation avg@8 exact match\n(dots: seeds; bar: 95% t)")
    ax.set_title("chain task, held-out questions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
