"""``python -m igpo.evaluate --demo NAME``: evaluate a model on the CPU demo's held-out questions as the demo's training
validates it, without restating its settings.

The settings are read from the configuration the demo trains with (``configs/cpu_demo.yaml``, plus
``configs/demo_model/NAME.yaml`` where the model has one): the agent's system prompt, tools, turn and length limits,
the prompt and response lengths, and the validation's sampling (``rollout.val_kwargs``: samples per question and
temperature; verl's default, one greedy answer, where the config sets none). The questions and the corpus are the
demo world's (``.cache/demo_world``, written by ``bash train_igpo.sh``), searched with the demo's top-k. The model
defaults to the demo's starting point (its warm-started model in ``.cache/``), so ``--demo NAME`` alone measures the
policy before training and ``--model-path`` a trained one. Flags given on the command line win over the preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from igpo.eval.settings import EvalInputError

# The demo's starting model per demo.model (train_igpo.sh builds both into .cache/).
STARTING_MODELS = {"tiny": "tiny_demo_warm", "smollm2": "smollm2_warm"}
# What train_igpo.sh exports for the HF rollout server of demo.model=smollm2 (float32 on both cores; the server's
# own default, float64 on one thread, suits the tiny model); tests/eval/test_demo_preset.py checks they agree.
ROLLOUT_ENV = {"smollm2": {"IGPO_CPU_ROLLOUT_DTYPE": "float32", "IGPO_CPU_ROLLOUT_THREADS": "2"}}


@dataclass(frozen=True)
class DemoPreset:
    inputs: dict[str, Any]
    """``data``, ``model_path`` and ``corpus``: used where the command line names no data, model or tools."""
    defaults: dict[str, Any]
    """python -m igpo.evaluate's argument defaults (argparse ``dest`` names)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment defaults for the local HF rollout server (an exported value wins)."""


def demo_preset(name: str, repo: Path, topk: int) -> DemoPreset:
    """The preset of ``demo.model=name`` in the checkout ``repo``, searching ``topk`` passages a call (the demo
    world's ``TOPK``: igpo.demo sits on this room's floor, so the caller passes it); EvalInputError naming the fix
    when the demo's files are missing."""
    from omegaconf import OmegaConf

    if name not in STARTING_MODELS:
        raise EvalInputError(f"--demo {name}: unknown demo model; use one of {', '.join(STARTING_MODELS)}.")
    config = OmegaConf.load(repo / "configs" / "cpu_demo.yaml")
    overlay = repo / "configs" / "demo_model" / f"{name}.yaml"
    if overlay.is_file():
        config = OmegaConf.merge(config, OmegaConf.load(overlay))
    world = repo / ".cache" / "demo_world"
    model = repo / ".cache" / STARTING_MODELS[name]
    wanted = (world / "val.parquet", world / "corpus.jsonl", model / "config.json")
    missing = [str(path.relative_to(repo)) for path in wanted if not path.exists()]
    if missing:
        raise EvalInputError(f"--demo {name}: {', '.join(missing)} not found; `bash train_igpo.sh demo.model={name} "
                             "--dry-run` builds the demo's world and model into .cache/.")
    agent = config.algorithm.igpo.agent
    val = config.actor_rollout_ref.rollout.get("val_kwargs") or {}
    sampled = bool(val.get("do_sample", False))
    inputs = {"data": world / "val.parquet", "model_path": str(model), "corpus": world / "corpus.jsonl"}
    defaults = {
        "topk": topk,
        "max_turns": int(agent.max_turns), "max_tokens_per_turn": int(agent.max_tokens_per_turn),
        "max_observation_tokens": int(agent.max_observation_tokens), "system_prompt": str(agent.system_prompt),
        "tool_names": ",".join(agent.tool_names), "prompt_length": int(config.data.max_prompt_length),
        "response_length": int(config.data.max_response_length),
        "runs": int(val.get("n", 1)) if sampled else 1,
        "temperature": float(val.get("temperature", 1.0)) if sampled else 0.0,
    }
    return DemoPreset(inputs=inputs, defaults=defaults, env=dict(ROLLOUT_ENV.get(name, {})))
