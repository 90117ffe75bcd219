"""A search_r1_local rehearsal that a flaky retriever stops, a crash inside its last checkpoint, and the resume.

Run A is the recipe scaled down (configs/rehearsal/cpu.yaml: tiny warm-started model, EM reward, search only, 32
prompts x 2), its retriever backend in front of our own local BM25 server playing Search-R1's /retrieve through a
fake that answers HTTP 503 to half of the distinct queries. After 2 consecutive steps with more than 20% of tool calls
failing the infra breaker (issue 25, "failures surface, never train around"; the other infra runs are
tests/e2e/test_e2e_infra.py) stops the run of 3 steps after step 2, with its line; A checkpoints after each step.

The crash is then simulated inside step 2's save, after our state file (written first) and before verl's part
finished: step 2's actor and dataloader files are gone and verl's pointer (latest_checkpointed_iteration.txt) still
names step 1. Run B (resume_mode=auto, same checkpoint folder) must resume step 1 with step 1's own state, not step
2's orphaned state file, and train step 2 again on the same prompts. Last, the recipe's evaluation of the model.
Guarded: each run's process group dies on timeout.
"""

import json
import os
import re
import shutil
import sys

import pytest

from fake_upstreams import FakeUpstream, InProcessServer
from fault_retriever import ShareFailing, bm25_reply
from guarded_run import REPO, run_guarded
from tool_server.config import ServerConfig

pytestmark = pytest.mark.e2e

# A warm-up threshold the rehearsal's EM never reaches: the gate stays closed with an EMA (a fresh gate has none), so
# a gate restarted from scratch instead of restored shows.
COMMON = ["+rehearsal=cpu", "trainer.save_freq=1", "algorithm.igpo.ig_warmup_threshold=0.99"]
PROMPTS_PER_STEP = 32  # configs/rehearsal/cpu.yaml


def _reports(log: str, kind: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(rf"igpo: {kind}[^{{\n]*(\{{.*\}})", log)]


def _prompts(rollouts, step: int) -> list[str]:
    """The prompts trained at ``step`` (verl's rollout dump, one JSON line per trajectory), order-free."""
    lines = (rollouts / f"{step}.jsonl").read_text().splitlines()
    return sorted(json.loads(line)["input"] for line in lines)


def _trajectories(rollouts, step: int) -> list[tuple[str, str]]:
    """Step ``step``'s (prompt, sampled response) pairs, order-free."""
    lines = (rollouts / f"{step}.jsonl").read_text().splitlines()
    return sorted((json.loads(line)["input"], json.loads(line)["output"]) for line in lines)


def _check_run_a(out: str, log: str, faults: ShareFailing, upstream: InProcessServer, checkpoints) -> dict:
    """The rehearsal and the breaker; returns run A's checkpoint reports by step."""
    assert "igpo: step:1" in out and "igpo: step:2/3" in out and "igpo: step:3/3" not in out, out[-3000:]
    assert "tool server (retriever)" in out
    assert "'train_reward_type': 'em'" in log or "train_reward_type: em" in log, "the recipe's reward was not used"
    assert upstream.service.stats.calls["search"] > 0, "no search reached the Search-R1-dialect upstream"
    # The breaker: its line, and every step line showing the infrastructure failures and the trajectories masked
    # for them.
    assert faults.failing >= 2, (faults.distinct, faults.failing)
    line = re.search(r"igpo: infra breaker: 2 consecutive steps with more than 20% of tool calls failing for "
                     r"infrastructure reasons \(this step: (\d+) of (\d+), (\d+) trajectories masked\); failing: "
                     r"retriever: http_503 x\d+.*Stopped after step 2/3; checkpoint \S+global_step_2\.", out)
    assert line, out[-4000:]
    steps = [s for s in out.splitlines() if re.match(r"igpo: step:\d", s)]
    assert len(steps) == 2 and all("igpo/infra_errors:" in s and "igpo/infra_masked_trajectories:" in s
                                   for s in steps), steps
    # A checkpoint after each step (the breaker's stop reuses step 2's), each with our state.
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    saved = {r["global_step"]: r for r in _reports(log, "checkpoint saved")}
    assert sorted(saved) == [1, 2], log[-3000:]
    assert saved[1]["warmup_gate"]["ema"] is not None and not saved[1]["warmup_gate"]["graduated"]
    # verl fetches one prompt per dataloader batch.
    assert [saved[s]["dataloader"]["samples"] for s in (1, 2)] == [PROMPTS_PER_STEP, 2 * PROMPTS_PER_STEP]
    assert saved[1]["actor_digests"] != saved[2]["actor_digests"], "the update did not change the weights"
    on_disk = json.loads((checkpoints / "global_step_1" / "igpo_state.json").read_text())
    assert on_disk["saved"] == saved[1]  # the state file holds what the log reports
    return saved


