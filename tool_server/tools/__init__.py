"""The tool registry: every tool the agent can call, one module each, registered here by one line.

The protocol parser and the system prompt (``igpo.agent.protocol``), the agent config's ``tool_names``, the client
(``tool_server.client.tool_request``), the server's ``POST /tools/<name>`` routes (``tool_server.app``) and the
service (``tool_server.service.ToolService.call``) all read this registry; none of them names a tool.

Adding a tool: write ``tool_server/tools/<name>.py`` with a ``tool_server.tools.base.Tool`` subclass, and add
``register(<Name>Tool())`` below. The tool is then served by every tool server; an agent calls it once its name is in
``algorithm.igpo.agent.tool_names`` (and its system prompt describes it: ``igpo.agent.protocol.system_prompt_for``).
"""
from __future__ import annotations

from .base import BadToolCall, Tool, ToolResponse
from .python import PythonTool
from .search import SearchTool
from .visit import VisitTool

_REGISTRY: dict[str, Tool] = {}

DEFAULT_TOOLS: tuple[str, ...] = ("search", "visit")
"""The tools an agent has (and its default system prompt describes) unless ``agent.tool_names`` says otherwise."""


def register(tool: Tool) -> Tool:
    """Add a tool; a second tool of the same name is refused (it would silently replace the first)."""
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not name or name != name.strip().lower():
        raise ValueError(f"tool {type(tool).__name__} has name {name!r}: a tool name must be a non-empty lower-case "
                         "string without spaces around it (the model writes it, the parser lower-cases it)")
    if name in _REGISTRY:
        raise ValueError(f"a tool named {name!r} is already registered ({type(_REGISTRY[name]).__name__}); "
                         "choose another name")
    if tool.schema.get("function", {}).get("name") != name:
        raise ValueError(f"tool {name!r}: its schema's function name is "
                         f"{tool.schema.get('function', {}).get('name')!r}; it must be {name!r}")
    _REGISTRY[name] = tool
    return tool


def names() -> tuple[str, ...]:
    """Every registered tool's name, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Tool:
    """The registered tool ``name``; ``BadToolCall`` (the caller's mistake) names the registered ones otherwise."""
    tool = _REGISTRY.get(name)
    if tool is None:
        raise BadToolCall(f"unknown tool {name!r}; available tools: {', '.join(_REGISTRY)}")
    return tool


def schemas(tool_names: tuple[str, ...] | list[str]) -> tuple[dict, ...]:
    """The prompt schemas of ``tool_names``, in that order (for ``igpo.agent.protocol.default_system_prompt``)."""
    return tuple(get(name).schema for name in tool_names)


register(SearchTool())
register(VisitTool())
register(PythonTool())

__all__ = ["BadToolCall", "DEFAULT_TOOLS", "Tool", "ToolResponse", "get", "names", "register", "schemas"]
