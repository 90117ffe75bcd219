"""Golden data from the reference system's OWN functions (issue 24): run DR-Venus' judge, outcome and turn-format code,
loaded at run time from a fetched snapshot of github.com/inclusionAI/DR-Venus, on generated inputs, and write the
inputs with the outputs to tests/golden/drvenus_reference.json (with the snapshot's commit id).

    python scripts/golden/golden_reference.py --drvenus /path/to/DR-Venus.git --igpo /path/to/IGPO.git \
        [--out tests/golden/drvenus_reference.json]

``--drvenus`` is a git directory (a bare one is fine: files are read with ``git show <commit>:<path>``). Nothing of
the reference is copied into this repository: its files are written to a temporary directory, imported there, and
deleted; only inputs and outputs are kept. tests/fidelity/test_reference_golden.py compares ``+fidelity=reference_drvenus``
with the file. Functions used (paths in the snapshot):

  judge    RL/verl/utils/reward_score/llm_judge.py  compute_score (its HTTP call answered by a recorder that keeps
           the request body and returns the case's fixed judge reply)
  outcome  RL/verl/utils/reward_score/format_and_f1.py compute_score (phase-1 F1/EM, set F1) and
           RL/verl/utils/reward_score/info_gain.py compute_f1 (the F1 that replaces it when IG is on, multiset F1)
  launch   the Hydra override keys of DR-Venus RL/train_igpo.sh and of github.com/GuoqingWang1/IGPO
           policy_optimization.sh (each must be a key of our config or refused naming ours)
  turns    RL/scrl/llm_agent/dr_agent_loop.py: the tag-fixing block of DRAgentLoop.run (located by its comments and
           executed as written), _parse_single_response and _filter_args; RL/verl/utils/reward_score/format_checker.py
           check_turn_format (the per-turn format penalty, applied by the trainer to the tag-fixed message text)
  advantage RL/verl/trainer/ppo/info_gain_advantage.py compute_grpo_info_gain_advantage (the grpo_info_gain
           estimator), fed the way the reference feeds it on the default path (USE_ROLLOUT_IG=false): the turn filter,
           the per-turn layout and the tool-filter expansion + format-penalty blocks of
           RayPPOTrainer._compute_async_info_gain (ray_trainer.py, located by their comments and executed as written),
           RL/scrl/llm_agent/prealigned_vectorized.py compute_ig_with_kv_cache (its worker call answered with the
           records' answer log-probs) and info_gain.compute_score (the token rewards, placed on <|im_end|> anchors of
           the token ids). Two steps are written here, not run from their code: the verl imports the estimator needs
           (stand-ins below) and naive_batch.py's few lines that hand the answer-format penalty over as the outcome.
           The batches are random agent-loop records (several seeds, sizes and norm modes; failed scorings, format
           penalties, malformed turns and tool timeouts); the file keeps the records and, per trained token, the
           reference's advantage (run-length encoded).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "golden" / "drvenus_reference.json"
FILES = {
    "judge": "RL/verl/utils/reward_score/llm_judge.py",
    "format_and_f1": "RL/verl/utils/reward_score/format_and_f1.py",
    "info_gain": "RL/verl/utils/reward_score/info_gain.py",
    "format_checker": "RL/verl/utils/reward_score/format_checker.py",
    "agent_loop": "RL/scrl/llm_agent/dr_agent_loop.py",
}
ESTIMATOR_FILES = {
    "estimator": "RL/verl/trainer/ppo/info_gain_advantage.py",
    "kv_info_gain": "RL/scrl/llm_agent/prealigned_vectorized.py",
    "trainer": "RL/verl/trainer/ppo/ray_trainer.py",
    "reward_manager": "RL/verl/workers/reward_manager/naive_batch.py",
}


def git(gitdir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=True, capture_output=True, text=True).stdout


def load_module(name: str, source: str, workdir: Path) -> types.ModuleType:
    path = workdir / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"drvenus_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def agent_loop_functions(source: str) -> dict:
    """The agent loop's parsing helpers and its tag-fixing block, without importing the module (it needs verl's
    patched agent-loop package): the module-level constants and the two functions are taken from the parsed source,
    the tag-fixing lines from DRAgentLoop.run between its 'Tag fixing' and 'Parse response' comments."""
    tree = ast.parse(source)
    wanted = {"_filter_args", "_parse_single_response", "_Flag"}
    pieces = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            pieces.append(ast.get_source_segment(source, node))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
            pieces.append(ast.get_source_segment(source, node))
    namespace: dict = {}
    exec("import json, re\nimport json5\nfrom typing import Any, Tuple\n" + "\n\n".join(pieces), namespace)
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "Tag fixing" in line)
    end = next(i for i in range(start, len(lines)) if "Parse response" in lines[i])
    block = textwrap.dedent("\n".join(lines[start + 1:end]))
    if "raw_content" not in block or "_raw_decoded" not in block:
        raise SystemExit(f"the tag-fixing block of {FILES['agent_loop']} changed shape; read it and update this script")
    fix = compile(block, "dr_agent_loop.run:tag-fixing", "exec")

    def tag_fix(raw_decoded: str, think: bool) -> str:
        scope = {"_raw_decoded": raw_decoded, "think": think}
        exec(fix, {}, scope)
        return scope["raw_content"]

    namespace["tag_fix"] = tag_fix
    return namespace


# ---- inputs -----------------------------------------------------------------------------------------------------
PROMPT = "<|im_start|>system\nYou are a researcher.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"

JUDGE_CASES = [
    # (final turn, ground truth, the judge's fixed reply)
    ("<think>t</think><answer>Paris</answer>", "Paris", "correct: no"),
    ("<think>t</think><answer>paris</answer>", "Paris", "correct: yes"),
    ("<think>t</think><answer>paris.</answer>", "Paris", "correct: no"),
    ("<think>t</think><answer>The Paris</answer>", "Paris", "reasoning ... correct: no"),
    ("<think>t</think><answer>answer here</answer>", "answer here", "correct: yes"),
    ("<think>t</think><answer>answer here</answer>", "Paris", "correct: yes"),
    ("<think>t</think><answer> </answer>", "Paris", "correct: yes"),
    ("<think>t</think>no answer tags", "Paris", "correct: yes"),
    ("<think>t</think><answer>City of Light</answer>", "Paris<|answer_split|>City of Light", "correct: yes"),
    ("<think>t</think><answer>Paris</answer>", "Paris<|answer_split|>City of Light", "correct: no"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "<think>correct: yes is wrong</think>\ncorrect: no"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "format: correct: yes|no\nextracted: Lutetia\ncorrect: no"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "incorrect: yes"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "**correct**: yes"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "correct = yes"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "Correct: YES"),
    ("<think>t</think><answer>Lutetia</answer>", "Paris", "the verdict is unclear"),
    ("<think>t</think><answer>Paris</answer><answer>Rome</answer>", "Rome", "correct: no"),
    ("<think>t</think><answer>42</answer>", "42.0", "correct: yes"),
    ("<think>t</think><Answer>Paris</Answer>", "Paris", "correct: yes"),
]

OUTCOME_CASES = [
    # (final turn, ground truth, data_source)
    ("<think>t</think><answer>Jean-Paul Sartre</answer>", "Jean Paul Sartre", "nq"),
    ("<think>t</think><answer>the United States</answer>", "United States", "nq"),
    ("<think>t</think><answer>U.S.</answer>", "US", "nq"),
    ("<think>t</think><Answer>Paris</Answer>", "Paris", "nq"),
    ("<think>t</think><ANSWER>Paris</ANSWER>", "paris", "hotpotqa"),
    ("<think>t</think>Paris", "Paris", "nq"),
    ("<think>t</think><answer>Paris</answer><answer>Rome</answer>", "Rome", "nq"),
    ("<think>t<answer>Paris</answer>", "Paris", "nq"),
    ("<think>t</think><answer>new new york</answer>", "new york city", "nq"),
    ("<think>t</think><answer>a a b</answer>", "a b b", "nq"),
    ("<think>t</think><answer>...</answer>", "?<|answer_split|>Paris", "nq"),
    ("<think>t</think><answer>!</answer>", "Paris<|answer_split|>", "nq"),
    ("<think>t</think><answer></answer>", "Paris", "nq"),
    ("<think>t</think><answer>false</answer>", '[{"label": "false"}, {"label": "true"}]', "nq"),
    ("<think>t</think><answer>label false label true</answer>", '[{"label": "false"}, {"label": "true"}]', "nq"),
    ("<think>t</think><answer>true</answer>", '[{"label": "TRUE"}]', "nq"),
    ("<think>t</think><answer>Barack Obama</answer>", "Obama<|answer_split|>Barack Hussein Obama", "2wiki"),
    ("<think>t</think><answer>1984</answer>", "1984<|answer_split|>nineteen eighty-four", "tq"),
    ("<think>t</think><answer>Paris</answer> <code>x", "Paris", "nq"),
]

TOOL = '<tool_call>{"name": "search", "arguments": {"query": ["who"]}}</tool_call>'
TURN_CASES = [
    # (generated text as decoded, think prefilled by the template, is the final turn)
    ("<think>look</think>" + TOOL, False, False),
    ("look</think>" + TOOL, True, False),
    ("look</think>" + TOOL, False, False),
    (TOOL, False, False),
    ("<think>look" + TOOL, False, False),
    ("<think>look</think>" + TOOL + "<tool_response>fake</tool_response>", False, False),
    ("<think>look</think>" + TOOL + "\n<tool_response>\nfake", False, False),
    ('<think>x</think><tool_call>{"name": "Browse", "arguments": {"url": "u"}}</tool_call>', False, False),
    ('<think>x</think><tool_call>{"name": "SEARCH", "arguments": {"query": ["q"]}}</tool_call>', False, False),
    ('<think>x</think><tool_call>{"name": "search", "arguments": "{\\"query\\": [\\"q\\"]}"}</tool_call>', False, False),
    ('<think>x</think><tool_call>{"name": "search", "arguments": ["q"]}</tool_call>', False, False),
    ('<think>x</think><tool_call>{"name": "search", "arguments": {"query": ["q"], "k": 3}}</tool_call>', False, False),
    ('<think>x</think><tool_call>{"name": "visit", "arguments": {"url": ["u"], "goal": "g", "x": 1}}</tool_call>',
     False, False),
    ("<think>x</think><tool_call>{'name': 'search', 'arguments': {'query': ['q'],}}</tool_call>", False, False),
    ('<think>x</think><tool_call>{"name": "search"}</tool_call>', False, False),
    ('<think>x</think><tool_call>["search"]</tool_call>', False, False),
    ("<think>x</think><tool_call>not json</tool_call>", False, False),
    ("<think>x</think><tool_call></tool_call>", False, False),
    ('<think>x</think><tool_call>{"name": "", "arguments": {}}</tool_call>', False, False),
    ("<think>x</think>" + TOOL + TOOL, False, False),
    ("<think>x</think>preface " + TOOL, False, False),
    ("<think>x</think>" + TOOL + " trailing", False, False),
    ("stray <think>x</think>" + TOOL, False, False),
    ("<think>a</think><think>b</think>" + TOOL, False, False),
    ("<think>x</think>" + TOOL + "<answer>y</answer>", False, False),
    ("<think>x</think><tool_call>{\"name\": \"search\", \"arguments\": {\"query\": [\"q\"]}}", False, False),
    ("<think>x</think>", False, False),
    ("", False, False),
    ("   ", True, False),
    ("<think>x</think><answer>Paris</answer>", False, True),
    ("x</think><answer>Paris</answer>", True, True),
    ("<answer>Paris</answer>", False, True),
    ("<answer>Paris</answer>", True, True),
    ("<think>x</think><answer> </answer>", False, True),
    ("<think>x</think><answer>a</answer><answer>b</answer>", False, True),
    ("<think>x</think>so: <answer>Paris</answer>", False, True),
    ("<think>x</think><answer>Paris</answer> done", False, True),
    ("<think>x</think><answer>Paris</answer><tool_response>y</tool_response>", False, True),
    ("<think>x<answer>Paris</answer>", False, True),
    ("<think>x</think>Paris", False, True),
    ("<think>x</think>" + TOOL, False, True),
    ("<think>x</think><answer>Paris", False, True),
    ("<Think>x</Think><answer>Paris</answer>", False, True),
    ("<think>x</think>\n\n<answer>\nParis\n</answer>\n", False, True),
    ('<think>x</think><tool_call>{"name": "PythonInterpreter", "arguments": {}}<code>print(1)</code></tool_call>',
     False, False),
    ("<think>x</think><tool_call>{\"name\": \"search\", \"arguments\": {\"query\": [\"q\"]}}</tool_call>",
     True, False),
]


def random_turns(seed: int, count: int) -> list[tuple[str, bool, bool]]:
    """Turn texts assembled from the pieces models get wrong: missing/extra/misplaced tags, stray text, bad JSON."""
    rng = random.Random(seed)
    think = ["<think>plan</think>", "plan</think>", "<think>plan", "", "<think>a</think><think>b</think>",
             "</think><think>", "x <think>plan</think>"]
    calls = [TOOL, '<tool_call>{"name": "visit", "arguments": {"url": ["u"], "goal": "g"}}</tool_call>',
             '<tool_call>{"name": "lookup", "arguments": 3}</tool_call>', "<tool_call>{bad}</tool_call>",
             '<tool_call>{"name": "search", "arguments": {"query": ["q"]}}', ""]
    answers = ["<answer>Paris</answer>", "<answer></answer>", "<answer>Paris", ""]
    tails = ["", " ", "\n", " extra", "<tool_response>obs</tool_response>", "<tool_response>\nobs"]
    out = []
    for _ in range(count):
        body = rng.choice(think) + rng.choice([" ", "", "\n"])
        body += rng.choice(calls) if rng.random() < 0.6 else ""
        body += rng.choice(answers) if rng.random() < 0.4 else ""
        out.append((body + rng.choice(tails), rng.random() < 0.3, rng.random() < 0.3))
    return out


# ---- runs -------------------------------------------------------------------------------------------------------
def run_judge(module) -> list[dict]:
    """Each case through the reference judge with the API answered by the case's fixed reply (recorded requests)."""
    os.environ["JUDGE_API_BASE"] = "http://judge.invalid/v1"
    os.environ.pop("ENABLE_JUDGE_THINKING", None)
    os.environ.pop("JUDGE_MODEL_NAME", None)
    results = []
    for final, gt, reply in JUDGE_CASES:
        requests_seen = []

        class Response:
            def raise_for_status(self):
                return None

            def json(self):
                return {"choices": [{"message": {"content": reply}}]}

        def post(url, json=None, headers=None, timeout=None):  # noqa: A002 - requests' own keyword
            requests_seen.append(json)
            return Response()

        module.requests = types.SimpleNamespace(post=post)
        module.random = types.SimpleNamespace(random=lambda: 1.0)  # no sampled debug print
        prompt = PROMPT.format(q="Which city is the capital of France?")
        score = module.compute_score(prompt, final, gt, "nq", False, None)
        body = requests_seen[0] if requests_seen else None
        results.append({
            "final_turn": final, "ground_truth": gt, "judge_reply": reply, "question": "Which city is the capital of "
            "France?", "score": float(score), "requested": bool(requests_seen),
            "temperature": body["temperature"] if body else None, "top_p": body.get("top_p") if body else None,
            "enable_thinking": (body.get("chat_template_kwargs") or {}).get("enable_thinking") if body else None,
            "gold_in_prompt_raw": (gt in body["messages"][0]["content"]) if body else None,
        })
    return results


