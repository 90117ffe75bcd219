"""When an ``igpo_sync`` run stops early, and what it reports on the way: the tool spend and its budgets, the
infra-error breaker, the health monitor, progress (ETA) and the tool calls per Ray node. Each stop saves a
checkpoint and ends cleanly after the step, naming the cause and how to resume."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import ray

from igpo.integration.infra_breaker import describe_failures
from igpo.integration.node_reach import describe_tool_calls, tool_calls_by_node
from igpo.integration.tool_spend import fetch_stats, spent_budgets, step_metrics

logger = logging.getLogger(__name__)


class RunControl:
    """Mixin of the trainer: every check runs after a step's metrics are known (``_after_step``)."""

    def _after_step(self, metrics: dict, timing_raw: dict) -> None:
        metrics.update(self._progress_metrics(timing_raw))
        self._record_tool_spend(metrics)
        self._check_infra(metrics)
        self._check_health(metrics)
        by_node = self._tool_calls_by_node() if getattr(self, "_loop_nodes", 0) > 1 else None
        if by_node:
            logger.warning("igpo: tool calls by Ray node so far: %s", describe_tool_calls(by_node))

    def _progress_metrics(self, timing_raw: dict) -> dict[str, float]:
        """``progress/total_steps`` and ``progress/eta_s`` (mean wall time of this process's steps, validation
        included, times the steps left): the launcher prints ``step i/N ETA``."""
        self._step_seconds.append(float(timing_raw.get("step", 0.0)) + float(timing_raw.get("testing", 0.0)))
        left = max(0, int(self.total_training_steps) - int(self.global_steps))
        return {"progress/total_steps": float(self.total_training_steps),
                "progress/eta_s": left * float(np.mean(self._step_seconds))}

    def _start_reports(self) -> None:
        """At the start of training: the baseline of step 1's tools/* deltas (validation before training is not
        charged to step 1), and where verl placed the agent-loop workers (round-robin over the nodes with CPUs): with
        several nodes, each step logs the tool calls per node, so a node whose calls fail is named."""
        url = self.igpo.agent.tool_server_url
        if url is not None:
            self._tool_stats = fetch_stats(url)
        self._loop_workers = list(getattr(self.agent_loop_manager, "agent_loop_workers", None) or [])
        nodes = self._tool_calls_by_node()
        self._loop_nodes = len(nodes or {})
        if nodes is not None:
            logger.warning("igpo: %d agent-loop workers on Ray nodes %s (%d distinct)", len(self._loop_workers),
                           json.dumps(sorted(nodes)), len(nodes))

    def _tool_calls_by_node(self) -> dict | None:
        """``igpo.integration.node_reach.tool_calls_by_node`` of this run's agent-loop workers; None (and a warning)
        when they cannot be asked: a report, never a reason to stop training."""
        if not getattr(self, "_loop_workers", None):
            return None
        try:
            return tool_calls_by_node(self._loop_workers)
        except (ray.exceptions.RayError, AttributeError) as error:
            logger.warning("igpo: could not ask the agent-loop workers for their tool calls (%s: %s)",
                           type(error).__name__, error)
            return None

    def _record_tool_spend(self, metrics: dict) -> None:
        """Log this step's ``tools/*`` metrics (``igpo.integration.tool_spend``); when a tool budget is spent, save a
        checkpoint and end the run after this step (``tools.stop_on_budget``) instead of training on refused calls."""
        url = self.igpo.agent.tool_server_url
        stats = fetch_stats(url) if url is not None else None
        if stats is None:
            return
        metrics.update(step_metrics(self._tool_stats, stats, self.tool_spend.price_per_1k))
        self._tool_stats = stats
        spent = spent_budgets(stats)
        if spent and self.tool_spend.stop_on_budget and self.global_steps < self.total_training_steps:
            step, total = int(self.global_steps), int(self.total_training_steps)
            folder = self._stop_after_this_step(metrics, "training/stopped_on_tool_budget")
            # Into the training log, and the launcher shows it on the terminal.
            print(f"igpo: tool budget spent ({'; '.join(spent)}): stopping cleanly after step {step}/{total}; "
                  f"checkpoint {folder}. To continue, restart the tool server with a larger --budget-* and rerun "
                  "with trainer.resume_mode=auto and the same trainer.default_local_dir (tools.stop_on_budget=false "
                  "trains on with the refused calls masked).", flush=True)

    def _check_infra(self, metrics: dict) -> None:
        """The infra-error breaker (``igpo.integration.infra_breaker``): ``tools.infra_breaker.steps`` consecutive
        steps in which more than ``max_share`` of the tool calls failed for infrastructure reasons save a checkpoint
        and stop the run after this step, naming the upstream and its failure classes."""
        calls, failures = metrics.get("igpo/tool_calls", 0.0), metrics.get("igpo/infra_errors", 0.0)
        stop = self.infra_breaker.update(calls, failures)
        metrics["igpo/infra_error_share"] = self.infra_breaker.last_share
        step, total = int(self.global_steps), int(self.total_training_steps)
        if not stop or step >= total or metrics.get("training/stopped_on_tool_budget"):
            return
        config = self.infra_breaker.config
        folder = self._stop_after_this_step(metrics, "training/stopped_on_infra_errors")
        print(f"igpo: infra breaker: {self.infra_breaker.strikes} consecutive steps with more than "
              f"{config.max_share:.0%} of tool calls failing for infrastructure reasons (this step: {int(failures)} of "
              f"{int(calls)}, {int(metrics.get('igpo/infra_masked_trajectories', 0))} trajectories masked); failing: "
              f"{describe_failures(metrics, self.igpo.agent.tool_server_url)}. Stopped after step {step}/{total}; "
              f"checkpoint {folder}. Fix the upstream (its /health on the tool server says what it answers), then "
              "rerun with trainer.resume_mode=auto and the same trainer.default_local_dir "
              "(tools.infra_breaker.steps=0 turns the breaker off).", flush=True)

    def _check_health(self, metrics: dict) -> None:
        """The early warning (``igpo.core.health``): one ``igpo: warning:`` line per finding, into the training log
        and the launcher's terminal; with ``trainer.health.stop_after`` consecutive warning steps, a checkpoint and a
        clean stop after this step."""
        step, total = int(self.global_steps), int(self.total_training_steps)
        for warning in self.health.update(step, metrics):
            print(f"igpo: warning: {warning}", flush=True)
        metrics["health/warning_streak"] = float(self.health.strikes)
        if self.health.should_stop and step < total:
            folder = self._stop_after_this_step(metrics, "training/stopped_on_health")
            print(f"igpo: warning: stopping after step {step}/{total}: {self.health.strikes} consecutive steps with "
                  f"health warnings (trainer.health.stop_after={self.health.config.stop_after}); checkpoint {folder}. "
                  "Inspect the rollouts (trainer.rollout_data_dir) before resuming with trainer.resume_mode=auto.",
                  flush=True)

    def _stop_after_this_step(self, metrics: dict, flag: str) -> str:
        """End the run cleanly after this step: a checkpoint of it (unless verl's save_freq saved it already), the
        metric ``flag`` = 1, and the loop's end moved here. Returns the checkpoint folder."""
        step = int(self.global_steps)
        save_freq = int(self.config.trainer.save_freq)
        if not (save_freq > 0 and step % save_freq == 0):  # verl saved this step already otherwise
            self._save_checkpoint()
        metrics[flag] = 1.0
        # verl's loop runs while global_steps <= total_training_steps: it ends after logging this step's metrics.
        self.total_training_steps = step
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{step}")
