"""Launch planning (igpo/launch_plan.py) and `bash train_igpo.sh --dry-run`: the GPU presets pass verl's validation
and ours without any GPU here, layouts verl or the job cannot use are refused up front with the keys and the fix."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from igpo.agent_config import RolloutScoringConfig
from igpo.launch_plan import ConfigError, Environment, plan_launch

REPO = Path(__file__).resolve().parent.parent
DATA = {"data.train_files": str(REPO / "data" / "train_nq_256.parquet"),
        "data.val_files": str(REPO / "data" / "qa_test_7src.parquet")}

# Qwen3-4B-Thinking-2507's config.json (the reference system's backbone); no weights are needed to plan.
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 262144, "rope_theta": 5000000, "vocab_size": 151936, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
}


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_4b_config_only")
    (folder / "config.json").write_text(json.dumps(QWEN3_4B))
    return folder


def _compose(overrides: list[str], config_name: str = "igpo_trainer"):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def _plan(model_dir, *overrides, flash=False, planning_only=True, config_name="igpo_trainer"):
    config = _compose([f"actor_rollout_ref.model.path={model_dir}", *(f"{k}={v}" for k, v in DATA.items()),
                       *overrides], config_name)
    return config, plan_launch(config, Environment(flash_attn=flash, planning_only=planning_only))


def test_node8_with_flash_attention_spreads_a_trajectory_over_four_gpus(qwen3_4b):
    config, plan = _plan(qwen3_4b, flash=True)
    assert (plan.gpus, plan.rollout, plan.tp, plan.sp, plan.context_tokens) == (8, "vllm", 2, 4, 131072)
    arr = config.actor_rollout_ref
    assert arr.model.use_remove_padding is True
    assert arr.model.override_config.attn_implementation == "flash_attention_2"
    assert arr.actor.ulysses_sequence_parallel_size == arr.ref.ulysses_sequence_parallel_size == 4
    assert arr.actor.ppo_max_token_len_per_gpu * 4 >= 131072
    assert arr.rollout.max_model_len == 131072
    assert arr.actor.strategy == arr.ref.strategy == "fsdp2"
    assert config.trainer.val_before_train is False


def test_without_flash_attention_the_fallback_is_sdpa_without_sequence_parallelism(qwen3_4b):
    config, plan = _plan(qwen3_4b, flash=False)
    assert (plan.attention, plan.sp, plan.tokens_per_gpu) == ("sdpa", 1, 131072)
    assert config.actor_rollout_ref.model.use_remove_padding is False
    assert any("flash-attn is not installed" in note for note in plan.notes)


def test_sequence_parallelism_without_flash_attention_is_a_configuration_error(qwen3_4b):
    with pytest.raises(ConfigError, match="sequence_parallel=4 needs flash-attn"):
        _plan(qwen3_4b, "igpo_launch.sequence_parallel=4", flash=False)


def test_forcing_flash_attention_that_is_missing_is_refused_unless_planning_for_other_machines(qwen3_4b):
    with pytest.raises(ConfigError, match="flash-attn does not import"):
        _plan(qwen3_4b, "igpo_launch.attention=flash_attention_2", flash=False, planning_only=False)
    _, plan = _plan(qwen3_4b, "igpo_launch.attention=flash_attention_2", flash=False, planning_only=True)
    assert plan.sp == 4 and any("assumed" in note for note in plan.notes)


def test_one_gpu_preset(qwen3_4b):
    config, plan = _plan(qwen3_4b, "gpu_preset=gpu1", "trainer.n_gpus_per_node=1")
    assert (plan.gpus, plan.tp, plan.sp, plan.context_tokens) == (1, 1, 1, 32768)
    assert config.data.train_batch_size == 4 and config.actor_rollout_ref.rollout.n == 4


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.name=???"], "rollout.name is not set"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], "tensor_model_parallel_size=3 does not divide"),
    (["igpo_launch.sequence_parallel=3"], "sequence_parallel=3"),
    (["data.max_response_length=300000"], "max_position_embeddings=262144"),
    (["data.max_response_length=8192"], "leaves no room for one tool call"),
    (["actor_rollout_ref.rollout.n=1"], "groups of >= 2"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=32"], "ppo_mini_batch_size=32 > data.train_batch_size=16"),
    (["actor_rollout_ref.actor.strategy=fsdp"], "set actor_rollout_ref.actor.strategy=fsdp2"),
    (["algorithm.igpo.score_on=rollout", "actor_rollout_ref.rollout.temperature=0.7"], "temperature=0.7"),
    (["algorithm.igpo.score_on=rollout", "trainer.v1.trainer_mode=separate_async"], "drops prompt_logprobs"),
    (["algorithm.rollout_correction.rollout_is=token"], "does not apply verl's rollout correction"),
    (["igpo_launch.sequence_parallel=2", "igpo_launch.tokens_per_gpu=16384"], "does not fit"),
])
def test_layouts_that_cannot_work_name_the_key_and_the_fix(qwen3_4b, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _plan(qwen3_4b, *overrides, flash=True)


def test_score_on_has_one_default():
    config = _compose([], "igpo_trainer")
    assert config.algorithm.igpo.score_on == RolloutScoringConfig.score_on == "actor"


def _dry_run(env_extra, *overrides):
    env = {**os.environ, **env_extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", "train_igpo.sh", "--dry-run", *overrides], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode, proc.stdout


def test_dry_run_plans_eight_and_one_gpus_without_any_gpu(qwen3_4b):
    rc, out = _dry_run({"IGPO_GPUS": "8", "MODEL_PATH": str(qwen3_4b)})
    assert rc == 0, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("igpo: dry run ok: gpus=8 nodes=1 rollout=vllm tp=2 sp=1 context_tokens=131072 "
                           "score_on=actor"), last
    rc, out = _dry_run({"IGPO_GPUS": "1", "MODEL_PATH": str(qwen3_4b)})
    assert rc == 0, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("igpo: dry run ok: gpus=1 nodes=1 rollout=vllm tp=1 sp=1 "
                                                   "context_tokens=32768"), out[-1000:]


def test_dry_run_reports_a_layout_verl_rejects(qwen3_4b):
    rc, out = _dry_run({"IGPO_GPUS": "8", "MODEL_PATH": str(qwen3_4b)}, "actor_rollout_ref.actor.use_dynamic_bsz=false",
                       "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                       "actor_rollout_ref.rollout.n=3")
    assert rc == 2, out[-3000:]
    assert "igpo: configuration error: verl rejects this layout: real_train_batch_size (9) must be divisible" in out


def test_gpus_asked_for_without_gpus_need_the_dry_run(qwen3_4b):
    env = {**os.environ, "IGPO_GPUS": "8", "MODEL_PATH": str(qwen3_4b)}
    proc = subprocess.run(["bash", "train_igpo.sh"], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=60)
    assert proc.returncode == 2 and "add --dry-run" in proc.stdout, proc.stdout[-2000:]


def test_gpus_are_counted_from_cuda_visible_devices_not_every_gpu_of_the_machine(qwen3_4b, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"  # a machine with 4 GPUs, as nvidia-smi lists them whatever CUDA_VISIBLE_DEVICES says
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H200 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "MODEL_PATH": str(qwen3_4b),
           "CUDA_VISIBLE_DEVICES": "1,3"}
    env.pop("IGPO_GPUS", None)
    env.pop("IGPO_DEVICE", None)
    proc = subprocess.run(["bash", "train_igpo.sh", "--dry-run"], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "igpo: 2 GPU(s) per node: preset node8" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("igpo: dry run ok: gpus=2 nodes=1 rollout=vllm tp=2")
