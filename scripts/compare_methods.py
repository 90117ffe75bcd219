"""Compare the credit methods on the CPU demo: GRPO (outcome only) vs IGPO vs InfoPO vs GiGPO vs ARPO, same agent
loop, same budget, several seeds each; writes ``results/cpu_compare/``.

Every run is ``bash train_igpo.sh`` on the CPU demo (verl's trainer, our agent loop, the tool server over HTTP, the
F1 reward) with validation before the first step and every ``--val-every`` steps. Methods differ only in their
overrides (``METHODS``); the budget (steps, prompts per step, rollouts per prompt) is the same for all. ARPO runs
with GRPO's advantage over its branched groups, so ARPO vs GRPO is "branching at equal trajectory budget".

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
                  policy in float32 for scripts/evaluate.py --model-path (checkpoints are deleted when it finishes)

The summary opens with the primary measure: each method's per-seed values, and its paired difference against
``--baseline`` (GRPO) with a 95% paired t interval and a bootstrap interval beside it (``igpo/eval/paired.py``); then the
per-hop reach and the k-th call split by correct and wrong hop where the task names its chains (``hop/*``), and
information gain by hop split the same way.

Usage:
    python scripts/compare_methods.py                      # grpo igpo infopo arpo, seeds 0 1 2, 20 steps, val every 10
    python scripts/compare_methods.py --methods grpo,igpo --seeds 0,1,2,3 --steps 10 -- data.train_batch_size=8
    python scripts/compare_methods.py --val-samples 4 --val-temperature 1.0 ...   # sampled validation, avg@4
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
import csv
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from igpo.eval.export import export_actor
from igpo.eval.paired import mean_interval, paired_difference

ROOT = Path(__file__).resolve().parent.parent

# What makes each method; everything else is the CPU demo's configuration (configs/cpu_demo.yaml).
METHODS: dict[str, list[str]] = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "igpo": ["algorithm.adv_estimator=igpo"],
    "infopo": ["algorithm.adv_estimator=infopo"],
    "gigpo": ["algorithm.adv_estimator=gigpo"],
    "arpo": ["algorithm.adv_estimator=grpo", "algorithm.arpo.enabled=true"],
    "igpo_arpo": ["algorithm.adv_estimator=igpo", "algorithm.arpo.enabled=true"],
    # IGPO with telescoped chain credit: raw rewards discounted into per-boundary returns with gamma = 1, then
    # z-scored (norm_order=after_discount), so every hop of a chain that reaches the answer shares the chain's gain
    # (docs/methods/igpo.md, the normalisation order).
    "igpo_telescoped": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_order=after_discount",
                        "algorithm.gamma=1.0"],
    # IGPO whose baseline does not depend on how many turns follow (verl RFC #7244's bias): the discounted returns are
    # z-scored once per turn index, nothing normalised is summed afterwards (docs/methods/igpo.md, "Normalising per
    # turn index").
    "igpo_turnnorm": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_order=after_discount",
                      "algorithm.igpo.norm_group=group_turn"],
    # The positive control: the demo world's hops as turn reward in IGPO's pipeline (docs/methods/oracle.md).
    "oracle": ["algorithm.adv_estimator=oracle"],
    # An exploratory variant of the positive control (not in results/turn_credit/plan.md's gate): the hop rewards
    # discounted into returns with the outcome before the z-score, so the outcome stays in every turn's return.
    "oracle_after_discount": ["algorithm.adv_estimator=oracle", "algorithm.igpo.norm_order=after_discount"],
    # Information gain against a random document in the result's place (docs/methods/ig_search.md).
    "ig_search": ["algorithm.adv_estimator=ig_search"],
    # Potential-based shaping with the frozen reference policy as teacher (docs/methods/tips.md; needs the KL loss on,
    # as configs/igpo_base.yaml has it).
    "tips": ["algorithm.adv_estimator=tips"],
}
PRIMARY = "outcome/success_share"
STEP_LINE = re.compile(r"step:(\d+) - (.*)")
# The line a continued run's logs carry where a new segment begins: its steps after the checkpoint replace the earlier
# segment's (trained again from the checkpoint's state).
RESUMED = "compare_methods: resumed from the checkpoint of step {}"
RESUMED_LINE = re.compile(r"^compare_methods: resumed from the checkpoint of step (\d+)$")
# The files every launch writes afresh; a continued run keeps the earlier segments' text in front of the new one's.
SEGMENTED = ("train.log", "console.log", "tool_server.log")
METRIC = re.compile(r"([A-Za-z0-9_@/\-.]+):(-?[0-9.]+(?:[eE][-+]?[0-9]+)?|nan|inf)")


@dataclass
class Run:
    method: str
    seed: int
    directory: Path
    wall_s: float = math.nan
    # (start, end) in wall-clock seconds since the epoch of each of the run's segments (one, or one per launch of a run
    # continued from its checkpoints): the comparison's wall time is the union of every run's intervals (runs overlap
    # under --jobs 2; a --resume spans sessions). Empty for a run kept from before they were recorded.
    intervals: list[tuple[float, float]] = field(default_factory=list)
    steps: dict[int, dict[str, float]] = field(default_factory=dict)


def parse_log(text: str) -> dict[int, dict[str, float]]:
    """Metrics per global step from verl's console lines (``step:N - key:value - key:value ...``); a step's
    validation line and training line are merged. In the log of a continued run (``RESUMED`` lines), the steps an
    earlier segment logged after the checkpoint the next one resumed from are dropped: the next segment trains them
    again."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        resumed = RESUMED_LINE.match(line)
        if resumed:
            steps = {step: metrics for step, metrics in steps.items() if step <= int(resumed.group(1))}
            continue
        match = STEP_LINE.search(line)
        if match:
            metrics = steps.setdefault(int(match.group(1)), {})
            metrics.update((k, float(v)) for k, v in METRIC.findall(match.group(2)))
    return steps


