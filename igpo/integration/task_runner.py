"""verl's v1 TaskRunner, with igpo's estimators and trainer mode registered before it runs.

``igpo.main`` starts this one in place of ``verl.trainer.main_ppo.TaskRunnerV1`` (``run_ppo`` takes the class for
that purpose) and sets ``IGPO_LAZY_REGISTRATION=1`` for the Ray cluster it starts, so that the other processes of the
job skip importing the estimator and trainer modules at ``import verl`` (igpo/plugin.py). Of the job's Ray processes
only this one reads those two registries: verl picks the trainer class by ``trainer.v1.trainer_mode`` and the
advantage function by ``algorithm.adv_estimator`` here.
"""

from __future__ import annotations

import importlib

import ray
from verl.trainer.main_ppo import TaskRunnerV1

from igpo.integration import REGISTERING_MODULES


class _TaskRunner(TaskRunnerV1.__ray_actor_class__):
    def run(self, config):
        # Imported here, once every module of this process is: importing them registers the estimators and the
        # igpo_sync trainer mode (an error here stops the run with its traceback).
        for name in REGISTERING_MODULES:
            importlib.import_module(name)
        return super().run(config)


TaskRunner = ray.remote(_TaskRunner)
