"""Compare the credit methods on the CPU demo: GRPO (outcome only) vs IGPO vs InfoPO vs GiGPO vs ARPO, same agent
loop, same budget, several seeds each; writes ``results/cpu_compare/``.

Every run is ``bash train_igpo.sh`` on the CPU demo (verl's trainer, our agent loop, the tool server over HTTP, the
F1 reward) with validation before the first step and every ``--val-every`` steps. Methods differ only in their
overrides (``METHODS``, in ``arms.py``); the budget (steps, prompts per step, rollouts per prompt) is the same for
all. ARPO runs with GRPO's advantage over its branched groups, so ARPO vs GRPO is "branching at equal trajectory
budget". This file is the command line; one run's execution and log parsing are in ``comparison_runs.py``, the
outputs below in ``comparison_report.py``.

Outputs (``--out``, default ``results/cpu_compare``):
    steps.csv     one row per (method, seed, step): train score, validation F1 (where validated), tool calls per
                  trajectory, step time
    val_f1.png    validation F1 vs step: the mean over seeds per method, with the min..max spread shaded
    summary.md    the settings, commit, data hash, per-method table (val F1 before / after as mean +- std over seeds,
                  tool calls per trajectory, wall time), the whole comparison's wall time, the first step at which
                  each method's mean validation F1 reaches ``--target`` (with each seed's first step and the final
                  F1's min-max), the share of single-outcome groups per step (no GRPO signal), the information gain
                  of the k-th tool call pooled over steps and seeds (methods that log it: IGPO's), and the
                  sample-efficiency line (steps for IGPO's mean curve
                  to reach GRPO's final mean validation F1, or that it does not get there)
    paired.csv    one row per (method, seed): the primary measure (``--primary``, default on-policy training success
                  ``outcome/success_share``, averaged over the second half of the run's steps), the baseline's at the
                  same seed, and their difference
    train_success.png  the primary metric per step: the mean over seeds per method, with the 95% t interval shaded
    runs/<method>-s<seed>/   each run's train.log and tool-server log; with --checkpoint-every also model/, the trained
                  policy in float32 for python -m igpo.evaluate --model-path (checkpoints are deleted when it finishes)

The summary opens with the primary measure: each method's per-seed values, and its paired difference against
``--baseline`` (GRPO) with a 95% paired t interval and a bootstrap interval beside it (``igpo/eval/paired.py``); then the
per-hop reach and the k-th call split by correct and wrong hop where the task names its chains (``hop/*``), and
information gain by hop split the same way.

Usage:
    python scripts/experiments/compare_methods.py              # every arm, seeds 0 1 2, 20 steps, val every 10
    python scripts/experiments/compare_methods.py --methods grpo,igpo --seeds 0,1,2,3 --steps 10 \
        -- data.train_batch_size=8
    python scripts/experiments/compare_methods.py --val-samples 4 --val-temperature 1.0 ...   # sampled, avg@4
Everything after ``--`` is passed to every run (Hydra overrides). A failed run stops the script with its log tail;
``--resume`` keeps finished runs (a run directory with a parsed final step) and runs only the missing ones.
``--checkpoint-every K`` saves every run's state every K steps; ``--resume`` then continues a stopped run from its
newest checkpoint whose step it logged (``resume_point``; the steps after it are trained again) instead of starting it
over: runs longer than a sitting finish over several. A run started over begins in an empty directory.
``--jobs 2`` runs two at a time (each run's torch work is single-threaded, the rest is mostly serial Python and
process start-up): about 1.35x the throughput on 2 cores, the same results (every training metric of a run at a seed is
identical alone or beside another); the wall time reported is the union of the runs' intervals.
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from arms import METHODS
from comparison_report import PRIMARY, write_outputs
from comparison_runs import Run, load_finished, resume_point, run_one, validation_overrides

ROOT = Path(__file__).resolve().parents[2]


def _trajectories_per_step(extra: list[str]) -> int:
    """Prompts per step x rollouts per prompt: the CPU demo's configuration, with any override of the two applied."""
    from omegaconf import OmegaConf

    demo = OmegaConf.load(ROOT / "configs" / "cpu_demo.yaml")
    values = {"data.train_batch_size": demo.data.train_batch_size,
              "actor_rollout_ref.rollout.n": demo.actor_rollout_ref.rollout.n}
    for override in extra:
        key, _, value = override.partition("=")
        if key in values:
            values[key] = int(value)
    return int(values["data.train_batch_size"]) * int(values["actor_rollout_ref.rollout.n"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated integers (>= 3 for a reported figure)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (the same for every method)")
    parser.add_argument("--val-every", type=int, default=10, help="validation every N steps (and before step 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu_compare",
                        help="the comparison's folder: runs/<method>-s<seed>/ and the outputs "
                             "(default results/cpu_compare)")
    parser.add_argument("--resume", action="store_true",
                        help="keep finished runs in --out/runs, run the rest (with --checkpoint-every: a stopped run "
                             "continues from its newest usable checkpoint)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="save each run's state every K steps (the last two checkpoints, deleted when the run "
                             "finishes), so that --resume continues a stopped run; 0 (default): no checkpoints")
    parser.add_argument("--target", type=float, default=0.25,
                        help="the summary's primary figure: the first step at which each method's mean validation F1 "
                             "reaches this")
    parser.add_argument("--primary", default=PRIMARY,
                        help="the summary's primary measure: this training metric averaged over the second half of "
                             "each run, paired by seed against --baseline")
    parser.add_argument("--baseline", default="grpo", help="the method the paired differences are taken against")
    parser.add_argument("--val-samples", type=int, default=1,
                        help="samples per held-out question at validation (verl's val_kwargs.n; the figure is avg@N)")
    parser.add_argument("--val-temperature", type=float, default=0.0,
                        help="validation temperature (0: greedy, verl's default; 1.0: the policy as it samples)")
    parser.add_argument("--timeout", type=float, default=7200.0,
                        help="seconds per run before it is killed (a 12-step chain run takes ~15 min on two quiet "
                             "cores and over 30 min beside other work; a run killed after its last step is lost)")
    parser.add_argument("--jobs", type=int, default=1, choices=(1, 2),
                        help="runs at a time: 2 overlaps one run's start-up and serial Python with the other's work "
                             "(each run's torch work is single-threaded on the CPU demo)")
    parser.add_argument("--val-before", default="all", choices=("all", "baseline", "none"),
                        help="which runs validate before step 1: every run, the baseline's only (before training "
                             "every method at a seed has the same model and the same seeded samples, so the others "
                             "would repeat it), or none (the initial model validated once, apart)")
    parser.add_argument("--trajectories", action="store_true",
                        help="keep every run's trajectory log (trainer.trajectory_dir) in its run directory")
    parser.add_argument("--validation-dumps", action="store_true",
                        help="keep verl's validation generations with their per-question scores "
                             "(trainer.validation_data_dir) in every run's directory")
    parser.add_argument("extra", nargs="*", help="Hydra overrides for every run, after --")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        parser.error(f"--methods {args.methods!r}: unknown {unknown}; choose from {', '.join(METHODS)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    if args.steps < 1 or args.val_every < 1:
        parser.error("--steps and --val-every must be >= 1")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every {args.checkpoint_every}: give a number of steps, or 0 for no checkpoints")
    try:  # checked before an hour of runs, not at the plot
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("matplotlib is not installed in this Python; run the script with .venv/bin/python (created by "
                     "bash scripts/test.sh or train_igpo.sh) or pip install matplotlib")
    try:
        args.extra = validation_overrides(args.val_samples, args.val_temperature) + args.extra
    except ValueError as error:
        parser.error(f"--val-samples/--val-temperature: {error}")
    trajectories = _trajectories_per_step(args.extra)

    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Run]] = {m: [Run(m, s, args.out / "runs" / f"{m}-s{s}") for s in args.seeds]
                                  for m in methods}
    # Seed by seed (every method at seed 0, then at seed 1, ...): a comparison stopped part-way still holds paired
    # seeds for every method, and --resume completes it. --jobs 2 runs the queue two at a time, in the same order.
    queue = []
    for seed_index in range(len(args.seeds)):
        for method in methods:
            run = runs[method][seed_index]
            if args.resume and load_finished(run, args.steps):
                print(f"compare: {method} seed {run.seed}: kept ({run.wall_s:.0f} s)", flush=True)
                continue
            step = resume_point(run.directory) if args.resume and args.checkpoint_every else 0
            if step:
                print(f"compare: {method} seed {run.seed}: continues from its checkpoint of step {step}", flush=True)
            queue.append(run)

    def run_and_report(run: Run) -> None:
        run_one(run, args.steps, args.val_every, args.extra, args.timeout,
                val_before=args.val_before == "all" or (args.val_before == "baseline" and run.method == args.baseline),
                trajectories=args.trajectories,
                validation_dumps=args.validation_dumps, checkpoint_every=args.checkpoint_every, resume=args.resume)
        final = run.steps[args.steps].get("val-core/all/f1", math.nan)
        print(f"compare: {run.method} seed {run.seed}: {run.wall_s:.0f} s, final validation F1 {final:.3f}", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pending = [pool.submit(run_and_report, run) for run in queue]
        for future in pending:  # in queue order; a failure stops the runs not yet started, finished ones are kept
            try:
                future.result()
            except BaseException:
                for other in pending:
                    other.cancel()
                raise
    print(write_outputs(args.out, runs, args, trajectories), end="")


if __name__ == "__main__":
    main()
