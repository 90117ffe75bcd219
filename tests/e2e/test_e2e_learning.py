"""One seed, one run — and the demo learns. `bash train_igpo.sh seed=1` for 10 steps and again for 2, both with the
CPU rollout server in its default float64 (in float32, IGPO_CPU_ROLLOUT_DTYPE=float32, a batch's shape moves a
request's logits by ~1e-7, which now and then flips a sampled token — a 20-step run repeated identically through
step 6, then diverged): the same validation before training and the same step metrics through step 2 (every one
but wall times and the engine-vs-actor log-prob comparison), and validation F1 rises over the 10 steps (the
second run validates before training only).

Both run as users get them, Ray's dashboard and prestarted workers included (the other trainer runs of the tests
start a lean Ray, tests/support/guarded_run.py), so the 10-step run is also the check of the default path: our
estimator, agent loop, trainer mode, CPU backend and tool server in verl's Ray trainer, answer scoring on the actor
(packed, FSDP2), information gain that tracks information in every step, TensorBoard events, and nothing of the run
outliving it. (verl's GPU precision, bf16 compute, is the InfoPO run's, tests/e2e/test_e2e_infra.py.) Guarded: the
whole process group dies on timeout."""

import os
import re

import pytest

from guarded_run import logged_values, run_guarded
from igpo.integration.trajectory_log import read_step
from logged_advantage import logged_turn_advantages

pytestmark = pytest.mark.e2e

# The demo (16 prompts x 4 per step), validated before the first step and after the last.
# Two steps repeated: step 2's rollout runs on the weights of step 1's update, so an update that did not repeat shows.
LEARN_STEPS, REPEAT_STEPS = 10, 2
# Metrics that are not functions of the seed: wall times, throughput, and the engine-vs-actor log-prob comparison
# (the CPU hf server batches whatever requests are waiting, and a batch's shape moves its logits by float rounding).
NOT_SEEDED = re.compile(r"timing|time|perf/|throughput|progress/|rollout_probs_diff|rollout_actor_probs|"
                        r"scoring_step_share|memory|_s$")
VALIDATION = re.compile(r"^val-")


def _run(tmp_path, name, steps, *overrides, leftovers=None):
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / name), "IGPO_DEVICE": "cpu", "IGPO_RAY_DASHBOARD": "1",
           "RAY_enable_worker_prestart": "1"}
    env.pop("TOOL_SERVER_URL", None)
    env.pop("IGPO_CPU_ROLLOUT_DTYPE", None)  # the default is what a user gets
    rc, out = run_guarded(["bash", "train_igpo.sh", "seed=1", f"trainer.total_training_steps={steps}", *overrides], env,
                          timeout=900, leftovers=leftovers)
    assert rc == 0, out[-4000:]
    return out, (tmp_path / name / "train.log").read_text()


def _pooled_ig(log: str, which: str) -> tuple[float, float]:
    """Count-weighted mean of igpo/ig_mean_answer_<which> over the logged steps, and the total count."""
    means = logged_values(log, f"igpo/ig_mean_answer_{which}")
    counts = logged_values(log, f"igpo/ig_count_answer_{which}")
    total = sum(counts)
    return sum(m * c for m, c in zip(means, counts) if c > 0) / max(total, 1.0), total


def _step_metrics(log: str) -> dict[int, dict[str, str]]:
    steps = {}
    for line in re.findall(r"step:(\d+) - (.*)", log):
        pairs = dict(item.split(":", 1) for item in line[1].split(" - ") if ":" in item)
        steps[int(line[0])] = {k: v for k, v in pairs.items() if not NOT_SEEDED.search(k)}
    return steps


