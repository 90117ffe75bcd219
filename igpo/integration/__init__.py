"""The adapters that plug igpo into verl: the trainer mode, estimators, actor worker, weight sync, rollout-failure
guard, tool-spend and infra accounting, metrics."""

# Registries that keep objects, not paths: these modules register the estimators and the trainer mode when imported.
REGISTERING_MODULES = ("igpo.integration.estimator", "igpo.integration.trainer")
# Set to 1 for the Ray cluster of a run whose TaskRunner (task_runner.py) imports REGISTERING_MODULES itself;
# igpo/plugin.py then skips them in every other process of the job.
LAZY_REGISTRATION_ENV = "IGPO_LAZY_REGISTRATION"