def console_value(directory: Path, pattern: str) -> str | None:
    """The first group of ``pattern`` in what the launcher printed into the run's console.log (None without one)."""
    console = directory / "console.log"
    found = re.search(pattern, console.read_text()) if console.is_file() else None
    return found.group(1) if found else None


def model_digest(run: Run) -> str | None:
    """The demo model's digest the launcher printed (``demo model sha256 <16 hex>``)."""
    return console_value(run.directory, r"demo model sha256 ([0-9a-f]{16})")


def tool_calls_per_trajectory(metrics: dict[str, float]) -> float:
    """Tool turns per training trajectory: assistant turns minus the answer turn (``igpo/turns_mean`` - 1), the same
    measure for every method (the tool server's ``tools/calls`` also counts the validation rollouts)."""
    turns = metrics.get("igpo/turns_mean")
    return turns - 1.0 if turns is not None else math.nan


def validation_overrides(samples: int, temperature: float) -> list[str]:
    """verl's validation sampling: ``samples`` per held-out question at ``temperature`` (0: greedy, verl's default;
    the trainer's ``val-core/all/*`` is then the avg@samples)."""
    if samples < 1 or temperature < 0:
        raise ValueError(f"validation: {samples} samples at temperature {temperature}; give samples >= 1 and a "
                         "temperature >= 0")
    if samples == 1 and temperature == 0:
        return []
    return [f"actor_rollout_ref.rollout.val_kwargs.n={samples}",
            f"actor_rollout_ref.rollout.val_kwargs.temperature={temperature}",
            f"actor_rollout_ref.rollout.val_kwargs.do_sample={'true' if temperature > 0 else 'false'}"]


