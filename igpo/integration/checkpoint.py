"""What our trainer modes save beside verl's checkpoint (``igpo_state.json``: the method's state, the health monitor,
the infra breaker, the prompts' numbering that seeds their sampling), the one-line report that shows a resume restored
it, and the line that says what a resume does with the rollout that was in flight: verl saves TransferQueue with the
checkpoint in every mode but its plain ``sync`` (ours included), so finished trajectories not yet trained come back as
they were, and prompts still being generated are generated again from their prompts on the resumed weights (their
partial trajectories are dropped)."""

from __future__ import annotations

import json
import logging
import os

import transfer_queue as tq

logger = logging.getLogger(__name__)

STATE_FILE = "igpo_state.json"


def rollout_in_checkpoint(listed: dict) -> dict[str, int]:
    """What a checkpoint's TransferQueue holds for the next steps, from its keys and tags (``tq.kv_list``): the prompt
    groups that finished generating and their trajectories (trained after the resume as they are), and the groups still
    pending or running with the trajectories they had written (verl drops those and generates the groups again).
    Trajectories whose group has no prompt entry any more were trained in the checkpoint's own step and are counted
    nowhere."""
    status = {key: tag.get("status") for key, tag in listed.items() if tag.get("is_prompt", False)}
    done = {key for key, value in status.items() if value in ("finished", "failure")}
    inflight = {key for key, value in status.items() if value in ("pending", "running")}
    owners = [key.split("_", 1)[0] for key, tag in listed.items() if not tag.get("is_prompt", False)]
    return {"finished_groups": len(done), "finished_trajectories": sum(owner in done for owner in owners),
            "inflight_groups": len(inflight), "partial_trajectories": sum(owner in inflight for owner in owners)}


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
                "prompts_fetched": self._prompts_fetched,
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
            json.dump({**self.method.state_dict(), "prompts_fetched": self._prompts_fetched,
                       "health": self.health.state(), "infra_breaker": self.infra_breaker.state(), "saved": report},
                      handle)
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
            # The prompts' uids seed their sampling (TurnLevelTrainer._fetch_one_gen_batch): numbering on from where
            # the checkpoint left off makes the resumed steps sample what the uninterrupted run sampled.
            self._prompts_fetched = int(state.get("prompts_fetched", 0))
            self.health.load(state.get("health", {}))
            self.infra_breaker.load(state.get("infra_breaker", {}))
        else:
            logger.warning("igpo: no %s in %s; the method's state (IGPO's warm-up gate), the health monitor, the "
                           "infra breaker and the prompts' numbering (their sampling seeds) restart from scratch",
                           STATE_FILE, folder)
        logger.warning("igpo: resumed from %s: %s", folder, json.dumps(self._checkpoint_report(), sort_keys=True))

    def _reissue_inflight_prompts(self, partition_id: str = "train") -> int:
        resumed = self.global_steps > 1  # fit() has moved to the step after the checkpoint's
        listed = (tq.kv_list(partition_id) or {}).get(partition_id, {}) if resumed else {}
        reissued = super()._reissue_inflight_prompts(partition_id)
        if resumed:
            held = rollout_in_checkpoint(listed)
            logger.warning("igpo: resumed rollout: %d finished trajectories of %d prompt groups restored from the "
                           "checkpoint's TransferQueue; %d prompt groups that were in flight are generated again from "
                           "their prompts (their %d partial trajectories dropped)", held["finished_trajectories"],
                           held["finished_groups"], reissued, held["partial_trajectories"])
        return reissued
