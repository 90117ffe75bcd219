"""Cost-aware tool service for deep-research agents: web search (Serper), page visits (Jina Reader + an LLM
summariser) or a local BM25 corpus, behind one HTTP API with caching, rate limits, retries and budgets.

Run the server with ``python -m tool_server --help``; agent code uses ``ToolClient`` (no server imports needed).
"""
from .client import ToolClient, ToolResult

__all__ = ["ToolClient", "ToolResult"]
