"""The adapters that plug igpo into verl: the trainer mode, estimators, actor worker, weight sync, rollout-failure
guard, tool-spend and infra accounting, metrics."""