class PeakMemory:
    """The peak resident memory of one run's process tree (the launcher, Ray and its workers, the tool server),
    sampled every ``every_s`` seconds while the block runs: the sum of the processes' RSS, so pages two processes
    share count twice (an upper bound). The run's root is this process's child whose environment names the run's
    ``OUTPUT_DIR``, which tells two runs of ``--jobs 2`` apart. Whenever the peak rises it is written to the run's
    ``peak_rss_mb.txt``, at least what an earlier segment of the run wrote there: a run stopped from outside keeps the
    peak it reached."""

    def __init__(self, directory: Path, every_s: float = 2.0):
        self.directory, self.every_s, self.peak_bytes = str(directory), every_s, 0
        self.path = directory / "peak_rss_mb.txt"
        self.earlier_mb = float(self.path.read_text()) if self.path.is_file() else 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _root(self):
        import psutil

        for child in psutil.Process().children():
            try:
                if child.environ().get("OUTPUT_DIR") == self.directory:
                    return child
            except psutil.Error:
                continue
        return None

    def _sample(self) -> None:
        import psutil

        root = None
        while not self._stop.wait(self.every_s):
            root = root if root is not None and root.is_running() else self._root()
            if root is None:
                continue
            total = 0
            try:
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in processes:
                try:
                    total += process.memory_info().rss
                except psutil.Error:
                    pass
            if total > self.peak_bytes:
                self.peak_bytes = total
                if self.path.parent.is_dir() and total / 2**20 > self.earlier_mb:
                    self.path.write_text(f"{total / 2**20:.0f}\n")


def resume_point(directory: Path) -> int:
    """The step a stopped run continues from (0: none): its newest checkpoint that is complete (verl's actor files and
    our state file, at or before verl's pointer ``latest_checkpointed_iteration.txt``, which moves only after a save
    finished) and whose step the log shows finished. verl saves a step's checkpoint before it validates and logs the
    step, so a run stopped in between (a validation takes minutes) continues from the checkpoint before (runs keep
    two) and trains that step again, rather than lose its metrics and validation."""
    folder = directory / "checkpoints"
    pointer = folder / "latest_checkpointed_iteration.txt"
    if not pointer.is_file():
        return 0
    newest = int(pointer.read_text().strip())
    logs = [directory / "train.log.earlier", directory / "train.log"]
    logged = parse_log("".join(log.read_text() for log in logs if log.is_file()))
    complete = []
    for step_folder in folder.iterdir():
        named = re.fullmatch(r"global_step_(\d+)", step_folder.name)
        if named and int(named.group(1)) <= newest and (step_folder / "actor").is_dir() and (
                step_folder / "igpo_state.json").is_file():
            complete.append(int(named.group(1)))
    return next((step for step in sorted(complete, reverse=True) if "timing_s/step" in logged.get(step, {})), 0)


def read_intervals(directory: Path) -> list[tuple[float, float]]:
    """The run's segments from ``interval.txt`` (a line "start end" each); a line with only its start is a segment
    that was stopped from outside (the session ended, the machine went down): it is closed at its train.log's last
    write, the last thing it did."""
    path = directory / "interval.txt"
    intervals = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        values = [float(v) for v in line.split()]
        if len(values) == 1:
            log = directory / "train.log"
            values.append(log.stat().st_mtime if log.is_file() else values[0])
        intervals.append((values[0], values[1]))
    return intervals


def _write_intervals(directory: Path, intervals: list[tuple[float, float]], open_start: float | None = None) -> None:
    lines = [f"{start:.1f} {end:.1f}" for start, end in intervals] + ([f"{open_start:.1f}"] if open_start else [])
    (directory / "interval.txt").write_text("".join(line + "\n" for line in lines))


