"""Search/visit backends: ``local`` (BM25 over a JSONL corpus) and ``web`` (Serper + Jina Reader + summariser)."""
from .base import Backend, PageResult, SearchHit

__all__ = ["Backend", "PageResult", "SearchHit"]
