"""End to end on CPU (issue 25, "failures surface, never train around"): `bash train_igpo.sh` with the retriever
backend in front of (a) a dead port: the launch stops before Ray with the retriever's URL; (b) a retriever failing
half of its queries: the infra breaker stops the run after tools.infra_breaker.steps steps with a checkpoint and its
line (that run is the search_r1_local rehearsal's, tests/launch/test_recipes.py); (c) one failing 5% of them,
training InfoPO: the run completes and the step lines show the masked counts."""

import math
import os
import re
import subprocess
import sys

import pytest

from fake_upstreams import FakeUpstream, InProcessServer
from fault_retriever import ShareFailing, bm25_reply
from guarded_run import GPU_PRECISION, REPO, SEARCHING_DEMO, run_guarded
from igpo.integration.trajectory_log import read_step
from tool_server.config import ServerConfig

pytestmark = pytest.mark.e2e


def _env(run, **extra):
    env = {**os.environ, "OUTPUT_DIR": str(run), "IGPO_DEVICE": "cpu", "TOOL_BACKEND": "retriever", **extra}
    env.pop("TOOL_SERVER_URL", None)
    return env


def test_a_dead_retriever_stops_the_launch_before_step_1(tmp_path):
    rc, out = run_guarded(["bash", "train_igpo.sh", "trainer.total_training_steps=2"],
                          _env(tmp_path / "run", RETRIEVER_URL="http://127.0.0.1:9"), timeout=600)
    assert rc == 2, out[-3000:]
    assert re.search(r"^igpo: upstream error: retriever at http://127\.0\.0\.1:9/retrieve: .*connection error.*; "
                     r"start the retrieval server, or point RETRIEVER_URL / --retriever-url at it$", out, re.M), out
    assert "step:" not in out and "Ray dashboard" not in out  # nothing started


def _world(tmp_path):
    world = tmp_path / "world"
    subprocess.run([sys.executable, "-m", "igpo.demo.world", "--out-dir", str(world), "--base-corpus",
                    str(REPO / "data" / "wiki_passages_1000.jsonl")], check=True, cwd=REPO, capture_output=True)
    return world / "corpus.jsonl"


def _run_behind(tmp_path, share: float, args: list[str]):
    """train_igpo.sh searching the demo world through a retriever that fails ``share`` of its queries."""
    with InProcessServer(ServerConfig(backend="local", corpus=_world(tmp_path))) as bm25, FakeUpstream() as fake:
        faults = ShareFailing(share, bm25_reply(bm25.url))
        fake.defaults["/retrieve"] = faults
        rc, out = run_guarded(["bash", "train_igpo.sh", *SEARCHING_DEMO, *args],
                              _env(tmp_path / "run", RETRIEVER_URL=fake.url), timeout=1500)
    print("\n".join(line for line in out.splitlines()  # what the terminal showed, for the record (pytest -s)
                    if re.match(r"igpo: (step:|infra breaker|upstream error|probe ok|tool server)", line)))
    return rc, out, faults


def test_infopo_behind_a_retriever_failing_5_percent_completes_showing_the_masked_counts(tmp_path):
    """(c), trained with adv_estimator=infopo: one run serves the infra path and InfoPO's (the actor scores each
    observation's counterfactual, the factual term comes from old_log_probs, the infopo/* metrics are logged with no
    failed turn), and InfoPO meets trajectories the infra policy masked. In verl's GPU precision (fp32 master
    weights, bf16 compute), the one trainer run of the tests in it: the actor's scoring and update under bf16. In the
    asynchronous trainer mode (igpo_colocate_async: a warm-up batch in flight, generation paused for each update and
    resumed on the new weights), the suite's run of that mode: each step logs verl's off-policy figures and the share
    of trajectories resumed on new weights, and the trajectory log records the weight versions of every turn."""
    rc, out, faults = _run_behind(tmp_path, 0.05, ["trainer.total_training_steps=2", "algorithm.adv_estimator=infopo",
                                                   f"trainer.trajectory_dir={tmp_path / 'trajectories'}",
                                                   "trainer.v1.trainer_mode=igpo_colocate_async", *GPU_PRECISION])
    assert rc == 0, out[-4000:]
    assert "igpo: step:2/2" in out and "infra breaker" not in out, out[-3000:]
    steps = [s for s in out.splitlines() if re.match(r"igpo: step:\d", s)]
    masked = [int(m) for s in steps for m in re.findall(r"igpo/infra_masked_trajectories:(\d+)", s)]
    assert faults.failing >= 1 and sum(masked) >= 1, (steps, faults.distinct, faults.failing)

    log = (tmp_path / "run" / "train.log").read_text()
    # The asynchronous mode takes the PPO ratio against the rollout's log-probs (the launcher's default there), so
    # old_log_probs are the rollout engine's and InfoPO scores its factual term beside the counterfactual.
    assert "InfoPO counterfactual information gain" in log, out[-3000:]
    assert "is recomputed beside the counterfactual: in rollout_correction bypass mode" in log, out[-3000:]
    assert "the PPO ratio is taken against the rollout's own log-probabilities" in out, out[-3000:]

    def values(key):
        return [float(v) for v in re.findall(rf"infopo/{key}:([0-9.eE+-]+|nan)", log)]

    assert len(values("gate_mean")) == 2 and all(0 < g <= 0.5 for g in values("gate_mean"))
    assert max(values("scored_turns")) > 0, "no turn was scored"
    assert values("failed_turns") == [0.0, 0.0]
    assert min(values("counterfactual_tokens")) <= min(values("counterfactual_tokens_unshared"))
    assert len(values("intrinsic_raw_std")) == 2 and all(math.isfinite(v) for v in values("intrinsic_raw_std"))
    # The trajectory log holds InfoPO's per-turn counterfactual term and each row's gate beside what trained; a
    # masked trajectory trained nothing and has no gate.
    rows = [row for step in (1, 2) for row in read_step(tmp_path / "trajectories" / f"step_{step:05d}.jsonl")]
    intrinsic = [v for row in rows for v in row["terms"]["intrinsic"] if v is not None]
    assert len(intrinsic) == sum(values("scored_turns")), (len(intrinsic), values("scored_turns"))
    for row in rows:
        assert len(row["terms"]["intrinsic"]) == len(row["turn_spans"])
        if row["advantage"]:
            assert 0 < row["terms"]["gate"] <= 0.5 and row["terms"]["beta"] > 0
    assert sum(not row["advantage"] for row in rows) >= sum(masked)
    # The asynchronous schedule: verl's staleness figures and our resumed share each step; every turn's versions.
    assert len(re.findall(r"training/off_policy/trajectory_spans/max:", log)) == 2, log[-3000:]
    shares = [float(v) for v in re.findall(r"igpo/partial_trajectory_share:([0-9.]+)", log)]
    assert len(shares) == 2 and all(0 <= v <= 1 for v in shares), shares
    versions = [v for row in rows for v in row["record"].turn_versions]
    assert versions and all(v is not None and 0 <= v[0] <= v[1] <= 2 for v in versions), versions[:10]
