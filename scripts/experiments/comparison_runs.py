"""One run of the method comparison and what it leaves: launching ``train_igpo.sh`` for an arm at a seed (with
checkpoints, resumption and the peak-memory sampler), parsing verl's console lines into per-step metrics, and reading
a finished run back. ``compare_methods.py`` drives it; the summaries (``comparison_report.py``,
``summarize_turn_credit.py``, ``summarize_real_model.py``) read runs through it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from arms import METHODS
from igpo.eval.export import export_actor

ROOT = Path(__file__).resolve().parents[2]

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
    if checkpoint_every:  # the trained policy, for python -m igpo.evaluate --model-path, before its checkpoints go
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
