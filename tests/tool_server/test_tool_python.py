"""The sandboxed ``python`` tool through the real HTTP tool server and client: normal runs, hostile code (fork bomb,
infinite loop, a socket connect to a listening port, reading .env and repository files, writing outside scratch,
huge output, memory), each contained as the model's error (never infra), with the server serving afterwards; and a
trajectory of the agent loop that calls it."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fake_upstreams import InProcessServer
from igpo.agent import protocol
from igpo.agent.agent_config import AgentLoopConfig
from tool_server import ToolClient, tools
from tool_server.config import ServerConfig
from tool_server.tools.python import PythonLimits

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"
# short limits keep the hostile cases fast; wall > cpu so a busy loop meets its CPU limit first
LIMITS = PythonLimits(cpu_s=1, wall_s=4.0, memory_mb=256, output_bytes=20_000, observation_chars=2_000)


@pytest.fixture(scope="module")
def server():
    tool = tools.get("python")
    saved, tool.limits = tool.limits, LIMITS
    try:
        with InProcessServer(ServerConfig(backend="local", corpus=CORPUS)) as s:
            yield s
    finally:
        tool.limits = saved


def call(server, name: str, arguments: dict):
    async def go():
        async with ToolClient(server.url, timeout_s=30) as client:
            return await client.call(name, arguments)
    return asyncio.run(go())


def run_code(server, code: str):
    return call(server, "python", {"code": code})


def assert_still_serving(server):
    ok = run_code(server, "print(6 * 7)")
    assert ok.ok and ok.text == "42" and ok.error_kind is None
    found = call(server, "search", {"query": ["Evan Morris lobbyist"]})
    assert found.ok and "Evan Morris" in found.text


def assert_models_fault(result, fragment: str):
    assert not result.ok and result.error_kind == "bad_request", (result.error_kind, result.text[:500])
    assert fragment in result.text, result.text[-800:]


def test_code_runs_and_its_output_is_the_observation(server):
    result = run_code(server, "import math, statistics\nprint(math.comb(10, 3), statistics.mean([1, 2, 6]))")
    assert result.ok and result.text == "120 3"
    quiet = run_code(server, "x = 1")
    assert quiet.ok and "printed nothing" in quiet.text


def test_an_exception_is_the_models_error_with_its_traceback(server):
    result = run_code(server, "def f(x):\n    return 1 / x\nf(0)")
    assert_models_fault(result, "ZeroDivisionError: division by zero")
    assert 'File "<code>", line 2, in f' in result.text and "return 1 / x" in result.text
    assert_models_fault(run_code(server, "def f(:"), "SyntaxError")


def test_fork_bomb_is_contained(server):
    assert_models_fault(run_code(server, "import os\nwhile True:\n    os.fork()"), "os.fork is not allowed")
    assert_models_fault(run_code(server, "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])"),
                        "not available")
    assert_models_fault(run_code(server, "import os\nos.system('echo hi')"), "os.system is not allowed")
    assert_models_fault(run_code(server, "import os\nos.posix_spawn('/bin/sh', ['sh'], {})"), "not allowed")
    threads = run_code(server, "import threading\ndef f():\n    while True:\n        threading.Thread(target=f)"
                               ".start()\nf()")
    assert not threads.ok and threads.error_kind == "bad_request"
    assert_still_serving(server)


def test_infinite_loop_meets_the_cpu_limit_and_sleep_the_wall_clock(server):
    assert_models_fault(run_code(server, "while True:\n    pass"), "CPU-time limit")
    assert_models_fault(run_code(server, "import time\nprint('started', flush=True)\ntime.sleep(60)"),
                        "wall-clock limit")
    assert_still_serving(server)


def test_no_network_a_listening_port_gets_no_connection(server):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        for code in (f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
                     f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                     f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
                     "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)"):
            result = run_code(server, code)
            assert not result.ok and result.error_kind == "bad_request" and "connected" not in result.text
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert_still_serving(server)


@pytest.mark.parametrize("path", [str(ROOT / ".env"), str(ROOT / "README.md"), str(ROOT / "pyproject.toml"),
                                  "/etc/passwd", "../../../../../../etc/hostname"],
                         ids=["repo/.env", "repo/README.md", "repo/pyproject.toml", "/etc/passwd", "relative-escape"])
def test_files_outside_scratch_cannot_be_read(server, path):
    result = run_code(server, f"print(open({path!r}).read())")
    assert_models_fault(result, "is not allowed")
    assert "[project]" not in result.text and "root:" not in result.text


def test_the_repository_cannot_be_reached_by_other_routes(server):
    for code in (f"import os\nos.symlink({str(ROOT / 'README.md')!r}, 'link')\nprint(open('link').read())",
                 f"import os\nprint(os.listdir({str(ROOT)!r}))",
                 "import igpo", "import tool_server", "import numpy",
                 "import gc\nprint(len(gc.get_objects()))", "import ctypes"):
        result = run_code(server, code)
        assert not result.ok and result.error_kind == "bad_request", (code, result.text)
        assert "README" not in result.text.replace("README.md", "")


def test_writing_outside_scratch_is_refused_and_scratch_is_removed(server, tmp_path):
    target = tmp_path / "evil.txt"
    assert_models_fault(run_code(server, f"open({str(target)!r}, 'w').write('x')"), "is not allowed")
    assert_models_fault(run_code(server, f"import os\nos.remove({str(CORPUS)!r})"), "not allowed")
    assert not target.exists() and CORPUS.exists()
    inside = run_code(server, "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())")
    assert inside.ok
    text, cwd = inside.text.split()
    assert text == "hi" and not Path(cwd).exists() and not str(cwd).startswith(str(ROOT))
    too_big = run_code(server, "open('big', 'wb').write(b'0' * (64 << 20))")
    assert_models_fault(too_big, "File too large")


def test_a_clean_environment_holds_no_secret(server, monkeypatch):
    monkeypatch.setenv("IGPO_TEST_SECRET", "s3cret-value")
    result = run_code(server, "import os\nprint(sorted(os.environ))")
    assert result.ok and "IGPO_TEST_SECRET" not in result.text and "s3cret" not in result.text
    # bwrap sets PWD (the scratch directory) when it enters it
    assert set(json.loads(result.text.replace("'", '"'))) - {"PWD"} == {"HOME", "LANG", "PATH", "TMPDIR"}


def test_huge_output_is_cut_and_the_code_stopped(server):
    result = run_code(server, "while True:\n    print('x' * 1000)")
    assert_models_fault(result, "the output passed 20000 bytes")
    assert len(result.text) < LIMITS.observation_chars + 300
    assert_models_fault(run_code(server, "x = bytearray(1 << 30)"), "MemoryError")
    assert_still_serving(server)


def test_bad_calls_are_rejected_before_running(server):
    assert_models_fault(call(server, "python", {}), "python needs 'code'")
    assert_models_fault(call(server, "python", {"code": "  "}), "python needs 'code'")
    assert_models_fault(call(server, "python", {"code": "print(1)", "timeout": 5}), "unknown argument(s)")
    long_code = "x = 1\n" * 5_000
    assert_models_fault(call(server, "python", {"code": long_code}), "the limit is 20000")


def test_the_sandbox_layers_are_reported(server):
    run_code(server, "print(1)")
    layers = tools.get("python").layers()
    assert {"process", "clean_env", "scratch_dir", "rlimits", "process_group_kill", "audit_hook", "user_namespace",
            "mount_namespace", "net_namespace", "pid_namespace", "pid_namespace_kill"} <= set(layers)
    assert ("rlimit_nproc" in layers) == (os.geteuid() != 0)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_s=1.0 must exceed cpu_s=2"):
        PythonLimits(cpu_s=2, wall_s=1.0)
    with pytest.raises(ValueError, match="memory_mb=0"):
        dataclasses.replace(LIMITS, memory_mb=0)


# ---------------------------------------------------------------------------------------------------- agent loop


class ScriptedEngine:
    """Plays fixed assistant turns (text), one per generation request."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tokenizer, turns, []
        self.eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.prompts.append(self.tokenizer.decode(prompt_ids))
        ids = self.tokenizer.encode(self.turns[len(self.prompts) - 1], add_special_tokens=False) + [self.eot]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