def run_outcome(f1_module, ig_module) -> list[dict]:
    results = []
    for final, gt, source in OUTCOME_CASES:
        results.append({
            "final_turn": final, "ground_truth": gt, "data_source": source,
            "f1_set": float(f1_module.compute_score(final, gt, source, val_type="f1")),
            "em": float(f1_module.compute_score(final, gt, source, val_type="em")),
            "f1_multiset": float(ig_module.compute_f1(final, gt, source, val_type="f1")),
        })
    return results


def run_turns(loop: dict, checker) -> list[dict]:
    results = []
    for text, think, final in TURN_CASES + random_turns(24, 60):
        fixed = loop["tag_fix"](text, think)
        flag, _thinking, payload = loop["_parse_single_response"](fixed, think=False)
        kind = {loop["_Flag"].END: "answer", loop["_Flag"].CALL: "tool_call", loop["_Flag"].ERROR: "error"}[flag]
        results.append({
            "text": text, "think_prefilled": think, "final": final, "tag_fixed": fixed, "kind": kind,
            "name": payload.get("name") if kind == "tool_call" else None,
            "arguments": payload.get("arguments") if kind == "tool_call" else None,
            "answer": payload if kind == "answer" else None,
            "format_ok": bool(checker.check_turn_format(fixed, final)),
        })
    return results


