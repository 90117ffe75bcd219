"""``python -m igpo.main [--dry-run] [hydra overrides]``: verl's PPO entry point with IGPO's config, planned and checked.

Before Ray starts: ``igpo.launch.launch_plan.plan_launch`` checks the inputs and derives the GPU layout (attention,
sequence parallelism, context window), then verl's own ``validate_config`` runs. Either one's refusal is printed as
``igpo: configuration error: ...`` and exits 2; so does an override of the reference launch scripts
(``igpo.config.REFERENCE_LAUNCH_KEYS``), checked before Hydra reads the command line. ``--dry-run`` stops there and
prints the plan, ending with
``igpo: dry run ok: gpus=... nodes=... rollout=... tp=... sp=... context_tokens=... score_on=... ...``.
A launch (and ``--dry-run --probe``) also calls the LLM judge once when a reward uses it; one that does not answer
stops here with ``igpo: upstream error: judge at <url>: <what came back>; <fix>`` (exit 2). A Ray node whose workers
cannot reach the tool server (``igpo.integration.node_reach``, checked by the trainer once Ray is up) stops the launch
with one ``igpo: upstream error: tool server at <url> from Ray node ...`` line per node (exit 2). Everything after
Hydra's composition is ``run(config, dry_run, probe)``, which returns the exit status.

``python -m verl.trainer.main_ppo --config-path configs --config-name igpo_trainer`` runs the same config without
the planning (set the planned keys yourself).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import hydra

from igpo.config import ConfigError, refuse_reference_overrides
from igpo.cpu import vllm_cpu
from igpo.integration import LAZY_REGISTRATION_ENV
from igpo.integration.node_reach import unreachable_cause
from igpo.launch.launch_plan import Environment, plan_launch

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
DRY_RUN_FLAG = "--dry-run"
PROBE_FLAG = "--probe"
_dry_run = False
_probe = False


def probe_upstreams(config) -> list[str]:
    """Problem lines of the upstreams this process itself depends on: the LLM judge when a reward uses it (the tool
    server probes its own upstreams, ``tool_server.probe``). [] when all answer."""
    from igpo.reward.judge import JudgeConfig, probe_judge
    from igpo.reward import OutcomeRewardConfig

    from omegaconf import OmegaConf

    section = OmegaConf.select(config, "reward.custom_reward_function.reward_kwargs")
    kwargs = OmegaConf.to_container(section, resolve=True) if section is not None else {}
    try:
        reward = OutcomeRewardConfig.from_kwargs(kwargs)
    except (TypeError, ValueError):
        return []  # not our reward function's kwargs: nothing of ours to probe
    types = {reward.train_reward_type, *dict(reward.reward_type_by_source or {}).values()}
    if "llm" not in types:
        return []
    try:
        judge = JudgeConfig.from_env(**dict(reward.judge))
    except ValueError as error:
        return [f"upstream error: judge: {error}"]
    problem = probe_judge(judge)
    return [problem] if problem else []


def pin_own_cluster(config, environ) -> None:
    """A run told of no cluster (``RAY_ADDRESS`` unset and no ``ray_kwargs.ray_init.address``) starts its own: set
    ``address=local``. Ray's default would join whichever cluster was last recorded on this machine (``ray start``
    and ``ray.cluster_utils.Cluster`` write ``<RAY_TMPDIR or TMPDIR or /tmp>/ray/ray_current_cluster``), whose
    resources are not this run's and which refuses the presets' ``num_cpus``/``num_gpus``."""
    from omegaconf import open_dict

    ray_init = config.ray_kwargs.ray_init
    if environ.get("RAY_ADDRESS") or ray_init.get("address"):
        return
    with open_dict(ray_init):
        ray_init.address = "local"


def prepare(config, dry_run: bool):
    """Plan and validate ``config`` in place; returns the ``Plan``. Raises ``ConfigError``."""
    from verl.trainer import main_ppo as verl_main
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    plan = plan_launch(config, Environment.detect(dry_run))
    if not dry_run and plan.rollout == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"actor_rollout_ref.rollout.name=vllm but vLLM is not installed in {sys.executable} (the "
                          "CPU environment?); install the GPU stack (README, 'Running on GPUs') or point IGPO_PYTHON "
                          "at the Python that has it.")
    if not plan.gpus:
        auto_set_device(config)  # GPU plans keep device=cuda even when planned on a machine without one
        if plan.rollout == "vllm" and not dry_run:
            vllm_cpu.set_engine_environment()  # before Ray starts: its workers inherit this environment
    try:
        validate_config(config=config, use_reference_policy=verl_main.need_reference_policy(config),
                        use_critic=verl_main.need_critic(config))
    except (AssertionError, ValueError) as error:
        raise ConfigError(f"verl rejects this layout: {error}") from None
    return plan


def run(config, dry_run: bool = False, probe: bool = False) -> int:
    """Everything after Hydra composed ``config``: plan and validate it (``prepare``), print the plan, call the LLM
    judge (a launch, or a dry run with ``probe``), then print the plan's line (dry run) or train. Returns the exit
    status: 0, or 2 after printing ``igpo: configuration error: ...`` or ``igpo: upstream error: ...``. The entry
    point below runs it; tests run it in their own process on a config they compose."""
    try:
        plan = prepare(config, dry_run)
    except ConfigError as error:
        print(f"igpo: configuration error: {error}", file=sys.stderr)
        return 2
    for line in plan.describe():
        print(line, flush=True)
    if not dry_run or probe:  # before Ray starts: a dead judge stops the launch, not the run hours later
        problems = probe_upstreams(config)
        for line in problems:
            print(f"igpo: {line}", file=sys.stderr, flush=True)
        if problems:
            return 2
    if dry_run:
        print(plan.line(), flush=True)
        return 0
    from verl.trainer import main_ppo as verl_main

    from igpo.integration.task_runner import TaskRunner

    # The Ray cluster run_ppo starts inherits this: its processes leave the estimator and trainer modules to the
    # TaskRunner (igpo/plugin.py). Workers of a cluster joined with RAY_ADDRESS do not see it and import them all.
    pin_own_cluster(config, os.environ)
    lazy = os.environ.get(LAZY_REGISTRATION_ENV)
    os.environ[LAZY_REGISTRATION_ENV] = "1"
    try:
        verl_main.run_ppo(config, task_runner_class=TaskRunner)
    except Exception as error:
        unreachable = unreachable_cause(error)
        if unreachable is None:
            raise
        for line in str(unreachable).splitlines():  # the trainer's per-node check, raised inside Ray's task runner
            print(f"igpo: {line}", file=sys.stderr, flush=True)
        return 2
    finally:
        if lazy is None:
            os.environ.pop(LAZY_REGISTRATION_ENV, None)
        else:
            os.environ[LAZY_REGISTRATION_ENV] = lazy
    return 0


@hydra.main(config_path=CONFIG_DIR, config_name="igpo_trainer", version_base=None)
def main(config) -> None:
    status = run(config, _dry_run, _probe)
    if status:
        sys.exit(status)


def check_overrides(argv: list[str]) -> None:
    """Refuse the reference launch scripts' keys before Hydra sees them (exit 2 naming ours): with a "+" Hydra would
    add and ignore them; without one it would print its generic "not in struct" error."""
    try:
        refuse_reference_overrides([a for a in argv if not a.startswith("-")])
    except ValueError as error:
        print(f"igpo: configuration error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if DRY_RUN_FLAG in sys.argv[1:]:
        sys.argv.remove(DRY_RUN_FLAG)
        _dry_run = True
    if PROBE_FLAG in sys.argv[1:]:  # with --dry-run: probe the upstreams too (a real launch always does)
        sys.argv.remove(PROBE_FLAG)
        _probe = True
    check_overrides(sys.argv[1:])
    main()
