"""Start ``python -m tool_server`` as a child process for as long as a ``with`` block runs: the one way the
evaluation, the warm-start, the benchmarks and the tests start a tool server of their own.

    with start_tool_server(["--backend", "local", "--corpus", "data/wiki_passages_1000.jsonl"]) as url:
        ...  # url is http://127.0.0.1:PORT, answering GET /health

The server gets a free port on 127.0.0.1 (unless the arguments name ``--host`` or ``--port``), runs in a process
group of its own (the python tool's sandboxes are its children), and writes its stdout and stderr to one log file.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import httpx

# the folder holding this package: on the child's PYTHONPATH, so ``-m tool_server`` is this very package
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])
_LISTENING = re.compile(r"tool_server listening on (http://\S+)")
_LOG_TAIL_CHARS = 2_000


class ToolServerStartError(RuntimeError):
    """The tool server exited or stayed silent before it answered ``/health``; the message names its log."""


@contextlib.contextmanager
def start_tool_server(args: Sequence[str], *, log_path: str | os.PathLike | None = None,
                      env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                      timeout_s: float = 120.0) -> Iterator[str]:
    """Run ``python -m tool_server *args`` until the block ends; yield its URL once ``GET /health`` answers 200.

    Args:
        args: the server's command-line arguments (``--backend`` and what it needs); ``--host 127.0.0.1`` and
            ``--port 0`` are added unless given.
        log_path: the file the server's stdout and stderr are appended to (kept); None: a temporary file, removed
            when the server stopped after a clean start.
        env: the child's environment (default: this process's); this package's folder is put first on its
            PYTHONPATH.
        cwd: the child's working directory, against which relative paths in ``args`` resolve (default: ours).
        timeout_s: how long the server may take to answer (the local backend builds its index on a first start).
    Raises:
        ToolServerStartError: it exited or did not answer within ``timeout_s``; the message names the log and
            shows its end.
    On leaving the block the server's process group gets SIGTERM, and SIGKILL 10 s later if it is still there.
    """
    command = [sys.executable, "-m", "tool_server", *args]
    if "--host" not in args:
        command += ["--host", "127.0.0.1"]
    if "--port" not in args:
        command += ["--port", "0"]
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, child_env.get("PYTHONPATH")) if p)
    temporary = log_path is None
    if temporary:
        handle, log_path = tempfile.mkstemp(prefix="tool_server.", suffix=".log")
        os.close(handle)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start_offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=child_env, cwd=cwd, start_new_session=True)
    try:
        url = _wait_until_healthy(process, log_path, start_offset, timeout_s)
    except BaseException:
        _stop(process)
        raise
    try:
        yield url
    finally:
        _stop(process)
    if temporary:
        log_path.unlink(missing_ok=True)


def _wait_until_healthy(process: subprocess.Popen, log_path: Path, start_offset: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        if url is None:
            with open(log_path, "rb") as log:
                log.seek(start_offset)
                match = _LISTENING.search(log.read().decode(errors="replace"))
            url = match.group(1) if match else None
        if url is not None:
            try:
                if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        if process.poll() is not None:
            raise ToolServerStartError(f"the tool server exited with code {process.returncode} before it answered "
                                       f"/health; its log {str(log_path)!r} ends with:\n{_tail(log_path)}")
        time.sleep(0.05)
    raise ToolServerStartError(f"the tool server did not answer /health within {timeout_s:g} s "
                               f"({'at ' + url if url else 'it announced no URL'}); its log {str(log_path)!r} ends "
                               f"with:\n{_tail(log_path)}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 10 s; the group goes even when the server is gone."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            # the leader is gone; anything it left in its group (a sandboxed run) goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        break
    process.wait()


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
