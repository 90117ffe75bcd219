"""The python tool's kernel sandbox on its own: with the audit hook switched off (``PythonTool.audit_hook``, a
test-only switch), hostile code sent through the real HTTP tool server still cannot read a planted secret outside its
scratch directory, see more of ``/`` than the interpreter needs, read another process's environment, write outside
scratch, reach a port listening on loopback, or leave a process running after the call returns. Also: the server
refuses to start where the sandbox cannot be built, names the fix, and starts with a warning under
``--python-sandbox unsafe``; ``off`` serves no python tool."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from fake_upstreams import InProcessServer
from tool_server import ToolClient, tools
from tool_server.config import ServerConfig
from tool_server.process import start_tool_server
from tool_server.tools.python import PythonLimits
from tool_server.tools.python_sandbox import SandboxUnavailable, bwrap_sandbox

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"
LIMITS = PythonLimits(cpu_s=2, wall_s=5.0, memory_mb=256, output_bytes=20_000, observation_chars=4_000)


@pytest.fixture(scope="module")
def server():
    tool = tools.get("python")
    saved = tool.limits, tool.audit_hook
    tool.limits, tool.audit_hook = LIMITS, False
    try:
        with InProcessServer(ServerConfig(backend="local", corpus=CORPUS)) as s:
            yield s
    finally:
        tool.limits, tool.audit_hook = saved


def run_code(server, code: str):
    async def go():
        async with ToolClient(server.url, timeout_s=30) as client:
            return await client.call("python", {"code": code})
    return asyncio.run(go())


def ran(server, code: str) -> str:
    """The output of code that must run to its end (its failures are printed, not raised)."""
    result = run_code(server, code)
    assert result.ok, result.text[-1500:]
    return result.text


def test_the_hook_is_off_so_only_the_kernel_stands(server):
    # each of these is refused by the audit hook when it is on
    text = ran(server, "import ctypes, gc, os\nprint('ctypes', len(gc.get_objects()) > 0, os.getpid())")
    assert text.startswith("ctypes True ")
    assert "audit_hook" not in tools.get("python").layers()


def test_a_planted_secret_outside_scratch_stays_unread(server, tmp_path):
    token = f"igpo-secret-{uuid.uuid4().hex}"
    secret = tmp_path / "secrets.env"
    secret.write_text(f"API_KEY={token}\n")
    targets = [str(secret), str(ROOT / ".env"), str(ROOT / "pyproject.toml"), "/etc/passwd", "/etc/shadow",
               f"/proc/1/root{secret}"]
    code = ("import os\n"
            f"for path in {targets!r}:\n"
            "    try:\n"
            "        print(path, 'READ', open(path).read())\n"
            "    except OSError as exc:\n"
            "        print(path, type(exc).__name__)\n"
            f"print('tmp holds', sorted(os.listdir({str(tmp_path.parent)!r})) if os.path.isdir("
            f"{str(tmp_path.parent)!r}) else 'nothing')\n")
    text = ran(server, code)
    assert token not in text and "READ" not in text and "[project]" not in text, text
    assert text.count("FileNotFoundError") == len(targets), text
    assert "tmp holds nothing" in text


def test_root_holds_only_what_the_interpreter_needs(server):
    text = ran(server, f"import os\nprint(sorted(os.listdir('/')))\nprint(os.path.exists({str(ROOT)!r}))")
    listing, repo_visible = text.splitlines()
    sandbox = bwrap_sandbox()
    needed = {"dev", "proc"} | {Path(p).parts[1] for p in (sandbox.interpreter, sandbox.loader, *sandbox.stdlib,
                                                         *sandbox.library_dirs, tempfile_root())}
    entries = set(eval(listing))  # a printed list of str
    assert entries <= needed, (entries, needed)
    assert "etc" not in entries and "home" not in entries
    assert repo_visible == "False"


def tempfile_root() -> str:
    import tempfile

    return tempfile.gettempdir()


def test_another_process_environment_is_out_of_sight(server, monkeypatch):
    token = f"igpo-env-{uuid.uuid4().hex}"
    monkeypatch.setenv("IGPO_SERVER_SECRET", token)  # the in-process server's own environment
    code = ("import os\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print('pids', pids)\n"
            "for pid in pids + [" + str(os.getpid()) + "]:\n"
            "    try:\n"
            "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError as exc:\n"
            "        print(pid, type(exc).__name__)\n")
    text = ran(server, code)
    assert token not in text and "IGPO_SERVER_SECRET" not in text, text
    pids = eval(text.splitlines()[0].removeprefix("pids "))
    assert len(pids) <= 2, text  # bwrap's init and the code itself: no process of the machine
    assert f"{os.getpid()} FileNotFoundError" in text or os.getpid() in pids


def test_nothing_is_written_outside_scratch(server, tmp_path):
    sandbox = bwrap_sandbox()
    targets = [str(tmp_path / "evil.txt"), "/evil.txt", str(ROOT / "evil.txt"),
               os.path.join(sandbox.stdlib[0], "evil.py"), os.path.join(sandbox.stdlib[0], "this.py"),
               os.path.join(sandbox.library_dirs[0], "evil.so"), "/proc/sys/kernel/core_pattern"]
    code = ("import os\n"
            f"for path in {targets!r}:\n"
            "    try:\n"
            "        with open(path, 'a') as f:\n"
            "            f.write('x')\n"
            "        print(path, 'WROTE')\n"
            "    except OSError as exc:\n"
            "        print(path, type(exc).__name__, exc.errno)\n"
            "open('inside.txt', 'w').write('ok')\n"
            "print('inside', open('inside.txt').read())\n")
    text = ran(server, code)
    assert "WROTE" not in text and "inside ok" in text, text
    for path in targets[:4] + targets[5:6]:
        assert not os.path.exists(path), path
    assert not Path(sandbox.stdlib[0], "this.py").read_text().endswith("x")


def test_no_kernel_setting_is_writable(server):
    """Run by root, the code is uid 0 outside its user namespace, which the kernel lets write root-owned sysctls
    (kernel.core_pattern runs a program as root on the host): /proc/sys must be out of reach."""
    code = ("import os\n"
            "writable = []\n"
            "for folder, subfolders, files in os.walk('/proc'):\n"
            "    if folder == '/proc':\n"
            "        subfolders[:] = [d for d in subfolders if not d.isdigit() and d not in ('self', 'thread-self')]\n"
            "    for name in files:\n"
            "        try:\n"
            "            os.close(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_NONBLOCK))\n"
            "            writable.append(os.path.join(folder, name))\n"
            "        except OSError:\n"
            "            pass\n"
            "print(os.listdir('/proc/sys'), writable)\n")
    text = ran(server, code)
    sysctls, writable = text.split("] [")
    assert sysctls == "[", text
    # pressure-stall triggers (/proc/pressure/*) are open to any user by design; nothing else may be
    assert all(path.startswith("'/proc/pressure/") for path in writable.rstrip("]").split(", ") if path), text


def test_a_listening_loopback_port_gets_no_connection(server):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        code = ("import socket\n"
                f"for host in ('127.0.0.1', 'localhost', '::1'):\n"
                "    try:\n"
                f"        socket.create_connection((host, {port}), timeout=1)\n"
                "        print(host, 'CONNECTED')\n"
                "    except OSError as exc:\n"
                "        print(host, type(exc).__name__, exc)\n"
                "print('interfaces', socket.if_nameindex())\n")
        text = ran(server, code)
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()
    # the namespace's own loopback answers (nothing listens there); the host's listener never sees a connection
    assert "CONNECTED" not in text and "127.0.0.1 ConnectionRefusedError" in text, text
    assert "interfaces [(1, 'lo')]" in text, text


# A child that starts its own session forks a grandchild that holds a file named by the token open and sleeps;
# the code's own process then ends (or, with keep_output, sleeps past the wall-clock limit with its output open).
ESCAPE = """
import os, sys, time
token, keep_output = {token!r}, {keep_output!r}
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        held = open(token, "w")
        if not keep_output:
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
        open(token + ".ready", "w").close()
        time.sleep(120)
    os._exit(0)