def _begin_segment(directory: Path, step: int) -> list[tuple[float, float]]:
    """Before a run continues from its checkpoint of ``step``: each file a launch writes afresh moves to
    ``<name>.earlier``, after the earlier segments' text, followed by the ``RESUMED`` line; every other checkpoint
    is deleted (verl keeps the last two it saved itself, ``trainer.max_actor_ckpt_to_keep``, and knows nothing of
    an earlier segment's: those would stay to the run's end, 1.6 GB each for SmolLM2; a newer one belongs to a step
    that was not logged and is saved again); returns the earlier segments' intervals (the stopped one closed)."""
    intervals = read_intervals(directory)
    for folder in (directory / "checkpoints").glob("global_step_*"):
        if folder.name != f"global_step_{step}":
            shutil.rmtree(folder)
    for name in SEGMENTED:
        earlier, current = directory / f"{name}.earlier", directory / name
        text = (earlier.read_text() if earlier.is_file() else "") + (current.read_text() if current.is_file() else "")
        earlier.write_text(text + RESUMED.format(step) + "\n")
        current.unlink(missing_ok=True)
    return intervals


def _join_segments(directory: Path) -> None:
    """After a continued run finished: every segmented file holds its segments in order, as one log."""
    for name in SEGMENTED:
        earlier, current = directory / f"{name}.earlier", directory / name
        if earlier.is_file():
            current.write_text(earlier.read_text() + (current.read_text() if current.is_file() else ""))
            earlier.unlink()


# transformers resolves its names lazily, and not safely across threads: with --jobs 2, two runs that finished
# together made one thread's `from transformers import AutoConfig` fail while the other thread was importing it
# (ImportError, the comparison stopped). Exports take turns.
_EXPORT_LOCK = threading.Lock()


def export_policy(actor_dir: Path, target: Path) -> None:
    """``export_actor``, one run at a time."""
    with _EXPORT_LOCK:
        export_actor(actor_dir, target)


def run_one(run: Run, steps: int, val_every: int, extra: list[str], timeout_s: float, val_before: bool = True,
            trajectories: bool = False, validation_dumps: bool = False, checkpoint_every: int = 0,
            resume: bool = False) -> None:
    """One ``train_igpo.sh`` run into ``run.directory``. ``val_before``: validate before step 1; ``trajectories``:
    the trajectory log (``trainer.trajectory_dir``: every step's trajectories, per-turn records and the applied
    advantages) into ``run.directory/trajectories``; ``validation_dumps``: verl's validation generations with their
    scores per question (``trainer.validation_data_dir``) into ``run.directory/validation``. The run's peak memory
    (``PeakMemory``) is kept in ``peak_rss_mb.txt``. ``checkpoint_every`` > 0: a checkpoint every that many steps in
    ``run.directory/checkpoints`` (the last two; the final one exported to ``run.directory/model`` by
    ``igpo.eval.export``, then deleted); with ``resume`` a run that has one
    continues from it (``resume_point``; no validation before its first step: the first segment's is in the log),
    else the run starts over in an emptied directory. The process's output streams into ``console.log``."""
    resume_from = resume_point(run.directory) if checkpoint_every and resume else 0
    if resume_from:
        earlier = _begin_segment(run.directory, resume_from)
        checkpoint = run.directory / "checkpoints" / f"global_step_{resume_from}"
        where = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}"]
    else:
        shutil.rmtree(run.directory, ignore_errors=True)  # nothing of a stopped attempt mixes into the new one
        earlier, where = [], ["trainer.resume_mode=disable"]
    run.directory.mkdir(parents=True, exist_ok=True)
    overrides = METHODS[run.method] + [
        f"trainer.total_training_steps={steps}",
        f"trainer.val_before_train={'true' if val_before and not resume_from else 'false'}",
        f"trainer.test_freq={val_every}",
        # One seed feeds every random source (configs/igpo_base.yaml): methods at the same seed share step 1.
        f"seed={run.seed}", f"trainer.save_freq={checkpoint_every or -1}", *where,
    ] + (["trainer.max_actor_ckpt_to_keep=2"] if checkpoint_every else []) + (
        [f"trainer.trajectory_dir={run.directory / 'trajectories'}"] if trajectories else []) + (
        [f"trainer.validation_data_dir={run.directory / 'validation'}"] if validation_dumps else []) + extra
    env = {**os.environ, "OUTPUT_DIR": str(run.directory), "IGPO_DEVICE": "cpu"}
    env.pop("TOOL_SERVER_URL", None)
    started = time.time()
    _write_intervals(run.directory, earlier, open_start=started)
    console = run.directory / "console.log"
    with PeakMemory(run.directory), console.open("w") as output:
        proc = subprocess.run(["bash", str(ROOT / "train_igpo.sh"), *overrides], cwd=ROOT, env=env, text=True,
                              stdout=output, stderr=subprocess.STDOUT, timeout=timeout_s)
    run.intervals = earlier + [(started, time.time())]
    _write_intervals(run.directory, run.intervals)
    if proc.returncode != 0:
        raise SystemExit(f"compare: {run.method} seed {run.seed} failed (exit {proc.returncode}); its output ends:\n"
                         + "\n".join(console.read_text().splitlines()[-25:]))
    if resume_from:
        log = (run.directory / "train.log").read_text()
        reports = [json.loads(m) for m in re.findall(r"igpo: resumed from \S+: (\{.*\})", log)]
        if not reports or reports[-1].get("global_step") != resume_from:
            raise SystemExit(f"compare: {run.method} seed {run.seed} was to continue from its checkpoint of step "
                             f"{resume_from} but its log reports {reports[-1:] or 'no resume'}; see "
                             f"{run.directory / 'train.log'}")
        _join_segments(run.directory)
    run.steps = parse_log((run.directory / "train.log").read_text())
    if steps not in run.steps:
        raise SystemExit(f"compare: {run.method} seed {run.seed} exited 0 but logged no step {steps}; see "
                         f"{run.directory / 'train.log'}")
    if checkpoint_every:  # the trained policy, for scripts/evaluate.py --model-path, before its checkpoints go
        export_policy(run.directory / "checkpoints" / f"global_step_{steps}" / "actor", run.directory / "model")
    shutil.rmtree(run.directory / "checkpoints", ignore_errors=True)
    run.wall_s = sum(end - start for start, end in run.intervals)
    (run.directory / "wall_s.txt").write_text(f"{run.wall_s:.1f}\n")


