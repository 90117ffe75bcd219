"""Shared fixtures (a tiny local Qwen2 checkpoint and tokenizer, built once and cached under .cache/) and the import
path of tests/support/."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "wiki_passages_1000.jsonl"

# tests/support/ holds the fakes and harnesses that tests in every folder import by module name. A few test modules
# also share helpers with a test in another folder (the scripted agent-loop rollouts of agent/test_agent_loop.py, the
# tiny scoring model of core/test_scoring.py), so every test folder is importable by module name whatever the
# collection order; test file names are unique across folders for that reason.
for _folder in sorted((REPO / "tests").iterdir()):
    if _folder.is_dir() and not _folder.name.startswith((".", "_")) and _folder.name != "golden":
        sys.path.insert(0, str(_folder))
_names = [p.name for p in (REPO / "tests").glob("*/*.py")]
_twice = sorted({n for n in _names if _names.count(n) > 1})
if _twice:
    raise RuntimeError(f"test modules with the same file name in two folders of tests/: {_twice}; rename one (they are "
                       "imported by module name).")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from igpo.demo.tiny_model import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny_model", CORPUS)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ------------------------------------------------------------------------------------------------ parallel runs
# scripts/test.sh runs the suite on several pytest-xdist workers (--dist loadgroup). A trainer start keeps two cores
# only ~60% busy (Ray and verl start their processes one after another), so an end-to-end test and the fast tests
# beside it share the machine well. Each end-to-end test is a unit of its own; every other test file is one unit (its
# module fixtures are built once). Units are handed out longest first, from the times in tests/durations.json, so no
# long test starts last; `bash scripts/test.sh --record-durations` updates that file with the tests it ran.
DURATIONS = REPO / "tests" / "durations.json"
UNKNOWN_E2E_S, UNKNOWN_S = 90.0, 1.0  # a test not yet in tests/durations.json


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="write each test's seconds (setup + call + teardown) into tests/durations.json")


def _unit(item) -> str:
    return item.nodeid if item.get_closest_marker("e2e") else item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    seconds: dict[str, float] = {}  # per unit, in order of first appearance
    for item in items:
        default = UNKNOWN_E2E_S if item.get_closest_marker("e2e") else UNKNOWN_S
        unit = _unit(item)
        seconds[unit] = seconds.get(unit, 0.0) + known.get(item.nodeid, default)
        item.add_marker(pytest.mark.xdist_group(unit))
    first_seen = {unit: i for i, unit in enumerate(seconds)}
    items.sort(key=lambda item: (-seconds[_unit(item)], first_seen[_unit(item)]))


_recorded: dict[str, float] = {}


def _plain(nodeid: str) -> str:
    """The test's id without the "@<unit>" that pytest-xdist appends under --dist loadgroup."""
    for i, char in enumerate(nodeid):
        if char == "@" and nodeid[i + 1:] in (nodeid[:i], nodeid[:i].split("::")[0]):
            return nodeid[:i]
    return nodeid


def pytest_runtest_logreport(report):
    if report.passed or report.failed:
        nodeid = _plain(report.nodeid)
        _recorded[nodeid] = round(_recorded.get(nodeid, 0.0) + report.duration, 2)


def pytest_sessionfinish(session):
    """With --record-durations: the tests this run made get their new times; the others keep theirs (a run of one
    folder does not forget the rest)."""
    if session.config.getoption("--record-durations") and not hasattr(session.config, "workerinput"):
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        DURATIONS.write_text(json.dumps(dict(sorted({**known, **_recorded}.items())), indent=0) + "\n")