for _ in range(200):
    if os.path.exists(token + ".ready"):
        break
    time.sleep(0.01)
print("grandchild ready", os.path.exists(token + ".ready"), flush=True)
if keep_output:
    time.sleep(120)
"""


def processes_holding(token: str) -> list[int]:
    """Host pids with an open file whose name contains ``token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(token in link for link in links):
            found.append(int(pid))
    return found


@pytest.mark.parametrize("keep_output", [False, True], ids=["code_ends", "wall_clock_kill"])
def test_no_process_outlives_the_call(server, keep_output):
    token = f"igpo-alive-{uuid.uuid4().hex}"
    result = run_code(server, ESCAPE.format(token=token, keep_output=keep_output))
    assert "grandchild ready True" in result.text, result.text
    if keep_output:
        assert not result.ok and "wall-clock limit" in result.text
    else:
        assert result.ok
    assert processes_holding(token) == []


def test_a_sandboxed_call_sees_its_own_pid_namespace(server):
    text = ran(server, "import os\nprint(os.getpid(), os.getppid())")
    assert text == "2 1"  # bwrap's init is 1, the code 2: numbers of its own namespace


# ------------------------------------------------------------------------------------ refusal and the opt-outs


def test_a_missing_bwrap_is_named_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"'bwrap' is not on PATH.*apt-get install -y bubblewrap.*"
                                                 r"--python-sandbox off.*--python-sandbox unsafe"):
        bwrap_sandbox.__wrapped__()


def test_a_bwrap_that_cannot_build_namespaces_is_named_with_what_it_said(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --help ] && echo '--disable-userns --info-fd --die-with-parent' "
                    "&& exit 0\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace.*allow user namespaces"):
        bwrap_sandbox.__wrapped__()


def start_server(*flags: str, path: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": path}
    return subprocess.Popen([sys.executable, "-m", "tool_server", "--backend", "local", "--corpus", str(CORPUS),
                             "--port", "0", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_server_refuses_to_start_without_the_sandbox_unless_told_unsafe(tmp_path):
    refused = start_server(path=str(tmp_path))
    out, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and out == "", err
    assert "tool_server: configuration error: python_sandbox='bwrap'" in err and "bubblewrap" in err, err

    log = tmp_path / "tool_server.log"
    env = {k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": str(tmp_path)}
    with start_tool_server(["--backend", "local", "--corpus", str(CORPUS), "--port", "0", "--python-sandbox",
                            "unsafe"], log_path=log, env=env, cwd=ROOT) as url:
        body = httpx.post(url + "/tools/python", json={"code": "print(6 * 7)"}, timeout=30).json()
        assert body["ok"] and body["text"] == "42"
        assert "mount_namespace" not in body["results"][0]["layers"]
    err = log.read_text()
    assert "--python-sandbox unsafe: model-written code runs WITHOUT kernel isolation" in err, err


def test_off_serves_no_python_tool():
    with InProcessServer(ServerConfig(backend="local", corpus=CORPUS, python_sandbox="off")) as s:
        result = run_code(s, "print(1)")
    assert not result.ok and result.error_kind == "infra" and "--python-sandbox off" in result.text
