"""igpo/eval/export.py: a one-rank verl FSDP actor checkpoint (weights saved as DTensors over a one-device mesh, as
FSDP2 saves them, with the config and tokenizer in actor/huggingface) comes back as a Hugging Face model that gives
the same logits, in float32; what it cannot read is refused with the fix."""

import json
import shutil

import pytest
import torch


@pytest.fixture(scope="module")
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _actor_checkpoint(tiny_model_dir, folder, mesh, ranks=1):
    from torch.distributed.tensor import Replicate, distribute_tensor
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():  # weights a training step would have moved, so a copy of the untrained model cannot pass
        for parameter in model.parameters():
            parameter.add_(1e-4)
    actor = folder / "actor"
    shutil.copytree(tiny_model_dir, actor / "huggingface", ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    torch.save({name: distribute_tensor(value, mesh, [Replicate()]) for name, value in model.state_dict().items()},
               actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": ranks}))
    return model, actor


def test_an_actor_checkpoint_comes_back_as_the_same_float32_model(tiny_model_dir, tmp_path, one_rank_mesh):
    from transformers import AutoModelForCausalLM

    from igpo.eval.export import export_actor, is_actor_checkpoint

    trained, actor = _actor_checkpoint(tiny_model_dir, tmp_path / "global_step_3", one_rank_mesh)
    assert is_actor_checkpoint(actor) and not is_actor_checkpoint(tiny_model_dir)
    exported = AutoModelForCausalLM.from_pretrained(export_actor(actor, tmp_path / "model"))
    assert exported.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    assert torch.equal(exported(ids).logits, trained(ids).logits)
    assert (tmp_path / "model" / "tokenizer_config.json").is_file()


def test_what_the_export_cannot_read_is_refused_with_the_fix(tiny_model_dir, tmp_path, one_rank_mesh):
    from igpo.eval.export import export_actor

    with pytest.raises(ValueError, match="give the actor folder of a verl FSDP checkpoint"):
        export_actor(tiny_model_dir, tmp_path / "out")
    _, actor = _actor_checkpoint(tiny_model_dir, tmp_path / "two", one_rank_mesh, ranks=2)
    with pytest.raises(ValueError, match="saved by 2 ranks.*verl.model_merger"):
        export_actor(actor, tmp_path / "out")


def test_the_command_line_names_a_wrong_folder_and_exits_2(tmp_path, capsys):
    from igpo.eval.export import main

    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path), str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert "no fsdp_config.json; give the actor folder" in capsys.readouterr().err
