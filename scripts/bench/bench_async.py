"""Benchmark the trainer modes under web-like tool latency: wall-clock per 1,000 trained trajectories of the CPU demo
in ``igpo_sync``, ``igpo_colocate_async`` and ``igpo_separate_async``, the same seed, the same tool server latency,
one run of this script.

    python scripts/bench/bench_async.py [--steps 8] [--seed 1] [--latency search=1:10] [--out results/async/<file>.md]

Each mode is one ``bash train_igpo.sh`` (the CPU demo: IGPO, 16 questions x 4 samples a step, validation off) whose
tool server adds a seeded log-normal delay to every call (``--latency``, docs/guide/tool_server.md): the demo's
local BM25 index answers in milliseconds, web search in seconds. Read from each run's train.log, per step:
``timing_s/step`` (a step's wall clock: waiting for the batch, scoring, log-probs, update, weight sync),
``timing_s/gen`` (the part spent waiting for the batch), the trained trajectories (the batch: prompts x samples),
verl's off-policy figures (``training/off_policy/trajectory_spans``: weight versions a trajectory spanned;
``trajectory_staleness_worst``: versions between its oldest weights and the update) and
``igpo/partial_trajectory_share`` (trajectories resumed on new weights). Start-up (Ray, model loading) is not in a
step and not counted; step 1 of the asynchronous mode includes dispatching its warm-up batch.

Wall-clock per 1,000 trained trajectories = 1,000 x sum of step times / trajectories trained, over all steps and over
steps 2.. (the steady state). The figure on the last line is the ratio of ``igpo_sync``'s figure to the better
asynchronous mode's (steady state): > 1 means that mode trains a trajectory in less wall time. On the CPU,
``igpo_separate_async`` gives the rollout a pool of its own on the same two cores (the launch plan's layout), so its
figure measures the schedule, not extra hardware.

Checked in the same run (exit 1 otherwise): every run exits 0, train every step with information gain
(``igpo/ig_active_ratio`` > 0 each step) and the synchronous run never spans two weight versions.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = ("igpo_sync", "igpo_colocate_async", "igpo_separate_async")
NUMBER = r"(?:np\.(?:float|int)\d+\()?(-?[0-9.eE+-]+|nan)\)?"


def step_metrics(log: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} from verl's console lines ``step:<n> - key:value - ...``."""
    steps: dict[int, dict[str, float]] = {}
    for step, rest in re.findall(r"step:(\d+) - (.*)", log):
        values = steps.setdefault(int(step), {})
        for key, value in re.findall(rf"([\w/@.\-]+):{NUMBER}(?: - |$)", rest):
            try:
                values[key] = float(value)
            except ValueError:
                continue
    return steps


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    out_dir = workdir / mode
    env = {**os.environ, "OUTPUT_DIR": str(out_dir), "IGPO_DEVICE": "cpu",
           "TOOL_SERVER_ARGS": " ".join(f"--latency {spec}" for spec in args.latency) + f" --latency-seed {args.seed}"}
    env.pop("TOOL_SERVER_URL", None)
    command = ["bash", "train_igpo.sh", f"seed={args.seed}", f"trainer.total_training_steps={args.steps}",
               f"trainer.v1.trainer_mode={mode}", "trainer.val_before_train=false", "trainer.test_freq=-1",
               f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
               f"actor_rollout_ref.rollout.n={args.samples}"]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - started
    log_path = out_dir / "train.log"
    log = log_path.read_text() if log_path.is_file() else ""
    steps = {s: m for s, m in step_metrics(log).items() if s >= 1 and "timing_s/step" in m}
    return {"mode": mode, "rc": proc.returncode, "tail": proc.stdout[-3000:], "wall": wall, "steps": steps}


def per_thousand(steps: dict[int, dict[str, float]], trajectories: int, first: int) -> float:
    chosen = [m["timing_s/step"] for s, m in sorted(steps.items()) if s >= first]
    return 1000.0 * sum(chosen) / (trajectories * len(chosen)) if chosen else float("nan")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def report(runs: list[dict], args: argparse.Namespace) -> tuple[str, float, list[str]]:
    trajectories = args.prompts * args.samples
    problems = []
    lines = [f"Trainer modes under tool latency {', '.join(args.latency)} (log-normal p50:p99 seconds, seed "
             f"{args.seed}), CPU demo IGPO {args.prompts} x {args.samples} a step, {args.steps} steps, seed {args.seed}; "
             f"machine: {os.cpu_count()} cores.", "",
             "| mode | s per 1,000 trajectories (all steps) | (steps 2..) | mean step s | mean wait for batch s | "
             "versions spanned mean / max | partial share | staleness worst max | run wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    figures = {}
    for run in runs:
        steps = run["steps"]
        if run["rc"] != 0 or len(steps) != args.steps:
            problems.append(f"{run['mode']}: exit {run['rc']}, {len(steps)} of {args.steps} steps\n{run['tail']}")
            continue
        if not all(m.get("igpo/ig_active_ratio", 0) > 0 for m in steps.values()):
            problems.append(f"{run['mode']}: a step without information gain")
        spans = [m.get("training/off_policy/trajectory_spans/mean", float("nan")) for m in steps.values()]
        span_max = max(m.get("training/off_policy/trajectory_spans/max", float("nan")) for m in steps.values())
        if run["mode"] == "igpo_sync" and span_max > 1:
            problems.append("igpo_sync: a trajectory spanned two weight versions")
        figures[run["mode"]] = per_thousand(steps, trajectories, 2)
        lines.append(
            f"| {run['mode']} | {per_thousand(steps, trajectories, 1):.1f} | {figures[run['mode']]:.1f} | "
            f"{mean([m['timing_s/step'] for m in steps.values()]):.2f} | "
            f"{mean([m.get('timing_s/gen', float('nan')) for m in steps.values()]):.2f} | "
            f"{mean(spans):.3f} / {span_max:.0f} | "
            f"{mean([m.get('igpo/partial_trajectory_share', float('nan')) for m in steps.values()]):.3f} | "
            f"{max(m.get('training/off_policy/trajectory_staleness_worst/max', float('nan')) for m in steps.values()):.0f}"
            f" | {run['wall']:.0f} |")
    lines += ["", "Per step (s): " + "; ".join(
        f"{run['mode']}: " + ", ".join(f"{m['timing_s/step']:.1f}" for _, m in sorted(run["steps"].items()))
        for run in runs)]
    ratios = {mode: figures.get("igpo_sync", float("nan")) / value for mode, value in figures.items()
              if mode != "igpo_sync"}
    lines += ["", "igpo_sync / mode (s per 1,000 trajectories, steps 2..): " +
              ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in ratios.items())]
    best = max(ratios, key=lambda mode: ratios[mode]) if ratios else "none"
    return "\n".join(lines), best, ratios.get(best, float("nan")), problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--latency", action="append", default=None,
                        help="TOOL=P50:P99 seconds, repeatable (default: search=1:10, visit=3:30)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args()
    args.latency = args.latency or ["search=1:10", "visit=3:30"]
    with tempfile.TemporaryDirectory(prefix="igpo-bench-async-") as tmp:
        runs = [run_mode(mode, args, Path(tmp)) for mode in MODES]
    table, best, ratio, problems = report(runs, args)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    print(f"igpo_sync / {best} (the better asynchronous mode) wall-clock per 1,000 trained trajectories "
          f"(steps 2..): {ratio:.2f}x")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
