"""Which step folder the IGPO state is read from on resume (no Ray: verl's loader is replaced by a stand-in that sets
the global step the way verl's does)."""

import json

import pytest
from omegaconf import OmegaConf
from test_trainer import _Verl, _fake_checkpointed_parts, _trainer


def _saved_gate(folder, ema: float) -> None:
    folder.mkdir(parents=True)
    (folder / "igpo_state.json").write_text(json.dumps({"warmup_gate": {"ema": ema, "graduated": True},
                                                        "prompts_fetched": round(ema * 40)}))


@pytest.mark.parametrize("mode", ["auto", "resume_path"])
def test_resume_reads_the_state_of_the_step_verl_resumed(tmp_path, monkeypatch, mode):
    """auto ignores a leftover resume_from_path (verl does too); resume_path reads the folder it names."""
    _saved_gate(tmp_path / "run" / "global_step_2", 0.2)
    _saved_gate(tmp_path / "other" / "global_step_5", 0.5)
    trainer = _trainer(ig_warmup_threshold=0.9)
    trainer.config = OmegaConf.create({"trainer": {
        "default_local_dir": str(tmp_path / "run"), "resume_mode": mode,
        "resume_from_path": str(tmp_path / "other" / "global_step_5")}})
    _fake_checkpointed_parts(trainer)
    step = 2 if mode == "auto" else 5

    def verl_load(self):
        self.global_steps = step

    monkeypatch.setattr(_Verl, "_load_checkpoint", verl_load)
    trainer._load_checkpoint()
    assert trainer.warmup.ema == pytest.approx(step / 10) and trainer.warmup.graduated
    assert trainer._prompts_fetched == step * 4  # the numbering that seeds the prompts' sampling, from the same folder


def test_relative_checkpoint_dir_resolves_against_the_working_directory(tmp_path, monkeypatch):
    _saved_gate(tmp_path / "ckpt" / "global_step_1", 0.3)
    monkeypatch.chdir(tmp_path)
    trainer = _trainer(ig_warmup_threshold=0.9)
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": "ckpt", "resume_mode": "auto",
                                                   "resume_from_path": None}})
    _fake_checkpointed_parts(trainer)
    monkeypatch.setattr(_Verl, "_load_checkpoint", lambda self: setattr(self, "global_steps", 1))
    trainer._load_checkpoint()
    assert trainer.warmup.ema == pytest.approx(0.3)


def test_what_a_checkpoints_rollout_holds_is_counted_by_group_status():
    """The resume line's figures (igpo.integration.checkpoint.rollout_in_checkpoint), from TransferQueue's keys and
    tags as verl writes them: a finished group's trajectories are restored, a running group's are dropped (verl
    generates the group again), a pending group has none yet, and trajectories whose group has no prompt entry (the
    checkpoint's own step trained them) count nowhere."""
    from igpo.integration.checkpoint import rollout_in_checkpoint

    listed = {
        "s1p0": {"is_prompt": True, "status": "finished"}, "s1p0_0_0": {"status": "success"},
        "s1p0_1_0": {"status": "success"},
        "s1p1": {"is_prompt": True, "status": "failure"}, "s1p1_0_0": {"status": "success"},
        "s1p2": {"is_prompt": True, "status": "running"}, "s1p2_0_0": {"status": "success"},
        "s1p3": {"is_prompt": True, "status": "pending"},
        "s0p9_0_0": {"status": "success"}, "s0p9_1_0": {"status": "success"},
    }
    assert rollout_in_checkpoint(listed) == {"finished_groups": 2, "finished_trajectories": 3, "inflight_groups": 2,
                                             "partial_trajectories": 1}
    assert rollout_in_checkpoint({}) == {"finished_groups": 0, "finished_trajectories": 0, "inflight_groups": 0,
                                         "partial_trajectories": 0}
