"""Run a command of the product (train_igpo.sh, a script) from a test so that nothing of it outlives the test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The CPU demo at the size the end-to-end tests of mechanics need (4 prompts x 2 rollouts, no validation); the demo
# as users run it (16 x 4, validation before and after) is tests/e2e/test_e2e_learning.py's.
NO_VALIDATION = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
SMALL_DEMO = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
              *NO_VALIDATION]
# For tests that need tool results in every step: the warm-started demo model searches first in only ~15-20% of its
# trajectories (measured: 0.17-0.25 at step 1), so 8 trajectories often hold no search (0.83^8 ~ 0.23); 32 prompts
# x 2 hold none with probability ~ 0.83^64 < 1e-5 (with ARPO's one initial rollout per prompt, 0.83^32 ~ 3e-3 per
# step).
SEARCHING_DEMO = ["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                  "actor_rollout_ref.rollout.n=2", *NO_VALIDATION]
# verl's GPU default precision for the FSDP engines: fp32 master weights, bf16 compute (mixed_precision unset); the
# CPU demo preset pins fp32, so these overrides put it back for both roles.
GPU_PRECISION = ["actor_rollout_ref.actor.fsdp_config.mixed_precision=null",
                 "actor_rollout_ref.ref.fsdp_config.mixed_precision=null"]
# A trainer run here starts its local Ray cluster without the dashboard (IGPO_RAY_DASHBOARD=0) and without idle
# workers started ahead of need (RAY_enable_worker_prestart=0), unless its environment says otherwise: fewer
# processes per start (results/suite/2026-12-05-b.md). tests/e2e/test_e2e_learning.py's runs have both on, as users
# get them.
LEAN_RAY = {"IGPO_RAY_DASHBOARD": "0", "RAY_enable_worker_prestart": "0"}


def logged_values(log: str, key: str) -> list[float]:
    """Every value of the metric ``key`` in a training log, in order: one per step that logged it (nan where verl
    logged nan)."""
    return [float(v) for v in re.findall(rf"{re.escape(key)}:([0-9.eE+-]+|nan)", log)]


def _live_members(group: int) -> list[str]:
    """The processes of a process group that still run (zombies, already exited, are not counted), with their
    command lines."""
    found = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
    live = []
    for pid in found:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # it ended meanwhile
            continue
        if state != "Z":
            live.append(f"{pid} {command[:160]}")
    return live


def run_guarded(args: list[str], env: dict[str, str], timeout: float,
                leftovers: list[str] | None = None, settle_s: float = 15.0) -> tuple[int, str]:
    """(exit code, stdout + stderr) of ``args`` run in the repository root in its own process group; on timeout the
    test fails with the output's tail. The whole group (Ray, the tool server) is killed afterwards in any case.

    ``leftovers``, when given, receives the processes of the group still running ``settle_s`` after the command
    exited (its Ray cluster, tool server and workers are in that group unless they left it, and take some seconds to
    shut down): a clean exit leaves it empty."""
    proc = subprocess.Popen(args, cwd=REPO, env={**LEAN_RAY, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        if leftovers is not None:
            deadline = time.monotonic() + settle_s
            while (live := _live_members(proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.5)
            leftovers.extend(live)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # SIGKILL is delivered when each process next runs: on a loaded machine that can take a moment, and the next
        # test (or the caller's own check) should not meet the group still alive.
        deadline = time.monotonic() + 30
        while _live_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return proc.returncode, out
