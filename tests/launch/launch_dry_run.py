"""`bash train_igpo.sh --dry-run`, two ways, for the tests of tests/launch/.

``script_dry_run`` runs the script itself: which GPUs and preset it finds, what it hands to Python, the exit code. It
costs a fresh Python that imports torch and verl (~5-7 CPU-seconds), so one test per path through the script uses it.
``dry_run_in_process`` runs what that Python runs, ``igpo.main.run`` (planning, verl's validation, the printed plan),
on the config the script's overrides compose, in this process: a composition, ~0.3 s."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from hydra import compose, initialize_config_dir

import igpo.main

REPO = Path(__file__).resolve().parents[2]
# the data a GPU dry run plans with when TRAIN_FILE / VAL_FILE are not set (train_igpo.sh)
DATA = (f"data.train_files={REPO / 'data' / 'train_nq_256.parquet'}",
        f"data.val_files={REPO / 'data' / 'qa_test_7src.parquet'}")


def script_dry_run(env_extra: dict[str, str], *overrides: str,
                   unset: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)) -> tuple[int, str]:
    """``bash train_igpo.sh --dry-run [overrides]`` with ``env_extra`` over this process's environment, less ``unset``:
    (exit status, stdout and stderr interleaved)."""
    env = {**os.environ, **env_extra}
    for key in unset:
        env.pop(key, None)
    proc = subprocess.run(["bash", "train_igpo.sh", "--dry-run", *overrides], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.returncode, proc.stdout


def dry_run_in_process(capsys, model_dir: Path, *overrides: str, gpus: int = 8,
                       preset: tuple[str, ...] = ()) -> tuple[int, str]:
    """What ``IGPO_GPUS=<gpus> MODEL_PATH=<model_dir> bash train_igpo.sh --dry-run [overrides]`` runs once it has
    chosen: igpo.main's dry run of configs/igpo_trainer.yaml with the script's overrides (``preset``: the preset's or
    recipe's, e.g. ``("gpu_preset=gpu1",)`` or ``("recipe=igpo_web",)``). (exit status, stderr then stdout: the last
    line is the plan's, as in the script's output)."""
    argv = [f"actor_rollout_ref.model.path={model_dir}", *DATA, *preset, f"trainer.n_gpus_per_node={gpus}",
            "trainer.nnodes=1", *overrides]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        config = compose(config_name="igpo_trainer", overrides=argv)
    status = igpo.main.run(config, dry_run=True)
    captured = capsys.readouterr()
    return status, captured.err + captured.out