# ---- advantage ------------------------------------------------------------------------------------------------------
# Token ids of the responses built for the reference: only <|im_start|>, <|im_end|> and the role words matter to it.
IM_START, IM_END, ASSISTANT, USER, NEWLINE, WORD = 1, 2, 3, 4, 5, 10
OBSERVATION_FRAME = 9  # "\n<|im_start|>user\n" ... "<|im_end|>\n<|im_start|>assistant\n" around the tool's text
TURN_TEXT = {  # (is the answer turn, format ok) -> an assistant message the reference's checker judges that way
    (False, True): "<think>plan</think>\n" + TOOL, (False, False): "plan " + TOOL,
    (True, True): "<think>plan</think>\n<answer>Paris</answer>", (True, False): "<answer>Paris</answer>",
}
ADVANTAGE_MODES = ("joint", "separate", "scaled_separate", "raw_ig")
TOOL_NAMES = ("visit", "search", "Visit", "VISIT")


class _Tokenizer:
    """What info_gain._find_turn_boundaries_by_tokens and compute_ig_with_kv_cache ask of a tokenizer."""

    pad_token_id = 0
    _text = {IM_START: "<|im_start|>", IM_END: "<|im_end|>", ASSISTANT: "assistant", USER: "user", NEWLINE: "\n"}

    def convert_tokens_to_ids(self, token):
        return {"<|im_start|>": IM_START, "<|im_end|>": IM_END}[token]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self._text.get(int(i), "x") for i in ids)


