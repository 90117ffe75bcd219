"""Faults with groups in flight, in the asynchronous trainer modes: what a dead tool server, a killed rollout server
and a killed trainer do to a run, counted from what the run wrote.

Each scenario trains the CPU demo (32 prompts x 2 samples a step, a checkpoint after every step, our trajectory log
and verl's rollout dump on) with ``bash train_igpo.sh`` in its own session, injects one fault once the training log
shows step ``--at``, waits for the run to end and, where the product offers a way on, resumes it:

    tool_server   the launcher's tool server is killed (SIGKILL): the tool calls of the groups in flight fail as
                  infrastructure errors and are masked, and the infra breaker (``tools.infra_breaker``, here
                  ``steps=1``) stops the run after the first step above its share, with a checkpoint. Then the run is
                  resumed (``trainer.resume_mode=auto``) with a new tool server.
    rollout       the rollout server's process (``ray::HFRolloutServer``) is killed: the run must end with an error
                  that names it, or recover; no step may train a half-made group.
    trainer       the launcher's whole session (trainer, Ray, tool server) is killed between steps, once step
                  ``--at``'s checkpoint is complete; then the run is resumed from it.

Counted from the trajectory log (one line per trained trajectory, with its prompt's group id): per run, the steps
trained, each step's trajectories and groups, whether every group came whole (``rollout.n`` samples) and the
trajectories masked for infrastructure failures; across a stopped run and its resume, the groups trained in two
steps (nothing may train twice), the first run's steps after its last checkpoint (their update is lost with it), the
groups in flight at the checkpoint that the resume trained, and the prompts fetched before the checkpoint that
neither run trained by its end. Writes ``<out>/result.json``, each run's console and command; prints one line. Run
from the repository root with the CPU environment's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from comparison_runs import parse_log

REPO = Path(__file__).resolve().parents[2]
PROMPTS, SAMPLES = 32, 2
RUN = [f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
       f"actor_rollout_ref.rollout.n={SAMPLES}", "trainer.val_before_train=false", "trainer.test_freq=-1",
       "trainer.save_freq=1", "actor_rollout_ref.actor.optim.lr_warmup_steps=0"]
FAULTS = ("tool_server", "rollout", "trainer")
PATTERNS = {"tool_server": "-m tool_server", "rollout": "ray::HFRolloutServer"}
# The console lines that say why a run ended: the breaker's, an error, the launcher's lines after a failure.
STOP_LINES = r"infra breaker|Error|error:|Traceback|igpo: a process of the run died|igpo: the newest checkpoint"


def _members(session: int, pattern: str) -> list[int]:
    """The processes of the run's session (the launcher is its leader) whose command line matches ``pattern``."""
    found = subprocess.run(["pgrep", "-s", str(session), "-f", "--", pattern], capture_output=True,
                           text=True).stdout.split()
    return [int(pid) for pid in found]


def _wait_until(ready, process: subprocess.Popen, timeout: float) -> bool:
    """True once ``ready()`` holds; False if the run ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.5)
    return False


def _wait_for(path: Path, pattern: str, process: subprocess.Popen, timeout: float) -> bool:
    """True once ``pattern`` is in the file; False if the run ended first or the time ran out."""
    return _wait_until(lambda: path.exists() and re.search(pattern, path.read_text(errors="replace")) is not None,
                       process, timeout)


def _launch(out: Path, name: str, mode: str, steps: int, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    run_dir = out / "run"  # one folder for both runs: the resume finds the checkpoints there
    env = {**os.environ, "OUTPUT_DIR": str(run_dir), "IGPO_DEVICE": "cpu", "IGPO_RAY_DASHBOARD": "0",
           "RAY_enable_worker_prestart": "0"}
    env.pop("TOOL_SERVER_URL", None)
    console = out / f"{name}.console.log"
    command = ["bash", "train_igpo.sh", *RUN, f"trainer.total_training_steps={steps}",
               f"trainer.v1.trainer_mode={mode}", f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
               f"+trainer.trajectory_dir={run_dir / 'trajectories'}",
               f"trainer.default_local_dir={run_dir / 'checkpoints'}", *extra]
    (out / f"{name}.command.txt").write_text(" ".join(command) + "\n")
    handle = console.open("w")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return process, console


def _finish(process: subprocess.Popen, timeout: float) -> tuple[int | None, float]:
    """The run's exit code (None: it did not end in time and its group was killed) and how long it took."""
    start = time.monotonic()
    try:
        rc = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    _kill_group(process.pid)
    return rc, time.monotonic() - start


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def trained_steps(trajectories: Path) -> dict[int, list[str]]:
    """{step: the group of every trajectory trained at it}, from our trajectory log (``step_<n>.jsonl``, written
    after the step's advantage, before verl's checkpoint and rollout dump, so a step whose end was cut short is still
    there). A group is one fetched prompt: its uid up to the sample's suffix (``s<fetch>p<prompt number>``); the same
    question fetched again in a later epoch is another group."""
    steps = {}
    for path in sorted(trajectories.glob("step_*.jsonl")) if trajectories.exists() else []:
        steps[int(path.stem.split("_")[1])] = [_group(json.loads(line)["uid"])
                                               for line in path.read_text().splitlines() if line]
    return steps


