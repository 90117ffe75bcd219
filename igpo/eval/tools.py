"""The tools of an evaluation: a local ``tool_server`` started on a corpus, and the run's top-k on search calls."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from tool_server.process import start_tool_server

from igpo.eval.settings import EvalInputError


class TopKTools:
    """Tool caller that gives every search call without a ``topk`` the run's top-k (a copy; arguments unchanged)."""

    def __init__(self, inner: Any, top_k: int) -> None:
        self.inner, self.top_k = inner, top_k

    async def call(self, name: str, arguments: dict) -> Any:
        if name == "search" and isinstance(arguments, dict) and "topk" not in arguments:
            arguments = {**arguments, "topk": self.top_k}
        return await self.inner.call(name, arguments)


@contextlib.contextmanager
def local_tool_server(corpus: Path, top_k: int, log_path: Path, start_timeout_s: float = 120.0) -> Iterator[str]:
    """``python -m tool_server --backend local`` on a corpus, on 127.0.0.1 and a free port, for the ``with`` block;
    yields its URL. Its log goes to ``log_path`` (``tool_server.process.start_tool_server`` shows the log's end when
    it fails to start)."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise EvalInputError(f"corpus {str(corpus)!r} does not exist; pass --corpus with a JSONL corpus such "
                             "as data/wiki_passages_1000.jsonl, or --tool-server URL of a running server.")
    args = ["--backend", "local", "--corpus", str(corpus.resolve()), "--default-topk", str(top_k),
            "--log-level", "WARNING"]
    with start_tool_server(args, log_path=log_path, timeout_s=start_timeout_s) as url:
        yield url
