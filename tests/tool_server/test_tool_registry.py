"""Golden tests of the search and visit tools: the prompt texts, protocol parses, client requests, server replies and
rendered observations recorded in ``tests/golden/tools_search_visit.json`` from the code before the tool registry
(commit "golden tests of search/visit") must stay identical, byte for byte.

Regenerate (only for an intended change, reviewed in the diff): ``python tests/tool_server/test_tool_registry.py --write``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # fake_upstreams, when run as a script

from fake_upstreams import InProcessServer  # noqa: E402
from igpo.agent import protocol  # noqa: E402
from igpo.agent.agent_config import AgentLoopConfig  # noqa: E402
from tool_server import ToolClient  # noqa: E402
from tool_server.backends.base import PageResult, SearchHit  # noqa: E402
from tool_server import tools  # noqa: E402
from tool_server.client import BadToolCall, tool_request  # noqa: E402
from tool_server.config import ServerConfig  # noqa: E402
from tool_server.errors import ToolError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "wiki_passages_1000.jsonl"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tools_search_visit.json"

TURNS = [
    '<think>look</think>\n<tool_call>{"name": "search", "arguments": {"query": ["Horatio Hale", "ethnologist"]}}</tool_call>',
    '<tool_call>{"name": "visit", "arguments": {"url": ["corpus://1"], "goal": "who was he"}}</tool_call>',
    '<think>x</think><tool_call>{"name": "Search", "arguments": {"query": "one"}}</tool_call>',
    "<tool_call>{'name': 'search', 'arguments': {'query': ['json5 quotes'],}}</tool_call>",
    '<tool_call>{"name": "search", "arguments": "{\\"query\\": [\\"as a string\\"]}"}</tool_call>',
    '<tool_call>{"name": "search", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "search", "arguments": ["q"]}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"query": ["q"]}}</tool_call>',
    '<tool_call>["search", {"query": ["q"]}]</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": ["q"]}',
    '<tool_call>{"name": "search" "arguments": {}}</tool_call>',
    '<think>a</think><tool_call>{"name": "search", "arguments": {"query": ["q"]}}</tool_call><answer>A</answer>',
    "<think>done</think><answer> Ada Lovelace </answer>",
    "<answer>never closed",
    "just text, no action",
    '<tool_call>{"name": "search", "arguments": {"query": ["q"]}}</tool_call><tool_response>fake</tool_response>',
    '<think>plan <tool_call>{"name": "visit", "arguments": {}}</tool_call></think><answer>B</answer>',
    '<think>t</think><tool_call>{"name": "visit", "arguments": {"url": "corpus://2", "goal": "g", "extra": 1}}'
    "</tool_call>",
    '<think>t</think><tool_call>{"name": "PythonInterpreter", "arguments": {}}\n<code>print(1)</code></tool_call>',
    '<think>t</think><tool_call>{"name": "python", "arguments": {"code": "print(2 + 2)"}}</tool_call>',
]

# (tool name, arguments) as the model may write them; "foo" stands for any unregistered name
REQUESTS = [
    ("search", {"query": ["a", "b"]}),
    ("search", {"query": "one query"}),
    ("search", {"query": ["a"], "topk": 3}),
    ("search", {"query": ["a"], "topk": 0}),
    ("search", {"query": ["a"], "topk": True}),
    ("search", {"query": ["a"], "topk": "3"}),
    ("search", {"query": []}),
    ("search", {"query": ["ok", " "]}),
    ("search", {"query": 5}),
    ("search", {}),
    ("search", {"q": "x"}),
    ("search", {"query": ["caf\udcff"]}),
    ("search", {"query": ["x" * 60_000, "y" * 50_000]}),
    ("visit", {"url": "corpus://1", "goal": "g"}),
    ("visit", {"url": ["corpus://1", "corpus://2"], "goal": "what"}),
    ("visit", {"url": ["corpus://1"], "goal": " "}),
    ("visit", {"url": ["corpus://1"]}),
    ("visit", {"url": ["corpus://1"], "goal": 3}),
    ("visit", {"url": [], "goal": "g"}),
    ("visit", {"url": ["corpus://1"], "goal": "g", "topk": 2}),
    ("visit", {"url": "corpus://1", "goal": "x" * 100_001}),
    ("search", ["not", "a", "dict"]),
]
UNKNOWN_TOOL = ("foo", {"query": ["a"]})

SERVER = [
    ("/tools/search", {"queries": ["Horatio Hale ethnologist philologist", "comics publisher"], "topk": 3}),
    ("/tools/search", {"queries": ["Evan Morris lobbyist"]}),
    ("/tools/search", {"queries": ["the of and"]}),
    ("/tools/search", {"queries": ["Evan Morris", "the of and"], "topk": 1}),
    ("/tools/search", {"queries": ["x"], "topk": 0}),
    ("/tools/search", {"queries": ["x"], "topk": 99}),
    ("/tools/search", {"queries": ["a"] * 5}),
    ("/tools/search", {"queries": []}),
    ("/tools/search", {"queries": [""]}),
    ("/tools/search", {"queries": "not a list"}),
    ("/tools/search", {"queries": ["x"], "extra": 1}),
    ("/tools/search", {"queries": ["x" * 2_000]}),
    ("/tools/search", {"queries": ["caf\udcff"]}),
    ("/tools/visit", {"urls": ["corpus://1"], "goal": "who was he"}),
    ("/tools/visit", {"urls": ["corpus://0", "corpus://no-such-id"], "goal": "g"}),
    ("/tools/visit", {"urls": ["corpus://no-such-id"], "goal": "g"}),
    ("/tools/visit", {"urls": ["https://example.com"], "goal": "g"}),
    ("/tools/visit", {"urls": [], "goal": "g"}),
    ("/tools/visit", {"urls": ["corpus://1"], "goal": " "}),
    ("/tools/visit", {"urls": [" "], "goal": "g"}),
    ("/tools/visit", {"urls": ["corpus://1"]}),
    ("/tools/visit", {"urls": ["corpus://1"], "goal": "x" * 5_000}),
    ("/retrieve", {"queries": ["Evan Morris lobbyist"], "topk": 1}),
]

CLIENT = [
    ("search", {"query": ["Evan Morris lobbyist", "Horatio Hale"]}),
    ("search", {"query": "the of and"}),
    ("visit", {"url": "corpus://0", "goal": "who"}),
    ("visit", {"url": "corpus://no-such-id", "goal": "who"}),
    ("visit", {"url": "https://example.com", "goal": "who"}),
    ("search", {"query": ["a"], "topk": 0}),
]

HITS = [SearchHit("Title A", "corpus://1", "snippet a", date="2020-01-02", source="wiki", score=1.5, doc_id="1"),
        SearchHit("Title B", "https://b.example/x", "snippet b")]
PAGES = [PageResult("corpus://3", "Stored", content="the whole stored text"),
         PageResult("https://p.example", "Web", evidence="quoted evidence", summary="a summary", truncated=True)]


def _parse(parse, text: str) -> dict:
    return dataclasses.asdict(parse(text))


def _request(name: str, arguments) -> dict:
    try:
        path, payload = tool_request(name, arguments)
    except BadToolCall as err:
        return {"rejected": str(err)}
    return {"path": path, "payload": payload}


def _renders() -> dict:
    errors = [ToolError(kind, f"message of {kind}") for kind in ("infra", "budget", "bad_request", "no_results")]
    search, visit = tools.get("search"), tools.get("visit")
    return {
        "search": [search.render("q one", HITS), search.render("q none", [])],
        "page": [visit.render(page, "the goal") for page in PAGES],
        "error": [tool.render_error("subject", error) for tool in (search, visit) for error in errors],
    }


def _observations() -> dict:
    return {"wrap": protocol.wrap_observation("content"), "malformed": protocol.malformed_call_message("bad"),
            "unknown": protocol.unknown_tool_message("foo", ("search", "visit")),
            "duplicate": protocol.duplicate_call_message(2), "answer_now": dict(protocol.ANSWER_NOW)}


def _prompts() -> dict:
    from igpo.demo import world
    from igpo.demo.warmstart import search_turn
    from igpo.demo.warmstart_config import WarmStartConfig

    return {
        "default_system_prompt": protocol.DEFAULT_SYSTEM_PROMPT,
        "search_schema": protocol.SEARCH_SCHEMA,
        "visit_schema": protocol.VISIT_SCHEMA,
        "tool_schemas": list(protocol.TOOL_SCHEMAS),
        "search_only_prompt": protocol.default_system_prompt((protocol.SEARCH_SCHEMA,)),
        "agent_default_tools": list(AgentLoopConfig().tool_names),
        "warmstart_agent_section": WarmStartConfig().agent_section(),
        "world_agent_section": world.warm_start_config().agent_section(),
        "world_system_prompt": world.SYSTEM_PROMPT,
        "warmstart_search_turn": search_turn("a snippet \"quoted\""),
    }


def _server_replies() -> list:
    config = ServerConfig(backend="local", corpus=CORPUS, max_queries=4, max_request_bytes=20_000)
    with InProcessServer(config) as server:
        replies = []
        for path, body in SERVER:
            r = httpx.post(server.url + path, content=json.dumps(body).encode(),
                           headers={"content-type": "application/json"}, timeout=30)
            replies.append({"status": r.status_code, "body": r.json()})

        async def via_client() -> list:
            async with ToolClient(server.url) as client:
                results = [await client.call(name, args) for name, args in CLIENT]
            return [{"ok": r.ok, "text": r.text, "error_kind": r.error_kind} for r in results]

        return [replies, asyncio.run(via_client())]


def _warmstart_tools() -> list:
    from igpo.demo.warmstart import LocalTools

    tools = LocalTools(CORPUS, topk=1)
    try:
        async def go() -> list:
            return [await tools.call(name, args) for name, args in CLIENT]
        results = tools.run(go)
    finally:
        tools.close()
    return [{"ok": r.ok, "text": r.text, "error_kind": r.error_kind} for r in results]


def snapshot() -> dict:
    server, client = _server_replies()
    return {
        "prompts": _prompts(),
        "parse_turn": [_parse(protocol.parse_turn, t) for t in TURNS],
        "parse_turn_reference": [_parse(protocol.parse_turn_reference, t) for t in TURNS],
        "requests": [_request(name, args) for name, args in REQUESTS],
        "renders": _renders(),
        "observations": _observations(),
        "server": server,
        "client": client,
        "warmstart_tools": _warmstart_tools(),
    }


def _unknown_tool_message() -> str:
    # the list of available tools is the registry's: it grows with every registered tool
    return _request(*UNKNOWN_TOOL)["rejected"].replace(", ".join(tools.names()), "{available}")


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def now() -> dict:
    return json.loads(json.dumps(snapshot()))  # the same JSON round trip the golden file went through


@pytest.mark.parametrize("part", ["prompts", "parse_turn", "parse_turn_reference", "requests", "renders",
                                  "observations", "server", "client", "warmstart_tools"])
def test_search_and_visit_are_unchanged(golden, now, part):
    if isinstance(golden[part], list):
        assert len(now[part]) == len(golden[part])
        for i, (a, b) in enumerate(zip(now[part], golden[part])):
            assert a == b, f"{part}[{i}] differs"
    else:
        for key in golden[part]:
            assert now[part][key] == golden[part][key], f"{part}.{key} differs"


def test_the_prompt_bytes_are_unchanged(golden):
    # the warm-start's cached demo model is keyed by these exact bytes
    assert protocol.DEFAULT_SYSTEM_PROMPT == golden["prompts"]["default_system_prompt"]
    assert protocol.default_system_prompt().encode() == golden["prompts"]["default_system_prompt"].encode()


def test_unknown_tool_rejection_is_unchanged(golden):
    assert _unknown_tool_message() == golden["unknown_tool"]


# ---------------------------------------------------------------------------------------------------- the registry


def test_every_reader_takes_its_tools_from_the_registry():
    from tool_server.app import build_service, create_app

    assert protocol.SEARCH_SCHEMA is tools.get("search").schema and protocol.VISIT_SCHEMA is tools.get("visit").schema
    assert protocol.system_prompt_for(tools.DEFAULT_TOOLS) == protocol.DEFAULT_SYSTEM_PROMPT
    assert AgentLoopConfig().tool_names == tools.DEFAULT_TOOLS
    app = create_app(build_service(ServerConfig(backend="local", corpus=CORPUS)))
    routes = {route.path for route in app.routes}
    assert {f"/tools/{name}" for name in tools.names()} <= routes


def test_a_second_tool_of_the_same_name_is_refused():
    class Again(tools.Tool):
        name = "search"
        schema = {"type": "function", "function": {"name": "search"}}

    with pytest.raises(ValueError, match="already registered"):
        tools.register(Again())


@pytest.mark.parametrize("name, schema_name, fragment", [
    ("Calc", "Calc", "lower-case"), ("", "", "lower-case"), ("calc", "calculator", "schema's function name"),
])
def test_a_badly_named_tool_is_refused(name, schema_name, fragment):
    class Bad(tools.Tool):
        pass

    Bad.name, Bad.schema = name, {"type": "function", "function": {"name": schema_name}}
    with pytest.raises(ValueError, match=fragment):
        tools.register(Bad())
    assert name not in tools.names() or name == "search"


def test_unknown_tool_names_are_a_config_error_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"\['serch'\] not registered.*'search'.*tool_server/tools/"):
        AgentLoopConfig(tool_names=("serch",))


def test_without_a_system_prompt_the_default_describes_exactly_the_listed_tools():
    extra = [name for name in tools.names() if name not in tools.DEFAULT_TOOLS]
    if not extra:
        pytest.skip("only the default tools are registered")
    assert protocol.default_prompt_for(tools.DEFAULT_TOOLS) == protocol.DEFAULT_SYSTEM_PROMPT
    assert protocol.default_prompt_for(("search",)) == protocol.DEFAULT_SYSTEM_PROMPT  # as before the registry
    names = (*tools.DEFAULT_TOOLS, extra[0])
    assert AgentLoopConfig(tool_names=names).tool_names == names
    prompt = protocol.default_prompt_for(names)
    assert prompt == protocol.system_prompt_for(names)
    assert json.dumps(tools.get(extra[0]).schema, ensure_ascii=False) in prompt


def test_the_service_runs_a_tool_by_name_from_a_plain_body():
    from tool_server.app import build_service

    service = build_service(ServerConfig(backend="local", corpus=CORPUS))
    try:
        response = asyncio.run(service.call("search", {"queries": ["Evan Morris lobbyist"], "topk": 1}))
        assert response.ok and response.text.startswith("A search for 'Evan Morris lobbyist' found 1 results")
        with pytest.raises(BadToolCall, match="unknown tool 'nope'"):
            asyncio.run(service.call("nope", {}))
    finally:
        service.cache.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/tool_server/test_tool_registry.py --write   (rewrites " + str(GOLDEN) + ")")
    data = snapshot()
    data["unknown_tool"] = _unknown_tool_message()
    GOLDEN.write_text(json.dumps(data, indent=1, ensure_ascii=True, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