_ABSENT = object()


@contextlib.contextmanager
def verl_stand_ins(format_checker):
    """Minimal stand-ins for the verl names the reference's estimator and trainer blocks import (AlgoConfig is only a
    type hint, register_adv_est only registers, DataProto only carries the worker call's arguments, and the format
    block imports the reference's own checker), installed while the reference's code runs; whatever was in
    sys.modules before (the real verl, when installed) is put back afterwards."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    stand_ins = {
        "verl": module("verl"),
        "verl.protocol": module("verl.protocol", DataProto=types.SimpleNamespace(
            from_dict=lambda tensors=None, meta_info=None: types.SimpleNamespace(batch=tensors, meta_info=meta_info))),
        "verl.trainer": module("verl.trainer"),
        "verl.trainer.config": module("verl.trainer.config", AlgoConfig=object),
        "verl.trainer.ppo": module("verl.trainer.ppo"),
        "verl.trainer.ppo.core_algos": module("verl.trainer.ppo.core_algos", register_adv_est=lambda name: (lambda f: f)),
        "verl.utils": module("verl.utils"),
        "verl.utils.reward_score": module("verl.utils.reward_score"),
        "verl.utils.reward_score.format_checker": format_checker,
    }
    saved = {name: sys.modules.get(name, _ABSENT) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def trainer_blocks(source: str) -> dict:
    """The parts of RayPPOTrainer._compute_async_info_gain that turn the rollout's records into per-turn IG lists and
    format penalties, located by their comments and compiled as written: the IG settings, step 3 (which turns are
    scored: the tool filter and frequency), the per-turn layout handed to the scorer, and steps 5b-7 (the tool-filter
    expansion to one entry per turn, None where unscored, and the format penalty in place of a turn's IG); and from
    fit() the curriculum block that sets the weights the estimator reads."""
    lines = source.splitlines()
    begin = next(i for i, line in enumerate(lines) if "def _compute_async_info_gain" in line)

    def block(first: str, stop: str):
        start = next(i for i in range(begin, len(lines)) if first in lines[i])
        end = next(i for i in range(start + 1, len(lines)) if stop in lines[i])
        return compile(textwrap.dedent("\n".join(lines[start:end])), f"ray_trainer.py:{start + 1}-{end}", "exec")

    fit = next(i for i, line in enumerate(lines) if "def fit(" in line)
    curriculum = next(i for i in range(fit, len(lines)) if "# Curriculum learning: compute dynamic" in lines[i])
    end = next(i for i in range(curriculum, len(lines)) if "batch = compute_advantage(" in lines[i])
    blocks = {"curriculum": compile(textwrap.dedent("\n".join(lines[curriculum:end])),
                                    f"ray_trainer.py:{curriculum + 1}-{end}", "exec"),
              "settings": block("_ig_compute_freq = max(", "# 1. Prepare ground truths"),
              "filter": block("# 3. Convert per-sample turn_boundaries", "# 4. Build trajectory"),
              "layout": block("max_filtered_turns = max(", "if not kv_turn_boundaries:"),
              "expand": block("# 5b. Tool-filter expansion", "# Count total boundaries for summary")}
    for name, needs in (("filter", "filtered_per_sample"), ("layout", "activate_list"),
                        ("expand", "check_turn_format")):
        if needs not in blocks[name].co_names and needs not in str(blocks[name].co_consts):
            raise SystemExit(f"the {name} block of {ESTIMATOR_FILES['trainer']} changed shape; read it and update "
                             "this script")
    return blocks


def random_records(rng: random.Random, groups: int, size: int) -> list[dict]:
    """Agent-loop records: per trajectory its prompt group, outcome and turns [generated tokens, observation tokens,
    tool name, tool status, format ok, answer log-prob at the turn's start boundary or None (scoring failed)]. Tool
    turns call visit/search in any case, or are malformed (no tool), or empty (an aborted generation: 0 generated
    tokens, the turn ends on the untrained end-of-turn token), or time out (status infra_error); the last turn
    answers. Some log-probs repeat the previous one (an IG of exactly 0)."""
    records = []
    for g in range(groups):
        outcomes = rng.choice([(0.0, 1.0), (0.0, 0.25, 0.5, 1.0), (1.0,), (0.0,)])
        for _ in range(size):
            n, turns, lp = rng.randint(1, 6), [], -1.0
            for j in range(n):
                u = rng.random()
                if j == n - 1:
                    name, status = None, "answer"
                elif u < 0.05:
                    name, status = None, "empty"  # an aborted generation: no token of its own
                elif u < 0.15:
                    name, status = None, "malformed"
                elif u < 0.3:
                    name, status = rng.choice(TOOL_NAMES), "infra_error"
                else:
                    name, status = rng.choice(TOOL_NAMES), "ok"
                ok = status != "empty" and rng.random() > (0.6 if status == "malformed" else 0.2)
                v = rng.random()
                lp = None if v < 0.12 else lp if (v < 0.2 and lp is not None) else round(-rng.uniform(0.05, 5.0), 4)
                obs = 0 if j == n - 1 else OBSERVATION_FRAME + rng.randint(0, 5)
                gen = 0 if status == "empty" else rng.randint(1, 6)
                turns.append([gen, obs, name, "malformed" if status == "empty" else status, int(ok), lp])
            records.append({"g": g, "outcome": rng.choice(outcomes), "turns": turns})
    return records


def advantage_cases(count: int) -> list[dict]:
    cases = []
    for seed in range(count):
        rng = random.Random(1000 + seed)
        config = {"norm_mode": ADVANTAGE_MODES[seed % 4], "gamma": rng.choice([0.95, 0.95, 1.0, 0.8]),
                  "norm_adv_by_std": rng.random() > 0.25, "ig_weight": rng.choice([1.0, 1.0, 0.5, 2.0]),
                  "adaptive_gamma_min_weight": rng.choice([0.0, 0.0, 0.3]),
                  "ig_tool_filter": rng.choice(["visit", "visit", "search,visit", ""]),
                  "format_penalty_scale": rng.choice([1.0, 1.0, 0.5]), "curriculum": None}
        if seed % 3 == 2:  # the curriculum on, at some step of a run
            total = rng.randint(5, 40)
            config["curriculum"] = {"step": rng.randint(0, total + 5), "total": total, "f1_init": 0.5,
                                    "f1_final": 1.0, "ig_init": rng.choice([1.0, 2.0]), "ig_final": 0.5}
        cases.append({"seed": 1000 + seed, "config": config,
                      "records": random_records(rng, rng.randint(1, 4), rng.randint(1, 6))})
    return cases


def run_length(values: list[float]) -> list[list]:
    out: list[list] = []
    for v in values:
        v = round(float(v), 7)
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def run_advantage(case: dict, estimator, kv, ig_module, blocks: dict) -> list[list]:
    """One batch through the reference: records -> IG lists and penalties (trainer blocks + KV scorer) -> token
    rewards (info_gain.compute_score, naive_batch's answer-penalty hand-over) -> grpo_info_gain. Returns, per
    trajectory, the advantage of each generated token (run-length encoded)."""
    cfg, records = case["config"], case["records"]
    tokenizer = _Tokenizer()
    ids, trained, tbs, messages = [], [], [], []
    for rec in records:
        row, mask, msgs, bounds = [], [], [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], []
        for j, (gen, obs, name, _status, ok, _lp) in enumerate(rec["turns"]):
            final = j == len(rec["turns"]) - 1
            bounds.append({"step": j, "msg_count": len(msgs), "token_len": len(row) + 1})
            if name is not None:  # the loop records a tool name only for a parsed call (a timeout included)
                bounds[-1]["tool_name"] = name
            msgs.append({"role": "assistant", "content": TURN_TEXT[(final, bool(ok))] if gen else ""})
            row += [WORD] * (gen - 1) + [IM_END]
            mask += [1] * gen if gen else [0]
            if not final:
                msgs.append({"role": "user", "content": "<tool_response>obs</tool_response>"})
                row += [NEWLINE, IM_START, USER, NEWLINE] + [WORD] * (obs - OBSERVATION_FRAME) + \
                       [IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
                mask += [0] * obs
        ids.append(row)
        trained.append(mask)
        tbs.append(bounds)
        messages.append(msgs)
    algo_cfg = types.SimpleNamespace(ig_compute_freq=1, info_gain_type="log_prob_diff",
                                     ig_tool_filter=cfg["ig_tool_filter"], use_format_penalty=True,
                                     format_penalty_scale=cfg["format_penalty_scale"])
    scope = {"algo_cfg": algo_cfg, "math": math, "np": np, "print": lambda *a, **k: None,
             "gen_batch_output": types.SimpleNamespace(non_tensor_batch={"turn_boundaries": tbs,
                                                                         "messages": messages})}
    exec(blocks["settings"], scope)
    exec(blocks["filter"], scope)
    scope["num_samples"] = len(records)
    exec(blocks["layout"], scope)
    kv_turns = scope["kv_turn_boundaries"]
    per_turn = torch.full((len(records), max(len(kv_turns), 1), 1), float("nan"), dtype=torch.float32)
    for si, kept in enumerate(scope["filtered_per_sample"]):
        for ti, tb in enumerate(kept):
            lp = records[si]["turns"][tb["step"]][5]
            per_turn[si, ti, 0] = float("nan") if lp is None else lp
    scorer = types.SimpleNamespace(compute_ig_with_kv_cache=lambda data: types.SimpleNamespace(
        batch={"per_turn_log_probs": per_turn}))
    with contextlib.redirect_stdout(io.StringIO()):
        result = kv.compute_ig_with_kv_cache(
            trajectory_input_ids=None, trajectory_attention_mask=None, trajectory_position_ids=None,
            gt_token_ids=[[WORD]] * len(records), gt_idx=[[0, 1]] * len(records), turn_boundaries=kv_turns,
            actor_rollout_wg=scorer, tokenizer=tokenizer, info_gain_type=scope["_info_gain_type"],
            num_samples=len(records))
    scope["ig_rewards"] = [list(r) for r in result["info_gain_rewards"]]
    exec(blocks["expand"], scope)
    ig_rewards, answer_penalty = scope["ig_rewards"], scope["_answer_fmt_penalties"]

    length = max(len(row) for row in ids)
    rewards = torch.zeros(len(records), length, dtype=torch.float32)  # naive_batch's reward tensor
    valid = torch.zeros(len(records), length, dtype=torch.long)
    for i, rec in enumerate(records):
        valid[i, :len(ids[i])] = 1
        # naive_batch.py: a malformed answer's penalty stands in for the outcome; without IG entries it is written
        # straight onto the last token, otherwise handed to info_gain.compute_score as the outcome score.
        outcome = float(np.float32(answer_penalty[i])) if answer_penalty.get(i, 0) < 0 else rec["outcome"]
        if not ig_rewards[i]:
            rewards[i, len(ids[i]) - 1] = outcome
            continue
        scores = ig_module.compute_score("", "", "", val_type="llm", info_gain_reward=ig_rewards[i],
                                         tokenizer=tokenizer, is_validation=False, outcome_score=outcome,
                                         original_token_ids=ids[i])
        rewards[i, :len(ids[i])] = torch.tensor(scores, dtype=torch.float32)
    config = types.SimpleNamespace(gamma=cfg["gamma"], info_gain_norm_mode=cfg["norm_mode"],
                                   norm_adv_by_std_in_grpo=cfg["norm_adv_by_std"], ig_weight=cfg["ig_weight"],
                                   adaptive_gamma_min_weight=cfg["adaptive_gamma_min_weight"], use_curriculum=False)
    if cfg["curriculum"]:  # fit()'s block sets config._curriculum_*_weight from the step (IG is active here)
        cur = cfg["curriculum"]
        config.use_curriculum = True
        for key in ("f1_init", "f1_final", "ig_init", "ig_final"):
            setattr(config, f"curriculum_{key}", cur[key])
        trainer = types.SimpleNamespace(config=types.SimpleNamespace(algorithm=config),
                                        total_training_steps=cur["total"], global_steps=cur["step"])
        exec(blocks["curriculum"], {"self": trainer, "_use_info_gain": True, "_ig_active_this_step": True,
                                    "metrics": {}, "open_dict": lambda _: contextlib.nullcontext()})
    index = np.array([f"q{rec['g']}" for rec in records], dtype=object)
    with contextlib.redirect_stdout(io.StringIO()):
        advantages, _, _ = estimator.compute_grpo_info_gain_advantage(
            token_level_rewards=rewards, response_mask=valid, index=index, config=config)
    return [run_length([float(advantages[i, t]) for t, m in enumerate(trained[i]) if m]) for i in range(len(records))]


def check_turn_texts(checker) -> None:
    for (final, ok), text in TURN_TEXT.items():
        if bool(checker.check_turn_format(text, final)) != ok:
            raise SystemExit(f"the reference's format checker judges {text!r} (final={final}) as {not ok}; pick "
                             "another text for this script's TURN_TEXT")


_OVERRIDE = re.compile(r"""(?:^|[\s"'])(\+{0,2}[A-Za-z_][\w.]*)=""")


def launch_keys(script: str) -> list[str]:
    """Override keys (with their + prefix) of the ``python3 -m verl.trainer.main_ppo`` command of a launch script."""
    start = script.index("verl.trainer.main_ppo")
    lines = []
    for line in script[start:].splitlines()[1:]:
        if line.strip().startswith("#"):
            continue
        lines.append(line)
        if not line.rstrip().endswith("\\"):
            break
    keys = []
    for line in lines:
        keys += [k for k in _OVERRIDE.findall(line) if k not in keys]
    return keys


def dump(data: dict) -> str:
    """The golden file: indented, except that each advantage batch is one compact line (keeps the file small)."""
    cases = data["advantage"]["cases"]
    head = dict(data, advantage=dict(data["advantage"], cases="@CASES@"))
    lines = ",\n".join("  " + json.dumps(case, separators=(",", ":")) for case in cases)
    return json.dumps(head, indent=1, ensure_ascii=False).replace('"@CASES@"', "[\n" + lines + "\n ]") + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drvenus", type=Path, required=True, help="git directory of a DR-Venus snapshot")
    parser.add_argument("--igpo", type=Path, required=True, help="git directory of a GuoqingWang1/IGPO snapshot")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--advantage-cases", type=int, default=48, help="random batches for the estimator")
    args = parser.parse_args(argv)
    commit = git(args.drvenus, "rev-parse", args.commit).strip()
    sources = {key: git(args.drvenus, "show", f"{commit}:{path}") for key, path in FILES.items()}
    if "openai" not in sys.modules:  # format_and_f1 imports the client at the top and never uses it
        sys.modules.setdefault("openai", types.SimpleNamespace(OpenAI=None))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        judge = load_module("llm_judge", sources["judge"], work)
        f1 = load_module("format_and_f1", sources["format_and_f1"], work)
        ig = load_module("info_gain", sources["info_gain"], work)
        checker = load_module("format_checker", sources["format_checker"], work)
        loop = agent_loop_functions(sources["agent_loop"])
        data = {
            "source": "github.com/inclusionAI/DR-Venus", "commit": commit, "files": FILES,
            "generated_by": "scripts/golden/golden_reference.py",
            "launch": {
                "drvenus_train_igpo": launch_keys(git(args.drvenus, "show", f"{commit}:RL/train_igpo.sh")),
                "igpo_commit": git(args.igpo, "rev-parse", "HEAD").strip(),
                "igpo_policy_optimization": launch_keys(git(args.igpo, "show", "HEAD:policy_optimization.sh")),
            },
            "judge": run_judge(judge), "outcome": run_outcome(f1, ig), "turns": run_turns(loop, checker),
        }
        check_turn_texts(checker)
        for key in ("IGPO_CROSSCHECK", "IGPO_IG_DIMINISH_RATE"):  # info_gain.compute_score reads them
            os.environ.pop(key, None)
        extra = {key: git(args.drvenus, "show", f"{commit}:{path}") for key, path in ESTIMATOR_FILES.items()}
        blocks = trainer_blocks(extra["trainer"])
        with verl_stand_ins(checker):
            estimator = load_module("info_gain_advantage", extra["estimator"], work)
            kv = load_module("prealigned_vectorized", extra["kv_info_gain"], work)
            cases = advantage_cases(args.advantage_cases)
            for case in cases:
                case["advantages"] = run_advantage(case, estimator, kv, ig, blocks)
        data["advantage"] = {"files": ESTIMATOR_FILES, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(data))
    print(f"wrote {args.out}: {len(data['judge'])} judge, {len(data['outcome'])} outcome, {len(data['turns'])} turn "
          f"cases, {len(data['advantage']['cases'])} advantage batches from DR-Venus {commit[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