def test_a_trajectory_calls_python_and_reads_the_result(server, tiny_tokenizer):
    """Enabling the tool is config: agent.tool_names and a system prompt that describes it."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    from igpo.agent.agent_loop import IGPOAgentLoop

    names = ["search", "visit", "python"]
    agent = {"tool_names": names, "system_prompt": protocol.system_prompt_for(names), "tool_server_url": server.url,
             "max_tokens_per_turn": 128, "max_observation_tokens": 256}
    assert AgentLoopConfig.from_dict(agent).tool_names == tuple(names)
    call_turn = ('<think>compute</think>\n<tool_call>{"name": "python", "arguments": {"code": '
                 '"print(sum(i * i for i in range(1, 11)))"}}</tool_call>')
    engine = ScriptedEngine(tiny_tokenizer, [call_turn, "<think>done</think>\n<answer>385</answer>"])
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": 2048, "response_length": 1024}},
        "algorithm": {"igpo": {"agent": agent}},
    })
    loop = IGPOAgentLoop(trainer_config=DictConfigWrap(config), server_manager=engine, tokenizer=tiny_tokenizer,
                         processor=None, dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                         hf_model_type=None, tools=ToolListWrap([]))

    async def go():
        return await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "Sum of squares 1..10?"}],
                              reward_model={"ground_truth": "385"}, data_source="t", extra_info={}, index=0,
                              uid="p0", global_steps=1)

    out = asyncio.run(go())
    extra = out.extra_fields
    assert extra["igpo_tool_names"] == ["python", None] and extra["igpo_tool_status"] == ["ok", "answer"]
    assert "<tool_response>\n385\n</tool_response>" in engine.prompts[1]
    assert '"name": "python"' in engine.prompts[0]  # the system prompt describes the tool
    assert extra["igpo_final_answer"] == "385"