def _crash_inside_step_2s_save(checkpoints) -> None:
    """Our state for step 2 is complete (it is written first), verl's part of step 2 is not. Step 2's orphaned state
    is marked (an open gate) to tell it from step 1's."""
    shutil.rmtree(checkpoints / "global_step_2" / "actor")
    (checkpoints / "global_step_2" / "data.pt").unlink()
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("1")
    orphan = checkpoints / "global_step_2" / "igpo_state.json"
    orphan.write_text(json.dumps({"warmup_gate": {"ema": 0.75, "graduated": True}}))


def _check_run_b(log_b: str, saved: dict, tmp_path, checkpoints) -> None:
    resumed = _reports(log_b, "resumed from")
    assert len(resumed) == 1, log_b[-3000:]
    # Global step, gate EMA and latch, curriculum position, dataloader position and actor weights: step 1's.
    assert resumed[0] == saved[1], (resumed[0], saved[1])
    assert "step:1 -" not in log_b and "step:2 -" in log_b, "the resumed run did not continue at step 2"
    # The dataloader position, seen from the data: the resumed step 2 trains the prompts run A trained at step 2.
    assert _prompts(tmp_path / "b" / "rollouts", 2) == _prompts(tmp_path / "a" / "rollouts", 2)
    # And samples what run A sampled there: the prompts' numbering, which seeds their sampling, was restored (from
    # scratch, step 2's prompts would be numbered from 0 and draw other samples), and the retriever fails the same
    # queries in both runs.
    assert _trajectories(tmp_path / "b" / "rollouts", 2) == _trajectories(tmp_path / "a" / "rollouts", 2)
    # Run B re-saved step 2 over the orphaned state file, now with verl's part complete.
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert json.loads((checkpoints / "global_step_2" / "igpo_state.json").read_text())["saved"] == \
        _reports(log_b, "checkpoint saved")[0]


def test_search_r1_rehearsal_stopped_by_a_flaky_retriever_resumes_after_a_crash_in_its_last_save(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    corpus = REPO / "data" / "wiki_passages_1000.jsonl"
    with InProcessServer(ServerConfig(backend="local", corpus=corpus)) as upstream, FakeUpstream() as flaky:
        faults = ShareFailing(0.5, bm25_reply(upstream.url))
        flaky.defaults["/retrieve"] = faults
        env = {**os.environ, "IGPO_DEVICE": "cpu", "IGPO_RECIPE": "search_r1_local", "RETRIEVER_URL": flaky.url}
        for key in ("TOOL_SERVER_URL", "TOOL_BACKEND", "TOOL_TOPK", "MODEL_PATH", "RAY_ADDRESS"):
            env.pop(key, None)

        def train(name: str, *extra: str) -> tuple[str, str]:
            run = tmp_path / name
            rc, out = run_guarded(["bash", "train_igpo.sh", *COMMON, f"trainer.default_local_dir={checkpoints}",
                                   f"trainer.rollout_data_dir={run / 'rollouts'}", *extra],
                                  {**env, "OUTPUT_DIR": str(run)}, timeout=540)
            assert rc == 0, out[-4000:]
            return out, (run / "train.log").read_text()

        out_a, log_a = train("a", "trainer.total_training_steps=3", "tools.infra_breaker.steps=2")
        saved = _check_run_a(out_a, log_a, faults, upstream, checkpoints)
        _crash_inside_step_2s_save(checkpoints)
        # Step 2 is the last step of run B: the breaker, restored with step 1's strike, has no step after it to stop.
        _, log_b = train("b", "trainer.total_training_steps=2", "trainer.resume_mode=auto")
        _check_run_b(log_b, saved, tmp_path, checkpoints)

        model = re.search(r"tiny model at (\S+)\)", out_a).group(1)
        retriever = InProcessServer(ServerConfig(backend="retriever", retriever_url=upstream.url, default_topk=3))
        with retriever:
            rc, out = run_guarded([sys.executable, "-m", "igpo.evaluate", "--data", "data/qa_test_7src.parquet",
                                   "--limit-per-source", "1", "--model-path", model, "--tool-server", retriever.url,
                                   "--recipe", "search_r1_local", "--max-tokens-per-turn", "64",
                                   "--max-observation-tokens", "96", "--response-length", "512",
                                   "--prompt-length", "1024", "--out", str(tmp_path / "eval")], env, 120)
    assert rc == 0, out[-4000:]
    comparison = (tmp_path / "eval" / "comparison.md").read_text()
    assert "| EM (%) | NQ | TriviaQA | PopQA | HotpotQA | 2Wiki | MuSiQue | Bamboogle | AVG |" in comparison
    assert re.search(r"\| \*\*ours\*\* \|( [0-9.]+ \|){7} [0-9.]+ \|", comparison), comparison
    assert f"This run's tools: backend `retriever` at `{retriever.url}`, top-k 3." in comparison
    settings = json.loads((tmp_path / "eval" / "settings.json").read_text())
    assert settings["tools"]["backend"] == "retriever" and settings["tools"]["top_k"] == 3
    assert settings["agent"]["max_turns"] == 4
    assert "wiki-18 lacks" in settings["recipe"]["corpus_caveat"]
