"""What the ``igpo_sync`` trainer saves beside verl's checkpoint (``igpo_state.json``: the method's state, the health
monitor, the infra breaker) and the one-line report that shows a resume restored it."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

STATE_FILE = "igpo_state.json"


class CheckpointState:
    """Mixin of the trainer (verl's ``_save_checkpoint`` / ``_load_checkpoint`` hooks)."""

    def _checkpoint_report(self) -> dict:
        """What a resume must restore, in one line: global step, the method's state (IGPO: warm-up gate, curriculum
        position), dataloader position and a digest of each actor rank's weights."""
        data = self.train_dataloader.state_dict()
        ranks = sorted(self.actor_rollout_wg.igpo_worker_report(True), key=lambda r: r["rank"])
        return {"global_step": self.global_steps, **self.method.report(self.global_steps, self.total_training_steps),
                "dataloader": {"batches": data.get("_num_yielded"),
                               "samples": (data.get("_sampler_iter_state") or {}).get("samples_yielded")},
                "actor_digests": [r["digest"] for r in ranks]}

    def _save_checkpoint(self):
        # Our state goes into the step's folder BEFORE verl's save, which ends by pointing
        # latest_checkpointed_iteration.txt at that folder: a crash in between leaves the pointer on the previous
        # step (whose state file is complete) instead of a resumable step without one. Written to a temporary file
        # and renamed, so a reader never sees half a file.
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE)
        report = self._checkpoint_report()
        with open(path + ".tmp", "w") as handle:
            json.dump({**self.method.state_dict(), "health": self.health.state(),
                       "infra_breaker": self.infra_breaker.state(), "saved": report}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(path + ".tmp", path)
        super()._save_checkpoint()
        logger.warning("igpo: checkpoint saved: %s", json.dumps(report, sort_keys=True))

    def _resume_folder(self) -> str:
        """The step folder verl's ``_load_checkpoint`` just resumed from (it set ``global_steps`` from its name):
        ``resume_from_path`` only in resume_mode=resume_path (auto ignores it), else the step under
        ``default_local_dir``; relative paths against the working directory, as verl resolves them."""
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if not self.global_steps:
            return
        folder = self._resume_folder()
        path = os.path.join(folder, STATE_FILE)
        if os.path.isfile(path):
            with open(path) as handle:
                state = json.load(handle)
            self.method.load_state_dict(state)
            self.health.load(state.get("health", {}))
            self.infra_breaker.load(state.get("infra_breaker", {}))
        else:
            logger.warning("igpo: no %s in %s; the method's state (IGPO's warm-up gate), the health monitor and the "
                           "infra breaker restart from scratch", STATE_FILE, folder)
        logger.warning("igpo: resumed from %s: %s", folder, json.dumps(self._checkpoint_report(), sort_keys=True))
