"""The LLM judge's start-up probe (issue 25): ``python -m igpo.main`` calls the judge once when a reward uses it
(``igpo.reward.judge.probe_judge``, from ``igpo.main.probe_upstreams``), against ``tests/support/fake_openai.py`` over real HTTP.
A judge that is down or refuses the key stops the launch before Ray with
``igpo: upstream error: judge at <url>: <what came back>; <fix>`` and exit 2, the key masked; a live one lets the
launch go on; a reward without the judge sends it nothing.

The live judge's launch runs the command itself (``--dry-run --probe`` read from the command line, the exit status);
the others run what it runs once Hydra has composed the config, ``igpo.main.run``, in this process: a fresh Python
would only import torch and verl again (~6 CPU-seconds a launch)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, Reply
from hydra import compose, initialize_config_dir

import igpo.main
from igpo.reward.judge import JUDGE_FIX, JudgeConfig, probe_judge

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-probe-SECRET-1234"
# Qwen3-4B's config.json: enough to plan a launch, no weights (as in test_launch_plan).
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 262144, "rope_theta": 5000000, "vocab_size": 151936, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
}


def dead_base() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # nothing listens there once closed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_4b_config_only")
    (folder / "config.json").write_text(json.dumps(QWEN3_4B))
    return folder


UNSET = ("API_BASE", "API_KEY", "ENABLE_JUDGE_THINKING", "RAY_ADDRESS")


def judge_env(api_base: str) -> dict[str, str]:
    """The judge's environment a launch reads (the names in UNSET are removed besides)."""
    return {"JUDGE_API_BASE": api_base, "JUDGE_API_KEY": KEY, "JUDGE_MODEL_NAME": "judge-model"}


def launch_overrides(model_dir: Path, reward_type: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={REPO / 'data' / 'train_nq_256.parquet'}",
            f"data.val_files={REPO / 'data' / 'qa_test_7src.parquet'}",
            f"+reward.custom_reward_function.reward_kwargs.train_reward_type={reward_type}"]


def launch_command(model_dir: Path, api_base: str) -> tuple[int, str]:
    """``python -m igpo.main --dry-run --probe`` (the probe a real launch runs before Ray), output and exit code."""
    env = {**os.environ, **judge_env(api_base)}
    for name in UNSET:
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "igpo.main", "--dry-run", "--probe", "--config-name", "igpo_trainer",
         *launch_overrides(model_dir, "llm")],
        cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode, proc.stdout


@pytest.fixture
def launch(monkeypatch, capsys, caplog):
    """``launch(model_dir, api_base, reward_type)``: what ``python -m igpo.main --dry-run --probe`` runs (the probe a
    real launch runs before Ray) with the judge's environment set: (exit status, everything it printed or logged)."""
    def run(model_dir: Path, api_base: str, reward_type: str = "llm") -> tuple[int, str]:
        for name, value in judge_env(api_base).items():
            monkeypatch.setenv(name, value)
        for name in UNSET:
            monkeypatch.delenv(name, raising=False)
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
            config = compose(config_name="igpo_trainer", overrides=launch_overrides(model_dir, reward_type))
        status = igpo.main.run(config, dry_run=True, probe=True)
        captured = capsys.readouterr()
        return status, captured.err + captured.out + caplog.text  # the log too: a key leaked there counts

    return run


def test_a_dead_judge_stops_the_launch_with_its_url_and_the_fix(model_dir, launch):
    base = dead_base()
    rc, out = launch(model_dir, base)
    assert rc == 2, out[-3000:]
    line = next((l for l in out.splitlines() if l.startswith("igpo: upstream error: judge at ")), None)
    assert line is not None, out[-3000:]
    assert line.startswith(f"igpo: upstream error: judge at {base}/chat/completions: ConnectError"), line
    assert line.endswith(f"; {JUDGE_FIX}"), line
    assert "dry run ok" not in out and KEY not in out


def test_a_judge_that_refuses_the_key_stops_the_launch_with_the_key_masked(model_dir, launch):
    with FakeOpenAI() as judge:
        # some gateways echo the key they refused
        judge.default = Reply(status=401, raw=json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}))
        rc, out = launch(model_dir, judge.base_url)
        assert len(judge.requests) == 1  # one call, no retries
    assert rc == 2, out[-3000:]
    assert (f"igpo: upstream error: judge at {judge.base_url}/chat/completions: HTTP 401: "
            '{"error": {"message": "Incorrect API key provided: ***"}}; ' + JUDGE_FIX) in out, out[-3000:]
    assert KEY not in out


def test_a_live_judge_gets_one_call_and_the_launch_goes_on(model_dir):
    with FakeOpenAI() as judge:
        rc, out = launch_command(model_dir, judge.base_url)
        requests = list(judge.requests)
    assert rc == 0 and "igpo: dry run ok" in out and "upstream error" not in out, out[-3000:]
    assert len(requests) == 1
    assert requests[0].body["model"] == "judge-model"
    assert requests[0].headers.get("authorization") == f"Bearer {KEY}"


def test_a_reward_without_the_judge_sends_it_nothing(model_dir, launch):
    with FakeOpenAI() as judge:
        rc, out = launch(model_dir, judge.base_url, reward_type="f1")
        assert judge.requests == []
    assert rc == 0 and "igpo: dry run ok" in out, out[-3000:]


@pytest.mark.parametrize("reply, finding", [
    (Reply(status=200, raw='{"object": "list", "data": []}'), "a reply that is not an OpenAI chat completion"),
    (Reply(status=503, raw="upstream overloaded"), "HTTP 503: upstream overloaded"),
])
def test_probe_findings(reply, finding):
    with FakeOpenAI() as judge:
        judge.default = reply
        problem = probe_judge(JudgeConfig(model="m", api_base=judge.base_url, api_key=KEY), timeout_s=5)
    assert problem == f"upstream error: judge at {judge.base_url}/chat/completions: {finding}; {JUDGE_FIX}"
