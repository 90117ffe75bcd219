"""End to end on CPU: a spent tool budget ends `bash train_igpo.sh` cleanly after the step, with a clear message, a
checkpoint and the logs; the final summary prints tool calls, cache hit ratio and estimated spend (issue #16). With
``tools.stop_on_budget=false`` the refused searches are masked and training goes on: that run is the README example
method's, tests/e2e/test_e2e_methods.py.

The same run trains GiGPO with verl-agent's search preset (``gigpo_preset=verl_agent_search``: similarity step groups at
0.9, mean_std_norm, penalty 0.01, gamma 0.95) for its one step through verl's real trainer on the demo's agent loop
and tools, reading anchor states from the rollout's observation tokens, logs the step-group metrics with the rows that
joined by similarity, and writes the trajectory log, from which the applied advantages are recomputed. It runs in the
asynchronous trainer mode (igpo_colocate_async), so the budget's clean stop also holds with a warm-up batch in flight."""

import os
import re

import pytest

from guarded_run import NO_VALIDATION, run_guarded
from igpo.core.gigpo import GiGPOConfig
from igpo.integration.trajectory_log import read_step
from logged_advantage import max_gigpo_log_error

pytestmark = pytest.mark.e2e


def test_gigpo_trains_until_a_budget_of_one_search_ends_the_run_cleanly_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OUTPUT_DIR": str(run), "IGPO_DEVICE": "cpu", "TOOL_SERVER_ARGS": "--budget-search 1"}
    env.pop("TOOL_SERVER_URL", None)
    rc, out = run_guarded(["bash", "train_igpo.sh", *NO_VALIDATION, "trainer.total_training_steps=3",
                           "tools.price_per_1k.local=2.0", "gigpo_preset=verl_agent_search",
                           f"trainer.trajectory_dir={tmp_path / 'trajectories'}",
                           "trainer.v1.trainer_mode=igpo_colocate_async",
                           # One trajectory per actor micro-batch: each refused search's masked trajectory is a
                           # micro-batch without a valid token, which verl's bypass-mode loss (the async default)
                           # refused with a ValueError (igpo/integration/policy_loss.py).
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"], env, timeout=420)
    assert rc == 0, out[-4000:]
    # Stopped after step 1 of 3, saying why and what to do.
    assert re.search(r"igpo: tool budget spent \(local: 1 of a budget of 1 upstream calls\): stopping cleanly after "
                     r"step 1/3", out), out[-3000:]
    assert "igpo: step:1/3" in out and "igpo: step:2" not in out, out[-3000:]
    # Nothing lost: the checkpoint verl can resume from, the training log and the TensorBoard events.
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (checkpoints / "global_step_1" / "igpo_state.json").is_file()
    assert any((checkpoints / "global_step_1" / "actor").iterdir())
    log = (run / "train.log").read_text()
    assert "step:1 -" in log and "training/stopped_on_tool_budget:1" in log
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    # Per-step tool metrics and the infra-failure counters are in the log (whether a refused search happens within
    # the step depends on the tiny model's calls: the budget is spent by the first search).
    assert "tools/upstream_calls/local:1.0" in log and "tools/budget_spent:1.0" in log
    masked = re.findall(r"igpo/infra_masked_trajectories:([0-9.]+)", log)
    assert len(masked) == 1, masked
    # The summary: tool calls, cache hit ratio (the local index is not cached) and the spend at $2 per 1,000 searches.
    summary = re.search(r"igpo: tools: (\d+) calls, (\d+) upstream calls, cache hit ratio (.*), estimated spend "
                        r"\$([0-9.]+)", out)
    assert summary, out[-3000:]
    assert int(summary.group(1)) >= 1 and int(summary.group(2)) == 1 and float(summary.group(4)) == 0.002
    assert summary.group(3) == "n/a (no cache lookups)"
    assert out.count("igpo: tool budget spent") == 2  # the trainer's line, and the summary repeating it

    # GiGPO's step: rollout.n = 4, so every prompt's first turns share the question and every step has groups of two
    # or more; its advantages reached the actor.
    assert "GiGPO episode + anchor-state step groups" in log, log[-3000:]

    def value(key):
        found = re.findall(rf"gigpo/{key}:([0-9.eE+-]+|nan)", log)
        assert len(found) == 1, (key, found)
        return float(found[0])

    assert value("step_group_size_max") >= 2 and 0 < value("grouped_row_share") <= 1
    assert value("step_rows") >= 8 and value("anchor_fallbacks") == 0
    assert value("episode_adv_abs_mean") >= 0 and value("step_adv_abs_mean") >= 0
    # Similarity groups were on: the rows after the first turn that joined a group by similarity, not identity.
    assert value("similarity_joined_rows_after_first") >= 0 and value("similarity_joined_rows") >= 0
    # The trajectory log holds what trained; GiGPO's formula on its logged inputs gives the logged advantages.
    rows = read_step(tmp_path / "trajectories" / "step_00001.jsonl")
    assert len(rows) == 64 and all({"advantage", "turn_spans", "terms"} <= row.keys() for row in rows)
    assert {"episode_advantage", "step_advantage", "step_group", "similarity_joined"} <= rows[0]["terms"].keys()
    preset = GiGPOConfig(mode="mean_std_norm", similarity=True, similarity_threshold=0.9, invalid_action_penalty=0.01,
                         gamma=0.95)
    assert max_gigpo_log_error(rows, preset) < 1e-6
    joined = sum(v == 1.0 for row in rows for v in row["terms"]["similarity_joined"])
    assert joined == value("similarity_joined_rows"), joined
    assert re.search(r"actor/pg_loss:-?[0-9.]+", log), log[-3000:]