def _group(uid: str) -> str:
    return uid.split("_", 1)[0]


def _prompt_number(group: str) -> int:
    return int(group.rsplit("p", 1)[1])


def step_counts(steps: dict[int, list[str]], masked: dict[int, float]) -> dict[str, dict]:
    """Per step: trajectories, groups, whether every group came with its ``SAMPLES`` samples, and the trajectories
    the trainer masked for infrastructure failures (``igpo/infra_masked_trajectories``)."""
    counts = {}
    for step, groups in sorted(steps.items()):
        sizes = {g: groups.count(g) for g in set(groups)}
        counts[str(step)] = {"trajectories": len(groups), "groups": len(sizes),
                             "groups_complete": all(n == SAMPLES for n in sizes.values()),
                             "infra_masked_trajectories": masked.get(step)}
    return counts


def _masked(train_log: Path) -> dict[int, float]:
    """``igpo/infra_masked_trajectories`` of every step the training log has a metrics line for."""
    text = train_log.read_text(errors="replace") if train_log.exists() else ""
    return {step: metrics["igpo/infra_masked_trajectories"] for step, metrics in parse_log(text).items()
            if "igpo/infra_masked_trajectories" in metrics}


def _saved(train_log: Path) -> dict[int, dict]:
    """The trainer's ``igpo: checkpoint saved {...}`` reports by step (prompts fetched, dataloader position)."""
    text = train_log.read_text(errors="replace") if train_log.exists() else ""
    reports = [json.loads(m) for m in re.findall(r"igpo: checkpoint saved: (\{.*\})", text)]
    return {int(r["global_step"]): r for r in reports}


def accounting(first: dict[int, list[str]], second: dict[int, list[str]], checkpoint: int, fetched: int,
               completed: bool) -> dict:
    """What happened to the groups across a stopped run and its resume: trained in two steps (never allowed),
    trained by the first run after its last checkpoint (their update was lost with the run: trained again or
    dropped), fetched by the first run before its checkpoint and trained only by the resume (in flight at the
    checkpoint: carried over), and fetched before the checkpoint but trained by neither (dropped; counted only when
    the resume ran to its last step)."""
    kept = {s: g for s, g in first.items() if s <= checkpoint}
    steps_of: dict[str, set] = {}
    for run in (kept, second):
        for step, groups in run.items():
            for group in set(groups):
                steps_of.setdefault(group, set()).add(step)
    trained = set(steps_of)
    lost = {g for s, groups in first.items() if s > checkpoint for g in groups}
    carried = {g for groups in second.values() for g in groups if _prompt_number(g) < fetched} - \
        {g for groups in kept.values() for g in groups}
    numbers = {_prompt_number(g) for g in trained}
    dropped = sorted(set(range(fetched)) - numbers) if completed else None
    return {"groups_trained_in_two_steps": sorted(g for g, steps in steps_of.items() if len(steps) > 1),
            "first_run_steps_after_its_checkpoint": sorted(s for s in first if s > checkpoint),
            "groups_of_those_steps": len(lost),
            "groups_in_flight_at_the_checkpoint_trained_by_the_resume": len(carried),
            "prompts_fetched_at_the_checkpoint": fetched,
            "prompts_fetched_before_the_checkpoint_not_trained_by_the_end": dropped}


def _lines(console: Path, pattern: str) -> list[str]:
    """The file's lines matching ``pattern``, each once, without Ray's colour codes and actor prefix."""
    found = []
    for line in console.read_text(errors="replace").splitlines():
        if re.search(pattern, line):
            found.append(re.sub(r"^\x1b\[\d+m\([^)]*\)\x1b\[0m ", "", line))
    return list(dict.fromkeys(found))


