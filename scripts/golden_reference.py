"""Golden data from the reference system's OWN functions (issue 24): run DR-Venus' judge, outcome and turn-format code,
loaded at run time from a fetched snapshot of github.com/inclusionAI/DR-Venus, on generated inputs, and write the
inputs with the outputs to tests/golden/drvenus_reference.json (with the snapshot's commit id).

    python scripts/golden_reference.py --drvenus /path/to/DR-Venus.git --igpo /path/to/IGPO.git \
        [--out tests/golden/drvenus_reference.json]

``--drvenus`` is a git directory (a bare one is fine: files are read with ``git show <commit>:<path>``). Nothing of
the reference is copied into this repository: its files are written to a temporary directory, imported there, and
deleted; only inputs and outputs are kept. tests/test_reference_golden.py compares ``+fidelity=reference_drvenus``
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
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "golden" / "drvenus_reference.json"
FILES = {
    "judge": "RL/verl/utils/reward_score/llm_judge.py",
    "format_and_f1": "RL/verl/utils/reward_score/format_and_f1.py",
    "info_gain": "RL/verl/utils/reward_score/info_gain.py",
    "format_checker": "RL/verl/utils/reward_score/format_checker.py",
    "agent_loop": "RL/scrl/llm_agent/dr_agent_loop.py",
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
    import os

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drvenus", type=Path, required=True, help="git directory of a DR-Venus snapshot")
    parser.add_argument("--igpo", type=Path, required=True, help="git directory of a GuoqingWang1/IGPO snapshot")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
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
            "generated_by": "scripts/golden_reference.py",
            "launch": {
                "drvenus_train_igpo": launch_keys(git(args.drvenus, "show", f"{commit}:RL/train_igpo.sh")),
                "igpo_commit": git(args.igpo, "rev-parse", "HEAD").strip(),
                "igpo_policy_optimization": launch_keys(git(args.igpo, "show", "HEAD:policy_optimization.sh")),
            },
            "judge": run_judge(judge), "outcome": run_outcome(f1, ig), "turns": run_turns(loop, checker),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: {len(data['judge'])} judge, {len(data['outcome'])} outcome, {len(data['turns'])} turn "
          f"cases from DR-Venus {commit[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
