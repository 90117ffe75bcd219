"""Python snippets, each run in a process that has imported nothing of igpo, verl or tool_server, for one interpreter
start: this process imports the third-party libraries they load (torch, transformers, numba, ray, ...: ~80% of the
~7 CPU-seconds of ``python -c "import igpo.integration.actor_worker"`` here), then forks one child per snippet. In the
child, what a first-import test checks happens as in a fresh ``python -c``: which of igpo's and verl's modules load in
which order, verl's plugin hook, the warnings printed.

``run_fresh(jobs)`` runs this file as a script: ``jobs`` is a list of ``{"code": str, "argv": [str], "env": {...}}``
(``env`` set over this environment); it returns ``{"returncode", "stdout", "stderr"}`` per job, in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# Leaves of the import graph of igpo and verl: none of them imports igpo, verl or tool_server (checked below).
PRELOAD = ("numpy", "torch", "numba", "transformers", "transformers.modeling_utils", "peft", "ray", "hydra",
           "omegaconf", "pandas", "pyarrow", "tensordict", "rich", "pydantic", "httpx", "fastapi", "aiohttp")
OURS = ("igpo", "verl", "tool_server")


def run_fresh(jobs: list[dict], timeout_s: float | None = None) -> list[dict]:
    """Each job's result; ``timeout_s`` for all of them (default: 180 s a job, as for one ``python -c`` each)."""
    timeout_s = timeout_s or 180.0 * len(jobs)
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{__file__} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _child(job: dict, out_path: str, err_path: str) -> None:
    """Runs in the forked child; never returns."""
    code = 1
    try:
        for target, path in ((1, out_path), (2, err_path)):
            fd = os.open(path, os.O_WRONLY)
            os.dup2(fd, target)
            os.close(fd)
        os.environ.update(job.get("env", {}))
        sys.argv = ["-c", *job.get("argv", [])]
        try:
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as stop:  # as the interpreter turns sys.exit's argument into a status
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:  # as `python -c` reports it
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_all(jobs: list[dict]) -> list[dict]:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in OURS)
    if loaded:
        raise RuntimeError(f"preloading {PRELOAD} imported {loaded}: the children would not start fresh")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for i, job in enumerate(jobs):
            out_path, err_path = Path(folder, f"{i}.out"), Path(folder, f"{i}.err")
            out_path.touch()
            err_path.touch()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(job, str(out_path), str(err_path))
            _, status = os.waitpid(pid, 0)
            results.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": out_path.read_text(),
                            "stderr": err_path.read_text()})
    return results


if __name__ == "__main__":
    sys.path[0] = ""  # the working directory, as for `python -c`, not this file's folder
    print(json.dumps(_run_all(json.loads(sys.stdin.read()))))
