"""A trained policy out of a verl FSDP checkpoint, as a Hugging Face model directory that ``python -m igpo.evaluate
--model-path`` (or any transformers loader) reads, in the precision it trained in.

verl's own merger (``python -m verl.model_merger merge --backend fsdp``) writes bfloat16. A small model trained at a
small learning rate on the CPU (float32) moves its weights by less than bfloat16's spacing, so a bfloat16 copy can
blur what training changed; this keeps the checkpoint's dtype. One rank only (the CPU demo's layout); a checkpoint of
several ranks is pointed at verl's merger."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SHARD = "model_world_size_1_rank_0.pt"


def is_actor_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is the actor folder of a verl FSDP checkpoint (``<checkpoints>/global_step_N/actor``)."""
    return (Path(path) / "fsdp_config.json").is_file()


def export_actor(actor_dir: str | Path, target: str | Path) -> Path:
    """Writes the actor's weights with the config, generation config, tokenizer and chat template verl saved beside
    them (``actor/huggingface``) into ``target``; returns ``target``."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    actor_dir, target = Path(actor_dir), Path(target)
    if not is_actor_checkpoint(actor_dir):
        raise ValueError(f"{actor_dir}: no fsdp_config.json; give the actor folder of a verl FSDP checkpoint "
                         "(<trainer.default_local_dir>/global_step_N/actor)")
    ranks = json.loads((actor_dir / "fsdp_config.json").read_text()).get("world_size")
    if ranks != 1:
        raise ValueError(f"{actor_dir}: saved by {ranks} ranks; this export reads one. Merge it with verl's "
                         f"`python -m verl.model_merger merge --backend fsdp --local_dir {actor_dir} --target_dir "
                         "<dir>` (it writes bfloat16)")
    hf_dir = actor_dir / "huggingface"
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{actor_dir}: no huggingface/config.json beside the weights (verl writes it with every "
                         "actor checkpoint); the model's config is needed to rebuild it")
    saved = torch.load(actor_dir / SHARD, map_location="cpu", weights_only=False)
    # One rank holds every parameter whole; FSDP2 saves them as DTensors over a one-device mesh.
    state = {name: value.to_local() if isinstance(value, DTensor) else value for name, value in saved.items()}
    dtype = next(iter(state.values())).dtype
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{actor_dir}: the weights do not fit the saved config (missing {sorted(set(missing) - tied)}"
                         f", unexpected {sorted(unexpected)})")
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(target)
    for name in ("generation_config.json", "chat_template.jinja"):
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, target / name)
    return target


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Export a verl FSDP actor checkpoint (one rank) as a Hugging Face "
                                                 "model directory in the dtype it trained in.")
    parser.add_argument("actor_dir", help="<trainer.default_local_dir>/global_step_N/actor")
    parser.add_argument("target", help="the model directory to write")
    args = parser.parse_args(argv)
    try:
        print(export_actor(args.actor_dir, args.target))
    except ValueError as error:
        parser.exit(2, f"igpo.eval.export: {error}\n")


if __name__ == "__main__":
    main()