def test_the_same_seed_gives_the_same_run_and_the_policy_learns(tmp_path):
    leftovers: list[str] = []
    out_a, log_a = _run(tmp_path, "a", LEARN_STEPS, leftovers=leftovers)
    # Run b validates before training only: its validation after the last step would prove nothing here.
    out_b, log_b = _run(tmp_path, "b", REPEAT_STEPS, "trainer.test_freq=-1",
                        f"trainer.trajectory_dir={tmp_path / 'trajectories'}")
    line_a = re.search(r"igpo: validation F1 before=([0-9.]+) after=([0-9.]+)", out_a)
    line_b = re.search(r"igpo: validation F1 before=([0-9.]+) after=n/a", out_b)
    assert line_a and line_b, out_a[-3000:]
    assert line_a.group(1) == line_b.group(1)
    steps_a, steps_b = _step_metrics(log_a), _step_metrics(log_b)
    assert sorted(steps_a) == list(range(LEARN_STEPS + 1)) and len(steps_a[1]) > 50, sorted(steps_a)
    assert sorted(steps_b) == list(range(REPEAT_STEPS + 1)), sorted(steps_b)
    # Through step 2 the two runs are one run: every seeded metric equal, validation (step 0) included.
    assert steps_a[0] == steps_b[0] and steps_a[0], (steps_a[0], steps_b[0])
    for step in range(1, REPEAT_STEPS + 1):
        a = {k: v for k, v in steps_a[step].items() if not VALIDATION.search(k)}
        b = {k: v for k, v in steps_b[step].items() if not VALIDATION.search(k)}
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        differ = {k: (v, b[k]) for k, v in a.items() if b[k] != v}
        assert not differ, (step, differ)
    assert "hf rollout server computes in float64" in log_a
    # The demo model is built by training on the CPU; another CPU type rounds differently and builds another model
    # (results/demo/2026-12-02-model-digests.md), so the bar must hold for every such model, not for one. Seed 1's
    # validation
    # F1 on three builds of this code, validated every step (that report's table): an AMD EPYC's (9315c3b2) 0.109 before,
    # +0.03 after step 3, +0.20 after step 5 (this test's earlier bars, +0.1 after 3 steps then after 5, failed there
    # and on the third build respectively); the same machine with AVX2 kernels (129948d1) +0.25 after step 5;
    # with SSE4.2/default kernels (4a6cc30d) 0.0625 flat through step 5, then 0.500 after step 6 and 0.469 after 10.
    # This test on the AMD build: 0.109 -> 0.891 after 10 steps.
    # No update gives +0 (validation sampling is seeded).
    before, after = float(line_a.group(1)), float(line_a.group(2))
    assert after >= before + 0.1, (before, after)
    # The health metrics the early warning reads are logged every step.
    assert all("health/wellformed_call_share" in steps_a[s] for s in range(1, LEARN_STEPS + 1))

    # The default path, on run a (once per step: 10 values).
    assert "answer scoring on the actor" in out_a and "igpo: Ray dashboard at http://127.0.0.1:8265" in out_a, \
        out_a[-3000:]
    ratios = logged_values(log_a, "igpo/ig_active_ratio")
    assert len(ratios) == LEARN_STEPS and min(ratios) > 0.05, f"too few trajectories carried information gain: {ratios}"
    raw_ig = logged_values(log_a, "igpo/raw_ig_mean")
    assert len(raw_ig) == LEARN_STEPS and all(abs(v) < 50 for v in raw_ig), raw_ig
    tokens = logged_values(log_a, "igpo/scoring_tokens")
    assert len(tokens) == LEARN_STEPS and min(tokens) > 0, "the actor scored nothing"
    assert logged_values(log_a, "igpo/scoring_errors") == [0.0] * LEARN_STEPS
    adv = logged_values(log_a, "igpo/adv_abs_mean")
    assert len(adv) == LEARN_STEPS and min(adv) > 0, adv
    grad_norms = logged_values(log_a, "actor/grad_norm")
    assert len(grad_norms) == LEARN_STEPS and min(grad_norms) > 0, grad_norms
    shares = logged_values(log_a, "igpo/scoring_step_share")
    assert len(shares) == LEARN_STEPS and all(0 < v < 1 for v in shares), shares
    # Information gain tracks information on the demo world: a search whose observation holds the answer raises the
    # answer's probability; one that does not (wrong hop, or the first hop of a two-hop question) lowers it.
    seen, seen_count = _pooled_ig(log_a, "seen")
    unseen, unseen_count = _pooled_ig(log_a, "unseen")
    assert seen_count > 0 and unseen_count > 0, (seen_count, unseen_count)
    assert seen > unseen + 1.0, (seen, unseen)
    assert list((tmp_path / "a" / "tensorboard").rglob("events.out.tfevents.*")), "no TensorBoard events were written"
    # Nothing the run started outlives it: Ray's GCS, raylet and workers, the tool server (all in its process group).
    assert not leftovers, f"processes of the run outlived it: {leftovers}"

    # Run b's trajectory log (its metrics equal run a's above, so keeping the log changes nothing that trains): with
    # the actor scoring, each line holds the answer log-prob at every scored boundary and the information gain of
    # every credited turn, and one advantage per turn on the trained tokens.
    rows = read_step(tmp_path / "trajectories" / "step_00001.jsonl")
    assert len(rows) == 64
    terms = [row["terms"] for row in rows]
    scored = [v for t in terms for v in t["answer_logprob"] if v is not None]
    gains = [v for t in terms for v in t["information_gain"] if v is not None]
    assert scored and gains and all(v <= 0 for v in scored), (len(scored), len(gains))
    # igpo/ig_active_samples counts the trajectories with a credited turn
    active = logged_values(log_b, "igpo/ig_active_samples")[0]
    assert sum(any(v is not None for v in t["information_gain"]) for t in terms) == active, active
    for row in rows:
        assert len(logged_turn_advantages(row)) == len(row["turn_spans"]) == len(row["terms"]["answer_logprob"])
