"""The import graph of igpo/ and tool_server/: rooms, floors, upward imports and cycles.

Reads every module's imports with ``ast`` (module level and inside functions alike; a function-level import is still
an edge), maps each module to its room (``igpo.core``, ``igpo.agent``, ..., ``tool_server``) and checks two rules:

    - every import points down: a room imports only rooms on a lower floor (or itself);
    - no cycle between modules, not even through a function-level import.

Dynamic imports by name (``importlib.import_module``, verl's class paths) are not edges: they are how plug-ins are
found, and the plug-in imports its host, never the reverse.

    python scripts/import_graph.py          # the room graph, every upward import and cycle; exit 1 if any

Last line: ``import_graph: modules=<n> edges=<e> upward=<u> cycles=<c>``.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("igpo", "tool_server")

# Floors, lowest first: a room may import rooms on its own floor's lower floors only. Within a floor, rooms do not
# import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("igpo.core", "tool_server"),         # pure math; the tool service (its client is what the agent uses)
    ("igpo.cpu",),                        # the CPU backend for verl
    ("igpo.agent",),                      # agent loops, protocol, chat frame, typed records, agent config
    ("igpo.reward", "igpo.config"),       # outcome rewards and the LLM judge (they read the agent's records); the
                                          # trainer-wide algorithm config, composed of the agent's and core's
    ("igpo.integration",),                # trainer mode, methods, estimators, actor worker
    ("igpo.launch", "igpo.demo", "igpo.eval"),  # planning a run; the CPU demo's world and model; evaluation
    ("igpo.main", "igpo.plugin", "igpo", "igpo.evaluate", "igpo.prepare_data"),  # entry points: the launcher,
                                          # verl's plugin hook, the evaluation and data commands (python -m igpo.…)
)
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] != "igpo" or len(parts) == 1 else ".".join(parts[:2])


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports (the deepest known module each import names)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # "from pkg import sub" imports the submodule; "from mod import name" imports mod
            names += [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def analyse() -> tuple[dict[str, set[str]], list[tuple[str, str]], list[list[str]], list[str]]:
    """(edges, upward imports as (importer, imported), module cycles, modules in no declared room)."""
    known = modules()
    edges = {module: imports(module, path, known) for module, path in known.items()}
    unplaced = sorted(module for module in known if room(module) not in FLOOR)
    upward = sorted((a, b) for a, targets in edges.items() for b in targets
                    if room(a) != room(b) and room(a) in FLOOR and room(b) in FLOOR
                    and FLOOR[room(b)] >= FLOOR[room(a)])
    return edges, upward, cycles(edges), unplaced


def main() -> int:
    edges, upward, loops, unplaced = analyse()
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if room(a) != room(b):
                rooms[room(a)].add(room(b))
    for name in sorted(rooms, key=lambda r: (FLOOR.get(r, 99), r)):
        print(f"{name} (floor {FLOOR.get(name, '?')}) -> {', '.join(sorted(rooms[name]))}")
    for a, b in upward:
        print(f"UPWARD: {a} -> {b} (floor {FLOOR[room(a)]} -> {FLOOR[room(b)]})")
    for loop in loops:
        print(f"CYCLE: {' <-> '.join(loop)}")
    for module in unplaced:
        print(f"NO ROOM: {module} (add its room to FLOORS)")
    n_edges = sum(len(t) for t in edges.values())
    print(f"import_graph: modules={len(edges)} edges={n_edges} upward={len(upward)} cycles={len(loops)}")
    return 1 if upward or loops or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
