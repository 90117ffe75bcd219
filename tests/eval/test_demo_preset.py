"""``python -m igpo.evaluate --demo NAME`` (igpo/eval/demo_preset.py): the demo's settings come from the configuration
it trains with, command-line flags win, and a checkout without the demo's files is told how to build them."""

import os
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import igpo.evaluate as evaluate_script
from igpo.demo.world import TOPK
from igpo.eval.demo_preset import demo_preset
from igpo.eval.settings import EvalInputError

REPO = Path(__file__).resolve().parents[2]


def _fake_checkout(tmp_path: Path, model_dir: str) -> Path:
    """The configs of this checkout and empty stand-ins for the demo's world and model files."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    for name in (".cache/demo_world/val.parquet", ".cache/demo_world/corpus.jsonl", f".cache/{model_dir}/config.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    return tmp_path


def test_smollm2_takes_the_overlay_over_the_cpu_demo_and_the_validation_sampling(tmp_path):
    repo = _fake_checkout(tmp_path, "smollm2_warm")
    preset = demo_preset("smollm2", repo, topk=TOPK)
    config = OmegaConf.merge(OmegaConf.load(REPO / "configs" / "cpu_demo.yaml"),
                             OmegaConf.load(REPO / "configs" / "demo_model" / "smollm2.yaml"))
    agent, val = config.algorithm.igpo.agent, config.actor_rollout_ref.rollout.val_kwargs
    d = preset.defaults
    assert d["max_tokens_per_turn"] == agent.max_tokens_per_turn == 48  # the overlay's, not cpu_demo.yaml's 32
    assert (d["max_turns"], d["max_observation_tokens"], d["system_prompt"]) == (
        agent.max_turns, agent.max_observation_tokens, agent.system_prompt)
    assert (d["prompt_length"], d["response_length"]) == (config.data.max_prompt_length, 416)
    assert (d["runs"], d["temperature"]) == (val.n, val.temperature) == (4, 1.0)
    assert d["topk"] == TOPK and d["tool_names"] == "search"
    assert preset.inputs == {"data": repo / ".cache" / "demo_world" / "val.parquet",
                             "model_path": str(repo / ".cache" / "smollm2_warm"),
                             "corpus": repo / ".cache" / "demo_world" / "corpus.jsonl"}
    assert preset.env == {"IGPO_CPU_ROLLOUT_DTYPE": "float32", "IGPO_CPU_ROLLOUT_THREADS": "2"}


def test_the_tiny_demo_validates_greedily_once(tmp_path):
    preset = demo_preset("tiny", _fake_checkout(tmp_path, "tiny_demo_warm"), topk=TOPK)
    assert (preset.defaults["runs"], preset.defaults["temperature"]) == (1, 0.0) and preset.env == {}
    assert preset.defaults["max_tokens_per_turn"] == 32


def test_missing_demo_files_name_the_command_that_builds_them(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    with pytest.raises(EvalInputError, match=r"\.cache/demo_world/val\.parquet.*bash train_igpo\.sh "
                                             r"demo\.model=smollm2 --dry-run"):
        demo_preset("smollm2", tmp_path, topk=TOPK)
    with pytest.raises(EvalInputError, match="unknown demo model"):
        demo_preset("qwen", tmp_path, topk=TOPK)


@pytest.mark.skipif(not (REPO / ".cache" / "demo_world" / "val.parquet").is_file()
                    or not (REPO / ".cache" / "tiny_demo_warm" / "config.json").is_file(),
                    reason="the demo's world and model are built by scripts/test.sh (train_igpo.sh --dry-run)")
def test_flags_win_over_the_preset_and_an_endpoint_or_tool_server_replaces_its_model_or_corpus():
    script = evaluate_script
    args = script.parse_args(["--demo", "tiny", "--out", "o", "--runs", "2", "--max-turns", "3",
                              "--model-path", "trained"])
    assert (args.runs, args.max_turns, args.model_path, args.max_tokens_per_turn) == (2, 3, "trained", 32)
    assert args.data == REPO / ".cache" / "demo_world" / "val.parquet"
    assert args.corpus == REPO / ".cache" / "demo_world" / "corpus.jsonl" and args.topk == TOPK
    args = script.parse_args(["--demo", "tiny", "--out", "o", "--endpoint", "http://h/v1", "--model", "m",
                              "--tokenizer", "t", "--tool-server", "http://t"])
    assert args.model_path is None and args.corpus is None
    with pytest.raises(SystemExit):  # without --demo the data, model and tools stay required
        script.parse_args(["--out", "o"])


def test_the_demos_environment_is_set_for_the_run_only(monkeypatch):
    script = evaluate_script
    monkeypatch.delenv("IGPO_CPU_ROLLOUT_DTYPE", raising=False)
    monkeypatch.setenv("IGPO_CPU_ROLLOUT_THREADS", "1")
    with script.environment_defaults({"IGPO_CPU_ROLLOUT_DTYPE": "float32", "IGPO_CPU_ROLLOUT_THREADS": "2"}):
        assert os.environ["IGPO_CPU_ROLLOUT_DTYPE"] == "float32"
        assert os.environ["IGPO_CPU_ROLLOUT_THREADS"] == "1"  # an exported value wins
    assert "IGPO_CPU_ROLLOUT_DTYPE" not in os.environ and os.environ["IGPO_CPU_ROLLOUT_THREADS"] == "1"


def test_the_rollout_environment_is_what_train_igpo_sh_exports_for_the_demo_model():
    from igpo.eval.demo_preset import ROLLOUT_ENV

    launcher = (REPO / "train_igpo.sh").read_text()
    for name, value in ROLLOUT_ENV["smollm2"].items():
        assert f'export {name}="${{{name}:-{value}}}"' in launcher, (name, value)
