"""The tool registry: every tool the agent can call, one module each, registered here by one line.

The protocol parser and the system prompt (``igpo.agent.protocol``), the agent config's ``tool_names``, the client
(``tool_server.client.tool_request``), the server's ``POST /tools/<name>`` routes (``tool_server.app``) and the
service (``tool_server.service.ToolService.call``) all read this registry; none of them names a tool.

Adding a tool: write ``tool_server/tools/<name>.py`` with a ``tool_server.tools.base.Tool`` subclass (a
``tool_server.tools.upstream_tool.UpstreamTool`` for one that calls an outside service), and add
``register(<Name>Tool())`` below. The tool is then served by every tool server, with a ``--budget-<name>`` flag for
each of its ``budgets`` and, for an outside service, its upstream in ``/stats``; an agent calls it once its name is
in ``algorithm.igpo.agent.tool_names`` (and its system prompt describes it: ``igpo.agent.protocol.system_prompt_for``).
A module outside this package registers its tools the same way, and ``python -m tool_server --tool-module MODULE``
imports it before reading the other flags.
"""
from __future__ import annotations

import re

from .base import BadToolCall, BudgetFlag, Tool, ToolResponse
from .python import PythonTool
from .search import SearchTool
from .upstream_tool import UpstreamTool
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
    _check_budgets(tool)
    _REGISTRY[name] = tool
    return tool


def _check_budgets(tool: Tool) -> None:
    taken = {flag.name: other.name for other in _REGISTRY.values() for flag in other.budgets}
    for flag in tool.budgets:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", flag.name):
            raise ValueError(f"tool {tool.name!r}: budget name {flag.name!r} must be lower-case letters, digits and "
                             "underscores (it becomes the flag --budget-<name>)")
        if flag.name in taken:
            raise ValueError(f"tool {tool.name!r}: the budget {flag.name!r} is already the {taken[flag.name]!r} "
                             "tool's; choose another name")
    if isinstance(tool, UpstreamTool):
        for attribute in ("upstream", "base_url_env"):
            if not isinstance(getattr(tool, attribute, None), str) or not getattr(tool, attribute):
                raise ValueError(f"tool {tool.name!r} calls an outside service: set its {attribute!r} (see "
                                 "tool_server/tools/upstream_tool.py)")
        if len(tool.budgets) != 1:
            raise ValueError(f"tool {tool.name!r} calls the upstream {tool.upstream!r}: it needs "
                             f"exactly one BudgetFlag in budgets, not {len(tool.budgets)}")
        upstreams = {other.upstream: other.name for other in upstream_tools()}
        if tool.upstream in upstreams:
            raise ValueError(f"tool {tool.name!r}: the upstream {tool.upstream!r} is already the "
                             f"{upstreams[tool.upstream]!r} tool's; choose another name")


def names() -> tuple[str, ...]:
    """Every registered tool's name, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Tool:
    """The registered tool ``name``; ``BadToolCall`` (the caller's mistake) names the registered ones otherwise."""
    tool = _REGISTRY.get(name)
    if tool is None:
        raise BadToolCall(f"unknown tool {name!r}; available tools: {', '.join(_REGISTRY)}")
    return tool


def budget_flags() -> tuple[BudgetFlag, ...]:
    """The budget flags of every registered tool, in registration order (``python -m tool_server``'s
    ``--budget-<name>`` flags)."""
    return tuple(flag for tool in _REGISTRY.values() for flag in tool.budgets)


def upstream_tools() -> tuple[UpstreamTool, ...]:
    """The registered tools that call an outside service themselves (each gets an upstream in ``/stats``)."""
    return tuple(tool for tool in _REGISTRY.values() if isinstance(tool, UpstreamTool))


def schemas(tool_names: tuple[str, ...] | list[str]) -> tuple[dict, ...]:
    """The prompt schemas of ``tool_names``, in that order (for ``igpo.agent.protocol.default_system_prompt``)."""
    return tuple(get(name).schema for name in tool_names)


register(SearchTool())
register(VisitTool())
register(PythonTool())

__all__ = ["BadToolCall", "BudgetFlag", "DEFAULT_TOOLS", "Tool", "ToolResponse", "UpstreamTool", "budget_flags",
           "get", "names", "register", "schemas", "upstream_tools"]
