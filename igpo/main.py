"""``python -m igpo.main [hydra overrides]``: verl's PPO entry point with IGPO's config and early, clear checks.

Equivalent to ``python -m verl.trainer.main_ppo --config-path configs --config-name igpo_trainer`` (which also works),
plus checks that turn the usual start-up mistakes into one-line errors before Ray starts: a missing model or data
file, an unknown or invalid ``algorithm.igpo`` key, or a GPU-only option on a machine without a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


class ConfigError(ValueError):
    """A user-fixable configuration problem; printed without a traceback."""


def check_config(config) -> None:
    """Fail fast on inputs the trainer would otherwise reject deep inside a Ray worker."""
    from igpo.config import IGPOConfig

    model_path = str(config.actor_rollout_ref.model.path)
    looks_like_hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/", "~"))
    if not Path(model_path).expanduser().is_dir() and not looks_like_hub_id:
        raise ConfigError(f"actor_rollout_ref.model.path={model_path!r} is not a directory; set MODEL_PATH (or the "
                          "override) to a local Hugging Face checkpoint.")
    for key in ("train_files", "val_files"):
        files = config.data.get(key)
        for path in ([files] if isinstance(files, str) else list(files or [])):
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path!r} does not exist; prepare it with scripts/prepare_data.py.")
    if config.algorithm.adv_estimator in ("igpo", "grpo_info_gain"):
        try:
            IGPOConfig.from_algorithm(config.algorithm)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    reward_kwargs = (config.reward.get("custom_reward_function") or {}).get("reward_kwargs") or {}
    reward_types = {reward_kwargs.get("train_reward_type", "f1"), *dict(reward_kwargs.get("reward_type_by_source")
                                                                     or {}).values()}
    if "llm" in reward_types:
        from omegaconf import OmegaConf

        from igpo.judge import JudgeConfig

        judge = reward_kwargs.get("judge") or {}
        try:
            JudgeConfig.from_env(**(OmegaConf.to_container(judge) if OmegaConf.is_config(judge) else dict(judge)))
        except ValueError as error:
            raise ConfigError(f"train_reward_type=llm: {error} Set it in .env (see .env.example) or use "
                              "reward.custom_reward_function.reward_kwargs.train_reward_type=f1.") from None
    if os.environ.get("VERL_PLATFORM", "").lower() == "cpu":
        rollout = config.actor_rollout_ref.rollout.name
        if rollout != "hf":
            raise ConfigError(f"actor_rollout_ref.rollout.name={rollout!r} needs a GPU, and this run is on the CPU; "
                              "use rollout.name=hf (the CPU demo preset does) or run on a GPU machine.")
        for role in ("actor", "ref"):
            strategy = config.actor_rollout_ref[role].strategy
            if strategy != "fsdp2":
                raise ConfigError(f"actor_rollout_ref.{role}.strategy={strategy!r} needs a GPU; use fsdp2 on CPU.")


@hydra.main(config_path=CONFIG_DIR, config_name="igpo_trainer", version_base=None)
def main(config) -> None:
    from verl.trainer import main_ppo as verl_main
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    try:
        check_config(config)
    except ConfigError as error:
        print(f"igpo: configuration error: {error}", file=sys.stderr)
        sys.exit(2)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=verl_main.need_reference_policy(config),
                    use_critic=verl_main.need_critic(config))
    verl_main.run_ppo(config, task_runner_class=verl_main.TaskRunnerV1)


if __name__ == "__main__":
    main()
