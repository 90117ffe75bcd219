"""One seed, one run — and the demo learns. `bash train_igpo.sh seed=1` twice on a short demo (5 steps) with the CPU rollout
server in its default float64 (in float32, IGPO_CPU_ROLLOUT_DTYPE=float32, a batch's shape moves a request's logits by
~1e-7, which now and then flips a sampled token — a 20-step run repeated identically through step 6, then diverged): the same
validation line and the same step metrics (every one but wall times and the engine-vs-actor log-prob comparison),
and validation F1 rises. Guarded: the whole process group dies on timeout."""

import os
import re

import pytest

from guarded_run import run_guarded

pytestmark = pytest.mark.e2e

# Five steps of the demo (16 prompts x 4), validated before and after: the first five of the lr warm-up (lr 0, 1e-4,
# ..., 4e-4), where validation F1 starts to move whatever CPU built the model (below).
SHORT = ["seed=1", "trainer.total_training_steps=5"]
# Metrics that are not functions of the seed: wall times, throughput, and the engine-vs-actor log-prob comparison
# (the CPU hf server batches whatever requests are waiting, and a batch's shape moves its logits by float rounding).
NOT_SEEDED = re.compile(r"timing|time|perf/|throughput|progress/|rollout_probs_diff|rollout_actor_probs|"
                        r"scoring_step_share|memory|_s$")


def _run(tmp_path, name):
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / name), "IGPO_DEVICE": "cpu"}
    env.pop("TOOL_SERVER_URL", None)
    env.pop("IGPO_CPU_ROLLOUT_DTYPE", None)  # the default is what a user gets
    rc, out = run_guarded(["bash", "train_igpo.sh", *SHORT], env, timeout=600)
    assert rc == 0, out[-4000:]
    return out, (tmp_path / name / "train.log").read_text()


def _step_metrics(log: str) -> dict[int, dict[str, str]]:
    steps = {}
    for line in re.findall(r"step:(\d+) - (.*)", log):
        pairs = dict(item.split(":", 1) for item in line[1].split(" - ") if ":" in item)
        steps[int(line[0])] = {k: v for k, v in pairs.items() if not NOT_SEEDED.search(k)}
    return steps


def test_the_same_seed_gives_the_same_run_and_the_policy_learns(tmp_path):
    out_a, log_a = _run(tmp_path, "a")
    out_b, log_b = _run(tmp_path, "b")
    line_a = re.search(r"igpo: validation F1 before=([0-9.]+) after=([0-9.]+)", out_a)
    line_b = re.search(r"igpo: validation F1 before=([0-9.]+) after=([0-9.]+)", out_b)
    assert line_a and line_b, out_a[-3000:]
    assert line_a.group(0) == line_b.group(0)
    steps_a, steps_b = _step_metrics(log_a), _step_metrics(log_b)
    assert sorted(steps_a) == [0, 1, 2, 3, 4, 5] and len(steps_a[1]) > 50, sorted(steps_a)
    for step in steps_a:
        differ = {k: (v, steps_b[step].get(k)) for k, v in steps_a[step].items() if steps_b[step].get(k) != v}
        assert not differ, (step, differ)
    assert "hf rollout server computes in float64" in log_a
    # The demo model is built by training on the CPU, and another CPU type rounds differently and builds another model
    # (README "What the CPU demo shows"), so the bar must hold for every such model, not one. Validation F1 of seed 1
    # after steps 0..5 (val every step), on three builds: an AMD EPYC's (9315c3b2) 0.109 0.109 0.109 0.141 0.203 0.313;
    # the same machine with torch's and MKL's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2,
    # another rounding: 129948d1) 0.078 0.078 0.078 0.094 0.156 0.328; an Intel Xeon's (5fe63b1e) 0.031 -> 0.188 after
    # step 3. After step 3 the AMD build had gained only +0.03 (this test's former 3-step bar failed there); after
    # step 5: +0.20 and +0.25. No update gives +0 (validation sampling is seeded).
    before, after = float(line_a.group(1)), float(line_a.group(2))
    assert after >= before + 0.1, (before, after)
    # The health metrics the early warning reads are logged every step.
    assert all("health/wellformed_call_share" in steps_a[s] for s in (1, 2, 3, 4, 5))