def _checkpoint_step(run_dir: Path) -> int | None:
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(marker.read_text().strip()) if marker.exists() else None


def scenario(mode: str, fault: str, at: int, steps: int, out: Path, timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    extra = ["tools.infra_breaker.steps=1"] if fault == "tool_server" else []
    process, console = _launch(out, "first", mode, steps, extra)
    injected = None
    if fault == "trainer":
        # Between steps: step `at`'s checkpoint is written (our state file is saved last of our part, and verl's
        # pointer after its own files), and step at + 1 is not yet logged.
        marker = rf"igpo: checkpoint saved[^\n]*\"global_step\": {at}\b"
        if _wait_for(out / "run" / "train.log", marker, process, timeout) and \
                _wait_until(lambda: _checkpoint_step(out / "run") == at, process, timeout):
            _kill_group(process.pid)
            injected = f"the launcher's process group killed (SIGKILL) after step {at}'s checkpoint"
    elif _wait_for(out / "run" / "train.log", rf"step:{at} - ", process, timeout):
        victims = _members(process.pid, PATTERNS[fault])
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        injected = (f"{len(victims)} process(es) matching {PATTERNS[fault]!r} killed (SIGKILL) after step {at} was "
                    "logged")
    rc, ended_s = _finish(process, timeout)
    run_dir = out / "run"
    first_log = run_dir / "train.log"
    (run_dir / "train_first.log").write_bytes(first_log.read_bytes() if first_log.exists() else b"")
    first = trained_steps(run_dir / "trajectories")
    checkpoint = _checkpoint_step(run_dir)
    result = {"mode": mode, "fault": fault, "at": at, "steps": steps, "injected": injected,
              "first": {"exit": rc, "seconds_to_exit_after_fault": round(ended_s, 1),
                        "trained": step_counts(first, _masked(run_dir / "train_first.log")),
                        "checkpoint": checkpoint,
                        "stop_lines": _lines(console, STOP_LINES)[-8:]}}
    if fault in ("tool_server", "trainer") and injected and checkpoint:
        (run_dir / "trajectories_first").mkdir(exist_ok=True)
        for path in (run_dir / "trajectories").glob("*.jsonl"):
            path.rename(run_dir / "trajectories_first" / path.name)
        process, _ = _launch(out, "resume", mode, steps, ["trainer.resume_mode=auto"])
        rc, _ = _finish(process, timeout)
        second = trained_steps(run_dir / "trajectories")
        fetched = int(_saved(run_dir / "train_first.log").get(checkpoint, {}).get("prompts_fetched", 0))
        result["resume"] = {"exit": rc, "trained": step_counts(second, _masked(first_log)),
                            "resumed_line": (_lines(first_log, r"igpo: resumed from") or [None])[0],
                            "resumed_rollout_line": (_lines(first_log, r"igpo: resumed rollout") or [None])[0],
                            **accounting(first, second, checkpoint, fetched, completed=rc == 0)}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", required=True, choices=["igpo_colocate_async", "igpo_separate_async"],
                        help="the asynchronous trainer mode to run")
    parser.add_argument("--fault", required=True, choices=FAULTS, help="which fault to inject (module docstring)")
    parser.add_argument("--at", type=int, default=2, help="the step after whose log line (or checkpoint, for "
                        "--fault trainer) the fault is injected (default 2)")
    parser.add_argument("--steps", type=int, default=4, help="trainer.total_training_steps of the run (default 4)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take before its process group "
                        "is killed and the run counted as hung (default 900)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the run, its consoles and result.json")
    args = parser.parse_args(argv)
    if not 1 <= args.at < args.steps:
        parser.error(f"--at {args.at} must be a step before the last (--steps {args.steps})")
    result = scenario(args.mode, args.fault, args.at, args.steps, args.out, args.timeout)
    first, resume = result["first"], result.get("resume", {})
    print(f"faults: {args.mode} {args.fault}: injected: {result['injected']}; first run exit {first['exit']}, "
          f"steps trained {sorted(map(int, first['trained']))}, checkpoint {first['checkpoint']}"
          + (f"; resume exit {resume['exit']}, steps {sorted(map(int, resume['trained']))}, groups trained in two "
             f"steps {len(resume['groups_trained_in_two_steps'])}, carried over "
             f"{resume['groups_in_flight_at_the_checkpoint_trained_by_the_resume']}, dropped "
             f"{resume['prompts_fetched_before_the_checkpoint_not_trained_by_the_end']}" if resume else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
