"""Start-up probe of the upstreams a tool server depends on: one cheap real call each (one attempt, no retry), so a
dead, misaddressed or misconfigured upstream stops a launch in seconds instead of turning every tool call of a
training run into a masked infrastructure failure.

    python -m tool_server --backend retriever --retriever-url http://127.0.0.1:8000 --probe   # probe, then serve
    python -m tool_server --backend web --env-file .env --probe-only                          # probe and exit
    python -m tool_server.probe http://HEAD:8765            # a running server: GET /health?probe=true

Each failure is one line, ``upstream error: <which> at <url>: <what came back>; <fix>``; the launcher prints it
as ``igpo: upstream error: ...`` and exits 2. Backends that call an upstream implement ``probe(deadline)``; the
local BM25 backend has none (its index was loaded at start-up).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

PROBE_TIMEOUT_S = 15.0  # one attempt per upstream; a healthy retriever, Serper or Jina answers in well under this


@dataclass(frozen=True)
class ProbeFailure:
    """An upstream that failed its probe: ``what`` came back from ``url``; ``fix`` says what to change."""

    upstream: str
    url: str
    what: str
    fix: str

    def line(self) -> str:
        return f"upstream error: {self.upstream} at {self.url}: {self.what}; {self.fix}"

    def to_dict(self) -> dict:
        return {"upstream": self.upstream, "url": self.url, "what": self.what, "fix": self.fix, "line": self.line()}


async def probe_backend(backend, timeout_s: float = PROBE_TIMEOUT_S) -> list[ProbeFailure]:
    """Probe every upstream of ``backend`` (empty list: all answered as they should, or there is none)."""
    probe = getattr(backend, "probe", None)
    if probe is None:
        return []
    return list(await probe(time.monotonic() + timeout_s))


def check_running_server(url: str, timeout_s: float = PROBE_TIMEOUT_S * 4) -> list[str]:
    """Problem lines for a running tool server at ``url`` (``GET /health?probe=true``: it probes its upstreams
    now); [] when it and every upstream answer. Used by the launcher for a ``TOOL_SERVER_URL`` it did not start."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/health", params={"probe": "true"}, timeout=timeout_s,
                             trust_env=False)
        body = response.json()
    except (httpx.HTTPError, ValueError) as error:
        return [f"upstream error: tool server at {url}: {type(error).__name__} ({error}); start it (python -m "
                "tool_server ...) on an address this machine and every Ray node reach, or fix TOOL_SERVER_URL"]
    if response.status_code != 200 or not isinstance(body, dict):
        return [f"upstream error: tool server at {url}: HTTP {response.status_code} on /health; is TOOL_SERVER_URL "
                "a tool server (python -m tool_server)?"]
    return [problem["line"] for problem in body.get("probe") or []]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tool_server.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the running tool server, e.g. http://127.0.0.1:8765")
    args = parser.parse_args(argv)
    problems = check_running_server(args.url)
    for line in problems:
        print(f"tool_server: {line}", file=sys.stderr)
    if not problems:
        print(f"tool_server: probe ok: {args.url} and its upstreams answer")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
