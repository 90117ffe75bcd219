"""`python -m igpo.main` on CPU stops a launch it cannot run with a clear error (exit 2) before Ray starts: the
entry point in a subprocess once, the other checks in this process (``igpo.main.run``, which the entry point calls). The
default path through verl's Ray trainer (our estimator, agent loop, trainer mode, CPU backend and tool server, IGPO
metrics) is tests/e2e/test_e2e_learning.py's 10-step run. Guarded: the whole process group dies on timeout."""

import importlib.util
import os
import sys

import pytest

from guarded_run import run_guarded

pytestmark = pytest.mark.e2e


def test_missing_model_path_is_a_clear_error():
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    rc, out = run_guarded([sys.executable, "-m", "igpo.main", "--config-name", "cpu_demo",
                    "actor_rollout_ref.model.path=/nonexistent/model"], env, timeout=120)
    assert rc == 2 and "actor_rollout_ref.model.path='/nonexistent/model' is not a directory" in out, out[-2000:]


def _launch_in_process(monkeypatch, capsys, *overrides: str) -> tuple[int, str]:
    """What ``python -m igpo.main --config-name cpu_demo [overrides]`` runs after Hydra's composition
    (``igpo.main.run``), in this process, with verl's trainer replaced by a failure: a check that lets the launch
    through fails the test instead of starting Ray here. (exit status, stderr then stdout.) The entry point itself is
    the subprocess above."""
    import verl.trainer.main_ppo
    from hydra import compose, initialize_config_dir

    import igpo.main

    monkeypatch.setattr(verl.trainer.main_ppo, "run_ppo", lambda *args, **kwargs: pytest.fail("the launch went on"))
    with initialize_config_dir(config_dir=igpo.main.CONFIG_DIR, version_base=None):
        config = compose(config_name="cpu_demo", overrides=list(overrides))
    status = igpo.main.run(config)
    captured = capsys.readouterr()
    return status, captured.err + captured.out


def _demo_data(model_dir) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=data/train_nq_256.parquet",
            "data.val_files=data/train_nq_256.parquet"]


@pytest.mark.parametrize("rollout, message", [
    ("sglang", "actor_rollout_ref.rollout.name='sglang' needs a GPU"),
    # vLLM runs on the CPU only in the vLLM CPU environment (tests/e2e/test_e2e_vllm.py); this Python is the CPU .venv.
    ("vllm", "build the vLLM CPU environment: bash scripts/env_vllm.sh"),
])
def test_gpu_only_rollout_on_cpu_is_a_clear_error(tiny_model_dir, monkeypatch, capsys, rollout, message):
    if rollout == "vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip(f"{sys.executable} has vLLM")
    rc, out = _launch_in_process(monkeypatch, capsys, *_demo_data(tiny_model_dir),
                                 f"actor_rollout_ref.rollout.name={rollout}")
    assert rc == 2 and message in out, out[-2000:]


def test_unknown_igpo_key_is_a_clear_error(tiny_model_dir, monkeypatch, capsys):
    rc, out = _launch_in_process(monkeypatch, capsys, *_demo_data(tiny_model_dir), "+algorithm.igpo.norm_mod=joint")
    assert rc == 2 and "norm_mod" in out and "check the spelling" in out, out[-2000:]


def test_llm_judge_without_its_endpoint_is_a_clear_error(tiny_model_dir, monkeypatch, capsys):
    for key in ("JUDGE_MODEL_NAME", "JUDGE_API_BASE", "API_BASE", "JUDGE_API_KEY", "API_KEY"):
        monkeypatch.delenv(key, raising=False)
    rc, out = _launch_in_process(monkeypatch, capsys, *_demo_data(tiny_model_dir),
                                 "reward.custom_reward_function.reward_kwargs.train_reward_type=llm")
    assert rc == 2 and "JUDGE_MODEL_NAME is not set" in out, out[-2000:]