def load_finished(run: Run, steps: int) -> bool:
    log, wall = run.directory / "train.log", run.directory / "wall_s.txt"
    if not (log.is_file() and wall.is_file()):
        return False
    parsed = parse_log(log.read_text())
    if steps not in parsed:
        return False
    run.steps, run.wall_s = parsed, float(wall.read_text())
    run.intervals = read_intervals(run.directory)
    return True


def comparison_wall_s(runs: list[Run]) -> float:
    """Seconds during which at least one run was going: the union of the runs' intervals, so overlapping runs
    (``--jobs 2``) count once and the gaps between sessions of a ``--resume`` not at all. A run without intervals
    (kept from an older version of this script) adds its own wall time."""
    timed = sorted(interval for r in runs for interval in r.intervals)
    total, reach = sum(r.wall_s for r in runs if not r.intervals), -math.inf
    for start, end in timed:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


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
        _plot_bands(out / "train_success.png", bands, primary,
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
        "# CPU method comparison (`scripts/compare_methods.py`)", "",
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


def _plot_bands(path: Path, bands: dict[str, dict[int, tuple[float, float, float]]], key: str, title: str) -> None:
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
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu_compare")
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
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    parser.add_argument("--jobs", type=int, default=1, choices=(1, 2),
                        help="runs at a time: 2 overlaps one run's start-up and serial Python with the other's work "
                             "(each run's torch work is single-threaded on the CPU demo)")
    parser.add_argument("--val-before", default="all", choices=("all", "baseline"),
                        help="which runs validate before step 1: every run, or the baseline's only (before training "
                             "every method at a seed has the same model and the same seeded samples, so the others "
                             "would repeat it)")
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
                val_before=args.val_before == "all" or run.method == args.baseline, trajectories=args.trajectories,
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
