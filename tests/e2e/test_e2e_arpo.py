"""End to end on CPU: `bash train_igpo.sh algorithm.arpo.enabled=true` grows each prompt's group as an ARPO tree
through verl's v1 agent-loop worker and trains on it (issue #15), on the stock-estimator path with hard attribution:
verl computes GRPO's advantages, igpo_sync reads them back from TransferQueue and writes the tree average. One run
serves both (the IGPO estimator over a branched group is tests/integration/test_trainer.py's; hard attribution on
verl's advantages without Ray, tests/integration/test_verl_estimator.py's). Guarded: the whole process group dies on
timeout."""

import math
import os
import re
import time

import pytest

from guarded_run import SEARCHING_DEMO, run_guarded

pytestmark = pytest.mark.e2e


def _values(log: str, key: str) -> list[float]:
    return [float(v) for v in re.findall(rf"{re.escape(key)}:([0-9.eE+-]+)", log)]


def test_train_igpo_sh_with_arpo_branches_keeps_the_tree_and_hard_attribution_rewrites_verls_grpo(tmp_path):
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "run"), "IGPO_DEVICE": "cpu"}
    env.pop("TOOL_SERVER_URL", None)
    started = time.monotonic()
    # tau = 1: every trajectory that reaches a tool result branches while its prompt has slots left (M = 3, N = 1),
    # so the branch draws cannot fail the run (they are covered in tests/agent/test_arpo_loop.py); 32 prompts make a
    # step whose initial rollouts all answer without searching rare (tests/support/guarded_run.py). M = 3 leaves room
    # for a second branch, so a branch re-branching at its own branch point (issue 27) would show.
    demo = [a for a in SEARCHING_DEMO if not a.startswith("actor_rollout_ref.rollout.n=")]
    rc, out = run_guarded(["bash", "train_igpo.sh", *demo, "actor_rollout_ref.rollout.n=3",
                           "algorithm.arpo.enabled=true", "trainer.total_training_steps=2",
                           "algorithm.arpo.branch_probability=1.0", "algorithm.arpo.attribution=hard",
                           "algorithm.adv_estimator=grpo"], env, timeout=600)
    elapsed = time.monotonic() - started
    log = (tmp_path / "run" / "train.log").read_text()
    assert rc == 0, out[-4000:]
    assert "igpo: step:2/2" in out, out[-3000:]
    assert "'default_agent_loop': 'arpo_agent'" in log  # the launcher switched the loop
    assert re.search(r"igpo: note: ARPO branching \(agent loop arpo_agent\): M=3 \(rollout\.n\), N=1, Z=2, tau=1, "
                     r".*, hard attribution", out), out[:3000]
    branches = _values(log, "arpo/branches_per_prompt")
    assert len(branches) == 2 and max(branches) > 0, branches
    assert len(_values(log, "arpo/delta_h_mean")) == 2 and max(_values(log, "arpo/measured_turns")) > 0
    assert len(_values(log, "igpo/tool_calls_per_trajectory")) == 2 and len(_values(log, "arpo/topups_per_prompt")) == 2
    # What verl stored and trained on carries the tree: every prompt has its M trajectories, and every branch equals
    # its parent (ids and loss mask) before arpo_branch_pos.
    assert _values(log, "arpo/prefix_mismatches") == [0.0, 0.0]
    assert _values(log, "arpo/incomplete_groups") == [0.0, 0.0]
    # one round of branching per tool result: no branch starts at its parent's own branch point
    assert _values(log, "arpo/rebranch_same_point") == [0.0, 0.0]
    # verl's GRPO advantages came back from TransferQueue and the shared prefixes' advantages were averaged.
    assert "igpo_sync: advantage estimator grpo" in log, log[-3000:]
    assert max(_values(log, "arpo/hard_shared_tokens")) > 0
    grad_norms = _values(log, "actor/grad_norm")
    assert len(grad_norms) == 2 and all(math.isfinite(g) for g in grad_norms) and max(grad_norms) > 0, grad_norms
    print(f"arpo e2e: {elapsed:.0f} s, branches per prompt {branches}, "
          f"second-level branches {_values(log, 'arpo/nested_branches')}")
